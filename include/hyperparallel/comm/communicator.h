// The collectives of a whole job on torch tensors: the fabric inside a node,
// c10d (Gloo on CPU, NCCL on GPU) across nodes.
//
// Rows are split over the world with torch.chunk semantics on dim 0, global
// rank g = node * local_world + local_rank owning chunk g, exactly as FSDP2
// shards parameters. A node's chunks are therefore contiguous, so within a
// node every collective is one of NodeComm's, and across nodes each local
// rank talks only to its counterparts (same local rank on the other nodes).
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <map>
#include <memory>

#include "hyperparallel/comm/node_comm.h"
#include "hyperparallel/fabric/fabric.h"

namespace hp::comm {

// fabric::Bootstrap over the job's c10d store.
class StoreBootstrap : public fabric::Bootstrap {
 public:
  explicit StoreBootstrap(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key, std::chrono::milliseconds timeout) override;

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

class Communicator;

// The collectives of a communicator on device tensors (CUDA). A device
// backend linked into the extension registers a factory for its device type;
// the first collective on such a tensor makes one (collectively: every rank
// reaches it at the same call).
class DeviceCollectives {
 public:
  virtual ~DeviceCollectives() = default;
  virtual void broadcast(at::Tensor& tensor, int64_t src) = 0;
  virtual void all_reduce(at::Tensor& tensor, ReduceOp op) = 0;
  virtual void all_gather(at::Tensor& out, const at::Tensor& in) = 0;
  virtual void reduce_scatter(at::Tensor& out, const at::Tensor& in, ReduceOp op) = 0;
  // The zero-copy reduce-scatter (see Communicator).
  virtual at::Tensor symmetric_empty(at::IntArrayRef sizes, at::ScalarType dtype) = 0;
  // Returns true if `tensor` is one of this backend's symmetric tensors
  // (then acquired: the current stream waits until peers finished reading it).
  virtual bool acquire(const at::Tensor& tensor) = 0;
  virtual void reduce_scatter_symmetric(at::Tensor& out, const at::Tensor& in, ReduceOp op) = 0;
  virtual Stats stats() const = 0;
  virtual void reset_stats() = 0;
};
using DeviceCollectivesFactory = std::unique_ptr<DeviceCollectives> (*)(Communicator& communicator,
                                                                        c10::Device device);
void register_device_collectives(c10::DeviceType type, DeviceCollectivesFactory factory);
// The device types whose backends are linked in ("cuda"), besides the CPU.
std::vector<std::string> device_backends();

class Communicator {
 public:
  // `store`: the job's c10d store. `cross_node`: the process group of this
  // rank's counterparts on every node (null on a single node).
  Communicator(fabric::Topology topology, c10::intrusive_ptr<c10d::Store> store,
               c10::intrusive_ptr<c10d::ProcessGroup> cross_node);

  const fabric::Topology& topology() const { return topology_; }
  NodeComm& node() { return node_; }
  const std::shared_ptr<fabric::Fabric>& fabric() const { return fabric_; }
  // This rank's counterparts on the other nodes (null on one node).
  const c10::intrusive_ptr<c10d::ProcessGroup>& cross_node() const { return cross_node_; }

  void barrier();
  void broadcast(at::Tensor& tensor, int64_t src);
  void all_reduce(at::Tensor& tensor, ReduceOp op);
  // out: the full tensor; in: this rank's rows (torch.chunk of out's dim 0).
  void all_gather(at::Tensor& out, const at::Tensor& in);
  // in: the full tensor; out: this rank's rows of the reduction.
  void reduce_scatter(at::Tensor& out, const at::Tensor& in, ReduceOp op);

  // Zero-copy collectives on node-shared memory (CPU tensors).
  // A tensor that exists once per node: every local rank sees the same data.
  at::Tensor shared_empty(at::IntArrayRef sizes, at::ScalarType dtype);
  // This rank's tensor in a window where every local rank has one (on a
  // GPU: this rank's device memory, mapped by every local rank).
  at::Tensor symmetric_empty(at::IntArrayRef sizes, at::ScalarType dtype, c10::Device device = c10::kCPU);
  // Waits until every rank is done reading the tensor's last round; then this
  // rank may write into it.
  void acquire(const at::Tensor& window_tensor);
  // `full` from shared_empty(): every rank wrote its rows; returns when all
  // rows are visible (rows from other nodes are received over c10d).
  void all_gather_shared(const at::Tensor& full);
  // `in` from symmetric_empty(): every rank wrote its full input; this rank's
  // rows of the reduction go to `out`.
  void reduce_scatter_symmetric(at::Tensor& out, const at::Tensor& in, ReduceOp op);

  // Bytes moved by this rank since the last reset, on the CPU and devices.
  Stats stats() const;
  void reset_stats();

  // This rank leaves the job (fabric::Fabric::shutdown); idempotent.
  void shutdown() { fabric_->shutdown(); }

 private:
  // The collectives for `tensor`'s device, made on first use.
  DeviceCollectives& device(const at::Tensor& tensor);
  Window& window_of(const at::Tensor& tensor, const char* what);
  at::Tensor window_tensor(Window& window, void* data, at::IntArrayRef sizes, at::ScalarType dtype);
  // After `inputs` (one slot per local rank, `rows` rows each) is published:
  // this rank's global rows of the reduction into out; releases `inputs`.
  void reduce_published(Window& inputs, int64_t rows, int64_t row_elems, at::ScalarType type, ReduceOp op,
                        at::Tensor& out);
  // Fills the rows of `full` (in node-shared memory) that this rank's
  // counterparts on other nodes own, then publishes it on the node.
  void gather_published(Window& window, at::Tensor& full);
  fabric::Topology topology_;
  std::shared_ptr<fabric::Fabric> fabric_;
  NodeComm node_;
  c10::intrusive_ptr<c10d::ProcessGroup> cross_node_;
  // Windows handed out as tensors, by base address; shared with the tensors'
  // deleters, which drop their entry.
  std::shared_ptr<std::map<const void*, Window>> windows_;
  std::map<std::string, std::unique_ptr<DeviceCollectives>> devices_;
};

DType dtype_of(at::ScalarType type);

}  // namespace hp::comm
