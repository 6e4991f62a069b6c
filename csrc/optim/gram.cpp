#include "gram.h"

#include <algorithm>
#include <cstring>

#include "simd/isa.h"

#if defined(__x86_64__)
// GCC 12 reports the intrinsics' own placeholder (__Y, _mm512_undefined_*'s)
// as maybe uninitialized where they inline into the emulated kernels: a false
// positive inside its header, silenced there only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

namespace hp::optim::gram {

Kind kind() {
  static const Kind here = simd::avx512_bf16()                  ? Kind::dot
                           : simd::isa() == simd::Isa::avx512 ? Kind::emulated
                                                              : Kind::none;
  return here;
}

bool fits(int64_t rows, int64_t cols, int64_t k, int threads) {
  if (rows < 2 || cols < 2 || k <= 0 || k % 2 != 0 || rows * cols * k <= 4096) return false;
  if (kind() != Kind::emulated) return true;
  if (k > 384 && k < 1536 && k % 4 != 0) return false;
  const int64_t outputs = rows * cols, team = std::max(threads, 1);
  const int64_t larger = (outputs + team - 1) / team, smaller = larger - 1, with_larger = outputs - smaller * team;
  for (int64_t t = 0; t < team; ++t) {
    const int64_t start = t <= with_larger ? t * larger : with_larger * larger + (t - with_larger) * smaller;
    const int64_t size = t < with_larger ? larger : smaller;
    if (size > 0 && (start % cols != 0 || size % cols != 0 || size / cols < 2)) return false;
  }
  return true;
}

int64_t packed_words(int64_t m, int64_t k) {
  const int64_t rows = (m + kBlock - 1) / kBlock * kBlock;
  return kind() == Kind::emulated ? rows * k : rows * (k / 2);
}

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
#define HP_GRAM_EMULATED_TARGET HP_SIMD_TARGET(HP_SIMD_AVX512)

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

// The bfloat16 at p in the lanes of `mask` (zeros in the others), as floats.
HP_GRAM_EMULATED_TARGET inline __m512 load_bf16(__mmask16 mask, const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
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
      if (c) v = _mm512_fmadd_ps(load_bf16(mask, c + at), vb, _mm512_mul_ps(v, va));
      _mm256_mask_storeu_epi16(out + at, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
}

// ---------------------------------------------------------------------------
// Emulated (gemm:jit:bf16's sums, see gram.h).

// The end of the k block (in pairs) that starts at pair q0.
int64_t emulated_block_end(int64_t k, int64_t q0) {
  const int64_t pairs = k / 2;
  if (k <= 384) return pairs;
  if (k <= 1536) return q0 == 0 ? pairs / 2 : pairs;  // halves (fits: pairs even)
  return std::min(q0 + 384, pairs);
}

// Pairs of k summed per pass over a 32-row block's tiles: the block's and
// the column block's floats for them (2 x 64 pairs x 64 floats x 4 bytes =
// 32 KiB) stay in the L1 data cache (48 KiB on Ice Lake) while all of the
// block's tiles read them. At k = 512 each is 64 KiB whole, and every tile
// streamed both from L2: a tile alone runs at about 150 GF/s from L1 and 125
// from L2 on one Ice Lake core; Newton-Schulz of 8 x 384 x 512 took 3% less
// time with the chunks.
constexpr int64_t kChunkPairs = 64;

// Pairs [from, to) of a k block, and how they stand in it: the sums start
// from zero (`fresh`) or go on from the last chunk's; the chunk closes the
// k block as its first (`first_block`), as a later one (`later_block`), or
// not (`open`).
struct Chunk {
  int64_t from, to;
  bool fresh;
  enum { open, first_block, later_block } closes;
};

// For rows [i, i + MR) of a 32-row block (`a`: the block's packed floats),
// the sums (MR x 32 floats at row i of `sums`) over the chunk's pairs of
// those rows · the packed column block `b`, each pair's odd k before its
// even one; when the chunk closes a k block, totals = alpha * sum (the
// first) or fma(sum, alpha, totals). A sum carried between chunks goes
// through memory: float stores are exact, so the chunks change no bit.
template <int MR>
HP_GRAM_EMULATED_TARGET void chunk_emulated(const float* a, int64_t i, const float* b, const Chunk& chunk,
                                            float alpha, float* sums, float* totals) {
  a += i;
  sums += i * kBlock;
  totals += i * kBlock;
  __m512 sum[MR][2];
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < 2; ++h) sum[r][h] = _mm512_setzero_ps();
  if (!chunk.fresh)
    for (int r = 0; r < MR; ++r)
      for (int h = 0; h < 2; ++h) sum[r][h] = _mm512_loadu_ps(sums + r * kBlock + h * 16);
  for (int64_t q = chunk.from; q < chunk.to; ++q) {
    const float* bq = b + q * 2 * kBlock;
    const __m512 odd0 = _mm512_loadu_ps(bq), odd1 = _mm512_loadu_ps(bq + 16);
    const __m512 even0 = _mm512_loadu_ps(bq + kBlock), even1 = _mm512_loadu_ps(bq + kBlock + 16);
    const float* aq = a + q * 2 * kBlock;
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      const __m512 odd = _mm512_set1_ps(aq[r]), even = _mm512_set1_ps(aq[kBlock + r]);
      sum[r][0] = _mm512_fmadd_ps(odd, odd0, sum[r][0]);
      sum[r][1] = _mm512_fmadd_ps(odd, odd1, sum[r][1]);
      sum[r][0] = _mm512_fmadd_ps(even, even0, sum[r][0]);
      sum[r][1] = _mm512_fmadd_ps(even, even1, sum[r][1]);
    }
  }
  const __m512 va = _mm512_set1_ps(alpha);
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < 2; ++h) {
      const int64_t at = r * kBlock + h * 16;
      if (chunk.closes == Chunk::open)
        _mm512_storeu_ps(sums + at, sum[r][h]);
      else
        _mm512_storeu_ps(totals + at, chunk.closes == Chunk::first_block
                                          ? _mm512_mul_ps(sum[r][h], va)
                                          : _mm512_fmadd_ps(sum[r][h], va, _mm512_loadu_ps(totals + at)));
    }
}

