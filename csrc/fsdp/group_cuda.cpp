// The CUDA backend's parameter groups (see param_group.h).
//
// A GPU computes on its own HBM, so every rank keeps the full parameters it
// is computing with in its own device memory, and only while it needs them:
//
// - This rank's rows of every parameter live in device memory its peers map
//   (fabric::PeerMemory): the DTensor shards the optimizer updates in place.
//   With mixed precision the owner also casts them, once per iteration, into
//   a low-precision copy that the peers read instead (a rank alone on its
//   node keeps no copy: it casts its rows into the full parameters).
// - Unsharding pulls every rank's rows straight into the full parameters'
//   storage (one flat allocation from torch's caching allocator, the
//   parameters views of it) with batched copies on the copy engines, on an
//   all-gather stream of its own: no flat buffer to copy in or out of, no SMs
//   taken from the compute beside it. Resharding gives the storage back; the
//   parameter tensors stay (autograd holds them), as in FSDP2.
// - Reduce-scatter: each rank puts its full gradients in its slot of a
//   gradient window every rank maps, and one kernel sums this rank's rows
//   over every slot into its sharded gradients, on a reduce-scatter stream.
//   With HSDP the nodes' all-reduce of those follows on a stream of its own.
//
// Streams of different ranks are ordered by fabric::DeviceSignal (IPC events
// whose rounds the host channels announce); nothing spins on the GPU.
// This file reaches CUDA only through c10's device interfaces and the
// torch-free device layer, so it compiles against a CPU-only torch; it is
// linked where torch has CUDA and registers itself then.
#include <c10/core/DeviceGuard.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "hyperparallel/comm/device_comm.h"
#include "hyperparallel/fabric/device.h"
#include "hyperparallel/fsdp/param_group.h"

namespace hp::fsdp {
namespace {

// Parameters start on 32-element boundaries (64 bytes of fp32), the kernels'
// vector loads' alignment and then some.
constexpr int64_t kAlignElems = 32;
// A shard's parameter starts at the same offset modulo kPhase as its rows in
// the full layout, so that the reduce kernel reads and writes 16 bytes at a
// time for fp32 and bf16 alike.
constexpr int64_t kPhase = 8;

int64_t align_up(int64_t elems) { return (elems + kAlignElems - 1) / kAlignElems * kAlignElems; }

using fabric::StreamHandle;

StreamHandle handle(const c10::Stream& stream) { return stream.native_handle(); }

c10::Stream current_stream(c10::Device device) {
  c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
  return impl.getStream(device);
}

// Where a group's parameters live, for every rank (each rank computes every
// rank's layout: its peers read its shards where this says they are).
struct Layout {
  std::vector<int64_t> numel, rows, row_elems, full_offset;  // per parameter
  int64_t full_elems = 0;
  std::vector<std::vector<comm::Range>> shard_rows;  // [rank][parameter]
  std::vector<std::vector<int64_t>> shard_offset;    // [rank][parameter], elements
  int64_t shard_capacity = 0;                        // the largest rank's shard buffer

