// Symmetric bfloat16 products for Newton–Schulz, bit for bit torch's.
//
// torch 2.13 computes Muon's G = X Xᵀ and H = b G + c G G with oneDNN's
// bfloat16 matmul. On CPUs with AVX-512 bfloat16 dot products that matmul
// gives every element one float32 sum of k in order, two k at a time
// (vdpbf16ps), in blocks: k itself up to 512, else blocks of 512 up to 1024,
// else blocks of 1024; each block is summed from zero and added to the
// running total. The result is rounded to bfloat16 (to nearest even), after
// the post-op fma(c, beta, alpha * sum) when there is a c.
//
// These kernels compute the same sums in the same order, but only for the
// 32-column blocks of the upper triangle (and the diagonal blocks whole):
// the caller mirrors the rest. That is about half the work of the full
// product. tests/python/test_muon.py checks them bit for bit against torch.
#pragma once

#include <cstdint>

namespace hp::optim::gram {

// Columns per block of the product.
constexpr int64_t kBlock = 32;

// Whether the kernels run: simd::isa() is AVX-512 and this CPU has bfloat16
// dot products (simd::avx512_bf16()); and whether a product over k (the
// inner dimension) fits them: k even.
bool available();
inline bool fits(int64_t k) { return k % 2 == 0 && k > 0; }

// uint32 words a packed y of m rows and k columns takes.
inline int64_t packed_words(int64_t m, int64_t k) { return (m + kBlock - 1) / kBlock * kBlock * (k / 2); }

// Packs y (m x k bfloat16, row-major, k even) into column blocks: block j
// holds, for each pair of k, the 32 rows' pairs side by side (zeros past m).
void pack(const uint16_t* y, int64_t m, int64_t k, uint32_t* packed);

// For column block `block` (columns [32 block, 32 block + 32) ∩ [0, m)):
// out[i, j] = y[i] · y[j] for the rows i < the block's end, rounded to
// bfloat16; when c is not null, fma(c[i, j], beta, alpha * y[i] · y[j]) then
// rounded. out and c are m x m row-major; `packed` is pack(y)'s.
void upper_block(const uint16_t* y, const uint32_t* packed, int64_t m, int64_t k, int64_t block, const uint16_t* c,
                 float beta, float alpha, uint16_t* out);

}  // namespace hp::optim::gram
