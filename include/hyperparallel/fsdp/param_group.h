// One FSDP parameter group: the parameters of one fully_shard call.
//
// The group's full parameters live once per node in a shared window, laid out
// parameter-major. Rank r owns rows chunk(rows, shard_size, r) of each
// parameter (torch.chunk on dim 0, as FSDP2), and its shard is a view of those
// rows: the optimizer updates them in place, so "unsharding" is a wait until
// every rank has posted its rows, never a copy. With mixed precision each
// owner also writes its rows, once per step, into a low-precision window that
// forward and backward read.
//
// Gradients are reduced on a Reducer thread while backward goes on: each rank
// copies its full gradients into its slot of a symmetric window, and reduces
// the rows it owns over all slots in one pass (then all-reduces its shard with
// its replicas on other nodes, for HSDP).
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <memory>
#include <optional>
#include <vector>

#include "hyperparallel/comm/communicator.h"
#include "hyperparallel/fsdp/reducer.h"

namespace hp::fsdp {

struct GroupOptions {
  // Dtype forward and backward compute in (MixedPrecisionPolicy.param_dtype);
  // nullopt: the parameters' own dtype, no low-precision copy.
  std::optional<at::ScalarType> param_dtype;
  // Dtype gradients are reduced in (MixedPrecisionPolicy.reduce_dtype, which
  // defaults to param_dtype); nullopt: the gradients' own dtype.
  std::optional<at::ScalarType> reduce_dtype;
  // HSDP: this rank's replicas of the same shard on other nodes (else null).
  c10::intrusive_ptr<c10d::ProcessGroup> replicate;
};

// A ring of symmetric windows for gradients, shared by all groups: a group
// holds one only from its backward to the end of its reduction.
class GradWindows {
 public:
  GradWindows(std::shared_ptr<comm::Communicator> communicator, int count);
  // Collective: makes sure every window holds `bytes`.
  void reserve(std::size_t bytes);
  // The next window in ring order (every rank takes them in the same order).
  comm::Window& next();

 private:
  std::shared_ptr<comm::Communicator> communicator_;
  std::vector<comm::Window> windows_;
  std::size_t bytes_ = 0;
  std::size_t next_ = 0;
};

class ParamGroup {
 public:
  // Collective over the node's ranks. `params` are the full parameters (each
  // rank contributes only its own rows of them).
  ParamGroup(std::shared_ptr<comm::Communicator> communicator, std::shared_ptr<Reducer> reducer,
             std::shared_ptr<GradWindows> grad_windows, const std::vector<at::Tensor>& params,
             GroupOptions options);
  // Waits for this group's pending reduction.
  ~ParamGroup();
  ParamGroup(const ParamGroup&) = delete;
  ParamGroup& operator=(const ParamGroup&) = delete;

  // Views into node-shared memory: the full parameters forward reads (in the
  // compute dtype) and this rank's rows of the parameters (in their own
  // dtype), which the optimizer updates in place.
  const std::vector<at::Tensor>& full() const { return compute_views_; }
  const std::vector<at::Tensor>& shards() const { return shard_views_; }
  int shard_rank() const;
  int shard_size() const;

  // Posts this rank's rows (after writing its low-precision copy); never blocks.
  void begin_unshard();
  // Returns once every rank of the node has posted its rows.
  void wait_unshard();

  // Hands this rank's full gradients (nullopt: none) to the reducer thread and
  // returns at once. `fresh_output`: reduce into new memory, because the
  // previous sharded gradients are still in use.
  void reduce(std::vector<std::optional<at::Tensor>> grads, bool fresh_output);
  // Waits for the reduction; returns this rank's sharded gradients (in the
  // parameters' dtype), nullopt for parameters that got no gradient here.
  std::vector<std::optional<at::Tensor>> sharded_grads();
  // Declares this rank done reading the full parameters and waits until every
  // rank is, so that the optimizer may write shards. Backward does this by
  // itself; needed after a forward without backward.
  void release();

 private:
  void run_reduce(const std::vector<std::optional<at::Tensor>>& grads, at::Tensor output);

  std::shared_ptr<comm::Communicator> communicator_;
  std::shared_ptr<Reducer> reducer_;
  std::shared_ptr<GradWindows> grad_windows_;
  GroupOptions options_;
  comm::Window params_;            // the parameters, in their own dtype
  std::optional<comm::Window> compute_;  // low-precision copy, with mixed precision
  std::vector<at::Tensor> param_views_, compute_views_, shard_views_, compute_shard_views_;
  std::vector<int64_t> offsets_;        // elements from the window's start, per parameter
  std::vector<comm::Range> shard_rows_; // per parameter
  std::vector<int64_t> row_elems_;
  std::vector<int64_t> shard_offsets_;  // in the sharded gradient buffer
  int64_t total_elems_ = 0, shard_elems_ = 0;
  at::ScalarType dtype_;
  bool unshard_posted_ = false;
  at::Tensor sharded_grad_buffer_;  // reused across steps
  at::Tensor last_output_;          // where the last reduction wrote
  std::vector<bool> has_grad_;
  ReduceTicket ticket_ = 0;  // the last reduction handed to the reducer
};

}  // namespace hp::fsdp
