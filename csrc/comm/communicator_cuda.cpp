// The communicator's collectives on CUDA tensors: DeviceNodeComm inside the
// node, c10d (NCCL, or Gloo where NCCL cannot run) across nodes. This file
// reaches CUDA only through c10's device interfaces and hyperparallel's own
// torch-free device layer, so it compiles against a CPU-only torch too; it is
// linked only where torch has CUDA, and registers itself then.
#include <c10/core/DeviceGuard.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <map>

#include "hyperparallel/comm/communicator.h"
#include "hyperparallel/comm/device_comm.h"

namespace hp::comm {
namespace {

std::pair<int64_t, int64_t> rows_of(const at::Tensor& tensor) {
  int64_t rows = tensor.dim() == 0 ? 1 : tensor.size(0);
  return {rows, rows == 0 ? 0 : tensor.numel() / rows};
}

class CudaCollectives : public DeviceCollectives {
 public:
  CudaCollectives(Communicator& communicator, c10::Device device)
      : communicator_(communicator), device_(device), topology_(communicator.topology()) {
    c10::DeviceGuard guard(device_);
    node_ = std::make_unique<DeviceNodeComm>(communicator.fabric(), device.index());
  }

  void broadcast(at::Tensor& tensor, int64_t src) override {
    Enter enter(*this, tensor);
    const int src_node = int(src / topology_.local_world_size), src_local = int(src % topology_.local_world_size);
    if (cross_node() && topology_.local_rank == src_local) {
      std::vector<at::Tensor> tensors{tensor};
      c10d::BroadcastOptions options;
      options.rootRank = src_node;
      cross_node()->broadcast(tensors, options)->wait();
    }
    node_->broadcast(tensor.data_ptr(), tensor.nbytes(), src_local, stream());
  }

  void all_reduce(at::Tensor& tensor, ReduceOp op) override {
    Enter enter(*this, tensor);
    const float scale = op == ReduceOp::Avg ? 1.0f / float(topology_.world_size) : 1.0f;
    if (!cross_node()) {
      node_->all_reduce(tensor.data_ptr(), tensor.numel(), dtype_of(tensor.scalar_type()), scale, stream());
      return;
    }
    // The node's sum and the sum over nodes both in fp32, rounded once.
    at::Tensor wide = tensor.to(at::kFloat).contiguous();
    if (wide.data_ptr() == tensor.data_ptr()) wide = wide.clone();
    node_->all_reduce(wide.data_ptr(), wide.numel(), DType::F32, scale, stream());
    std::vector<at::Tensor> tensors{wide};
    cross_node()->allreduce(tensors)->wait();
    tensor.copy_(wide);
  }

  void all_gather(at::Tensor& out, const at::Tensor& in) override {
    Enter enter(*this, out);
    auto [rows, row_elems] = rows_of(out);
    const std::size_t row_bytes = row_elems * out.element_size();
    const int local = topology_.local_world_size, node = topology_.node;
    // Within the node: every rank's rows straight into place.
    std::vector<Range> ranges;
    for (int r = 0; r < local; ++r) ranges.push_back(chunk(rows, topology_.world_size, node * local + r));
    node_->all_gather(in.data_ptr(), out.data_ptr(), ranges, row_bytes, stream());
    if (!cross_node()) return;
    // Across nodes: a node's rows are contiguous (torch.chunk order), so each
    // counterpart group swaps whole node blocks, padded to one size.
    const int nodes = topology_.num_nodes;
    const int64_t per_rank = (rows + topology_.world_size - 1) / topology_.world_size;
    const int64_t per_node = per_rank * local;
    auto block = [&](int m) {
      Range first = chunk(rows, topology_.world_size, m * local), last = chunk(rows, topology_.world_size, m * local + local - 1);
      return Range{first.begin, last.end};
    };
    at::Tensor flat = out.view({rows, row_elems});
    at::Tensor send = at::zeros({per_node, row_elems}, out.options());
    const Range mine = block(node);
    send.narrow(0, 0, int64_t(mine.size())).copy_(flat.narrow(0, mine.begin, mine.size()));
    std::vector<at::Tensor> received;
    for (int m = 0; m < nodes; ++m) received.push_back(at::empty({per_node, row_elems}, out.options()));
    std::vector<std::vector<at::Tensor>> outputs{received};
    std::vector<at::Tensor> inputs{send};
    cross_node()->allgather(outputs, inputs)->wait();
    for (int m = 0; m < nodes; ++m) {
      if (m == node) continue;
      const Range theirs = block(m);
      flat.narrow(0, theirs.begin, theirs.size()).copy_(outputs[0][m].narrow(0, 0, int64_t(theirs.size())));
    }
  }

  void reduce_scatter(at::Tensor& out, const at::Tensor& in, ReduceOp op) override {
    Enter enter(*this, in);
    auto [rows, row_elems] = rows_of(in);
    const DType dtype = dtype_of(in.scalar_type());
    const float scale = op == ReduceOp::Avg ? 1.0f / float(topology_.world_size) : 1.0f;
    const int local = topology_.local_world_size;
    if (!cross_node()) {
      const Range mine = chunk(rows, local, topology_.local_rank);
      node_->reduce(in.data_ptr(), in.numel(), dtype,
                    {ReduceSegment{mine.begin * row_elems, 0, mine.size() * row_elems}}, scale, out.data_ptr(), dtype,
                    stream());
      return;
    }
    // Sum over this node the rows of each of this rank's counterparts, in
    // fp32; then sum over nodes and keep this rank's part.
    const int nodes = topology_.num_nodes;
    const int64_t per = (rows + topology_.world_size - 1) / topology_.world_size * row_elems;
    at::Tensor partial = at::zeros({nodes, per}, in.options().dtype(at::kFloat));
    std::vector<ReduceSegment> segments;
    for (int m = 0; m < nodes; ++m) {
      const Range theirs = chunk(rows, topology_.world_size, m * local + topology_.local_rank);
      segments.push_back(ReduceSegment{theirs.begin * row_elems, uint64_t(m * per), theirs.size() * row_elems});
    }
    node_->reduce(in.data_ptr(), in.numel(), dtype, segments, scale, partial.data_ptr(), DType::F32, stream());
    std::vector<at::Tensor> tensors{partial};
    cross_node()->allreduce(tensors)->wait();
    out.view({-1}).copy_(partial[topology_.node].narrow(0, 0, out.numel()));
  }

