// The fused modules' float32 matrix product on the CPU, with AVX-512.
//
// Why our own: torch's float32 mm on the CPU is MKL's sgemm, and MKL takes
// its AVX2 code path on CPUs it does not recognise as Intel's. On an AMD Zen 5
// core (two 512-bit FMA pipes) that is half the core: MKL reaches ~110 GF/s
// where this kernel reaches ~230 (bench/nn_modules.py, with and without
// HP_SIMD=avx2). The fused modules spend nearly all of their time in these
// products, so they run here on such CPUs; on Intel's, MKL's AVX-512 sgemm
// is the faster and the fused ops keep it (ops/matmul.cpp). bfloat16
// products stay with ATen (oneDNN's, already AVX-512).
//
// The usual blocked scheme (Goto/BLIS): B is packed in panels of 32 columns
// per block of k, A in panels of 12 rows, and a 12 x 32 register tile of
// C accumulates over a block of k (256) with one FMA per 16 products. The
// sum of each element runs over k in order within a block, blocks added in
// order: deterministic, and the same for any thread count (threads split
// C, never k). No torch headers: the C++ tests run it against a reference.
#pragma once

#include <cstdint>

namespace hp::ops::gemm {

// Whether sgemm runs here: simd::isa() is AVX-512 (HP_SIMD caps it, so
// HP_SIMD=avx2 sends the fused modules back to ATen's products everywhere).
bool available();

// c (m x n, row stride ldc) = op(a) op(b), or c += op(a) op(b) when
// accumulate. op(a) is m x k: a stored m x k (row stride lda), or k x m when
// trans_a; op(b) is k x n: b stored k x n (row stride ldb), or n x k when
// trans_b. Row-major float32, any sizes (k = 0 gives zeros or leaves c);
// one thread: callers split c among threads. Only where available().
void sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
           int64_t ldb, float* c, int64_t ldc, bool accumulate);

}  // namespace hp::ops::gemm
