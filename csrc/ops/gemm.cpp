#include "gemm.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "simd/isa.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace hp::ops::gemm {

bool available() {
#if defined(__x86_64__)
  return simd::isa() == simd::Isa::avx512;
#else
  return false;
#endif
}

#if defined(__x86_64__)
namespace {

#define HP_GEMM_TARGET HP_SIMD_TARGET(HP_SIMD_AVX512)

// The register tile is kRows x kCols (24 of the 32 zmm registers hold it);
// a block of k is kDepth deep, so that a B panel (32 KB) stays in L1 while
// the A panels of kRowBlock rows (96 KB) stream from L2. B is packed kColBlock
// columns at a time (2 MB, L3). Tuned on Zen 5; within 5% for MR 8..14,
// depth 128..384.
constexpr int kRows = 12;
constexpr int kCols = 32;
constexpr int64_t kDepth = 256;
constexpr int64_t kRowBlock = kRows * 8;
constexpr int64_t kColBlock = 2048;

// Masks of the first `cols` (0..32) columns of a tile, as two 16-lane halves.
HP_GEMM_TARGET inline __mmask16 low_mask(int64_t cols) {
  return cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
}
HP_GEMM_TARGET inline __mmask16 high_mask(int64_t cols) { return low_mask(std::max<int64_t>(cols - 16, 0)); }

// Rows [i0, i0 + rows) and k [p0, p0 + depth) of op(a) into panels of kRows
// rows: panel r holds, for each k, its kRows values side by side (zeros past
// the last row).
HP_GEMM_TARGET void pack_a(bool trans, const float* a, int64_t lda, int64_t i0, int64_t rows, int64_t p0, int64_t depth,
                           float* out) {
  for (int64_t i = 0; i < rows; i += kRows, out += kRows * depth) {
    const int64_t n = std::min<int64_t>(kRows, rows - i);
    if (trans) {  // a is k x m: a panel's values for one k are contiguous
      for (int64_t p = 0; p < depth; ++p) {
        const float* src = a + (p0 + p) * lda + i0 + i;
        float* dst = out + p * kRows;
        std::memcpy(dst, src, sizeof(float) * n);
        std::fill(dst + n, dst + kRows, 0.f);
      }
    } else {
      for (int64_t r = 0; r < n; ++r) {
        const float* src = a + (i0 + i + r) * lda + p0;
        for (int64_t p = 0; p < depth; ++p) out[p * kRows + r] = src[p];
      }
      for (int64_t r = n; r < kRows; ++r)
        for (int64_t p = 0; p < depth; ++p) out[p * kRows + r] = 0.f;
    }
  }
}

// k [p0, p0 + depth) and columns [j0, j0 + cols) of op(b) into panels of
// kCols columns: panel j holds, for each k, its kCols values (zeros past the
// last column).
HP_GEMM_TARGET void pack_b(bool trans, const float* b, int64_t ldb, int64_t p0, int64_t depth, int64_t j0,
                           int64_t cols, float* out) {
  for (int64_t j = 0; j < cols; j += kCols, out += kCols * depth) {
    const int64_t n = std::min<int64_t>(kCols, cols - j);
    if (trans) {  // b is n x k: one column of op(b) is a contiguous row
      for (int64_t c = 0; c < n; ++c) {
        const float* src = b + (j0 + j + c) * ldb + p0;
        for (int64_t p = 0; p < depth; ++p) out[p * kCols + c] = src[p];
      }
      for (int64_t c = n; c < kCols; ++c)
        for (int64_t p = 0; p < depth; ++p) out[p * kCols + c] = 0.f;
    } else {
      const __mmask16 lo = low_mask(n), hi = high_mask(n);
      for (int64_t p = 0; p < depth; ++p) {
        const float* src = b + (p0 + p) * ldb + j0 + j;
        _mm512_store_ps(out + p * kCols, _mm512_maskz_loadu_ps(lo, src));
        _mm512_store_ps(out + p * kCols + 16, _mm512_maskz_loadu_ps(hi, src + 16));
      }
    }
  }
}

// The first `rows` x `cols` of c's tile (+)= a panel times a B panel over
// `depth` k. Each k: two loads of B, kRows broadcasts of A, 2 kRows FMAs.
HP_GEMM_TARGET void tile(int64_t depth, const float* ap, const float* bp, float* c, int64_t ldc, int64_t rows,
                         int64_t cols, bool add) {
  __m512 lo[kRows], hi[kRows];
#pragma GCC unroll 12
  for (int r = 0; r < kRows; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < depth; ++p, ap += kRows, bp += kCols) {
    const __m512 b0 = _mm512_load_ps(bp), b1 = _mm512_load_ps(bp + 16);
#pragma GCC unroll 12
    for (int r = 0; r < kRows; ++r) {
      const __m512 x = _mm512_set1_ps(ap[r]);
      lo[r] = _mm512_fmadd_ps(x, b0, lo[r]);
      hi[r] = _mm512_fmadd_ps(x, b1, hi[r]);
    }
  }
  const __mmask16 ml = low_mask(cols), mh = high_mask(cols);
#pragma GCC unroll 12
  for (int r = 0; r < kRows; ++r) {
    if (r >= rows) break;
    float* cr = c + r * ldc;
    __m512 l = lo[r], h = hi[r];
    if (add) {
      l = _mm512_add_ps(_mm512_maskz_loadu_ps(ml, cr), l);
      h = _mm512_add_ps(_mm512_maskz_loadu_ps(mh, cr + 16), h);
    }
    _mm512_mask_storeu_ps(cr, ml, l);
    _mm512_mask_storeu_ps(cr + 16, mh, h);
  }
}

// 64-byte aligned scratch of at least n floats, one per thread, kept.
float* scratch(std::vector<float>& buffer, int64_t n) {
  buffer.resize(n + 16);
  const auto at = reinterpret_cast<uintptr_t>(buffer.data());
  return reinterpret_cast<float*>((at + 63) & ~uintptr_t(63));
}

}  // namespace

void sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
           int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) {
    if (!accumulate)
      for (int64_t i = 0; i < m; ++i) std::fill(c + i * ldc, c + i * ldc + n, 0.f);
    return;
  }
  thread_local std::vector<float> a_buffer, b_buffer;
  const int64_t depth_max = std::min(kDepth, k);
  float* bp = scratch(b_buffer, std::min(kColBlock, (n + kCols - 1) / kCols * kCols) * depth_max);
  float* ap = scratch(a_buffer, kRowBlock * depth_max);
  for (int64_t j0 = 0; j0 < n; j0 += kColBlock) {
    const int64_t cols = std::min(kColBlock, n - j0);
    for (int64_t p0 = 0; p0 < k; p0 += kDepth) {
      const int64_t depth = std::min(kDepth, k - p0);
      const bool add = accumulate || p0 > 0;
      pack_b(trans_b, b, ldb, p0, depth, j0, cols, bp);
      for (int64_t i0 = 0; i0 < m; i0 += kRowBlock) {
        const int64_t rows = std::min(kRowBlock, m - i0);
        pack_a(trans_a, a, lda, i0, rows, p0, depth, ap);
        for (int64_t j = 0; j < cols; j += kCols)
          for (int64_t i = 0; i < rows; i += kRows)
            tile(depth, ap + i * depth, bp + j * depth, c + (i0 + i) * ldc + j0 + j, ldc,
                 std::min<int64_t>(kRows, rows - i), std::min<int64_t>(kCols, cols - j), add);
      }
    }
  }
}
#else
// available() is false here, so nothing calls it.
void sgemm(bool, bool, int64_t, int64_t, int64_t, const float*, int64_t, const float*, int64_t, float*, int64_t,
           bool) {
  __builtin_trap();
}
#endif

}  // namespace hp::ops::gemm
