// What Muon's CPU and device plans compute alike: which rows of a matrix a
// shard holds, a matrix's Newton–Schulz cost, torch's learning-rate scaling;
// the peer-bytes counter they share.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "hyperparallel/comm/reduce.h"
#include "hyperparallel/optim/muon.h"

namespace hp::optim::plan {

// torch.optim.Muon's _adjust_lr, per matrix.
inline double adjusted_lr(const StepOptions& options, int64_t rows, int64_t cols) {
  const double ratio = options.adjust_lr == AdjustLr::MatchRmsAdamw
                           ? 0.2 * std::sqrt(double(std::max(rows, cols)))
                           : std::sqrt(std::max(1.0, double(rows) / double(cols)));
  return options.lr * ratio;
}

// Rows [begin, begin + count) of matrix `expert` of a parameter of global
// `shape` that mesh shard `shard` of `shards` holds (torch.chunk on dim 0: an
// expert stack is split by experts, a matrix by rows); count 0: none.
inline std::pair<int64_t, int64_t> held_rows(const std::vector<int64_t>& shape, int64_t shards, int64_t shard,
                                             int64_t expert) {
  if (shape.size() == 3) {
    const comm::Range experts = comm::chunk(shape[0], int(shards), int(shard));
    const bool held = expert >= int64_t(experts.begin) && expert < int64_t(experts.end);
    return {0, held ? shape[1] : 0};
  }
  const comm::Range rows = comm::chunk(shape[0], int(shards), int(shard));
  return {int64_t(rows.begin), int64_t(rows.size())};
}

// Adds a step's bytes of rows read from the node's other ranks to
// muon_peer_bytes() (muon.h); both plans count theirs.
void add_peer_bytes(uint64_t bytes);

// Newton–Schulz's cost of a rows x cols matrix, for balancing owners.
inline int64_t ns_cost(int64_t rows, int64_t cols) { return rows * cols * std::min(rows, cols); }

}  // namespace hp::optim::plan
