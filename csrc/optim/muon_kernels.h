// hp.optim.Muon's elementwise passes, each one pass over the data where
// ATen's ops take two or three. Compiled once per instruction-set tier
// (simd/foreach_isa.h); the tier simd::isa() names runs.
#pragma once

#include <cstdint>

#include "simd/bf16.h"

namespace hp::optim {

struct MuonKernels {
  // Momentum on n floats: buf = lerp(buf, grad, 1 - momentum) and, when out
  // is not null, the update (nesterov: lerp(grad, buf, momentum), else buf)
  // rounded to bfloat16 into out. lerp as ATen's vectorised kernel computes
  // it (one FMA), so the results are torch's lerp_'s.
  void (*momentum)(float* buf, const float* grad, simd::bf16* out, int64_t n, double momentum, bool nesterov);
  // param = param * decay, then param += alpha * float(update): torch's mul_
  // then add_(update, alpha=alpha), in one pass.
  void (*apply)(float* param, const simd::bf16* update, int64_t n, float decay, float alpha);
};

// The kernels of the tier simd::isa() chose.
const MuonKernels& muon_kernels();

}  // namespace hp::optim
