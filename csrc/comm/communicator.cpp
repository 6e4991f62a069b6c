#include "hyperparallel/comm/communicator.h"
#include "hyperparallel/comm/c10d.h"

#include <c10/util/Exception.h>

namespace hp::comm {
namespace {

std::shared_ptr<fabric::Fabric> make_fabric(const fabric::Topology& topology, c10::intrusive_ptr<c10d::Store> store) {
  StoreBootstrap bootstrap(std::move(store));
  return std::make_shared<fabric::Fabric>(topology, bootstrap);
}

void check_dense(const at::Tensor& tensor, const char* what) {
  TORCH_CHECK(tensor.is_contiguous(), "hyperparallel ", what, ": expected a contiguous tensor; call .contiguous() first");
}

void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* what) {
  TORCH_CHECK(a.device() == b.device(), "hyperparallel ", what, ": out is on ", a.device(), " but in is on ",
              b.device());
}

std::map<c10::DeviceType, DeviceCollectivesFactory>& device_factories() {
  static std::map<c10::DeviceType, DeviceCollectivesFactory> factories;
  return factories;
}

// (rows, elements per row) of a tensor split on dim 0; a scalar is one row.
std::pair<int64_t, int64_t> rows_of(const at::Tensor& tensor) {
  int64_t rows = tensor.dim() == 0 ? 1 : tensor.size(0);
  return {rows, rows == 0 ? 0 : tensor.numel() / rows};
}

Range scaled(Range rows, int64_t row_elems) { return Range{rows.begin * row_elems, rows.end * row_elems}; }

}  // namespace

void register_device_collectives(c10::DeviceType type, DeviceCollectivesFactory factory) {
  device_factories()[type] = factory;
}

std::vector<std::string> device_backends() {
  std::vector<std::string> names;
  for (const auto& [type, factory] : device_factories()) names.push_back(c10::DeviceTypeName(type, /*lower_case=*/true));
  return names;
}

DType dtype_of(at::ScalarType type) {
  if (type == at::kFloat) return DType::F32;
  TORCH_CHECK(type == at::kBFloat16, "hyperparallel collectives take float32 or bfloat16 tensors, got ", type,
              "; cast with .float() or .bfloat16() first");
  return DType::BF16;
}