  at::Tensor symmetric_empty(at::IntArrayRef sizes, at::ScalarType dtype) override {
    c10::DeviceGuard guard(device_);
    const std::size_t bytes = c10::multiply_integers(sizes) * c10::elementSize(dtype);
    auto window = std::make_shared<DeviceWindow>(node_->window(bytes));
    const void* base = window->memory->local();
    (*windows_)[base] = window;
    // The tensor keeps the window alive; when it goes, so does the registry
    // entry, and the memory once the peers have finished reading it (each
    // rank drops its tensor when it likes; a peer's reduce may still be
    // queued on its GPU). Without the communicator there is no peer left to
    // wait for.
    std::weak_ptr<std::map<const void*, std::shared_ptr<DeviceWindow>>> registry = windows_;
    const c10::Device device = device_;
    return at::from_blob(
        window->memory->local(), sizes,
        [registry, window, base, device](void*) {
          auto windows = registry.lock();
          if (!windows) return;
          windows->erase(base);
          try {
            c10::DeviceGuard guard(device);
            c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
            DeviceNodeComm::drain(*window, impl.getStream(device).native_handle());
          } catch (const std::exception& error) {
            TORCH_WARN("hyperparallel: freeing a symmetric tensor without its peers' last reads: ", error.what());
          }
        },
        at::TensorOptions().dtype(dtype).device(device_));
  }

  bool acquire(const at::Tensor& tensor) override {
    DeviceWindow* window = window_of(tensor);
    if (!window) return false;
    Enter enter(*this, tensor);
    node_->acquire(*window, stream());
    return true;
  }

  void reduce_scatter_symmetric(at::Tensor& out, const at::Tensor& in, ReduceOp op) override {
    DeviceWindow* window = window_of(in);
    TORCH_CHECK(window && in.data_ptr() == window->memory->local(),
                "hyperparallel reduce_scatter_symmetric: expected this rank's whole tensor from "
                "hp.comm.symmetric_empty(..., device=", device_, ")");
    TORCH_CHECK(!cross_node(), "hyperparallel reduce_scatter_symmetric: on a GPU this is a node-local collective; "
                "across nodes use reduce_scatter_tensor");
    Enter enter(*this, in);
    auto [rows, row_elems] = rows_of(in);
    const Range mine = chunk(rows, topology_.local_world_size, topology_.local_rank);
    TORCH_CHECK(out.is_contiguous() && out.numel() == int64_t(mine.size()) * row_elems &&
                    out.scalar_type() == in.scalar_type(),
                "hyperparallel reduce_scatter_symmetric: out needs ", mine.size() * row_elems, " contiguous elements of ",
                in.scalar_type());
    const DType dtype = dtype_of(in.scalar_type());
    const float scale = op == ReduceOp::Avg ? 1.0f / float(topology_.world_size) : 1.0f;
    node_->reduce_window(*window, dtype, {ReduceSegment{mine.begin * row_elems, 0, mine.size() * row_elems}}, scale,
                         out.data_ptr(), dtype, stream());
  }

  Stats stats() const override { return node_->stats(); }
  void reset_stats() override { node_->reset_stats(); }

 private:
  // Every collective runs on the caller's current stream of this rank's device.
  struct Enter {
    c10::DeviceGuard guard;
    Enter(CudaCollectives& self, const at::Tensor& tensor) : guard(self.device_) {
      TORCH_CHECK(tensor.device() == self.device_, "hyperparallel collectives: a tensor on ", tensor.device(),
                  " but this rank's collectives run on ", self.device_, "; one rank drives one device");
    }
  };

  DeviceWindow* window_of(const at::Tensor& tensor) {
    const char* address = static_cast<const char*>(tensor.data_ptr());
    auto it = windows_->upper_bound(address);
    if (it == windows_->begin()) return nullptr;
    --it;
    const char* base = static_cast<const char*>(it->first);
    return address < base + it->second->memory->bytes() ? it->second.get() : nullptr;
  }

  fabric::StreamHandle stream() const {
    c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    return impl.getStream(device_).native_handle();
  }
  const c10::intrusive_ptr<c10d::ProcessGroup>& cross_node() const { return communicator_.cross_node(); }

  Communicator& communicator_;
  c10::Device device_;
  fabric::Topology topology_;
  std::unique_ptr<DeviceNodeComm> node_;
  // Symmetric tensors handed out, by base address.
  std::shared_ptr<std::map<const void*, std::shared_ptr<DeviceWindow>>> windows_ =
      std::make_shared<std::map<const void*, std::shared_ptr<DeviceWindow>>>();
};

std::unique_ptr<DeviceCollectives> make_cuda_collectives(Communicator& communicator, c10::Device device) {
  return std::make_unique<CudaCollectives>(communicator, device);
}

const bool registered = (register_device_collectives(c10::DeviceType::CUDA, &make_cuda_collectives), true);

}  // namespace
}  // namespace hp::comm
