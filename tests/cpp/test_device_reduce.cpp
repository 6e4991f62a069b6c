// The device reduce kernel's own code (csrc/comm/device_reduce.h), run on the
// host block by block and thread by thread: every element of every segment is
// summed in rank order and rounded once, whatever the sizes and alignments;
// nothing outside the segments is written.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "comm/device_reduce.h"
#include "hyperparallel/comm/reduce.h"

namespace k = hp::comm::kernel;

namespace {

// What the GPU does for one launch: every thread of every block.
template <typename In, typename Out>
void run_kernel(k::Args& args) {
  const uint64_t tiles = k::plan_tiles(args, k::vector_width<In>());
  for (uint64_t block = 0; block < tiles; ++block)
    for (unsigned thread = 0; thread < k::kThreads; ++thread) k::reduce_thread<In, Out>(args, block, thread);
}

template <typename T>
T from_double(double value) {
  if constexpr (sizeof(T) == 2)
    return hp::simd::float_to_bf16(float(value));
  else
    return float(value);
}

// Inputs in 16-byte aligned buffers; segments at random offsets and lengths
// (tails, heads, misaligned source/destination pairs); the result against a
// per-element sum in the same order.
template <typename In, typename Out>
void check_random_launch(unsigned seed, int peers, int segments, float scale) {
  std::mt19937 rng(seed);
  const uint64_t n = 3 * k::kUnitsPerTile * k::vector_width<In>() + 37;
  std::vector<std::vector<In>> inputs(peers);
  std::vector<const void*> pointers;
  std::normal_distribution<double> normal;
  // Over-allocate so that each input can start on a 16-byte boundary.
  std::vector<std::vector<unsigned char>> storage(peers, std::vector<unsigned char>(n * sizeof(In) + 16));
  k::Args args;
  args.peers = peers;
  args.scale = scale;
  for (int p = 0; p < peers; ++p) {
    auto* base = storage[p].data();
    base += (16 - reinterpret_cast<uintptr_t>(base) % 16) % 16;
    In* data = reinterpret_cast<In*>(base);
    for (uint64_t i = 0; i < n; ++i) data[i] = from_double<In>(normal(rng));
    args.in[p] = data;
    pointers.push_back(data);
  }
  std::vector<unsigned char> out_storage(2 * n * sizeof(Out) + 16);
  auto* out_base = out_storage.data();
  out_base += (16 - reinterpret_cast<uintptr_t>(out_base) % 16) % 16;
  Out* out = reinterpret_cast<Out*>(out_base);
  const Out poison = from_double<Out>(-12345.0);
  for (uint64_t i = 0; i < 2 * n; ++i) out[i] = poison;
  args.out = out;

  std::uniform_int_distribution<uint64_t> any(0, n - 1);
  std::vector<bool> covered(2 * n, false);
  args.segments = 0;
  uint64_t next_dst = 0;
  for (int s = 0; s < segments; ++s) {
    const uint64_t src = any(rng) % (n / 2);
    uint64_t count = s % 3 == 0 ? any(rng) % 9 : any(rng) % (n - src);  // some tiny, some long
    count = std::min(count, n - src);
    // Half the segments share the source's alignment phase (vector path).
    uint64_t dst = next_dst + (s % 2 == 0 ? (src % k::vector_width<In>()) : 3);
    if (dst + count > 2 * n) break;
    args.segment[args.segments++] = k::Segment{src, dst, count};
    for (uint64_t i = 0; i < count; ++i) covered[dst + i] = true;
    next_dst = dst + count + k::vector_width<In>();
  }
  run_kernel<In, Out>(args);

  for (int s = 0; s < args.segments; ++s) {
    const k::Segment& seg = args.segment[s];
    for (uint64_t i = 0; i < seg.count; ++i) {
      float sum = k::to_float(reinterpret_cast<const In*>(args.in[0])[seg.src + i]);
      for (int p = 1; p < peers; ++p) sum += k::to_float(reinterpret_cast<const In*>(args.in[p])[seg.src + i]);
      const Out expected = k::from_float<Out>(scale == 1.0f ? sum : sum * scale);
      ASSERT_EQ(0, std::memcmp(&expected, &out[seg.dst + i], sizeof(Out)))
          << "segment " << s << " (src " << seg.src << ", dst " << seg.dst << ", count " << seg.count
          << ") element " << i;
    }
  }
  for (uint64_t i = 0; i < 2 * n; ++i) {
    if (covered[i]) continue;
    ASSERT_EQ(0, std::memcmp(&poison, &out[i], sizeof(Out))) << "wrote outside segments at " << i;
  }
}

}  // namespace

