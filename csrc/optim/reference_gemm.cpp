#include "reference_gemm.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "simd/bf16.h"
#include "simd/isa.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace hp::optim::reference_gemm {

bool available() {
  static const bool yes = simd::cpu_isa() == simd::Isa::avx2 && !simd::cpu_native_bf16();
  return yes && simd::isa() == simd::Isa::avx2;
}

#if defined(__x86_64__)
namespace {

using simd::bf16_to_float;
using simd::float_to_bf16;

#define HP_REF_TARGET HP_SIMD_TARGET(HP_SIMD_AVX2)
// The accumulators stay in registers only if every loop over them unrolls.
#define HP_UNROLL _Pragma("GCC unroll 16")

HP_REF_TARGET inline __m256 load_bf16(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

HP_REF_TARGET inline void store_bf16(uint16_t* p, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i bias =
      _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1)));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

// The epilogue of every order, for one element (c is read only when beta is
// not 0).
HP_REF_TARGET inline uint16_t finish(float sum, float alpha, float beta, const uint16_t* c) {
  sum *= alpha;
  if (beta != 0.0f) sum = __builtin_fmaf(beta, bf16_to_float(*c), sum);
  return float_to_bf16(sum);
}

// Elements of k per stretch of a dot block: its 6 rows' stretches (24 KiB)
// fit L1.
constexpr int64_t kDotStretch = 1024;

// Within 8 lanes: ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)).
HP_REF_TARGET inline float lanes(__m256 v) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

// Rows and columns per dot block.
constexpr int64_t kDotBlock = 3;

// The dots order for an R x C block of dot products: rows [i0, i0 + R) of a
// with rows [j0, j0 + C) of b (both k wide), into sums[0..R)[0..C). Each of a
// dot's 8 accumulator vectors sums only the chunks' lanes 8 v .. 8 v + 7,
// independently of the others, so the block runs them one v at a time: R + C
// loads feed R C FMAs, where a dot alone loads twice per FMA. The products
// are exact, so an FMA adds the same value as an add.
template <int R, int C>
HP_REF_TARGET void dot_block(const float* rows_a, int64_t i0, const float* rows_b, int64_t j0, int64_t k,
                             float (*sums)[kDotBlock]) {
  const float* a[R];
  const float* b[C];
  for (int i = 0; i < R; ++i) a[i] = rows_a + (i0 + i) * k;
  for (int j = 0; j < C; ++j) b[j] = rows_b + (j0 + j) * k;
  const int64_t k64 = k / 64 * 64;
  alignas(32) float acc[R][C][64] = {};
  // k in stretches of kDotStretch, so that the block's rows stay in L1 over
  // the 8 passes; each accumulator still adds its chunks in order.
  for (int64_t from = 0; from < k64; from += kDotStretch) {
    const int64_t to = std::min(k64, from + kDotStretch);
    for (int v = 0; v < 8; ++v) {
      __m256 s[R][C];
      HP_UNROLL
      for (int t = 0; t < R * C; ++t) s[t / C][t % C] = _mm256_load_ps(acc[t / C][t % C] + 8 * v);
      for (int64_t l = from + 8 * v; l < to; l += 64) {
        __m256 av[R];
        HP_UNROLL
        for (int i = 0; i < R; ++i) av[i] = _mm256_loadu_ps(a[i] + l);
        HP_UNROLL
        for (int j = 0; j < C; ++j) {
          const __m256 bv = _mm256_loadu_ps(b[j] + l);
          HP_UNROLL
          for (int i = 0; i < R; ++i) s[i][j] = _mm256_fmadd_ps(av[i], bv, s[i][j]);
        }
      }
      HP_UNROLL
      for (int t = 0; t < R * C; ++t) _mm256_store_ps(acc[t / C][t % C] + 8 * v, s[t / C][t % C]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) {
      __m256 t[8];
      for (int v = 0; v < 8; ++v) t[v] = _mm256_load_ps(acc[i][j] + 8 * v);
      for (int v = 0; v < 4; ++v) t[v] = _mm256_add_ps(t[v], t[v + 4]);  // 32 apart
      for (int v = 0; v < 2; ++v) t[v] = _mm256_add_ps(t[v], t[v + 2]);  // 16 apart
      float sum = lanes(_mm256_add_ps(t[0], t[1]));                      // 8 apart
      __m256 tail = _mm256_setzero_ps();
      int64_t l = k64;
      for (; l + 16 <= k; l += 16) {
        tail = _mm256_fmadd_ps(_mm256_loadu_ps(a[i] + l), _mm256_loadu_ps(b[j] + l), tail);
        tail = _mm256_fmadd_ps(_mm256_loadu_ps(a[i] + l + 8), _mm256_loadu_ps(b[j] + l + 8), tail);
      }
      sum += lanes(tail);
      for (; l < k; ++l) sum += a[i][l] * b[j][l];
      sums[i][j] = sum;
    }
}

// sums = a[i0, i0 + r) · b[j0, j0 + c), for r, c in [1, kDotBlock].
void dots_at(const float* a, int64_t i0, int64_t r, const float* b, int64_t j0, int64_t c, int64_t k,
             float sums[kDotBlock][kDotBlock]) {
  if (r == 3 && c == 3) return dot_block<3, 3>(a, i0, b, j0, k, sums);
  // Edges: one row at a time, up to three columns.
  for (int64_t i = 0; i < r; ++i) {
    if (c == 3) dot_block<1, 3>(a, i0 + i, b, j0, k, sums + i);
    if (c == 2) dot_block<1, 2>(a, i0 + i, b, j0, k, sums + i);
    if (c == 1) dot_block<1, 1>(a, i0 + i, b, j0, k, sums + i);
  }
}

// Row blocks paired first with last, second with second to last, ...: a
// pair's share of a triangle is the same for every pair.
void triangle_tasks(int64_t blocks, const Parallel& parallel, const std::function<void(int64_t)>& block) {
  parallel((blocks + 1) / 2, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      block(p);
      if (blocks - 1 - p != p) block(blocks - 1 - p);
    }
  });
}

