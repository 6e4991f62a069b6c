// bfloat16 storage and its conversions, as c10::BFloat16 does them: widening
// is exact, narrowing rounds to nearest even and turns every NaN into the
// quiet NaN 0x7FC0. vec.h applies the same rule lane by lane; tests/cpp
// checks the two agree. Arithmetic is always float32.
#pragma once

#include <cstdint>
#include <cstring>

// The two conversions also compile for the GPU (csrc/comm's device kernels),
// so that a CUDA reduction rounds exactly as the CPU's does.
#if defined(__CUDACC__)
#define HP_SIMD_HD __host__ __device__
#else
#define HP_SIMD_HD
#endif

namespace hp::simd {

inline HP_SIMD_HD float bf16_to_float(uint16_t bits) {
  const uint32_t wide = uint32_t(bits) << 16;
  float value;
  memcpy(&value, &wide, sizeof value);
  return value;
}

inline HP_SIMD_HD uint16_t float_to_bf16(float value) {
  if (value != value) return 0x7FC0;
  uint32_t bits;
  memcpy(&bits, &value, sizeof bits);
  return uint16_t((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// A float32 or bfloat16 element (its bits as uint16_t) to float32 and back:
// what kernels templated on the element type read and write.
template <typename T>
inline HP_SIMD_HD float to_float(T value) {
  if constexpr (sizeof(T) == 2)
    return bf16_to_float(value);
  else
    return value;
}

template <typename T>
inline HP_SIMD_HD T from_float(float value) {
  if constexpr (sizeof(T) == 2)
    return float_to_bf16(value);
  else
    return value;
}

// A bfloat16 element in memory (layout-compatible with c10::BFloat16 and
// torch's bfloat16 tensors' storage).
struct bf16 {
  uint16_t bits;
  bf16() = default;
  explicit bf16(float value) : bits(float_to_bf16(value)) {}
  explicit operator float() const { return bf16_to_float(bits); }
};
static_assert(sizeof(bf16) == 2);

}  // namespace hp::simd
