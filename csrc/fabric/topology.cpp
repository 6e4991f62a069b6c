#include "hyperparallel/fabric/topology.h"

#include <sstream>
#include <stdexcept>

#include "sys.h"

namespace hp::fabric {
namespace {

int env_int(const char* name, int fallback) {
  std::string text = sys::env_or(name, "");
  if (text.empty()) return fallback;
  try {
    std::size_t used = 0;
    int value = std::stoi(text, &used);
    if (used == text.size()) return value;
  } catch (const std::exception&) {
  }
  throw std::invalid_argument("environment variable " + std::string(name) + "='" + text +
                              "' is not an integer; launch with torchrun, which sets it");
}

}  // namespace

Topology Topology::make(int rank, int world_size, int local_rank, int local_world_size, int node) {
  auto fail = [](const std::string& message) {
    throw std::invalid_argument("hyperparallel topology: " + message);
  };
  if (world_size < 1) fail("WORLD_SIZE=" + std::to_string(world_size) + " must be >= 1");
  if (rank < 0 || rank >= world_size)
    fail("RANK=" + std::to_string(rank) + " is outside [0, WORLD_SIZE=" + std::to_string(world_size) + ")");
  if (local_world_size < 1 || local_world_size > world_size)
    fail("LOCAL_WORLD_SIZE=" + std::to_string(local_world_size) + " must be in [1, WORLD_SIZE=" +
         std::to_string(world_size) + "]");
  if (world_size % local_world_size != 0)
    fail("WORLD_SIZE=" + std::to_string(world_size) + " is not a multiple of LOCAL_WORLD_SIZE=" +
         std::to_string(local_world_size) + "; start the same number of ranks on every node (torchrun --nproc-per-node)");
  if (local_rank < 0 || local_rank >= local_world_size)
    fail("LOCAL_RANK=" + std::to_string(local_rank) + " is outside [0, LOCAL_WORLD_SIZE=" +
         std::to_string(local_world_size) + ")");
  Topology t;
  t.rank = rank;
  t.world_size = world_size;
  t.local_rank = local_rank;
  t.local_world_size = local_world_size;
  t.num_nodes = world_size / local_world_size;
  t.node = node;
  if (node < 0 || node >= t.num_nodes)
    fail("node index " + std::to_string(node) + " (GROUP_RANK) is outside [0, " + std::to_string(t.num_nodes) + ")");
  if (rank != node * local_world_size + local_rank)
    fail("RANK=" + std::to_string(rank) + " is not GROUP_RANK*LOCAL_WORLD_SIZE+LOCAL_RANK=" +
         std::to_string(node * local_world_size + local_rank) +
         "; hyperparallel expects torchrun's contiguous rank order within a node");
  return t;
}

Topology Topology::from_env() {
  int rank = env_int("RANK", 0);
  int world = env_int("WORLD_SIZE", 1);
  int local_rank = env_int("LOCAL_RANK", rank);
  int local_world = env_int("LOCAL_WORLD_SIZE", world);
  int node = env_int("GROUP_RANK", local_world > 0 ? (rank - local_rank) / local_world : 0);
  return make(rank, world, local_rank, local_world, node);
}

std::string Topology::describe() const {
  std::ostringstream out;
  out << "rank " << rank << "/" << world_size << " (node " << node << "/" << num_nodes << ", local rank "
      << local_rank << "/" << local_world_size << ")";
  return out.str();
}

}  // namespace hp::fabric