// out rows [i, i + rows) of the column block [j0, j0 + cols) from their
// totals: fma(c, beta, total) when there is an addend c, rounded to bfloat16
// (simd::float_to_bf16's rounding, without the instruction this CPU lacks).
// out and c have rows of `ld` elements.
HP_GRAM_EMULATED_TARGET void store_emulated(const float* totals, int64_t rows, int64_t ld, int64_t i, int64_t j0,
                                            int64_t cols, const uint16_t* c, float beta, uint16_t* out) {
  const __m512 vb = _mm512_set1_ps(beta);
  const __m512i half = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1), nan = _mm512_set1_epi32(0x7FC0);
  for (int64_t r = 0; r < rows; ++r)
    for (int h = 0; h < 2; ++h) {
      const int64_t n = std::clamp<int64_t>(cols - 16 * h, 0, 16);
      if (n == 0) break;
      const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
      const int64_t at = (i + r) * ld + j0 + 16 * h;
      __m512 v = _mm512_loadu_ps(totals + r * kBlock + h * 16);
      if (c) v = _mm512_fmadd_ps(load_bf16(mask, c + at), vb, v);
      const __m512i u = _mm512_castps_si512(v);
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
      __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(half, lsb)), 16);
      rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), nan);
      _mm256_mask_storeu_epi16(out + at, mask, _mm512_cvtepi32_epi16(rounded));
    }
}