  Layout(const std::vector<at::Tensor>& params, int ranks) {
    for (const auto& param : params) {
      numel.push_back(param.numel());
      rows.push_back(param.size(0));
      row_elems.push_back(param.size(0) == 0 ? 0 : param.numel() / param.size(0));
      full_offset.push_back(full_elems);
      full_elems += align_up(param.numel());
    }
    shard_rows.resize(ranks);
    shard_offset.resize(ranks);
    for (int r = 0; r < ranks; ++r) {
      int64_t offset = 0;
      for (std::size_t i = 0; i < params.size(); ++i) {
        const comm::Range mine = comm::chunk(rows[i], ranks, r);
        const int64_t phase = (full_offset[i] + int64_t(mine.begin) * row_elems[i]) % kPhase;
        shard_rows[r].push_back(mine);
        shard_offset[r].push_back(align_up(offset) + phase);
        offset = shard_offset[r].back() + int64_t(mine.size()) * row_elems[i];
      }
      shard_capacity = std::max(shard_capacity, align_up(offset));
    }
  }
  int64_t shard_numel(int rank, std::size_t i) const { return int64_t(shard_rows[rank][i].size()) * row_elems[i]; }
};

// One gradient window: every rank's full gradients for one group at a time,
// which of them it had (host memory every rank of the node maps), and the
// signals that keep a rank from overwriting its slot before every peer has
// read it.
struct GradWindow {
  std::shared_ptr<fabric::PeerMemory> memory;
  std::shared_ptr<fabric::Segment> flags;  // [local rank][parameter]: 1 where that rank had a gradient
  std::unique_ptr<fabric::DeviceSignal> ready, done;
};

// What all CUDA groups of a process share: the all-gather, reduce-scatter
// and (HSDP) nodes' all-reduce streams, and a ring of two gradient windows
// (a group holds one from its backward to the end of its reduction; two let
// one reduction overlap the next group's backward).
class CudaState : public BackendState {
 public:
  CudaState(std::shared_ptr<fabric::Fabric> fabric, c10::Device device)
      : fabric_(std::move(fabric)),
        device_(device),
        all_gather(c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getStreamFromGlobalPool(device, true)),
        reduce_scatter(c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getStreamFromGlobalPool(device, true)),
        all_reduce(c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getStreamFromGlobalPool(device, true)) {
    for (auto& window : windows_) {
      window.ready = std::make_unique<fabric::DeviceSignal>(*fabric_, device.index());
      window.done = std::make_unique<fabric::DeviceSignal>(*fabric_, device.index());
    }
  }

  // Collective (every rank at the same fully_shard call): windows of at
  // least `bytes` per rank, with flags for at least `params` parameters.
  void reserve(std::size_t bytes, std::size_t params) {
    if (bytes <= bytes_ && params <= params_) return;
    for (auto& window : windows_) {
      // Peers may still read the old buffer and flags: wait until they are
      // done with their last round before they go.
      if (window.memory && window.done->posted() > 0) {
        window.done->wait_all(window.done->posted(), handle(reduce_scatter), "growing the gradient windows");
        fabric::device::synchronize(handle(reduce_scatter));
      }
      if (bytes > bytes_) {
        window.memory.reset();
        window.memory = std::make_shared<fabric::PeerMemory>(*fabric_, device_.index(), bytes);
      }
      if (params > params_) window.flags = fabric_->allocate(std::size_t(fabric_->local_world()) * params);
    }
    bytes_ = std::max(bytes, bytes_);
    params_ = std::max(params, params_);
  }
  // Local rank `rank`'s flags in `window`.
  uint8_t* flags(const GradWindow& window, int rank) const {
    return static_cast<uint8_t*>(window.flags->data()) + std::size_t(rank) * params_;
  }
  // The next window in ring order (the reducer thread alone takes them, in
  // the same order on every rank).
  GradWindow& next() {
    GradWindow& window = windows_[next_];
    next_ = (next_ + 1) % std::size(windows_);
    return window;
  }

 private:
  std::shared_ptr<fabric::Fabric> fabric_;
  c10::Device device_;

 public:
  const c10::Stream all_gather, reduce_scatter, all_reduce;

 private:
  GradWindow windows_[2];
  std::size_t bytes_ = 0, params_ = 0, next_ = 0;
};

// A tensor over peer memory; it keeps the memory alive.
at::Tensor over(const std::shared_ptr<fabric::PeerMemory>& memory, int64_t elems, at::ScalarType dtype,
                c10::Device device) {
  return at::from_blob(memory->local(), {elems}, [memory](void*) {},
                       at::TensorOptions().dtype(dtype).device(device));
}

class CudaParamGroup : public ParamGroup {
 public:
  CudaParamGroup(std::shared_ptr<Context> context, const std::vector<at::Tensor>& params, GroupOptions options);
  ~CudaParamGroup() override;

