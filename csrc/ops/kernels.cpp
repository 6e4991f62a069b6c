// Compiles kernels_isa.h once per instruction set and picks one at load time.
#include "kernels.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#define HP_INL inline __attribute__((always_inline))
#define HP_LAMBDA __attribute__((always_inline))

namespace hp::ops::simd {

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2")
namespace avx512 {
#define HP_SIMD_WIDTH 16
#include "kernels_isa.h"
#undef HP_SIMD_WIDTH
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2")
namespace avx2 {
#define HP_SIMD_WIDTH 8
#include "kernels_isa.h"
#undef HP_SIMD_WIDTH
}  // namespace avx2
#pragma GCC pop_options
#endif

namespace baseline {
#define HP_SIMD_WIDTH 4
#include "kernels_isa.h"
#undef HP_SIMD_WIDTH
}  // namespace baseline

namespace {

Kernels choose() {
  const char* env = std::getenv("HP_SIMD");
  const std::string cap = env ? env : "";
  TORCH_CHECK(cap.empty() || cap == "avx512" || cap == "avx2" || cap == "baseline", "HP_SIMD=", cap,
              " is not an instruction set hyperparallel knows: use avx512, avx2 or baseline (or leave it unset)");
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool has_avx512 = has_avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (has_avx512 && (cap.empty() || cap == "avx512")) return avx512::table("avx512");
  if (has_avx2 && cap != "baseline") return avx2::table("avx2");
#endif
  return baseline::table("baseline");
}

}  // namespace

const Kernels& kernels() {
  static const Kernels chosen = choose();
  return chosen;
}

}  // namespace hp::ops::simd
