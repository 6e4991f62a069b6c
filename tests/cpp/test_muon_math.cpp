// hp.optim.Muon's per-element arithmetic on a GPU (csrc/optim/muon_math.h),
// run on the host against the CPU passes (muon_kernels.h, torch's lerp_,
// mul_ and add_ bit for bit by tests/python/test_muon.py): the CUDA passes
// give the same bits.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "optim/muon_kernels.h"
#include "optim/muon_math.h"

namespace m = hp::optim::math;
using hp::simd::bf16;

namespace {

uint32_t bits(float value) {
  uint32_t out;
  std::memcpy(&out, &value, sizeof out);
  return out;
}

// Values of every scale, exact zeros and equal pairs among them: lerp's
// branches and roundings all get exercised.
std::vector<float> values(int64_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_int_distribution<int> exponent(-30, 10), kind(0, 9);
  std::vector<float> out(n);
  for (float& v : out) v = kind(rng) == 0 ? 0.f : std::ldexp(normal(rng), exponent(rng));
  return out;
}

TEST(MuonMath, MomentumIsTheCpuPassBitForBit) {
  const int64_t n = 4099;  // vector chunks and a tail
  for (const double momentum : {0.95, 0.9, 0.5, 0.3, 0.0})
    for (const bool nesterov : {true, false}) {
      std::vector<float> buf = values(n, 1), grad = values(n, 2);
      for (int64_t i = 0; i < n; i += 7) grad[i] = buf[i];
      std::vector<float> expected = buf;
      std::vector<bf16> out(n);
      hp::optim::muon_kernels().momentum(expected.data(), grad.data(), out.data(), n, momentum, nesterov);
      for (int64_t i = 0; i < n; ++i) {
        const m::Momentum got = m::momentum(buf[i], grad[i], float(1.0 - momentum), float(momentum), nesterov);
        ASSERT_EQ(bits(got.buf), bits(expected[i])) << "momentum " << momentum << " element " << i;
        ASSERT_EQ(hp::simd::float_to_bf16(got.update), out[i].bits)
            << "momentum " << momentum << " nesterov " << nesterov << " element " << i;
      }
    }
}

TEST(MuonMath, ApplyIsTheCpuPassBitForBit) {
  const int64_t n = 4099;
  for (const float decay : {1.0f, 0.9998f, 0.5f})
    for (const float alpha : {-2e-3f, -0.37f, 1.0f}) {
      const std::vector<float> param = values(n, 3), update = values(n, 4);
      std::vector<bf16> rounded(n);
      for (int64_t i = 0; i < n; ++i) rounded[i] = bf16(update[i]);
      std::vector<float> expected = param;
      hp::optim::muon_kernels().apply(expected.data(), rounded.data(), n, decay, alpha);
      for (int64_t i = 0; i < n; ++i)
        ASSERT_EQ(bits(m::apply(param[i], float(rounded[i]), decay, alpha)), bits(expected[i]))
            << "decay " << decay << " alpha " << alpha << " element " << i;
    }
}

}  // namespace
