// hp.optim.Muon's elementwise passes for one element, __host__ __device__:
// the CUDA passes (muon_kernels.cu) compute every element with these
// functions, and the C++ tests run them on the host against the CPU passes
// (muon_kernels.h), whose results are torch's lerp_, mul_ and add_ bit for
// bit. float32 throughout; no fast math.
#pragma once

#include <cmath>

#include "simd/bf16.h"

namespace hp::optim::math {

// ATen's lerp(self, end, weight) for a scalar weight, as its kernels compute
// it: one FMA from the nearer end.
inline HP_SIMD_HD float lerp(float self, float end, float weight) {
  const bool small = fabsf(weight) < 0.5f;
  return fmaf(small ? weight : weight - 1.0f, end - self, small ? self : end);
}

// buf = lerp(buf, grad, 1 - momentum) and the update Newton–Schulz takes:
// lerp(grad, buf, momentum) with nesterov, else buf. The weights as torch
// passes them (its Scalars rounded to float).
struct Momentum {
  float buf, update;
};
inline HP_SIMD_HD Momentum momentum(float buf, float grad, float to_grad, float to_buf, bool nesterov) {
  const float next = lerp(buf, grad, to_grad);
  return {next, nesterov ? lerp(grad, next, to_buf) : next};
}

// param.mul_(decay) then param.add_(update, alpha): the product rounded, then
// one FMA (ATen's add computes self + alpha * other).
inline HP_SIMD_HD float apply(float param, float update, float decay, float alpha) {
#if defined(__CUDA_ARCH__)
  const float decayed = __fmul_rn(param, decay);  // never contracted into the FMA below
#else
  const float decayed = param * decay;
#endif
  return fmaf(update, alpha, decayed);
}

}  // namespace hp::optim::math
