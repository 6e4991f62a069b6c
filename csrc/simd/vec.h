// Vector primitives for one instruction set. foreach_isa.h includes this
// file once per tier, each time inside a namespace and a `#pragma GCC
// target` region of its own, with HP_SIMD_WIDTH floats to a vector: there is
// deliberately no include guard. GCC's vector extensions become AVX-512, AVX2
// or SSE instructions according to that region.
//
// Loops run over whole vectors, then one partial vector: loads of a partial
// vector fill the missing lanes with a neutral value and stores write only
// the valid lanes, so every lane goes through the same arithmetic.

constexpr int W = HP_SIMD_WIDTH;
typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
typedef uint32_t vu __attribute__((vector_size(W * 4)));
typedef uint16_t vh __attribute__((vector_size(W * 2)));
using bf16 = ::hp::simd::bf16;

HP_INL vf splat(float x) { return vf{} + x; }

HP_INL vf load(const float* p, int64_t m, float pad = 0.f) {
  vf v = splat(pad);
  std::memcpy(&v, p, m * sizeof(float));
  return v;
}
HP_INL vf load(const bf16* p, int64_t m, float pad = 0.f) {
  vh h = {};
  std::memcpy(&h, p, m * sizeof(bf16));
  vf v = (vf)(__builtin_convertvector(h, vu) << 16);
  if (m < W) {
    for (int64_t l = m; l < W; ++l) v[l] = pad;
  }
  return v;
}

// simd::float_to_bf16 (bf16.h) on every lane, in the low 16 bits.
HP_INL vu bf16_bits(vf v) {
  vu u = (vu)v;
  vu rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  vu nan = (vu)(v != v);
  return (rounded & ~nan) | (0x7FC0u & nan);
}

HP_INL void store(float* p, vf v, int64_t m) { std::memcpy(p, &v, m * sizeof(float)); }
HP_INL void store(bf16* p, vf v, int64_t m) {
  vh h = __builtin_convertvector(bf16_bits(v), vh);
  std::memcpy(p, &h, m * sizeof(bf16));
}

// The value v holds after a round trip through storage type T: HF casts to
// the input dtype at these points, and bf16 results must round alike.
template <typename T>
HP_INL vf round_as(vf v) {
  if constexpr (std::is_same_v<T, bf16>) {
    return (vf)(bf16_bits(v) << 16);
  } else {
    return v;
  }
}

// body(i, m) for the vectors of [0, n): m == W but for the last.
template <class Body>
HP_INL void for_chunks(int64_t n, Body&& body) {
  int64_t i = 0;
  for (; i + W <= n; i += W) body(i, int64_t{W});
  if (i < n) body(i, n - i);
}

HP_INL float hsum(vf v) {
  float s = 0.f;
  for (int l = 0; l < W; ++l) s += v[l];
  return s;
}
HP_INL float hmax(vf v) {
  float s = v[0];
  for (int l = 1; l < W; ++l) s = s > v[l] ? s : v[l];
  return s;
}
HP_INL vf vmax(vf a, vf b) { return a > b ? a : b; }

// a * b + c rounded once, as ATen's vec::fmadd.
HP_INL vf vfma(vf a, vf b, vf c) {
#if HP_SIMD_WIDTH == 16
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif HP_SIMD_WIDTH == 8
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  vf r;
  for (int l = 0; l < W; ++l) r[l] = std::fma(a[l], b[l], c[l]);
  return r;
#endif
}