// Rows [0, rows) of the output's column block [j0, j0 + cols): `a` is the
// packed rows, `b` the packed column block.
void block_emulated(const float* a, const float* b, int64_t rows, int64_t ld, int64_t k, int64_t j0, int64_t cols,
                    const uint16_t* c, float beta, float alpha, uint16_t* out) {
  alignas(64) float sums[kBlock * kBlock], totals[kBlock * kBlock];
  for (int64_t r0 = 0; r0 < rows; r0 += kBlock) {
    // Tiles stay within a packed 32-row block: their rows' floats share a base.
    const float* block = a + r0 * k;
    const int64_t height = std::min(kBlock, rows - r0);
    for (int64_t q0 = 0, pairs = k / 2; q0 < pairs;) {
      const int64_t q1 = emulated_block_end(k, q0);
      for (int64_t s = q0; s < q1; s += kChunkPairs) {
        const int64_t e = std::min(s + kChunkPairs, q1);
        const Chunk chunk{s, e, s == q0, e < q1 ? Chunk::open : q0 == 0 ? Chunk::first_block : Chunk::later_block};
        // 32 rows as 12 + 12 + 8: every row in a tile that reuses each load
        // of b for 8 or more rows.
        int64_t i = 0;
        for (; i + 12 <= height; i += 12) chunk_emulated<12>(block, i, b, chunk, alpha, sums, totals);
        for (; i + 8 <= height; i += 8) chunk_emulated<8>(block, i, b, chunk, alpha, sums, totals);
        for (; i + 4 <= height; i += 4) chunk_emulated<4>(block, i, b, chunk, alpha, sums, totals);
        for (; i < height; ++i) chunk_emulated<1>(block, i, b, chunk, alpha, sums, totals);
      }
      q0 = q1;
    }
    store_emulated(totals, height, ld, r0, j0, cols, c, beta, out);
  }
}

void upper_block_dot(const uint16_t* y, const uint32_t* packed, int64_t m, int64_t k, int64_t block,
                     const uint16_t* c, float beta, float alpha, uint16_t* out) {
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

}  // namespace

void upper_block(const uint16_t* y, const uint32_t* packed, int64_t m, int64_t k, int64_t block, const uint16_t* c,
                 float beta, float alpha, uint16_t* out) {
  if (kind() == Kind::emulated) {
    const auto* floats = reinterpret_cast<const float*>(packed);
    const int64_t j0 = block * kBlock, cols = std::min(kBlock, m - j0);
    block_emulated(floats, floats + j0 * k, j0 + cols, m, k, j0, cols, c, beta, alpha, out);
  } else {
    upper_block_dot(y, packed, m, k, block, c, beta, alpha, out);
  }
}

HP_GRAM_EMULATED_TARGET void pack_transposed(const uint16_t* z, int64_t k, int64_t m, uint32_t* out) {
  auto* packed = reinterpret_cast<float*>(out);
  for (int64_t j0 = 0; j0 < m; j0 += kBlock) {
    float* block = packed + j0 * k;
    const int64_t cols = std::min(kBlock, m - j0);
    const __mmask16 low = static_cast<__mmask16>((1u << std::min<int64_t>(cols, 16)) - 1);
    const __mmask16 high = static_cast<__mmask16>((1u << std::clamp<int64_t>(cols - 16, 0, 16)) - 1);
    for (int64_t q = 0; q < k / 2; ++q)
      for (int e = 0; e < 2; ++e) {  // the odd k's row first, then the even k's
        const uint16_t* row = z + (2 * q + 1 - e) * m + j0;
        float* dst = block + (2 * q + e) * kBlock;
        _mm512_storeu_ps(dst, load_bf16(low, row));
        _mm512_storeu_ps(dst + 16, load_bf16(high, row + 16));
      }
  }
}

void product_block(const uint32_t* a, const uint32_t* bt, int64_t m, int64_t n, int64_t k, int64_t block,
                   const uint16_t* c, float beta, float alpha, uint16_t* out) {
  const auto* rows = reinterpret_cast<const float*>(a);
  const int64_t j0 = block * kBlock, cols = std::min(kBlock, n - j0);
  block_emulated(rows, reinterpret_cast<const float*>(bt) + j0 * k, m, n, k, j0, cols, c, beta, alpha, out);
}
#else
// available() is false here, so nothing calls it.
void upper_block(const uint16_t*, const uint32_t*, int64_t, int64_t, int64_t, const uint16_t*, float, float,
                 uint16_t*) {
  __builtin_trap();
}
void product_block(const uint32_t*, const uint32_t*, int64_t, int64_t, int64_t, int64_t, const uint16_t*, float,
                   float, uint16_t*) {
  __builtin_trap();
}
void pack_transposed(const uint16_t*, int64_t, int64_t, uint32_t*) { __builtin_trap(); }
#endif

}  // namespace hp::optim::gram