// Columns per panel of the product: three vectors of eight; rows per block.
constexpr int64_t kPanel = 24;
constexpr int kProductRows = 4;

// The product order for R rows of a and a panel of NV vectors of b (packed
// as k rows of 8 NV floats). Partial q sums only l = q mod 4, independently
// of the other three, so the block runs them one q at a time: R broadcasts
// and NV loads feed R NV FMAs.
template <int R, int NV>
HP_REF_TARGET void product_block(const float* a, int64_t k, const float* packed, const uint16_t* c, int64_t ldc,
                                 float beta, float alpha, uint16_t* out, int64_t ldo) {
  const int64_t k4 = k / 4 * 4;
  __m256 part[4][R][NV];
  for (int q = 0; q < 4; ++q) {
    __m256 s[R][NV] = {};
    auto add = [&](int64_t l) HP_REF_TARGET {
      __m256 bv[NV];
      HP_UNROLL
      for (int v = 0; v < NV; ++v) bv[v] = _mm256_loadu_ps(packed + l * 8 * NV + 8 * v);
      HP_UNROLL
      for (int i = 0; i < R; ++i) {
        const __m256 x = _mm256_broadcast_ss(a + i * k + l);
        HP_UNROLL
        for (int v = 0; v < NV; ++v) s[i][v] = _mm256_fmadd_ps(x, bv[v], s[i][v]);
      }
    };
    for (int64_t l = q; l < k4; l += 4) add(l);
    if (q == 0)
      for (int64_t l = k4; l < k; ++l) add(l);
    HP_UNROLL
    for (int t = 0; t < R * NV; ++t) part[q][t / NV][t % NV] = s[t / NV][t % NV];
  }
  const __m256 va = _mm256_set1_ps(alpha), vb = _mm256_set1_ps(beta);
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < NV; ++v) {
      __m256 sum =
          _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(part[0][i][v], part[1][i][v]), part[2][i][v]), part[3][i][v]);
      sum = _mm256_mul_ps(va, sum);
      if (beta != 0.0f) sum = _mm256_fmadd_ps(vb, load_bf16(c + i * ldc + 8 * v), sum);
      store_bf16(out + i * ldo + 8 * v, sum);
    }
}

template <int NV>
void product_panel(const float* a, int64_t m, int64_t k, const float* packed, const uint16_t* c, int64_t n, float beta,
                   float alpha, uint16_t* out) {
  int64_t i = 0;
  for (; i + kProductRows <= m; i += kProductRows)
    product_block<kProductRows, NV>(a + i * k, k, packed, c ? c + i * n : nullptr, n, beta, alpha, out + i * n, n);
  for (; i < m; ++i)
    product_block<1, NV>(a + i * k, k, packed, c ? c + i * n : nullptr, n, beta, alpha, out + i * n, n);
}

