// bfloat16 by hand, independent of the code under test.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace hp::testing {

// Round to nearest even; every NaN becomes c10's quiet NaN 0x7FC0.
inline uint16_t to_bf16_reference(float value) {
  if (std::isnan(value)) return 0x7FC0;
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  uint32_t lower = bits & 0xffff, upper = bits >> 16;
  if (lower > 0x8000 || (lower == 0x8000 && (upper & 1))) ++upper;
  return uint16_t(upper);
}

inline float from_bf16_reference(uint16_t bits) {
  uint32_t wide = uint32_t(bits) << 16;
  float value;
  std::memcpy(&value, &wide, 4);
  return value;
}

}  // namespace hp::testing
