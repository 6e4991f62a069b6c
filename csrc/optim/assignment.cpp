#include "hyperparallel/optim/assignment.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <stdexcept>
#include <tuple>

namespace hp::optim {

double Assignment::balance() const {
  if (load.empty()) return 1.0;
  const int64_t total = std::accumulate(load.begin(), load.end(), int64_t(0));
  if (total == 0) return 1.0;
  const int64_t largest = *std::max_element(load.begin(), load.end());
  return double(largest) * double(load.size()) / double(total);
}

Assignment assign_owners(const std::vector<int64_t>& costs, const std::vector<std::vector<int>>& homes, int ranks) {
  if (ranks < 1) throw std::invalid_argument("hp.optim assign_owners: needs at least one rank");
  if (homes.size() != costs.size())
    throw std::invalid_argument("hp.optim assign_owners: one list of homes per item, even if empty");
  const std::size_t items = costs.size();
  // Turn of each item among the equal-cost items with the same first home.
  std::vector<int64_t> turn(items);
  std::map<std::pair<int64_t, int>, int64_t> seen;
  for (std::size_t i = 0; i < items; ++i) turn[i] = seen[{costs[i], homes[i].empty() ? -1 : homes[i].front()}]++;
  std::vector<std::size_t> order(items);
  std::iota(order.begin(), order.end(), std::size_t(0));
  std::sort(order.begin(), order.end(), [&](std::size_t x, std::size_t y) {
    return std::make_tuple(-costs[x], turn[x], x) < std::make_tuple(-costs[y], turn[y], y);
  });

  Assignment result;
  result.owner.assign(items, -1);
  result.load.assign(ranks, 0);
  for (std::size_t item : order) {
    const int64_t least = *std::min_element(result.load.begin(), result.load.end());
    int chosen = -1;
    for (int home : homes[item])
      if (home >= 0 && home < ranks && result.load[home] == least && (chosen < 0 || home < chosen)) chosen = home;
    if (chosen < 0) chosen = int(std::find(result.load.begin(), result.load.end(), least) - result.load.begin());
    result.owner[item] = chosen;
    result.load[chosen] += costs[item];
  }
  return result;
}

}  // namespace hp::optim
