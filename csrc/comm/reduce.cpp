#include "hyperparallel/comm/reduce.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <type_traits>

namespace hp::comm {
namespace {

// Blocks small enough that the fp32 accumulator stays in L1.
constexpr std::size_t kBlock = 2048;

// Each kernel is compiled for AVX-512, AVX2 and plain x86-64; the loader
// picks the best the CPU has. The loops are written for the vectoriser.
#if defined(__x86_64__) && !defined(__clang__)
#define HP_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define HP_VECTOR_CLONES
#endif

inline float bf16_to_float(uint16_t bits) {
  uint32_t wide = uint32_t(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof value);
  return value;
}

inline uint16_t float_to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x40);  // NaN stays NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest, ties to even
  return uint16_t(bits >> 16);
}

HP_VECTOR_CLONES
void reduce_f32(float* out, const float* const* srcs, int count, std::size_t n, float scale) {
  float acc[kBlock];
  for (std::size_t base = 0; base < n; base += kBlock) {
    const std::size_t len = std::min(kBlock, n - base);
    const float* first = srcs[0] + base;
    for (std::size_t i = 0; i < len; ++i) acc[i] = first[i];
    for (int s = 1; s < count; ++s) {
      const float* src = srcs[s] + base;
      for (std::size_t i = 0; i < len; ++i) acc[i] += src[i];
    }
    float* dst = out + base;
    if (scale == 1.0f) {
      for (std::size_t i = 0; i < len; ++i) dst[i] = acc[i];
    } else {
      for (std::size_t i = 0; i < len; ++i) dst[i] = acc[i] * scale;
    }
  }
}

// Out is uint16_t (bf16, rounded) or float (the fp32 sum itself).
template <typename Out>
HP_VECTOR_CLONES void reduce_bf16(Out* out, const uint16_t* const* srcs, int count, std::size_t n, float scale) {
  float acc[kBlock];
  for (std::size_t base = 0; base < n; base += kBlock) {
    const std::size_t len = std::min(kBlock, n - base);
    const uint16_t* first = srcs[0] + base;
    for (std::size_t i = 0; i < len; ++i) acc[i] = bf16_to_float(first[i]);
    for (int s = 1; s < count; ++s) {
      const uint16_t* src = srcs[s] + base;
      for (std::size_t i = 0; i < len; ++i) acc[i] += bf16_to_float(src[i]);
    }
    Out* dst = out + base;
    if constexpr (std::is_same_v<Out, float>) {
      for (std::size_t i = 0; i < len; ++i) dst[i] = acc[i] * scale;
    } else {
      for (std::size_t i = 0; i < len; ++i) dst[i] = float_to_bf16(acc[i] * scale);
    }
  }
}

}  // namespace

std::size_t dtype_size(DType dtype) { return dtype == DType::F32 ? 4 : 2; }

Range chunk(std::size_t rows, int parts, int index) {
  if (parts <= 0 || index < 0 || index >= parts) throw std::out_of_range("chunk: index outside [0, parts)");
  const std::size_t per = (rows + parts - 1) / parts;
  Range range;
  range.begin = std::min(rows, per * index);
  range.end = std::min(rows, range.begin + per);
  return range;
}

void reduce(void* out, DType out_dtype, const void* const* srcs, int count, std::size_t n, DType dtype,
            float scale) {
  if (count < 1) throw std::invalid_argument("reduce: needs at least one source");
  if (dtype == DType::F32) {
    if (out_dtype != DType::F32) throw std::invalid_argument("reduce: fp32 sources need an fp32 output");
    reduce_f32(static_cast<float*>(out), reinterpret_cast<const float* const*>(srcs), count, n, scale);
    return;
  }
  auto* bf16_srcs = reinterpret_cast<const uint16_t* const*>(srcs);
  if (out_dtype == DType::F32)
    reduce_bf16(static_cast<float*>(out), bf16_srcs, count, n, scale);
  else
    reduce_bf16(static_cast<uint16_t*>(out), bf16_srcs, count, n, scale);
}

void reduce(void* out, const void* const* srcs, int count, std::size_t n, DType dtype, float scale) {
  reduce(out, dtype, srcs, count, n, dtype, scale);
}

}  // namespace hp::comm
