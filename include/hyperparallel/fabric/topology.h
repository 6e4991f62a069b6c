// Where this process sits in the job: global rank, node, rank within the node.
#pragma once

#include <string>

namespace hp::fabric {

struct Topology {
  int rank = 0;              // global rank (RANK)
  int world_size = 1;        // WORLD_SIZE
  int local_rank = 0;        // rank within this node (LOCAL_RANK)
  int local_world_size = 1;  // ranks on this node (LOCAL_WORLD_SIZE)
  int node = 0;              // this node's index (GROUP_RANK, else derived)
  int num_nodes = 1;

  // Reads torchrun's environment. Missing variables default to a
  // single-process job; inconsistent ones (a world size that is not a
  // multiple of the node size, a rank out of range) raise std::invalid_argument
  // naming the variable and the fix.
  static Topology from_env();
  // Validates and derives num_nodes; raises as from_env does.
  static Topology make(int rank, int world_size, int local_rank, int local_world_size, int node);
  std::string describe() const;
};

}  // namespace hp::fabric