  const std::vector<at::Tensor>& full() const override { return full_views_; }
  const std::vector<at::Tensor>& shards() const override { return shard_views_; }
  void publish() override;
  void begin_unshard() override;
  void wait_unshard() override;
  void reshard() override;
  void reduce(std::vector<std::optional<at::Tensor>> grads) override;
  std::vector<std::optional<at::Tensor>> sharded_grads() override;
  at::Tensor sharded_grad_buffer() const override { return sharded_grad_buffer_.narrow(0, 0, layout_.shard_capacity); }
  void release() override;
  void discard_held() override;

 private:
  void allocate_full();
  void free_full();
  void run_reduce(const std::vector<std::optional<at::Tensor>>& grads, at::Tensor output, float scale,
                  bool all_reduce);
  // run_reduce's two ways: alone on the node (this rank's gradients are the
  // sum), or through a window every rank of the node reads. Each returns, per
  // parameter, whether any rank of the node had a gradient.
  std::vector<uint8_t> reduce_alone(const std::vector<std::optional<at::Tensor>>& grads, at::Tensor& output,
                                    float scale);
  std::vector<uint8_t> reduce_window(const std::vector<std::optional<at::Tensor>>& grads, at::Tensor& output,
                                     float scale, StreamHandle stream);
  StreamHandle compute() const { return handle(current_stream(device_)); }
  int rank() const { return communicator_->node().rank(); }
  int ranks() const { return communicator_->node().size(); }