TEST(DeviceReduce, SplitCoversEverySegmentOnce) {
  for (unsigned vector : {4u, 8u})
    for (uint64_t src = 0; src < 20; ++src)
      for (uint64_t dst = 0; dst < 20; ++dst)
        for (uint64_t count = 0; count < 40; ++count) {
          k::Split s = k::split(k::Segment{src, dst, count}, vector);
          ASSERT_EQ(s.head + s.units * s.width + s.tail, count);
          if (s.width > 1 && s.units > 0) {
            ASSERT_EQ((src + s.head) % vector, 0u);  // vector loads start aligned
            ASSERT_EQ((dst + s.head) % vector, 0u);
            ASSERT_LT(s.head, vector);
            ASSERT_LT(s.tail, vector);
          }
        }
}

TEST(DeviceReduce, SegmentOfFindsTheTileOwner) {
  k::Args args;
  args.segments = 4;
  args.segment[0] = {0, 0, 5000};
  args.segment[1] = {0, 0, 0};  // empty: owns no tile
  args.segment[2] = {3, 7, 3};  // misaligned and tiny: one tile
  args.segment[3] = {0, 0, 9000};
  const uint64_t tiles = k::plan_tiles(args, 4);
  ASSERT_EQ(tiles, args.first_tile[4]);
  for (uint64_t tile = 0; tile < tiles; ++tile) {
    int s = k::segment_of(args, tile);
    EXPECT_LE(args.first_tile[s], tile);
    EXPECT_LT(tile, args.first_tile[s + 1]);
  }
}

TEST(DeviceReduce, Fp32SumsMatchInRankOrder) {
  for (unsigned seed = 0; seed < 4; ++seed) check_random_launch<float, float>(seed, 1 + seed, 12, 1.0f);
  check_random_launch<float, float>(7, 3, 20, 1.0f / 3.0f);
}

TEST(DeviceReduce, Bf16RoundsOnce) {
  for (unsigned seed = 0; seed < 4; ++seed) check_random_launch<uint16_t, uint16_t>(seed, 2 + seed, 12, 1.0f);
  check_random_launch<uint16_t, uint16_t>(9, 4, 20, 0.25f);
}

TEST(DeviceReduce, Bf16IntoFp32KeepsTheSum) {
  for (unsigned seed = 0; seed < 3; ++seed) check_random_launch<uint16_t, float>(seed, 2 + seed, 12, 0.5f);
}

TEST(DeviceReduce, Fp32IntoBf16RoundsTheSumOnce) {
  for (unsigned seed = 0; seed < 3; ++seed) check_random_launch<float, uint16_t>(seed, 2 + seed, 12, 0.5f);
}

TEST(DeviceReduce, MatchesTheCpuReduceBitForBit) {
  // The device kernel and comm::reduce must agree, so that a job's result
  // does not depend on where it ran.
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  const std::size_t n = 10007;
  for (int peers : {2, 3, 8}) {
    std::vector<std::vector<float>> inputs(peers, std::vector<float>(n));
    std::vector<const void*> sources;
    k::Args args;
    args.peers = peers;
    args.scale = 1.0f / float(peers);
    for (int p = 0; p < peers; ++p) {
      for (auto& x : inputs[p]) x = normal(rng);
      sources.push_back(inputs[p].data());
      args.in[p] = inputs[p].data();
    }
    std::vector<float> cpu(n), device(n);
    hp::comm::reduce(cpu.data(), sources.data(), peers, n, hp::comm::DType::F32, args.scale);
    args.out = device.data();
    args.segments = 1;
    args.segment[0] = {0, 0, n};
    run_kernel<float, float>(args);
    ASSERT_EQ(0, std::memcmp(cpu.data(), device.data(), n * sizeof(float))) << peers << " peers";
  }
}

TEST(DeviceReduce, Bf16RoundingMatchesNearestEven) {
  EXPECT_EQ(hp::simd::float_to_bf16(1.0f), 0x3f80);
  float halfway;  // exactly between two bf16 values: ties to even
  uint32_t bits = 0x3f808000u;
  std::memcpy(&halfway, &bits, 4);
  EXPECT_EQ(hp::simd::float_to_bf16(halfway), 0x3f80);
  bits = 0x3f818000u;
  std::memcpy(&halfway, &bits, 4);
  EXPECT_EQ(hp::simd::float_to_bf16(halfway), 0x3f82);
  EXPECT_EQ(hp::simd::float_to_bf16(std::numeric_limits<float>::quiet_NaN()) & 0x7fc0, 0x7fc0);
  EXPECT_EQ(hp::simd::bf16_to_float(0x4040), 3.0f);
}
