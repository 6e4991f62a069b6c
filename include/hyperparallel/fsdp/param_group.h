// One FSDP parameter group: the parameters of one fully_shard call.
//
// Rank r owns rows chunk(rows, shard_size, r) of each parameter (torch.chunk
// on dim 0, as FSDP2) and its shard is a view of those rows that the
// optimizer updates in place. Where the full parameters live depends on the
// device, and is the only thing that does:
//
// - CPU: once per node, in a shared window laid out parameter-major; every
//   rank's shard is a view into it, so "unsharding" is a wait until every
//   rank has posted its rows, never a copy (group_cpu.cpp).
// - CUDA: every rank keeps its shards in device memory its peers map, and
//   unsharding pulls the peers' rows straight into the full parameters'
//   storage on the copy engines, on a stream of its own, ahead of the compute
//   that needs them; resharding frees that storage (group_cuda.cpp).
//
// Gradients are reduced on a Reducer thread while backward goes on: each rank
// puts its full gradients in its slot of a window every rank reads, and
// reduces the rows it owns over all slots in one pass (then all-reduces its
// shard with its replicas on other nodes, for HSDP).
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <atomic>
#include <chrono>
#include <map>
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

// What a device backend shares among all groups of a process (streams,
// gradient buffers); each backend defines its own.
struct BackendState {
  virtual ~BackendState() = default;
};

// What all groups of a process share: the communicator, the one reducer
// thread, and each device backend's state.
class Context {
 public:
  explicit Context(std::shared_ptr<comm::Communicator> communicator);
  const std::shared_ptr<comm::Communicator>& communicator() const { return communicator_; }
  const std::shared_ptr<Reducer>& reducer() const { return reducer_; }
  // Seconds callers spent blocked on other ranks in the groups' waits
  // (unshard, the end of a reduction), since the last reset: for benchmarks.
  double wait_seconds(bool reset);
  // Counts the time from `since` to now as waiting.
  void count_wait(std::chrono::steady_clock::time_point since);
  // The backend's state for `device`, made by `make` on first use.
  template <typename State, typename Make>
  State& backend(c10::Device device, Make make) {
    auto& slot = backends_[device.str()];
    if (!slot) slot = make();
    return static_cast<State&>(*slot);
  }

 private:
  std::shared_ptr<comm::Communicator> communicator_;
  std::shared_ptr<Reducer> reducer_;
  std::map<std::string, std::shared_ptr<BackendState>> backends_;
  std::atomic<int64_t> wait_ns_{0};
};

class ParamGroup {
 public:
  // Collective over the node's ranks: a group over `params` (the full
  // parameters; each rank contributes only its own rows of them), on their
  // device.
  static std::shared_ptr<ParamGroup> create(std::shared_ptr<Context> context, const std::vector<at::Tensor>& params,
                                            GroupOptions options);
  virtual ~ParamGroup() = default;

  // The full parameters forward reads (in the compute dtype) and this rank's
  // rows of the parameters (in their own dtype), which the optimizer updates
  // in place. On a GPU the full parameters have storage only while unsharded.
  virtual const std::vector<at::Tensor>& full() const = 0;
  virtual const std::vector<at::Tensor>& shards() const = 0;

  // Makes this rank's rows (after the optimizer wrote them) available to its
  // peers for this iteration; never blocks. The root's forward does it for
  // every group at once.
  virtual void publish() = 0;
  // Starts making the full parameters whole (publishing first if needed);
  // returns without waiting for it: a prefetch.
  virtual void begin_unshard() = 0;
  // After this, the current stream (on the CPU: this thread) may read the
  // full parameters.
  virtual void wait_unshard() = 0;
  // The full parameters are not needed until the next unshard: on a GPU
  // their memory goes back to the allocator.
  virtual void reshard() = 0;

  // Hands this rank's full gradients (nullopt: none) to the reducer thread and
  // returns at once. The sharded gradients land in the last reduction's
  // memory unless something still holds that (the optimizer's .grad, or a
  // caller keeping last step's): then in new memory, as torch never writes a
  // gradient it handed out.
  virtual void reduce(std::vector<std::optional<at::Tensor>> grads) = 0;
  // Waits for the reduction; returns this rank's sharded gradients (in the
  // parameters' dtype), nullopt for parameters that got no gradient on any
  // rank of the job (so that every rank holds the same ones).
  virtual std::vector<std::optional<at::Tensor>> sharded_grads() = 0;
  // After sharded_grads(): the one flat buffer every sharded gradient it
  // returned is a view of (FSDP2's reduce output, for its all-reduce hook).
  virtual at::Tensor sharded_grad_buffer() const = 0;
  // Declares this rank done reading its peers' rows and waits until every
  // rank is, so that the optimizer may write shards. Backward does this by
  // itself; needed after a forward without backward.
  virtual void release() = 0;
  // Waits for the last reduction and drops the sum held from reductions made
  // without all-reduce (HSDP, set_requires_all_reduce(false)): an aborted
  // iteration's gradients are thrown away (FSDP2's reset_iter_state).
  virtual void discard_held() = 0;

  // Gradients are summed over the job's ranks and divided by `factor`
  // (FSDP2's set_gradient_divide_factor); nullopt: by the number of ranks,
  // an average. From the next reduce() on.
  void set_gradient_divide_factor(std::optional<double> factor) { divide_factor_ = factor; }
  // HSDP: false keeps each backward's node-reduced shard in a running sum
  // instead of all-reducing it across nodes, and hands out no gradients; the
  // next reduction made with true all-reduces the sum (FSDP2's
  // set_requires_all_reduce: gradient accumulation that keeps the gradients
  // sharded and the network idle until the last micro-batch). From the next
  // reduce() on; no effect without replicas.
  void set_requires_all_reduce(bool required) { requires_all_reduce_ = required; }

 protected:
  // What reduce() multiplies the sum over the job's ranks (the node's
  // `node_ranks` times the replicas in `options`) by.
  float gradient_scale(int node_ranks, const GroupOptions& options) const {
    const int replicas = options.replicate ? options.replicate->getSize() : 1;
    return divide_factor_ ? float(1.0 / *divide_factor_) : 1.0f / float(node_ranks * replicas);
  }
  bool requires_all_reduce() const { return requires_all_reduce_; }
  // The HSDP end of a reduction, on the reducer thread: `output` (the node's
  // reduced shard) plus the sum held from reductions without all-reduce,
  // all-reduced over `replicate` when `all_reduce` (returns true), else held
  // in that sum (returns false: there is nothing to hand out yet).
  bool all_reduce_across_nodes(at::Tensor& output, c10d::ProcessGroup& replicate, bool all_reduce);
  // Drops that held sum (reducer thread idle).
  void drop_held() { held_ = at::Tensor(); }

 private:
  std::optional<double> divide_factor_;
  bool requires_all_reduce_ = true;
  at::Tensor held_;  // the running sum of all_reduce_across_nodes (reducer thread only)
};

// How a device backend makes groups; a backend linked into the extension
// registers itself for its device type (the CPU's is built in).
using GroupFactory = std::shared_ptr<ParamGroup> (*)(std::shared_ptr<Context>, const std::vector<at::Tensor>&,
                                                      GroupOptions);
void register_group_factory(c10::DeviceType type, GroupFactory factory);

}  // namespace hp::fsdp