  std::shared_ptr<Context> context_;
  std::shared_ptr<comm::Communicator> communicator_;
  std::shared_ptr<Reducer> reducer_;
  c10::Device device_;
  CudaState& state_;
  GroupOptions options_;
  at::ScalarType dtype_, compute_dtype_, grad_dtype_;
  Layout layout_;
  std::shared_ptr<fabric::PeerMemory> shard_, compute_shard_;  // compute_shard_: with mixed precision
  at::Tensor shard_flat_, compute_shard_flat_;
  std::vector<at::Tensor> shard_views_;
  at::Tensor full_flat_;  // its storage is swapped in and out; the views stay
  std::vector<at::Tensor> full_views_;
  std::unique_ptr<fabric::DeviceSignal> shard_ready_;  // this rank's rows are readable for this iteration
  std::unique_ptr<fabric::DeviceSignal> pulled_;       // this rank finished a pull of its peers' rows
  fabric::DeviceEvent published_at_, allocated_at_, unsharded_at_, grads_at_, summed_at_, reduced_at_, seen_at_;
  uint64_t publish_round_ = 0;
  uint64_t released_round_ = 0;  // pulled_'s round the last release waited for
  bool published_ = false, allocated_ = false, pull_pending_ = false, unsharded_ = false;
  at::Tensor sharded_grad_buffer_;  // the last reduction's output, reused while nothing else holds it
  // Per parameter: some rank of the job had a gradient in the last reduction
  // that was handed out (written by the reducer thread, read after its wait;
  // with HSDP, read back from seen_ once seen_at_ has passed).
  std::vector<uint8_t> any_grad_;
  at::Tensor seen_;  // HSDP: pinned host copy of the all-reduced flags
  bool seen_pending_ = false;
  ReduceTicket ticket_ = 0;
};

CudaParamGroup::CudaParamGroup(std::shared_ptr<Context> context, const std::vector<at::Tensor>& params,
                               GroupOptions options)
    : context_(context),
      communicator_(context->communicator()),
      reducer_(context->reducer()),
      device_(params.at(0).device()),
      state_(context->backend<CudaState>(device_, [&] {
        c10::DeviceGuard guard(device_);
        return std::make_shared<CudaState>(context->communicator()->fabric(), device_);
      })),
      options_(std::move(options)),
      dtype_(params[0].scalar_type()),
      compute_dtype_(options_.param_dtype.value_or(dtype_)),
      grad_dtype_(options_.reduce_dtype.value_or(options_.param_dtype.value_or(dtype_))),
      layout_(params, communicator_->node().size()),
      published_at_(device_.index()),
      allocated_at_(device_.index()),
      unsharded_at_(device_.index()),
      grads_at_(device_.index()),
      summed_at_(device_.index()),
      reduced_at_(device_.index()),
      seen_at_(device_.index()) {
  c10::DeviceGuard guard(device_);
  for (const auto& param : params) {
    TORCH_CHECK(param.scalar_type() == dtype_, "hyperparallel fully_shard: one group's parameters must share a dtype, ",
                "found ", dtype_, " and ", param.scalar_type(), "; call fully_shard on a submodule to split them");
    TORCH_CHECK(param.dim() >= 1, "hyperparallel fully_shard: 0-dim parameters cannot be sharded on dim 0; ",
                "make it a 1-element tensor or pass it in ignored_params");
  }
  comm::dtype_of(dtype_);
  comm::dtype_of(compute_dtype_);
  comm::dtype_of(grad_dtype_);
  fabric::Fabric& fabric = *communicator_->fabric();
  const int index = device_.index();

  shard_ = std::make_shared<fabric::PeerMemory>(fabric, index, layout_.shard_capacity * c10::elementSize(dtype_));
  shard_flat_ = over(shard_, layout_.shard_capacity, dtype_, device_);
  for (std::size_t i = 0; i < params.size(); ++i) {
    const comm::Range rows = layout_.shard_rows[rank()][i];
    std::vector<int64_t> sizes = params[i].sizes().vec();
    sizes[0] = int64_t(rows.size());
    shard_views_.push_back(shard_flat_.narrow(0, layout_.shard_offset[rank()][i], layout_.shard_numel(rank(), i)).view(sizes));
    // Each rank contributes the rows it owns, as FSDP2 keeps each rank's chunk.
    shard_views_[i].copy_(params[i].detach().narrow(0, rows.begin, rows.size()));
  }
  // Peers read a low-precision copy of the rows; a rank alone on its node
  // keeps none and casts its rows straight into the full parameters.
  if (compute_dtype_ != dtype_ && ranks() > 1) {
    compute_shard_ = std::make_shared<fabric::PeerMemory>(fabric, index,
                                                          layout_.shard_capacity * c10::elementSize(compute_dtype_));
    compute_shard_flat_ = over(compute_shard_, layout_.shard_capacity, compute_dtype_, device_);
  }
  // The full parameters: views of one flat tensor whose storage comes and goes.
  full_flat_ = at::empty({layout_.full_elems}, at::TensorOptions().dtype(compute_dtype_).device(device_));
  for (std::size_t i = 0; i < params.size(); ++i)
    full_views_.push_back(full_flat_.narrow(0, layout_.full_offset[i], layout_.numel[i]).view(params[i].sizes()));
  allocated_ = true;
  free_full();
  shard_ready_ = std::make_unique<fabric::DeviceSignal>(fabric, index);
  pulled_ = std::make_unique<fabric::DeviceSignal>(fabric, index);
  // A rank alone on its node reduces its own gradients in place: no window.
  if (ranks() > 1) state_.reserve(layout_.full_elems * c10::elementSize(grad_dtype_), params.size());
}

CudaParamGroup::~CudaParamGroup() {
  try {
    reducer_->wait(ticket_);
    c10::DeviceGuard guard(device_);
    // The gradient buffer goes back to the compute stream's pool: after the
    // last reduction's writes (an iteration aborted after its reduce()).
    reduced_at_.wait(compute());
    // Peers may still be pulling this rank's rows: their memory goes only
    // after the last pull. If the last release already waited for it, the
    // peers' events are not touched again (a peer may have destroyed them:
    // groups die when each process's garbage collector gets to them).
    if (pulled_ && pulled_->posted() > 0) {
      if (pulled_->posted() > released_round_)
        pulled_->wait_all(pulled_->posted(), compute(), "freeing a group (peers finishing their pulls)");
      fabric::device::synchronize(compute());
    }
  } catch (...) {
    // A peer died (its error was raised where it was awaited) or this is the
    // process's exit: nothing will read this memory again.
  }
}

void CudaParamGroup::allocate_full() {
  // From torch's caching allocator on the compute stream, which alone reads
  // the parameters; the all-gather stream writes them only after the compute
  // stream reached this point (allocated_at_), so a block the allocator
  // hands back is never written while an earlier reader still runs.
  const std::size_t bytes = std::size_t(layout_.full_elems) * c10::elementSize(compute_dtype_);
  at::Tensor fresh = at::empty({int64_t(bytes)}, at::TensorOptions().dtype(at::kByte).device(device_));
  c10::StorageImpl* storage = full_flat_.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(std::move(fresh.storage().unsafeGetStorageImpl()->mutable_data_ptr()));
  storage->set_nbytes(bytes);
  allocated_ = true;
}

void CudaParamGroup::free_full() {
  c10::StorageImpl* storage = full_flat_.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, device_));
  storage->set_nbytes(0);
  allocated_ = false;
}

