#include "isa.h"

#include <cstdlib>
#include <string>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace hp::simd {

Isa cpu_isa() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  // Every feature of HP_SIMD_AVX2 / HP_SIMD_AVX512: code built for a tier may
  // use any of them.
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi") &&
                    __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("pclmul");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (avx512) return Isa::avx512;
  if (avx2) return Isa::avx2;
#endif
  return Isa::baseline;
}

Isa capped(Isa best, const char* cap) {
  const std::string text = cap ? cap : "";
  Isa limit;
  if (text.empty() || text == "avx512") {
    limit = Isa::avx512;
  } else if (text == "avx2") {
    limit = Isa::avx2;
  } else if (text == "baseline") {
    limit = Isa::baseline;
  } else {
    throw std::invalid_argument("HP_SIMD=" + text +
                                " is not an instruction set hyperparallel knows: use avx512, avx2 or baseline (or "
                                "leave it unset)");
  }
  return best < limit ? best : limit;
}

Isa isa() {
  static const Isa chosen = capped(cpu_isa(), std::getenv("HP_SIMD"));
  return chosen;
}

bool avx512_bf16() {
#if defined(__x86_64__)
  static const bool yes = isa() == Isa::avx512 && __builtin_cpu_supports("avx512bf16");
  return yes;
#else
  return false;
#endif
}

bool cpu_native_bf16() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  // CPUID leaf 7 subleaf 1: AVX-VNNI in EAX bit 4, AVX-VNNI-INT8 and
  // AVX-NE-CONVERT in EDX bits 4 and 5.
  unsigned a = 0, b = 0, c = 0, d = 0;
  const bool leaf = __get_cpuid_count(7, 1, &a, &b, &c, &d);
  const bool avx2_vnni_2 = leaf && (a & (1u << 4)) && (d & (1u << 4)) && (d & (1u << 5));
  return __builtin_cpu_supports("avx512bf16") || (__builtin_cpu_supports("avx2") && avx2_vnni_2);
#else
  return true;  // nothing to widen around: the products are torch's
#endif
}

bool cpu_intel() {
#if defined(__x86_64__)
  unsigned a = 0, b = 0, c = 0, d = 0;  // CPUID leaf 0: the vendor in EBX, EDX, ECX
  return __get_cpuid(0, &a, &b, &c, &d) && b == 0x756E6547u && d == 0x49656E69u && c == 0x6C65746Eu;
#else
  return false;
#endif
}

const char* name(Isa isa) {
  switch (isa) {
    case Isa::avx512:
      return "avx512";
    case Isa::avx2:
      return "avx2";
    default:
      return "baseline";
  }
}

}  // namespace hp::simd
