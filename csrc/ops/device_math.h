// The per-element arithmetic of the fused ops' CUDA kernels, __host__
// __device__ so that the C++ tests run it without a GPU (against float64
// derivatives). Each function is the CPU kernel's formula (kernels_isa.h) for
// one element or one rotate-half pair.
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define HP_MATH_HD __host__ __device__ inline
#else
#define HP_MATH_HD inline
#endif

namespace hp::ops::math {

HP_MATH_HD float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// a = silu(g) * u.
HP_MATH_HD float swiglu(float g, float u) { return g * sigmoid(g) * u; }

struct SwigluGrad {
  float dg, du, a;
};
// The gradients of w * swiglu(g, u) given da (before the weight w), and a itself.
HP_MATH_HD SwigluGrad swiglu_grad(float g, float u, float da, float w) {
  const float sig = sigmoid(g), silu = g * sig, da_w = da * w;
  return {da_w * u * sig * (1.0f + g * (1.0f - sig)), da_w * silu, silu * u};
}

// Rotate-half RoPE on the pair (x[j], x[j + d/2]) = (a, b) with cos/sin at j
// and j + d/2: out[j] = a cos_j - b sin_j, out[j + d/2] = b cos_h + a sin_h.
struct Pair {
  float lo, hi;
};
HP_MATH_HD Pair rope(float a, float b, float cos_lo, float sin_lo, float cos_hi, float sin_hi) {
  return {a * cos_lo - b * sin_lo, b * cos_hi + a * sin_hi};
}
// Its transpose: the gradient w.r.t. (a, b) of the pair's gradient (ga, gb).
HP_MATH_HD Pair rope_backward(float ga, float gb, float cos_lo, float sin_lo, float cos_hi, float sin_hi) {
  return {ga * cos_lo + gb * sin_hi, gb * cos_hi - ga * sin_lo};
}

}  // namespace hp::ops::math