void CudaParamGroup::publish() {
  if (published_) return;
  c10::DeviceGuard guard(device_);
  const StreamHandle all_gather = handle(state_.all_gather);
  // The optimizer wrote the shards on the compute stream.
  published_at_.record(compute());
  published_at_.wait(all_gather);
  if (compute_shard_) {
    c10::StreamGuard on(state_.all_gather);
    compute_shard_flat_.copy_(shard_flat_);  // one cast over the whole buffer, padding included
  }
  publish_round_ = shard_ready_->post(all_gather);
  published_ = true;
}

void CudaParamGroup::begin_unshard() {
  if (pull_pending_ || unsharded_) return;  // on its way, or whole
  c10::DeviceGuard guard(device_);
  publish();
  const StreamHandle all_gather = handle(state_.all_gather);
  if (!allocated_) allocate_full();
  allocated_at_.record(compute());
  allocated_at_.wait(all_gather);
  const auto started = std::chrono::steady_clock::now();
  shard_ready_->wait_all(publish_round_, all_gather, "unshard (waiting for peers' rows)");
  context_->count_wait(started);
  if (compute_dtype_ != dtype_ && !compute_shard_) {
    // Alone on the node: the cast is the all-gather.
    c10::StreamGuard on(state_.all_gather);
    for (std::size_t i = 0; i < full_views_.size(); ++i) full_views_[i].copy_(shard_views_[i]);
  } else {
    const std::size_t esize = c10::elementSize(compute_dtype_);
    char* full = static_cast<char*>(full_flat_.data_ptr());
    const auto& sources = compute_shard_ ? compute_shard_->peers() : shard_->peers();
    fabric::CopyBatch copies;
    for (int r = 0; r < ranks(); ++r) {
      for (std::size_t i = 0; i < layout_.numel.size(); ++i) {
        const int64_t begin = layout_.full_offset[i] + int64_t(layout_.shard_rows[r][i].begin) * layout_.row_elems[i];
        copies.add(full + begin * esize, static_cast<const char*>(sources[r]) + layout_.shard_offset[r][i] * esize,
                   layout_.shard_numel(r, i) * esize);
      }
    }
    copies.run(all_gather);
  }
  // A peer waits only for the last pull before it writes its rows (release,
  // the destructor), and cannot pull again before that wait (its next rows
  // are published after it): a pull needs no acknowledgement before its slot
  // is recorded again. Without this, a ninth pull before a release (eight
  // forwards sharing one backward, an evaluation with grad enabled) would
  // wait for acknowledgements that come only at the release.
  pulled_->acknowledge(pulled_->post(all_gather));
  unsharded_at_.record(all_gather);
  pull_pending_ = true;
}