// The product order for one column (the last n mod 8).
float column_sum(const float* a, const float* b, int64_t k, int64_t n) {
  float p[4] = {0, 0, 0, 0};
  int64_t l = 0;
  for (; l + 4 <= k; l += 4)
    for (int q = 0; q < 4; ++q) p[q] += a[l + q] * b[(l + q) * n];
  for (; l < k; ++l) p[0] += a[l] * b[l * n];
  return ((p[0] + p[1]) + p[2]) + p[3];
}

// The gram_sequential order for rows [i0, i0 + R) and the NV vectors of
// columns from j0: one accumulator per element, y's rows in order.
template <int R, int NV>
HP_REF_TARGET void sequential_block(const float* y, int64_t k, int64_t m, int64_t i0, int64_t j0, uint16_t* out) {
  __m256 s[R][NV] = {};
  for (int64_t l = 0; l < k; ++l) {
    const float* row = y + l * m;
    __m256 bv[NV];
    HP_UNROLL
    for (int v = 0; v < NV; ++v) bv[v] = _mm256_loadu_ps(row + j0 + 8 * v);
    HP_UNROLL
    for (int i = 0; i < R; ++i) {
      const __m256 x = _mm256_broadcast_ss(row + i0 + i);
      HP_UNROLL
      for (int v = 0; v < NV; ++v) s[i][v] = _mm256_fmadd_ps(x, bv[v], s[i][v]);
    }
  }
  // Rows [i0, i0 + R) are this task's; mirror() fills the rest afterwards.
  alignas(32) float sums[8 * NV];
  HP_UNROLL
  for (int i = 0; i < R; ++i) {
    HP_UNROLL
    for (int v = 0; v < NV; ++v) _mm256_store_ps(sums + 8 * v, s[i][v]);
    for (int64_t j = 0; j < 8 * NV; ++j) out[(i0 + i) * m + j0 + j] = float_to_bf16(sums[j]);
  }
}

template <int R>
void sequential_rows(const float* y, int64_t k, int64_t m, int64_t i0, uint16_t* out) {
  const int64_t m8 = m / 8 * 8;
  int64_t j0 = i0 / 8 * 8;
  for (; j0 + kPanel <= m8; j0 += kPanel) sequential_block<R, 3>(y, k, m, i0, j0, out);
  for (; j0 + 8 <= m8; j0 += 8) sequential_block<R, 1>(y, k, m, i0, j0, out);
  for (int64_t i = i0; i < i0 + R; ++i)
    for (int64_t j = std::max(m8, i); j < m; ++j) {
      float sum = 0.0f;
      for (int64_t l = 0; l < k; ++l) sum += y[l * m + i] * y[l * m + j];
      out[i * m + j] = float_to_bf16(sum);
    }
}

// out's lower triangle from its upper one, after every task has written its
// rows: writing both from the tasks would have threads write the same cache
// lines (a column of the upper triangle is a row of the lower one).
void mirror(uint16_t* out, int64_t m, const Parallel& parallel) {
  parallel(m, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int64_t j = 0; j < i; ++j) out[i * m + j] = out[j * m + i];
  });
}

}  // namespace

void gram(const float* x, int64_t m, int64_t k, uint16_t* out, const Parallel& parallel) {
  const int64_t blocks = (m + kDotBlock - 1) / kDotBlock;
  triangle_tasks(blocks, parallel, [&](int64_t bi) {
    const int64_t i0 = bi * kDotBlock, r = std::min(kDotBlock, m - i0);
    for (int64_t j0 = i0; j0 < m; j0 += kDotBlock) {
      const int64_t c = std::min(kDotBlock, m - j0);
      float sums[kDotBlock][kDotBlock];
      dots_at(x, i0, r, x, j0, c, k, sums);
      for (int64_t i = 0; i < r; ++i)
        for (int64_t j = 0; j < c; ++j) out[(i0 + i) * m + j0 + j] = float_to_bf16(sums[i][j]);
    }
  });
  mirror(out, m, parallel);  // x_i · x_j and x_j · x_i: the same products in the same order
}