void StoreBootstrap::set(const std::string& key, const std::string& value) {
  store_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

std::string StoreBootstrap::get(const std::string& key, std::chrono::milliseconds timeout) {
  store_->wait({key}, timeout);
  auto bytes = store_->get(key);
  return std::string(bytes.begin(), bytes.end());
}

Communicator::Communicator(fabric::Topology topology, c10::intrusive_ptr<c10d::Store> store,
                           c10::intrusive_ptr<c10d::ProcessGroup> cross_node)
    : topology_(topology),
      fabric_(make_fabric(topology, std::move(store))),
      node_(fabric_),
      cross_node_(std::move(cross_node)),
      windows_(std::make_shared<std::map<const void*, Window>>()) {
  TORCH_CHECK(topology.num_nodes == 1 || cross_node_,
              "hyperparallel: a job over ", topology.num_nodes, " nodes needs the cross-node process group");
  if (cross_node_)
    TORCH_CHECK(cross_node_->getSize() == topology.num_nodes && cross_node_->getRank() == topology.node,
                "hyperparallel: the cross-node group must hold this rank's counterparts on every node, ordered by node");
}

DeviceCollectives& Communicator::device(const at::Tensor& tensor) {
  const c10::Device device = tensor.device();
  auto& slot = devices_[device.str()];
  if (!slot) {
    auto it = device_factories().find(device.type());
    TORCH_CHECK(it != device_factories().end(), "hyperparallel collectives: a tensor on ", device,
                ", but this build of hyperparallel has no ", c10::DeviceTypeName(device.type()),
                " backend; rebuild it against a torch with ", c10::DeviceTypeName(device.type()),
                " (and nvcc on PATH for CUDA), or pass CPU tensors");
    TORCH_CHECK(devices_.size() == 1, "hyperparallel collectives: this rank already used another device (",
                devices_.begin()->first, "); one rank drives one device");
    slot = it->second(*this, device);
  }
  return *slot;
}

Stats Communicator::stats() const {
  Stats total = node_.stats();
  for (const auto& [name, device] : devices_) {
    Stats more = device->stats();
    total.bytes_copied += more.bytes_copied;
    total.bytes_reduced += more.bytes_reduced;
  }
  return total;
}

void Communicator::reset_stats() {
  node_.reset_stats();
  for (auto& [name, device] : devices_) device->reset_stats();
}

void Communicator::barrier() {
  node_.barrier();
  if (cross_node_) {
    cross_node_->barrier()->wait();
    node_.barrier();
  }
}

void Communicator::broadcast(at::Tensor& tensor, int64_t src) {
  check_dense(tensor, "broadcast");
  TORCH_CHECK(src >= 0 && src < topology_.world_size, "hyperparallel broadcast: src=", src, " is not a rank of this ",
              topology_.world_size, "-rank job");
  dtype_of(tensor.scalar_type());
  if (!tensor.device().is_cpu()) return device(tensor).broadcast(tensor, src);
  const int src_node = int(src / topology_.local_world_size), src_local = int(src % topology_.local_world_size);
  if (cross_node_ && topology_.local_rank == src_local) {
    std::vector<at::Tensor> tensors{tensor};
    c10d::BroadcastOptions options;
    options.rootRank = src_node;
    cross_node_->broadcast(tensors, options)->wait();
  }
  node_.broadcast(tensor.data_ptr(), tensor.numel(), dtype_of(tensor.scalar_type()), src_local);
}

void Communicator::all_reduce(at::Tensor& tensor, ReduceOp op) {
  check_dense(tensor, "all_reduce");
  const DType dtype = dtype_of(tensor.scalar_type());
  if (!tensor.device().is_cpu()) return device(tensor).all_reduce(tensor, op);
  const int64_t n = tensor.numel();
  if (!cross_node_) {
    node_.all_reduce(tensor.data_ptr(), n, dtype, op);
    return;
  }
  // Reduce this rank's chunk over the node, sum it across nodes, share it.
  const std::size_t esize = dtype_size(dtype), bytes = n * esize;
  Window& inputs = node_.scratch_inputs(bytes);
  node_.copy(inputs.slot(node_.rank()), tensor.data_ptr(), bytes);
  node_.publish(inputs);
  Range mine = chunk(n, node_.size(), node_.rank());
  // The node's partial sum stays fp32 until the sum over nodes is complete.
  at::Tensor wide = at::empty({int64_t(mine.size())}, at::kFloat);
  const float scale = op == ReduceOp::Avg ? 1.0f / float(topology_.world_size) : 1.0f;
  node_.reduce_rows(inputs, mine, dtype, scale, wide.data_ptr(), DType::F32);
  node_.release(inputs);
  std::vector<at::Tensor> parts{wide};
  cross_node_->allreduce(parts)->wait();
  at::Tensor part = wide.to(tensor.scalar_type());
  Window& results = node_.scratch_results(bytes);
  node_.copy(static_cast<char*>(results.slot(0)) + mine.begin * esize, part.data_ptr(), mine.size() * esize);
  node_.publish(results);
  node_.copy(tensor.data_ptr(), results.slot(0), bytes);
  node_.release(results);
}

void Communicator::all_gather(at::Tensor& out, const at::Tensor& in) {
  check_dense(out, "all_gather (out)");
  check_dense(in, "all_gather (in)");
  TORCH_CHECK(out.scalar_type() == in.scalar_type(), "hyperparallel all_gather: out is ", out.scalar_type(),
              " but in is ", in.scalar_type());
  auto [rows, row_elems] = rows_of(out);
  Range mine = chunk(rows, topology_.world_size, topology_.rank);
  TORCH_CHECK(in.numel() == int64_t(mine.size()) * row_elems, "hyperparallel all_gather: rank ", topology_.rank,
              " owns rows [", mine.begin, ", ", mine.end, ") of out's ", rows, " (torch.chunk over ",
              topology_.world_size, " ranks), so in needs ", mine.size() * row_elems, " elements, not ", in.numel());
  const DType dtype = dtype_of(out.scalar_type());
  check_same_device(out, in, "all_gather");
  if (!out.device().is_cpu()) return device(out).all_gather(out, in);
  if (!cross_node_) {
    node_.all_gather(in.data_ptr(), out.data_ptr(), rows, row_elems, dtype);
    return;
  }
  const std::size_t row_bytes = row_elems * dtype_size(dtype);
  Window& results = node_.scratch_results(rows * row_bytes);
  node_.copy(static_cast<char*>(results.slot(0)) + mine.begin * row_bytes, in.data_ptr(), mine.size() * row_bytes);
  at::Tensor full = at::from_blob(results.slot(0), out.sizes(), out.options());
  gather_published(results, full);
  node_.copy(out.data_ptr(), results.slot(0), rows * row_bytes);
  node_.release(results);
}

void Communicator::reduce_scatter(at::Tensor& out, const at::Tensor& in, ReduceOp op) {
  check_dense(out, "reduce_scatter (out)");
  check_dense(in, "reduce_scatter (in)");
  TORCH_CHECK(out.scalar_type() == in.scalar_type(), "hyperparallel reduce_scatter: out is ", out.scalar_type(),
              " but in is ", in.scalar_type());
  auto [rows, row_elems] = rows_of(in);
  Range mine = chunk(rows, topology_.world_size, topology_.rank);
  TORCH_CHECK(out.numel() == int64_t(mine.size()) * row_elems, "hyperparallel reduce_scatter: rank ", topology_.rank,
              " owns rows [", mine.begin, ", ", mine.end, ") of in's ", rows, " (torch.chunk over ",
              topology_.world_size, " ranks), so out needs ", mine.size() * row_elems, " elements, not ", out.numel());
  const DType dtype = dtype_of(in.scalar_type());
  check_same_device(out, in, "reduce_scatter");
  if (!in.device().is_cpu()) return device(in).reduce_scatter(out, in, op);
  if (!cross_node_) {
    node_.reduce_scatter(in.data_ptr(), out.data_ptr(), rows, row_elems, dtype, op);
    return;
  }
  const std::size_t bytes = in.numel() * dtype_size(dtype);
  Window& inputs = node_.scratch_inputs(bytes);
  node_.copy(inputs.slot(node_.rank()), in.data_ptr(), bytes);
  node_.publish(inputs);
  reduce_published(inputs, rows, row_elems, in.scalar_type(), op, out);
}

void Communicator::reduce_published(Window& inputs, int64_t rows, int64_t row_elems, at::ScalarType type,
                                    ReduceOp op, at::Tensor& out) {
  const DType dtype = dtype_of(type);
  const float scale = op == ReduceOp::Avg ? 1.0f / float(topology_.world_size) : 1.0f;
  if (!cross_node_) {
    node_.reduce_rows(inputs, scaled(chunk(rows, node_.size(), node_.rank()), row_elems), dtype, scale,
                      out.data_ptr());
    node_.release(inputs);
    return;
  }
  // Sum, over this node, the rows of every counterpart on every node; then
  // each counterpart keeps its own rows of the sum over nodes.
  const int nodes = topology_.num_nodes;
  const int64_t per = (rows + topology_.world_size - 1) / topology_.world_size * row_elems;
  // Partial sums stay fp32 until the sum over nodes is complete.
  at::Tensor partial = at::zeros({nodes, per}, at::kFloat);
  for (int m = 0; m < nodes; ++m) {
    Range theirs = chunk(rows, topology_.world_size, m * topology_.local_world_size + topology_.local_rank);
    node_.reduce_rows(inputs, scaled(theirs, row_elems), dtype, scale, partial[m].data_ptr(), DType::F32);
  }
  node_.release(inputs);
  at::Tensor received = at::empty({per}, at::kFloat);
  at::Tensor flat = partial.view({-1});
  c10d_compat::reduce_scatter_single(*cross_node_, received, flat)->wait();
  out.view({-1}).copy_(received.narrow(0, 0, out.numel()));
}

void Communicator::gather_published(Window& window, at::Tensor& full) {
  if (cross_node_) {
    auto [rows, row_elems] = rows_of(full);
    const int nodes = topology_.num_nodes;
    const int64_t per = (rows + topology_.world_size - 1) / topology_.world_size;
    Range mine = chunk(rows, topology_.world_size, topology_.rank);
    at::Tensor send = at::zeros({per, row_elems}, full.options());
    send.narrow(0, 0, mine.size()).copy_(full.view({rows, row_elems}).narrow(0, mine.begin, mine.size()));
    at::Tensor received = at::empty({nodes * per, row_elems}, full.options());
    c10d_compat::all_gather_single(*cross_node_, received, send)->wait();
    for (int m = 0; m < nodes; ++m) {
      if (m == topology_.node) continue;
      Range theirs = chunk(rows, topology_.world_size, m * topology_.local_world_size + topology_.local_rank);
      full.view({rows, row_elems})
          .narrow(0, theirs.begin, theirs.size())
          .copy_(received.narrow(0, m * per, theirs.size()));
    }
  }
  node_.publish(window);
}

at::Tensor Communicator::window_tensor(Window& window, void* data, at::IntArrayRef sizes, at::ScalarType dtype) {
  const void* base = window.data();
  (*windows_)[base] = window;
  // The tensor keeps the mapping alive; when it goes, so does the registry entry.
  std::weak_ptr<std::map<const void*, Window>> registry = windows_;
  auto segment = window.segment();
  return at::from_blob(
      data, sizes,
      [registry, segment, base](void*) {
        if (auto windows = registry.lock()) windows->erase(base);
      },
      at::TensorOptions().dtype(dtype));
}

at::Tensor Communicator::shared_empty(at::IntArrayRef sizes, at::ScalarType dtype) {
  // Shared and symmetric tensors are node-shared CPU memory; on a GPU every
  // rank computes on its own copy (see fabric/device.h).
  dtype_of(dtype);
  Window window = node_.shared(c10::multiply_integers(sizes) * c10::elementSize(dtype));
  return window_tensor(window, window.data(), sizes, dtype);
}

at::Tensor Communicator::symmetric_empty(at::IntArrayRef sizes, at::ScalarType dtype, c10::Device on) {
  dtype_of(dtype);
  if (!on.is_cpu()) return device(at::empty({0}, at::TensorOptions().dtype(dtype).device(on))).symmetric_empty(sizes, dtype);
  Window window = node_.symmetric(c10::multiply_integers(sizes) * c10::elementSize(dtype));
  return window_tensor(window, window.slot(node_.rank()), sizes, dtype);
}

Window& Communicator::window_of(const at::Tensor& tensor, const char* what) {
  const char* address = static_cast<const char*>(tensor.data_ptr());
  auto it = windows_->upper_bound(address);
  bool found = it != windows_->begin();
  if (found) {
    --it;
    found = address < static_cast<const char*>(it->first) + it->second.bytes();
  }
  TORCH_CHECK(found, "hyperparallel ", what, ": the tensor is not in shared memory; make it with ",
              "hp.comm.shared_empty / symmetric_empty, or use the copying collective");
  return it->second;
}

void Communicator::acquire(const at::Tensor& tensor) {
  if (!tensor.device().is_cpu() && device(tensor).acquire(tensor)) return;
  node_.acquire(window_of(tensor, "acquire"));
}

void Communicator::all_gather_shared(const at::Tensor& full) {
  Window& window = window_of(full, "all_gather_shared");
  TORCH_CHECK(window.slots() == 1 && full.data_ptr() == window.data(),
              "hyperparallel all_gather_shared: expected the whole tensor from shared_empty()");
  at::Tensor view = full;
  gather_published(window, view);
}

void Communicator::reduce_scatter_symmetric(at::Tensor& out, const at::Tensor& in, ReduceOp op) {
  check_same_device(out, in, "reduce_scatter_symmetric");
  if (!in.device().is_cpu()) return device(in).reduce_scatter_symmetric(out, in, op);
  Window& window = window_of(in, "reduce_scatter_symmetric");
  TORCH_CHECK(window.slots() == node_.size() && in.data_ptr() == window.slot(node_.rank()),
              "hyperparallel reduce_scatter_symmetric: expected this rank's tensor from symmetric_empty()");
  check_dense(out, "reduce_scatter_symmetric (out)");
  auto [rows, row_elems] = rows_of(in);
  Range mine = chunk(rows, topology_.world_size, topology_.rank);
  TORCH_CHECK(out.numel() == int64_t(mine.size()) * row_elems && out.scalar_type() == in.scalar_type(),
              "hyperparallel reduce_scatter_symmetric: out needs ", mine.size() * row_elems, " elements of ",
              in.scalar_type());
  node_.publish(window);
  reduce_published(window, rows, row_elems, in.scalar_type(), op, out);
}

}  // namespace hp::comm