void CudaParamGroup::wait_unshard() {
  begin_unshard();
  if (!pull_pending_) return;
  unsharded_at_.wait(compute());
  pull_pending_ = false;
  unsharded_ = true;
}

void CudaParamGroup::reshard() {
  if (!allocated_) return;
  // Never give back memory a copy may still write.
  if (pull_pending_) unsharded_at_.wait(compute());
  pull_pending_ = unsharded_ = false;
  free_full();
}

void CudaParamGroup::reduce(std::vector<std::optional<at::Tensor>> grads) {
  TORCH_CHECK(grads.size() == shard_views_.size(), "hyperparallel fsdp: got ", grads.size(), " gradients for ",
              shard_views_.size(), " parameters");
  c10::DeviceGuard guard(device_);
  at::Tensor output;
  if (sharded_grad_buffer_.defined() && sharded_grad_buffer_.storage().use_count() == 1) {
    output = sharded_grad_buffer_;  // nothing holds the last step's gradients
  } else {
    // Zeros: the kernels write the parameters' rows only, and the padding
    // between them must read as nothing to an all-reduce hook's norm. HSDP:
    // the flags travel in the tail of the shard's all-reduced sum: this
    // output's, unless the sum is in another dtype (run_reduce).
    const int64_t tail = options_.replicate && grad_dtype_ == dtype_ ? int64_t(grads.size()) : 0;
    output = at::zeros({layout_.shard_capacity + tail}, at::TensorOptions().dtype(dtype_).device(device_));
    sharded_grad_buffer_ = output;
  }
  // The gradients and the output are ready on the compute stream here. The
  // allocator may hand the gradients' memory to the compute stream again as
  // soon as this function drops them: tell it the reduce-scatter stream
  // still reads them.
  grads_at_.record(compute());
  c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
  for (const auto& grad : grads)
    if (grad) impl.recordDataPtrOnStream(grad->storage().data_ptr(), state_.reduce_scatter);
  const float scale = gradient_scale(ranks(), options_);
  ticket_ = reducer_->submit([this, grads = std::move(grads), output, scale, all_reduce = requires_all_reduce()] {
    run_reduce(grads, output, scale, all_reduce);
  });
}

