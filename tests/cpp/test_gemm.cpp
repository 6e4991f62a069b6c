// The fused ops' float32 GEMM (csrc/ops/gemm.h) against a float64 reference:
// every transpose, sizes around the tile (12 x 32) and block (96 rows, 256
// deep, 2048 columns) edges, strided operands, accumulation, k = 0.
#include "ops/gemm.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

using hp::ops::gemm::available;
using hp::ops::gemm::sgemm;

namespace {

struct Case {
  int64_t m, n, k;
  bool trans_a, trans_b;
};

// A stored matrix of `rows` x `cols` with `pad` unused floats after each row.
struct Stored {
  int64_t rows, cols, ld;
  std::vector<float> data;
  Stored(int64_t r, int64_t c, int64_t pad, std::mt19937& rng) : rows(r), cols(c), ld(c + pad), data(r * (c + pad)) {
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    for (float& x : data) x = u(rng);
  }
  float at(int64_t i, int64_t j) const { return data[i * ld + j]; }
};

// Runs one case and compares with float64 sums: the error bound is float32
// rounding of a k-term sum of terms of at most 1 in size.
void check(const Case& c, bool accumulate, int64_t pad) {
  std::mt19937 rng(static_cast<uint32_t>(c.m * 7919 + c.n * 104729 + c.k * 13 + c.trans_a * 2 + c.trans_b));
  const Stored a = c.trans_a ? Stored(c.k, c.m, pad, rng) : Stored(c.m, c.k, pad, rng);
  const Stored b = c.trans_b ? Stored(c.n, c.k, pad, rng) : Stored(c.k, c.n, pad, rng);
  Stored out(c.m, c.n, pad, rng);
  const std::vector<float> before = out.data;
  sgemm(c.trans_a, c.trans_b, c.m, c.n, c.k, a.data.data(), a.ld, b.data.data(), b.ld, out.data.data(), out.ld,
        accumulate);
  const double bound = 4e-7 * static_cast<double>(c.k + 2);
  for (int64_t i = 0; i < c.m; ++i) {
    for (int64_t j = 0; j < c.n; ++j) {
      double expected = accumulate ? before[i * out.ld + j] : 0.0;
      for (int64_t p = 0; p < c.k; ++p)
        expected += static_cast<double>(c.trans_a ? a.at(p, i) : a.at(i, p)) * (c.trans_b ? b.at(j, p) : b.at(p, j));
      ASSERT_NEAR(out.at(i, j), expected, bound) << "m " << c.m << " n " << c.n << " k " << c.k << " at (" << i << ", "
                                                 << j << ")";
    }
    // The padding after each row of c is never written.
    for (int64_t j = c.n; j < out.ld; ++j) ASSERT_EQ(out.data[i * out.ld + j], before[i * out.ld + j]);
  }
}

class Gemm : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!available()) GTEST_SKIP() << "no AVX-512 here (or HP_SIMD caps it): the fused ops use ATen's products";
  }
};

TEST_F(Gemm, EveryTransposeAroundTileEdges) {
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (int64_t m : {1, 11, 12, 13, 97})
        for (int64_t n : {1, 31, 32, 33, 70})
          for (int64_t k : {1, 2, 63}) check({m, n, k, ta, tb}, false, 0);
}

TEST_F(Gemm, DeepAndWideBlocks) {
  // k over two depth blocks (256) plus a tail; n over the column block (2048).
  for (bool ta : {false, true})
    for (bool tb : {false, true}) check({29, 45, 600, ta, tb}, false, 0);
  check({13, 2100, 7, false, true}, false, 0);
  check({200, 40, 257, true, false}, false, 0);
}

TEST_F(Gemm, AccumulatesIntoStridedOutput) {
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      check({23, 37, 300, ta, tb}, true, 5);
      check({23, 37, 300, ta, tb}, false, 3);
    }
}

TEST_F(Gemm, EmptyProducts) {
  std::vector<float> c(6, 5.f);
  sgemm(false, false, 2, 3, 0, nullptr, 1, nullptr, 3, c.data(), 3, /*accumulate=*/true);
  for (float x : c) EXPECT_EQ(x, 5.f);
  sgemm(false, false, 2, 3, 0, nullptr, 1, nullptr, 3, c.data(), 3, /*accumulate=*/false);
  for (float x : c) EXPECT_EQ(x, 0.f);
  sgemm(false, false, 0, 3, 4, nullptr, 4, nullptr, 3, c.data(), 3, false);  // no rows: nothing read or written
}

}  // namespace
