// Newton–Schulz's bfloat16 products bit for bit as torch's reference GEMM
// sums them, vectorised and on every thread.
//
// On a CPU without AVX-512 (no avx512bw/vl/dq: oneDNN has no bfloat16 matmul
// there) torch 2.13's bfloat16 mm and addmm are ATen's reference GEMM
// (cpublas), up to 35x slower than its float32 mm. A bfloat16 product is
// exact in float32, so the order of each sum is all that decides the bits.
// Muon's products use three orders, found by comparing with torch on such a
// CPU (every element of many shapes, bit for bit):
// - dots: rows of A dotted with rows of B (X Xᵀ with X row-major; A Bᵀ with
//   B's columns contiguous, as a tall matrix's first round multiplies its
//   transposed view), ATen's dot_with_fp32_arith: chunks of 64, element l into
//   accumulator l mod 64, the 64 summed as a tree (32 apart, 16 apart, ...,
//   1 apart; within 8 lanes 4, then 2, then 1 apart); then the chunks of 16
//   past the last whole 64 into 8 more accumulators (l mod 8, the low 8
//   before the high 8), summed as a tree and added; then the last k mod 16
//   one by one.
// - product: A B with A and B row-major (addmm(g, g, g), addmm(x, h, x)),
//   ATen's sum(): four partial sums, element l into partial l mod 4 up to the
//   last multiple of 4 and the rest into partial 0, then ((p0 + p1) + p2) + p3.
// - gram_sequential: Yᵀ Y with Y row-major (a tall matrix's first X Xᵀ, X
//   being Yᵀ's column-major view), ATen's gemm_transb: one sum per element,
//   l in order.
// The result is fma(beta, c, alpha * sum) when beta is not 0, else alpha *
// sum, rounded to bfloat16 to nearest even. tests/python/test_muon.py checks
// the Newton–Schulz built on them bit for bit against torch.optim.Muon.
//
// Operands are float32 (bfloat16 values widened: exact), results and c
// bfloat16 bits; all row-major and contiguous. Every function splits its work
// into tasks and runs them through `parallel`; each element's sum is the same
// whichever thread computes it.
#pragma once

#include <cstdint>
#include <functional>

namespace hp::optim::reference_gemm {

// Whether these kernels give torch's bits here and run: the CPU has no
// bfloat16 ISA of oneDNN's (AVX-512, or AVX2 with AVX-NE-CONVERT), so torch
// uses its reference GEMM, and simd::isa() is AVX2.
bool available();

// Runs body(begin, end) over [0, tasks), in parallel where it can.
using Parallel = std::function<void(int64_t tasks, const std::function<void(int64_t, int64_t)>& body)>;

// out (m x m) = x xᵀ for x (m x k), the dots order.
void gram(const float* x, int64_t m, int64_t k, uint16_t* out, const Parallel& parallel);

// out (m x m) = yᵀ y for y (k x m), the gram_sequential order.
void gram_sequential(const float* y, int64_t k, int64_t m, uint16_t* out, const Parallel& parallel);

// out (m x n) = fma(beta, c, alpha * a bᵀ) for a (m x k), b (n x k) and c
// (m x n; unread when beta is 0), the dots order.
void dots(const float* a, const float* b, int64_t m, int64_t n, int64_t k, const uint16_t* c, float beta, float alpha,
          uint16_t* out, const Parallel& parallel);

// out (m x n) = fma(beta, c, alpha * a b) for a (m x k), b (k x n) and c
// (m x n; unread when beta is 0), the product order. out may be c.
void product(const float* a, const float* b, int64_t m, int64_t k, int64_t n, const uint16_t* c, float beta,
             float alpha, uint16_t* out, const Parallel& parallel);

}  // namespace hp::optim::reference_gemm