void gram_sequential(const float* y, int64_t k, int64_t m, uint16_t* out, const Parallel& parallel) {
  const int64_t blocks = (m + kProductRows - 1) / kProductRows;
  triangle_tasks(blocks, parallel, [&](int64_t bi) {
    const int64_t i0 = bi * kProductRows;
    switch (std::min<int64_t>(kProductRows, m - i0)) {
      case 4:
        return sequential_rows<4>(y, k, m, i0, out);
      case 3:
        return sequential_rows<3>(y, k, m, i0, out);
      case 2:
        return sequential_rows<2>(y, k, m, i0, out);
      default:
        return sequential_rows<1>(y, k, m, i0, out);
    }
  });
  mirror(out, m, parallel);
}

void dots(const float* a, const float* b, int64_t m, int64_t n, int64_t k, const uint16_t* c, float beta, float alpha,
          uint16_t* out, const Parallel& parallel) {
  if (beta == 0.0f) c = nullptr;
  parallel((m + kDotBlock - 1) / kDotBlock, [&](int64_t begin, int64_t end) {
    for (int64_t bi = begin; bi < end; ++bi) {
      const int64_t i0 = bi * kDotBlock, r = std::min(kDotBlock, m - i0);
      for (int64_t j0 = 0; j0 < n; j0 += kDotBlock) {
        const int64_t cols = std::min(kDotBlock, n - j0);
        float sums[kDotBlock][kDotBlock];
        dots_at(a, i0, r, b, j0, cols, k, sums);
        for (int64_t i = 0; i < r; ++i)
          for (int64_t j = 0; j < cols; ++j) {
            const int64_t at = (i0 + i) * n + j0 + j;
            out[at] = finish(sums[i][j], alpha, beta, c ? c + at : nullptr);
          }
      }
    }
  });
}

void product(const float* a, const float* b, int64_t m, int64_t k, int64_t n, const uint16_t* c, float beta,
             float alpha, uint16_t* out, const Parallel& parallel) {
  const int64_t n8 = n / 8 * 8;
  if (beta == 0.0f) c = nullptr;
  // A task is a band of rows and packs each panel of b for itself: a copy of
  // k x 24 floats against the band's rows x k x 24 FMAs.
  parallel((m + kProductRows - 1) / kProductRows, [&](int64_t begin, int64_t end) {
    const int64_t i0 = begin * kProductRows, rows = std::min(m, end * kProductRows) - i0;
    const float* band = a + i0 * k;
    const uint16_t* band_c = c ? c + i0 * n : nullptr;
    uint16_t* band_out = out + i0 * n;
    std::vector<float> packed;
    for (int64_t j0 = 0; j0 < n8; j0 += kPanel) {
      const int64_t width = std::min(kPanel, n8 - j0);
      packed.resize(std::size_t(k * width));
      for (int64_t l = 0; l < k; ++l) std::memcpy(&packed[l * width], b + l * n + j0, sizeof(float) * width);
      const uint16_t* panel_c = band_c ? band_c + j0 : nullptr;
      if (width == 24) product_panel<3>(band, rows, k, packed.data(), panel_c, n, beta, alpha, band_out + j0);
      if (width == 16) product_panel<2>(band, rows, k, packed.data(), panel_c, n, beta, alpha, band_out + j0);
      if (width == 8) product_panel<1>(band, rows, k, packed.data(), panel_c, n, beta, alpha, band_out + j0);
    }
    for (int64_t j = n8; j < n; ++j)  // the last n mod 8 columns, one at a time
      for (int64_t i = 0; i < rows; ++i)
        band_out[i * n + j] =
            finish(column_sum(band + i * k, b + j, k, n), alpha, beta, band_c ? band_c + i * n + j : nullptr);
  });
}
#else
// available() is false here, so nothing calls them.
void gram(const float*, int64_t, int64_t, uint16_t*, const Parallel&) { __builtin_trap(); }
void gram_sequential(const float*, int64_t, int64_t, uint16_t*, const Parallel&) { __builtin_trap(); }
void dots(const float*, const float*, int64_t, int64_t, int64_t, const uint16_t*, float, float, uint16_t*,
          const Parallel&) {
  __builtin_trap();
}
void product(const float*, const float*, int64_t, int64_t, int64_t, const uint16_t*, float, float, uint16_t*,
             const Parallel&) {
  __builtin_trap();
}
#endif

}  // namespace hp::optim::reference_gemm