void CudaParamGroup::run_reduce(const std::vector<std::optional<at::Tensor>>& grads, at::Tensor output, float scale,
                                bool all_reduce) {
  c10::DeviceGuard guard(device_);
  c10::StreamGuard on(state_.reduce_scatter);  // the ATen casts below run there too
  const StreamHandle stream = handle(state_.reduce_scatter);
  grads_at_.wait(stream);
  // This group's last all-reduce across nodes (on a stream of its own) is
  // done with the output before this reduction writes it again.
  reduced_at_.wait(stream);
  // HSDP sums across nodes in the reduce dtype, as FSDP2 does: the node's sum
  // stays in it, flags in its tail, and is cast to the shards' dtype once,
  // after the nodes' all-reduce (bf16 shards with an fp32 reduce round once).
  const int64_t capacity = layout_.shard_capacity, n = int64_t(grads.size());
  at::Tensor sum = options_.replicate && grad_dtype_ != dtype_
                       ? at::zeros({capacity + n}, output.options().dtype(grad_dtype_))
                       : output;
  std::vector<uint8_t> any =
      ranks() == 1 ? reduce_alone(grads, sum, scale) : reduce_window(grads, sum, scale, stream);
  StreamHandle finished = stream;
  if (options_.replicate) {
    // The node's flags as 0s and 1s: summed over nodes with the gradients
    // (and into a held sum with it), non-zero where any node had one. Both
    // ways through pinned memory, so that this thread goes on to the next
    // group while this one's all-reduce runs; sharded_grads() waits.
    at::Tensor tail = sum.narrow(0, capacity, n);
    at::Tensor flags = at::empty({n}, tail.options().device(at::kCPU).pinned_memory(true));
    flags.copy_(at::from_blob(any.data(), {n}, at::TensorOptions().dtype(at::kByte)));
    tail.copy_(flags, /*non_blocking=*/true);
    // The nodes' all-reduce on a stream of its own, as FSDP2's: the next
    // group's reduction within the node runs beside it instead of after it.
    summed_at_.record(stream);
    finished = handle(state_.all_reduce);
    summed_at_.wait(finished);
    if (!sum.is_same(output)) sum.record_stream(state_.all_reduce);  // freed here, read there
    c10::StreamGuard on_nodes(state_.all_reduce);
    if (!all_reduce_across_nodes(sum, *options_.replicate, all_reduce)) {
      any.assign(any.size(), 0);  // held, flags included, until a backward that all-reduces
      seen_pending_ = false;      // an earlier reduction's flags are not this held sum's
    } else {
      if (!seen_.defined()) seen_ = at::empty({n}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
      seen_.copy_(tail.ne(0).to(at::kByte), /*non_blocking=*/true);
      seen_at_.record(finished);
      seen_pending_ = true;
      if (!sum.is_same(output)) output.narrow(0, 0, capacity).copy_(sum.narrow(0, 0, capacity));
    }
  }
  any_grad_ = std::move(any);
  reduced_at_.record(finished);
}

std::vector<uint8_t> CudaParamGroup::reduce_alone(const std::vector<std::optional<at::Tensor>>& grads,
                                                  at::Tensor& output, float scale) {
  // What the window's kernel computes for one input: each gradient rounded
  // to the reduce dtype, times the scale, rounded to the output's dtype.
  std::vector<uint8_t> had(grads.size(), 0);
  for (std::size_t i = 0; i < grads.size(); ++i) {
    at::Tensor rows = output.narrow(0, layout_.shard_offset[0][i], layout_.numel[i]);
    if (!grads[i]) {
      rows.zero_();
      continue;
    }
    had[i] = 1;
    const at::Tensor grad = grads[i]->to(grad_dtype_).reshape({-1});
    // Out of place: the product must not land in the caller's gradient.
    rows.copy_(scale == 1.0f ? grad : at::mul(grad.to(at::kFloat), scale));
  }
  return had;
}

std::vector<uint8_t> CudaParamGroup::reduce_window(const std::vector<std::optional<at::Tensor>>& grads,
                                                   at::Tensor& output, float scale, StreamHandle stream) {
  GradWindow& window = state_.next();
  // On the host too: once every peer posted its `done`, it has read the
  // flags of the last round in this window.
  if (window.done->posted() > 0)
    window.done->wait_all(window.done->posted(), stream, "reduce-scatter (peers finishing the last reduction)");
  at::Tensor mine = over(window.memory, layout_.full_elems, grad_dtype_, device_);
  const std::size_t esize = c10::elementSize(grad_dtype_);
  uint8_t* my_flags = state_.flags(window, rank());
  fabric::CopyBatch copies;
  for (std::size_t i = 0; i < grads.size(); ++i) {
    my_flags[i] = grads[i].has_value();
    at::Tensor slot = mine.narrow(0, layout_.full_offset[i], layout_.numel[i]);
    if (!grads[i]) {
      slot.zero_();  // a parameter unused here may be used on a peer
    } else if (grads[i]->scalar_type() == grad_dtype_ && grads[i]->is_contiguous()) {
      copies.add(slot.data_ptr(), grads[i]->data_ptr(), layout_.numel[i] * esize);
    } else {
      slot.copy_(grads[i]->reshape({-1}));
    }
  }
  copies.run(stream);
  // The flags are written before the round is posted, so every peer's are
  // there once the host wait below returns.
  const uint64_t round = window.ready->post(stream);
  window.ready->wait_all(round, stream, "reduce-scatter (waiting for peers' gradients)");
  std::vector<uint8_t> any(grads.size(), 0);
  for (int r = 0; r < ranks(); ++r) {
    const uint8_t* theirs = state_.flags(window, r);
    for (std::size_t i = 0; i < grads.size(); ++i) any[i] |= theirs[i];
  }
  std::vector<comm::ReduceSegment> segments;
  for (std::size_t i = 0; i < grads.size(); ++i) {
    const int64_t src = layout_.full_offset[i] + int64_t(layout_.shard_rows[rank()][i].begin) * layout_.row_elems[i];
    segments.push_back(
        comm::ReduceSegment{uint64_t(src), uint64_t(layout_.shard_offset[rank()][i]), uint64_t(layout_.shard_numel(rank(), i))});
  }
  std::vector<const void*> inputs(window.memory->peers().begin(), window.memory->peers().end());
  comm::device_reduce(output.data_ptr(), comm::dtype_of(output.scalar_type()), inputs, comm::dtype_of(grad_dtype_),
                      segments, scale, stream);
  window.done->post(stream);
  return any;
}

std::vector<std::optional<at::Tensor>> CudaParamGroup::sharded_grads() {
  const auto started = std::chrono::steady_clock::now();
  reducer_->wait(ticket_);
  context_->count_wait(started);
  c10::DeviceGuard guard(device_);
  reduced_at_.wait(compute());
  if (seen_pending_) {  // HSDP: which gradients any node had, once they are back from the device
    seen_at_.synchronize();
    any_grad_.assign(seen_.const_data_ptr<uint8_t>(), seen_.const_data_ptr<uint8_t>() + seen_.numel());
    seen_pending_ = false;
  }
  std::vector<std::optional<at::Tensor>> grads;
  for (std::size_t i = 0; i < shard_views_.size(); ++i) {
    if (!any_grad_.empty() && any_grad_[i]) {
      grads.push_back(sharded_grad_buffer_.narrow(0, layout_.shard_offset[rank()][i], shard_views_[i].numel())
                          .view(shard_views_[i].sizes()));
    } else {
      grads.push_back(std::nullopt);
    }
  }
  return grads;
}

void CudaParamGroup::release() {
  reducer_->wait(ticket_);
  c10::DeviceGuard guard(device_);
  // The optimizer writes this rank's shards on the compute stream: only after
  // every peer's pulls of them have completed.
  if (pulled_->posted() > 0)
    pulled_->wait_all(pulled_->posted(), compute(), "release (peers finishing reading this rank's rows)");
  // The next iteration publishes new rows and pulls them again, into the
  // storage still held if the group was not resharded. This round's rows
  // will not be waited for any more (a group no forward reached was never
  // unsharded): acknowledge them, or nine such iterations would block the
  // ninth publish.
  if (published_) shard_ready_->acknowledge(publish_round_);
  published_ = false;
  released_round_ = pulled_->posted();
  if (pull_pending_) unsharded_at_.wait(compute());
  pull_pending_ = unsharded_ = false;
}

void CudaParamGroup::discard_held() {
  reducer_->wait(ticket_);
  c10::DeviceGuard guard(device_);
  reduced_at_.wait(compute());  // the compute stream reuses the gradient buffer's memory only after its writes
  drop_held();
  any_grad_.clear();
  seen_pending_ = false;
}

std::shared_ptr<ParamGroup> make_cuda_group(std::shared_ptr<Context> context, const std::vector<at::Tensor>& params,
                                            GroupOptions options) {
  return std::make_shared<CudaParamGroup>(std::move(context), params, std::move(options));
}

const bool registered = (register_group_factory(c10::DeviceType::CUDA, &make_cuda_group), true);

}  // namespace
}  // namespace hp::fsdp
