// The one instruction-set policy of the C++ kernels. Every vectorised kernel
// (comm's reductions, ops' row kernels, optim's Muon passes and bfloat16 Gram
// products, checkpoint's CRC-32) is built for the tiers below and runs the
// tier isa() names: the best this CPU has, capped by HP_SIMD. Nothing else
// decides, so HP_SIMD=avx2|baseline takes every kernel down together (tests
// run the whole kernel suite so). No torch headers: the fabric links this.
#pragma once

#include <stdexcept>

namespace hp::simd {

// Ordered: a tier runs everything a lower one does.
enum class Isa : int { baseline = 0, avx2 = 1, avx512 = 2 };

// What code built for a tier may use, as `#pragma GCC target` / target
// attribute strings. The CPU must have every one of these for isa() to pick
// the tier. avx2 is x86-64-v3 plus CLMUL (every AVX2 CPU has it), avx512 adds
// the AVX-512 subsets of x86-64-v4.
#define HP_SIMD_AVX2 "avx2,fma,f16c,bmi,bmi2,pclmul"
#define HP_SIMD_AVX512 HP_SIMD_AVX2 ",avx512f,avx512bw,avx512vl,avx512dq"
// AVX-512 with bfloat16 dot products (optim's Gram kernels): see avx512_bf16().
#define HP_SIMD_AVX512_BF16 HP_SIMD_AVX512 ",avx512bf16"
// Compiles one function for such a string: HP_SIMD_TARGET(HP_SIMD_AVX512).
#define HP_SIMD_TARGET(features) __attribute__((target(features)))

// The tier kernels run: cpu_isa() capped by HP_SIMD (read once per process).
// Throws std::invalid_argument naming the fix when HP_SIMD is not one of
// avx512, avx2, baseline or empty.
Isa isa();

// isa() on top of AVX-512, with bfloat16 dot products (vdpbf16ps) on this CPU.
bool avx512_bf16();

// The best tier this CPU runs.
Isa cpu_isa();

// Whether this CPU has what oneDNN, torch's bfloat16 GEMM on x86, computes
// bfloat16 products with natively: AVX-512 BF16 (every AMX CPU has it too),
// or AVX2 with oneDNN's avx2_vnni_2 set (AVX-VNNI, AVX-VNNI-INT8 and
// AVX-NE-CONVERT: recent Intel cores). No kernel uses it. Elsewhere oneDNN
// emulates them (AVX-512 CPUs from Skylake-SP to Ice Lake), or on AVX2 CPUs
// torch does not hand them to oneDNN and ATen's own loops run them, at a
// fraction of the float32 rate: ops' products widen to float32 there, and
// optim's reference GEMM kernels sum in ATen's order.
bool cpu_native_bf16();

// Whether this CPU is Intel's (CPUID vendor "GenuineIntel"). No kernel uses
// it; MKL, torch's float32 GEMM on x86, runs its AVX-512 code only there
// (ops' own GEMM stands aside).
bool cpu_intel();

// The policy itself: `best` capped by `cap` (null or empty: no cap). Throws
// as isa() does for an unknown cap.
Isa capped(Isa best, const char* cap);

// "avx512", "avx2" or "baseline".
const char* name(Isa isa);

// The instance of a kernel built for isa(), of the three built for each tier.
template <class T>
T pick(T avx512, T avx2, T baseline) {
  switch (isa()) {
    case Isa::avx512:
      return avx512;
    case Isa::avx2:
      return avx2;
    default:
      return baseline;
  }
}

}  // namespace hp::simd
