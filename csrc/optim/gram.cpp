#include "gram.h"

#include <algorithm>
#include <cstring>

#include "simd/isa.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace hp::optim::gram {

bool available() { return simd::avx512_bf16(); }

void pack(const uint16_t* y, int64_t m, int64_t k, uint32_t* packed) {
  const int64_t pairs = k / 2;
  const auto* words = reinterpret_cast<const uint32_t*>(y);  // a pair of bfloat16 is one word: no arithmetic
  for (int64_t j0 = 0; j0 < m; j0 += kBlock) {
    uint32_t* block = packed + j0 * pairs;
    const int64_t rows = std::min(kBlock, m - j0);
    if (rows < kBlock) std::memset(block, 0, sizeof(uint32_t) * kBlock * pairs);
    // 4 x 4 words at a time by register transposes; the rest one by one.
    const int64_t rows4 = rows / 4 * 4, pairs4 = pairs / 4 * 4;
#if defined(__SSE2__)
    for (int64_t r = 0; r < rows4; r += 4)
      for (int64_t q = 0; q < pairs4; q += 4) {
        const uint32_t* src = words + (j0 + r) * pairs + q;
        const __m128i r0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
        const __m128i r1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + pairs));
        const __m128i r2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * pairs));
        const __m128i r3 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 3 * pairs));
        const __m128i lo01 = _mm_unpacklo_epi32(r0, r1), hi01 = _mm_unpackhi_epi32(r0, r1);
        const __m128i lo23 = _mm_unpacklo_epi32(r2, r3), hi23 = _mm_unpackhi_epi32(r2, r3);
        uint32_t* dst = block + q * kBlock + r;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm_unpacklo_epi64(lo01, lo23));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + kBlock), _mm_unpackhi_epi64(lo01, lo23));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * kBlock), _mm_unpacklo_epi64(hi01, hi23));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 3 * kBlock), _mm_unpackhi_epi64(hi01, hi23));
      }
#else
    for (int64_t r = 0; r < rows4; ++r)
      for (int64_t q = 0; q < pairs4; ++q) block[q * kBlock + r] = words[(j0 + r) * pairs + q];
#endif
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t q = r < rows4 ? pairs4 : 0; q < pairs; ++q) block[q * kBlock + r] = words[(j0 + r) * pairs + q];
  }
}

#if defined(__x86_64__)
namespace {

#define HP_GRAM_TARGET HP_SIMD_TARGET(HP_SIMD_AVX512_BF16)

// The blocks of k oneDNN sums separately (see gram.h), in elements.
int64_t k_block(int64_t k) { return k <= 512 ? k : k <= 1024 ? 512 : 1024; }

// acc (MR x 32 floats) = rows a[0..MR) (row stride `pairs` words) · the
// packed block's 32 columns, k summed in oneDNN's blocks.
template <int MR>
HP_GRAM_TARGET void tile(const uint32_t* a, const uint32_t* b, int64_t pairs, int64_t block_pairs, float* acc) {
  for (int64_t q0 = 0; q0 < pairs; q0 += block_pairs) {
    const int64_t q1 = std::min(q0 + block_pairs, pairs);
    __m512 sum[MR][2];
    for (int r = 0; r < MR; ++r) sum[r][0] = sum[r][1] = _mm512_setzero_ps();
    for (int64_t q = q0; q < q1; ++q) {
      const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + q * kBlock);
      const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + q * kBlock + 16);
#pragma GCC unroll 12
      for (int r = 0; r < MR; ++r) {
        const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[r * pairs + q]));
        sum[r][0] = _mm512_dpbf16_ps(sum[r][0], x, b0);
        sum[r][1] = _mm512_dpbf16_ps(sum[r][1], x, b1);
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int h = 0; h < 2; ++h) {
        float* dst = acc + r * kBlock + h * 16;
        _mm512_storeu_ps(dst, q0 == 0 ? sum[r][h] : _mm512_add_ps(_mm512_loadu_ps(dst), sum[r][h]));
      }
  }
}

// out rows [i, i + MR) of the block's columns from acc, with the post-op.
HP_GRAM_TARGET void store(const float* acc, int rows, int64_t m, int64_t i, int64_t j0, int64_t cols,
                          const uint16_t* c, float beta, float alpha, uint16_t* out) {
  const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
  for (int r = 0; r < rows; ++r)
    for (int h = 0; h < 2; ++h) {
      const int64_t n = std::clamp<int64_t>(cols - 16 * h, 0, 16);
      if (n == 0) break;
      const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
      const int64_t at = (i + r) * m + j0 + 16 * h;
      __m512 v = _mm512_loadu_ps(acc + r * kBlock + h * 16);
      if (c) {
        const __m256i bits = _mm256_maskz_loadu_epi16(mask, c + at);
        const __m512 cv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
        v = _mm512_fmadd_ps(cv, vb, _mm512_mul_ps(v, va));
      }
      _mm256_mask_storeu_epi16(out + at, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
}

}  // namespace

void upper_block(const uint16_t* y, const uint32_t* packed, int64_t m, int64_t k, int64_t block, const uint16_t* c,
                 float beta, float alpha, uint16_t* out) {
  const int64_t pairs = k / 2, block_pairs = k_block(k) / 2;
  const int64_t j0 = block * kBlock, cols = std::min(kBlock, m - j0), rows = j0 + cols;
  const auto* words = reinterpret_cast<const uint32_t*>(y);
  const uint32_t* b = packed + j0 * pairs;
  alignas(64) float acc[12 * kBlock];
  int64_t i = 0;
  for (; i + 12 <= rows; i += 12) {
    tile<12>(words + i * pairs, b, pairs, block_pairs, acc);
    store(acc, 12, m, i, j0, cols, c, beta, alpha, out);
  }
  for (; i + 4 <= rows; i += 4) {
    tile<4>(words + i * pairs, b, pairs, block_pairs, acc);
    store(acc, 4, m, i, j0, cols, c, beta, alpha, out);
  }
  for (; i < rows; ++i) {
    tile<1>(words + i * pairs, b, pairs, block_pairs, acc);
    store(acc, 1, m, i, j0, cols, c, beta, alpha, out);
  }
}
#else
// available() is false here, so nothing calls it.
void upper_block(const uint16_t*, const uint32_t*, int64_t, int64_t, int64_t, const uint16_t*, float, float,
                 uint16_t*) {
  __builtin_trap();
}
#endif

}  // namespace hp::optim::gram
