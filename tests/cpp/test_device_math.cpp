// The fused ops' CUDA per-element arithmetic (csrc/ops/device_math.h), run on
// the host: SwiGLU's gradients against float64 central differences, and the
// RoPE backward as the exact transpose of the forward.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "ops/device_math.h"

namespace m = hp::ops::math;

namespace {

double swiglu64(double g, double u) { return g / (1.0 + std::exp(-g)) * u; }

TEST(DeviceMath, SwigluGradientsMatchCentralDifferences) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 2.f);
  for (int i = 0; i < 2000; ++i) {
    const float g = normal(rng), u = normal(rng), da = normal(rng), w = std::abs(normal(rng));
    const m::SwigluGrad grad = m::swiglu_grad(g, u, da, w);
    const double h = 1e-5;
    const double dg = w * da * (swiglu64(g + h, u) - swiglu64(g - h, u)) / (2 * h);
    const double du = w * da * (swiglu64(g, u + h) - swiglu64(g, u - h)) / (2 * h);
    EXPECT_NEAR(grad.dg, dg, 1e-4 * (1 + std::abs(dg))) << g << " " << u;
    EXPECT_NEAR(grad.du, du, 1e-4 * (1 + std::abs(du))) << g << " " << u;
    EXPECT_NEAR(grad.a, swiglu64(g, u), 1e-5 * (1 + std::abs(swiglu64(g, u))));
    EXPECT_FLOAT_EQ(m::swiglu(g, u), grad.a);
  }
}

TEST(DeviceMath, RopeBackwardIsTheTransposeOfRope) {
  // <rope(a, b), (ga, gb)> == <(a, b), rope_backward(ga, gb)> for any cos/sin,
  // including the distinct values at j and j + d/2 that positions can give.
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> uniform(-1.f, 1.f);
  for (int i = 0; i < 2000; ++i) {
    const float a = uniform(rng), b = uniform(rng), ga = uniform(rng), gb = uniform(rng);
    const float cl = uniform(rng), sl = uniform(rng), ch = uniform(rng), sh = uniform(rng);
    const m::Pair y = m::rope(a, b, cl, sl, ch, sh);
    const m::Pair gx = m::rope_backward(ga, gb, cl, sl, ch, sh);
    EXPECT_NEAR(double(y.lo) * ga + double(y.hi) * gb, double(a) * gx.lo + double(b) * gx.hi, 1e-5);
  }
}

TEST(DeviceMath, RopeIsHfRotateHalf) {
  // HF: q * cos + rotate_half(q) * sin, rotate_half(q) = (-q[d/2:], q[:d/2]).
  const float a = 0.3f, b = -1.7f, theta = 0.9f;
  const float c = std::cos(theta), s = std::sin(theta);
  const m::Pair y = m::rope(a, b, c, s, c, s);
  EXPECT_FLOAT_EQ(y.lo, a * c + (-b) * s);
  EXPECT_FLOAT_EQ(y.hi, b * c + a * s);
  EXPECT_NEAR(std::hypot(y.lo, y.hi), std::hypot(a, b), 1e-6);  // a rotation
}

}  // namespace
