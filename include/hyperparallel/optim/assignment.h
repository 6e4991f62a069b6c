// Which rank does a piece of work that must happen exactly once in the job.
#pragma once

#include <cstdint>
#include <vector>

namespace hp::optim {

struct Assignment {
  std::vector<int> owner;     // per item: the rank that does it
  std::vector<int64_t> load;  // per rank: the summed cost of its items
  // Largest load over the mean load: 1 is a perfect balance.
  double balance() const;
};

// Longest processing time first: items in decreasing cost, each to the
// least-loaded rank (a greedy that stays within 4/3 of the best possible
// largest load). At equal load an item goes to one of its `homes` (ranks
// that already hold it whole, so need no copy of it) if one is among the
// least loaded, else to the lowest rank; equal-cost items take turns between
// homes, so that every home gets its share. Pure and deterministic: every
// rank computes the same assignment from the same input.
Assignment assign_owners(const std::vector<int64_t>& costs, const std::vector<std::vector<int>>& homes, int ranks);

}  // namespace hp::optim
