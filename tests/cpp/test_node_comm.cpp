#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "hyperparallel/comm/node_comm.h"
#include "ranks.h"

using namespace hp;
using comm::DType;
using comm::ReduceOp;
using hp::testing::check;
using hp::testing::run_ranks;

namespace {

float value(int rank, std::size_t i) { return std::sin(float(rank * 7919 + i)); }

std::vector<float> inputs_of(int rank, std::size_t n) {
  std::vector<float> data(n);
  for (std::size_t i = 0; i < n; ++i) data[i] = value(rank, i);
  return data;
}

// The sum in rank order, as the collectives compute it.
float expected_sum(int world, std::size_t i) {
  float sum = value(0, i);
  for (int r = 1; r < world; ++r) sum += value(r, i);
  return sum;
}

class NodeCommTest : public ::testing::TestWithParam<int> {};

}  // namespace

TEST_P(NodeCommTest, CopyingCollectivesMatchTheirDefinitions) {
  const int world = GetParam();
  auto exits = run_ranks(world, [world](int rank, std::shared_ptr<fabric::Fabric> fab) {
    comm::NodeComm node(fab);
    for (std::size_t n : {1u, 1001u, 300000u}) {  // the last grows the scratch windows
      auto data = inputs_of(rank, n);
      node.all_reduce(data.data(), n, DType::F32, ReduceOp::Sum);
      for (std::size_t i = 0; i < n; ++i) check(data[i] == expected_sum(world, i), "all_reduce sum");

      data = inputs_of(rank, n);
      node.all_reduce(data.data(), n, DType::F32, ReduceOp::Avg);
      for (std::size_t i = 0; i < n; ++i) check(data[i] == expected_sum(world, i) * (1.0f / world), "all_reduce avg");

      data = inputs_of(rank, n);
      node.broadcast(data.data(), n, DType::F32, world - 1);
      for (std::size_t i = 0; i < n; ++i) check(data[i] == value(world - 1, i), "broadcast");
    }
    // Rows not divisible by the world, and fewer rows than ranks.
    for (std::size_t rows : {1u, 7u, 1000u}) {
      const std::size_t row_elems = 3;
      auto full = inputs_of(0, rows * row_elems);
      comm::Range mine = comm::chunk(rows, world, rank);
      std::vector<float> out(rows * row_elems, -1.0f);
      node.all_gather(full.data() + mine.begin * row_elems, out.data(), rows, row_elems, DType::F32);
      check(out == full, "all_gather");

      auto in = inputs_of(rank, rows * row_elems);
      std::vector<float> shard(mine.size() * row_elems);
      node.reduce_scatter(in.data(), shard.data(), rows, row_elems, DType::F32, ReduceOp::Sum);
      for (std::size_t i = 0; i < shard.size(); ++i)
        check(shard[i] == expected_sum(world, mine.begin * row_elems + i), "reduce_scatter");
    }
  });
  for (auto& exit : exits) EXPECT_EQ(exit.status, 0) << exit.error;
}

TEST_P(NodeCommTest, ZeroCopyCollectivesCopyNothing) {
  const int world = GetParam();
  auto exits = run_ranks(world, [world](int rank, std::shared_ptr<fabric::Fabric> fab) {
    comm::NodeComm node(fab);
    const std::size_t n = 12345;
    comm::Window full = node.shared(n * sizeof(float));
    comm::Window grads = node.symmetric(n * sizeof(float));
    auto* params = static_cast<float*>(full.data());
    comm::Range mine = comm::chunk(n, world, rank);
    std::vector<float> shard(mine.size());
    for (int step = 0; step < 20; ++step) {
      node.acquire(full);  // peers are done reading the last step's parameters
      for (std::size_t i = mine.begin; i < mine.end; ++i) params[i] = value(rank + step, i);
      node.all_gather(full);
      for (int r = 0; r < world; ++r) {
        comm::Range theirs = comm::chunk(n, world, r);
        for (std::size_t i = theirs.begin; i < theirs.end; ++i) check(params[i] == value(r + step, i), "gathered");
      }
      node.acquire(grads);
      auto* grad = static_cast<float*>(grads.slot(rank));
      for (std::size_t i = 0; i < n; ++i) grad[i] = value(rank, i) * float(step);
      node.reduce_scatter(grads, n, DType::F32, ReduceOp::Sum, shard.data());
      for (std::size_t i = 0; i < shard.size(); ++i) {
        float expected = value(0, mine.begin + i) * float(step);
        for (int r = 1; r < world; ++r) expected += value(r, mine.begin + i) * float(step);
        check(shard[i] == expected, "reduced");
      }
    }
    check(node.stats().bytes_copied == 0, "zero-copy collectives copied bytes");
  });
  for (auto& exit : exits) EXPECT_EQ(exit.status, 0) << exit.error;
}

INSTANTIATE_TEST_SUITE_P(Ranks, NodeCommTest, ::testing::Values(2, 3, 4));
