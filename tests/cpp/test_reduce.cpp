#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "bf16_reference.h"
#include "hyperparallel/comm/reduce.h"

using namespace hp::comm;

using hp::testing::from_bf16_reference;
using hp::testing::to_bf16_reference;

TEST(Chunk, MatchesTorchChunk) {
  // torch.chunk(torch.arange(10), 4) -> sizes 3,3,3,1
  EXPECT_EQ(chunk(10, 4, 0).begin, 0u);
  EXPECT_EQ(chunk(10, 4, 2).size(), 3u);
  EXPECT_EQ(chunk(10, 4, 3).begin, 9u);
  EXPECT_EQ(chunk(10, 4, 3).size(), 1u);
  // torch.chunk(torch.arange(5), 4) -> sizes 2,2,1 and an empty fourth
  EXPECT_EQ(chunk(5, 4, 2).size(), 1u);
  EXPECT_EQ(chunk(5, 4, 3).size(), 0u);
  EXPECT_EQ(chunk(5, 4, 3).begin, 5u);
  // fewer rows than parts
  EXPECT_EQ(chunk(1, 4, 0).size(), 1u);
  EXPECT_EQ(chunk(1, 4, 1).size(), 0u);
  EXPECT_EQ(chunk(0, 2, 1).size(), 0u);
  EXPECT_THROW(chunk(4, 2, 2), std::out_of_range);
}

TEST(Reduce, Float32SumsInSourceOrderAndScales) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  for (std::size_t n : {1u, 15u, 2048u, 2049u, 10007u}) {
    for (int count : {1, 2, 3, 8}) {
      std::vector<std::vector<float>> srcs(count, std::vector<float>(n));
      std::vector<const void*> pointers;
      for (auto& src : srcs) {
        for (auto& x : src) x = normal(rng);
        pointers.push_back(src.data());
      }
      std::vector<float> out(n);
      reduce(out.data(), pointers.data(), count, n, DType::F32, 0.5f);
      for (std::size_t i = 0; i < n; ++i) {
        float expected = srcs[0][i];
        for (int s = 1; s < count; ++s) expected += srcs[s][i];
        ASSERT_EQ(out[i], expected * 0.5f) << "n=" << n << " count=" << count << " i=" << i;
      }
    }
  }
}

TEST(Reduce, OutputMayAliasASource) {
  std::vector<float> a(5000, 1.0f), b(5000, 2.0f);
  const void* srcs[] = {a.data(), b.data()};
  reduce(a.data(), srcs, 2, a.size(), DType::F32, 1.0f);
  for (float x : a) ASSERT_EQ(x, 3.0f);
}

TEST(Reduce, BFloat16WidensSumsAndRoundsOnceToNearestEven) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  const std::size_t n = 4099;
  const int count = 4;
  std::vector<std::vector<uint16_t>> srcs(count, std::vector<uint16_t>(n));
  std::vector<const void*> pointers;
  for (auto& src : srcs) {
    for (auto& x : src) x = to_bf16_reference(normal(rng));
    pointers.push_back(src.data());
  }
  std::vector<uint16_t> out(n);
  reduce(out.data(), pointers.data(), count, n, DType::BF16, 0.25f);
  for (std::size_t i = 0; i < n; ++i) {
    float sum = 0;
    for (int s = 0; s < count; ++s) sum += from_bf16_reference(srcs[s][i]);
    ASSERT_EQ(out[i], to_bf16_reference(sum * 0.25f)) << i;
  }
}

TEST(Reduce, Float32IntoBFloat16RoundsTheSumOnce) {
  std::mt19937 rng(12);
  std::normal_distribution<float> normal;
  const std::size_t n = 4099;
  const int count = 3;
  std::vector<std::vector<float>> srcs(count, std::vector<float>(n));
  std::vector<const void*> pointers;
  for (auto& src : srcs) {
    for (auto& x : src) x = normal(rng);
    pointers.push_back(src.data());
  }
  std::vector<uint16_t> out(n);
  reduce(out.data(), DType::BF16, pointers.data(), count, n, DType::F32, 0.5f);
  for (std::size_t i = 0; i < n; ++i) {
    float sum = 0;
    for (int s = 0; s < count; ++s) sum += srcs[s][i];
    ASSERT_EQ(out[i], to_bf16_reference(sum * 0.5f)) << i;
  }
}

TEST(Reduce, BFloat16KeepsNaNAndInfinity) {
  uint16_t nan = to_bf16_reference(std::numeric_limits<float>::quiet_NaN());
  uint16_t inf = to_bf16_reference(std::numeric_limits<float>::infinity());
  uint16_t one = to_bf16_reference(1.0f);
  std::vector<uint16_t> a = {nan, inf, one}, b = {one, one, one}, out(3);
  const void* srcs[] = {a.data(), b.data()};
  reduce(out.data(), srcs, 2, 3, DType::BF16, 1.0f);
  EXPECT_TRUE(std::isnan(from_bf16_reference(out[0])));
  EXPECT_TRUE(std::isinf(from_bf16_reference(out[1])));
  EXPECT_EQ(from_bf16_reference(out[2]), 2.0f);
}
