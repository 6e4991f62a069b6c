// Symmetric bfloat16 products for Newton–Schulz, bit for bit torch's.
//
// torch 2.13 computes Muon's G = X Xᵀ and H = b G + c G G with oneDNN's
// bfloat16 matmul, which on an AVX-512 CPU is one of two GEMMs:
// - dot (AVX-512 bfloat16 dot products, vdpbf16ps): every element is one
//   float32 sum of k in order, two k at a time, in blocks: k itself up to
//   512, else blocks of 512 up to 1024, else blocks of 1024; each block is
//   summed from zero and added to the running total. The result is rounded to
//   bfloat16 (to nearest even), after the post-op fma(c, beta, alpha * sum)
//   when there is a c.
// - emulated (AVX-512 without them: Intel Skylake-SP to Ice Lake): oneDNN's
//   gemm:jit:bf16, which does each dot product as two float32 FMAs, the odd
//   k of a pair before the even one. Its k blocks: k itself up to 384, else
//   two halves up to 1536, else blocks of 768.
//   Each block is summed from zero; the first block's sum s gives
//   total = alpha * s, every later block's adds as fma(s, alpha, total), and
//   the result is fma(c, beta, total) when there is a c. Found by comparing
//   with torch on an Ice Lake CPU, every element of many shapes, at 1 and 2
//   threads.
//
// These kernels compute the same sums in the same order, but only for the
// 32-column blocks of the upper triangle (and the diagonal blocks whole):
// the caller mirrors the rest. That is about half the work of the full
// product. tests/python/test_muon.py checks them bit for bit against torch.
// The dot GEMM's blocks are those of contiguous operands: for a transposed
// one past k = 1024 they differ between CPUs (512 on a Zen 4, 1024 on a
// Zen 5), and the caller runs torch's own call there.
#pragma once

#include <cstdint>

namespace hp::optim::gram {

// Columns per block of the product.
constexpr int64_t kBlock = 32;

// Which GEMM's sums the kernels reproduce here (above): none where
// simd::isa() is below AVX-512 (torch's GEMM is another there).
enum class Kind { none, dot, emulated };
Kind kind();

// Whether the kernels run here.
inline bool available() { return kind() != Kind::none; }

// Whether torch's (rows x k) (k x cols) product, on `threads` threads, is
// the GEMM whose sums the kernels reproduce:
// - ATen hands oneDNN only products of more than 4096 multiply-adds, and
//   neither a single row nor a single column;
// - k even, whole pairs in every block (emulated: not the halves of an odd
//   number of pairs, 384 < k < 1536 with k / 2 odd, whose second half pairs
//   its k from its own start);
// - emulated: oneDNN's matmul splits the outputs evenly over the threads
//   (balance211), and a share that does not start and end on a row, or holds
//   a single row, goes to its gemv kernel, which sums in another order.
bool fits(int64_t rows, int64_t cols, int64_t k, int threads);

// uint32 words a packed y of m rows and k columns takes.
int64_t packed_words(int64_t m, int64_t k);

// The dot kind's packing of y (m x k bfloat16, row-major, k even): column
// blocks of 32 rows, for each pair of k the 32 rows' bfloat16 pairs side by
// side; zeros past m.
void pack(const uint16_t* y, int64_t m, int64_t k, uint32_t* packed);

// The emulated kind's packing of y = zᵀ (m x k), from z (k x m, row-major,
// k even): column blocks of 32 rows, for each pair of k the 32 rows' odd k
// as floats, then their even k; zeros past m. Each pair of y's k is two of
// z's rows, so this converts row segments instead of transposing, and a
// symmetric y is its own z.
void pack_transposed(const uint16_t* z, int64_t k, int64_t m, uint32_t* packed);

// For column block `block` (columns [32 block, 32 block + 32) ∩ [0, m)):
// out[i, j] = y[i] · y[j] for the rows i < the block's end, rounded to
// bfloat16; when c is not null, fma(c[i, j], beta, alpha * y[i] · y[j]) then
// rounded (emulated: the post-op as above). out and c are m x m row-major;
// `packed` is y's packing (pack(y), or pack_transposed(yᵀ) on the emulated
// kind).
void upper_block(const uint16_t* y, const uint32_t* packed, int64_t m, int64_t k, int64_t block, const uint16_t* c,
                 float beta, float alpha, uint16_t* out);

// The emulated kind's general product, for Newton–Schulz's H X: for column
// block `block` (columns [32 block, 32 block + 32) ∩ [0, n)), every row of
// out = a b (m x n) with the post-op as above; `a` is the packing of a
// (m x k), pack_transposed(aᵀ), and `bt` that of bᵀ (n x k),
// pack_transposed(b). out and c are m x n row-major.
void product_block(const uint32_t* a, const uint32_t* bt, int64_t m, int64_t n, int64_t k, int64_t block,
                   const uint16_t* c, float beta, float alpha, uint16_t* out);

}  // namespace hp::optim::gram
