// The CPU's parameter groups: the group's full parameters live once per node
// in a shared window laid out parameter-major, and every rank's shard is a
// view of its rows there, so unsharding is a wait. With mixed precision each
// owner also writes its rows, once per iteration, into a low-precision window
// that forward and backward read.
#include "group_cpu.h"

#include <c10/util/Exception.h>

namespace hp::fsdp {
namespace {

constexpr int64_t kAlignElems = 32;  // 64-byte aligned starts for fp32 and bf16

int64_t align_up(int64_t elems) { return (elems + kAlignElems - 1) / kAlignElems * kAlignElems; }

// A tensor over window memory; it keeps the mapping alive.
at::Tensor over(const comm::Window& window, void* data, int64_t elems, at::ScalarType dtype) {
  auto segment = window.segment();
  return at::from_blob(data, {elems}, [segment](void*) {}, at::TensorOptions().dtype(dtype));
}

// A ring of symmetric windows for gradients, shared by all of a process's CPU
// groups: a group holds one only from its backward to the end of its
// reduction.
class GradWindows : public BackendState {
 public:
  GradWindows(std::shared_ptr<comm::Communicator> communicator, int count)
      : communicator_(std::move(communicator)), windows_(count) {}
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

class CpuParamGroup : public ParamGroup {
 public:
  CpuParamGroup(std::shared_ptr<Context> context, const std::vector<at::Tensor>& params, GroupOptions options);
  // Waits for this group's pending reduction.
  ~CpuParamGroup() override;

  const std::vector<at::Tensor>& full() const override { return compute_views_; }
  const std::vector<at::Tensor>& shards() const override { return shard_views_; }
  // Posts this rank's rows (after writing its low-precision copy).
  void publish() override;
  void begin_unshard() override { publish(); }
  // Returns once every rank of the node has posted its rows.
  void wait_unshard() override;
  // The full parameters stay in shared memory: nothing to free.
  void reshard() override {}
  void reduce(std::vector<std::optional<at::Tensor>> grads) override;
  std::vector<std::optional<at::Tensor>> sharded_grads() override;
  at::Tensor sharded_grad_buffer() const override { return sharded_grad_buffer_.narrow(0, 0, shard_elems_); }
  void release() override;
  void discard_held() override;

 private:
  void run_reduce(const std::vector<std::optional<at::Tensor>>& grads, at::Tensor output, float scale,
                  bool all_reduce);

  std::shared_ptr<Context> context_;
  std::shared_ptr<comm::Communicator> communicator_;
  std::shared_ptr<Reducer> reducer_;
  GradWindows& grad_windows_;
  GroupOptions options_;
  comm::Window params_;                  // the parameters, in their own dtype
  std::optional<comm::Window> compute_;  // low-precision copy, with mixed precision
  std::vector<at::Tensor> param_views_, compute_views_, shard_views_, compute_shard_views_;
  std::vector<int64_t> offsets_;         // elements from the window's start, per parameter
  std::vector<comm::Range> shard_rows_;  // per parameter
  std::vector<int64_t> row_elems_;
  std::vector<int64_t> shard_offsets_;   // in the sharded gradient buffer
  int64_t total_elems_ = 0, shard_elems_ = 0;
  // Bytes into a gradient slot where the per-parameter flags "this rank has a
  // gradient" start, after the gradients.
  int64_t flags_at_ = 0;
  at::ScalarType dtype_;
  at::ScalarType grad_dtype_;  // what gradients are reduced in: reduce_dtype, else param_dtype, else dtype_
  bool posted_ = false;              // this rank's rows are posted for the coming unshard
  at::Tensor sharded_grad_buffer_;  // the last reduction's output, reused while nothing else holds it
  // Per parameter: some rank of the job had a gradient in the last reduction,
  // so every rank's shard has one (a rank whose inputs skipped the module
  // contributed zeros). Written by the reducer thread before its ticket ends.
  std::vector<uint8_t> any_grad_;
  ReduceTicket ticket_ = 0;  // the last reduction handed to the reducer
};

void GradWindows::reserve(std::size_t bytes) {
  if (bytes <= bytes_) return;
  bytes_ = bytes;
  // Collective: every rank reserves at the same fully_shard call.
  for (auto& window : windows_) {
    if (window.segment()) communicator_->node().acquire(window);
    window = communicator_->node().symmetric(bytes);
  }
}

comm::Window& GradWindows::next() {
  TORCH_CHECK(bytes_ > 0, "hyperparallel fsdp: no gradient window reserved");
  comm::Window& window = windows_[next_];
  next_ = (next_ + 1) % windows_.size();
  return window;
}

CpuParamGroup::CpuParamGroup(std::shared_ptr<Context> context, const std::vector<at::Tensor>& params,
                             GroupOptions options)
    : context_(context),
      communicator_(context->communicator()),
      reducer_(context->reducer()),
      grad_windows_(context->backend<GradWindows>(c10::Device(c10::kCPU), [&] {
        return std::make_shared<GradWindows>(context->communicator(), 2);
      })),
      options_(std::move(options)) {
  dtype_ = params[0].scalar_type();
  comm::NodeComm& node = communicator_->node();
  const int shards = node.size(), rank = node.rank();
  for (const auto& param : params) {
    TORCH_CHECK(param.scalar_type() == dtype_, "hyperparallel fully_shard: one group's parameters must share a dtype, ",
                "found ", dtype_, " and ", param.scalar_type(), "; call fully_shard on a submodule to split them");
    TORCH_CHECK(param.dim() >= 1, "hyperparallel fully_shard: 0-dim parameters cannot be sharded on dim 0; ",
                "make it a 1-element tensor or pass it in ignored_params");
    comm::dtype_of(param.scalar_type());  // raises for unsupported dtypes
    offsets_.push_back(total_elems_);
    total_elems_ += align_up(param.numel());
    const int64_t rows = param.size(0);
    row_elems_.push_back(rows == 0 ? 0 : param.numel() / rows);
    shard_rows_.push_back(comm::chunk(rows, shards, rank));
    shard_offsets_.push_back(shard_elems_);
    shard_elems_ += int64_t(shard_rows_.back().size()) * row_elems_.back();
  }
  params_ = node.shared(total_elems_ * c10::elementSize(dtype_));
  at::Tensor storage = over(params_, params_.data(), total_elems_, dtype_);
  if (options_.param_dtype && *options_.param_dtype != dtype_) {
    compute_ = node.shared(total_elems_ * c10::elementSize(*options_.param_dtype));
  }
  at::Tensor compute_storage = compute_ ? over(*compute_, compute_->data(), total_elems_, *options_.param_dtype)
                                        : storage;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto& param = params[i];
    const comm::Range rows = shard_rows_[i];
    param_views_.push_back(storage.narrow(0, offsets_[i], param.numel()).view(param.sizes()));
    compute_views_.push_back(compute_storage.narrow(0, offsets_[i], param.numel()).view(param.sizes()));
    shard_views_.push_back(param_views_[i].narrow(0, rows.begin, rows.size()));
    compute_shard_views_.push_back(compute_views_[i].narrow(0, rows.begin, rows.size()));
    // Each rank contributes the rows it owns, as FSDP2 keeps each rank's chunk.
    shard_views_[i].copy_(param.detach().narrow(0, rows.begin, rows.size()));
  }
  grad_dtype_ = options_.reduce_dtype.value_or(options_.param_dtype.value_or(dtype_));
  comm::dtype_of(grad_dtype_);
  flags_at_ = align_up(total_elems_) * int64_t(c10::elementSize(grad_dtype_));
  grad_windows_.reserve(std::size_t(flags_at_) + params.size());
  publish();
  wait_unshard();
}

void CpuParamGroup::publish() {
  if (posted_) return;
  if (compute_) {
    for (std::size_t i = 0; i < shard_views_.size(); ++i) compute_shard_views_[i].copy_(shard_views_[i]);
  }
  communicator_->node().post(compute_ ? *compute_ : params_);
  posted_ = true;
}

void CpuParamGroup::wait_unshard() {
  if (!posted_) publish();
  const auto started = std::chrono::steady_clock::now();
  communicator_->node().wait(compute_ ? *compute_ : params_);
  context_->count_wait(started);
  posted_ = false;
}

void CpuParamGroup::reduce(std::vector<std::optional<at::Tensor>> grads) {
  TORCH_CHECK(grads.size() == shard_views_.size(), "hyperparallel fsdp: got ", grads.size(), " gradients for ",
              shard_views_.size(), " parameters");
  at::Tensor output;
  if (sharded_grad_buffer_.defined() && sharded_grad_buffer_.storage().use_count() == 1) {
    output = sharded_grad_buffer_;  // nothing holds the last step's gradients
  } else {
    // HSDP: the flags travel in the tail of the shard's all-reduced sum: this
    // output's, unless the sum is in another dtype (run_reduce).
    const int64_t tail = options_.replicate && grad_dtype_ == dtype_ ? int64_t(grads.size()) : 0;
    output = at::empty({shard_elems_ + tail}, at::TensorOptions().dtype(dtype_));
    sharded_grad_buffer_ = output;
  }
  const float scale = gradient_scale(communicator_->node().size(), options_);
  ticket_ = reducer_->submit([this, grads = std::move(grads), output, scale, all_reduce = requires_all_reduce()] {
    run_reduce(grads, output, scale, all_reduce);
  });
}

void CpuParamGroup::run_reduce(const std::vector<std::optional<at::Tensor>>& grads, at::Tensor output, float scale,
                               bool all_reduce) {
  comm::NodeComm& node = communicator_->node();
  comm::Window& read = compute_ ? *compute_ : params_;
  comm::Window& window = grad_windows_.next();
  // HSDP sums across nodes in the reduce dtype, as FSDP2 does: the node's sum
  // stays in it, flags in its tail, and is cast to the shards' dtype once,
  // after the nodes' all-reduce (bf16 shards with an fp32 reduce round once).
  at::Tensor sum = options_.replicate && grad_dtype_ != dtype_
                       ? at::empty({shard_elems_ + int64_t(grads.size())}, at::TensorOptions().dtype(grad_dtype_))
                       : output;
  node.acquire(window);  // peers are done with the last group that used it
  at::Tensor mine = over(window, window.slot(node.rank()), total_elems_, grad_dtype_);
  auto flags = [&](int rank) { return static_cast<uint8_t*>(window.slot(rank)) + flags_at_; };
  for (std::size_t i = 0; i < grads.size(); ++i) {
    at::Tensor slot = mine.narrow(0, offsets_[i], param_views_[i].numel());
    if (grads[i]) {
      slot.copy_(grads[i]->reshape({-1}));
    } else {
      slot.zero_();  // a parameter unused here may be used on a peer
    }
    flags(node.rank())[i] = grads[i].has_value();
  }
  // This rank's backward no longer reads the parameters. Peers publish their
  // gradients after their own release, so once the gradients are published
  // every rank is done reading, and the optimizer may write the shards.
  node.release(read);
  node.publish(window);
  node.acquire(read);
  std::vector<uint8_t> any(grads.size(), 0);
  for (int r = 0; r < node.size(); ++r)
    for (std::size_t i = 0; i < grads.size(); ++i) any[i] |= flags(r)[i];
  const std::size_t out_size = c10::elementSize(sum.scalar_type());
  for (std::size_t i = 0; i < grads.size(); ++i) {
    const comm::Range rows = shard_rows_[i];
    const comm::Range elems{std::size_t(offsets_[i] + rows.begin * row_elems_[i]),
                            std::size_t(offsets_[i] + rows.end * row_elems_[i])};
    void* out = static_cast<char*>(sum.data_ptr()) + shard_offsets_[i] * out_size;
    node.reduce_rows(window, elems, comm::dtype_of(grad_dtype_), scale, out, comm::dtype_of(sum.scalar_type()));
  }
  node.release(window);
  if (options_.replicate) {
    at::Tensor tail = sum.narrow(0, shard_elems_, int64_t(any.size()));
    tail.copy_(at::from_blob(any.data(), {int64_t(any.size())}, at::TensorOptions().dtype(at::kByte)));
    if (!all_reduce_across_nodes(sum, *options_.replicate, all_reduce)) {
      any_grad_.assign(any.size(), 0);  // held, flags included, until a backward that all-reduces
      return;
    }
    at::Tensor seen = tail.ne(0).to(at::kByte);  // a sum of 0s and 1s, non-zero where any node had one
    std::copy_n(seen.const_data_ptr<uint8_t>(), any.size(), any.begin());
    if (!sum.is_same(output)) output.narrow(0, 0, shard_elems_).copy_(sum.narrow(0, 0, shard_elems_));
  }
  any_grad_ = std::move(any);
}

std::vector<std::optional<at::Tensor>> CpuParamGroup::sharded_grads() {
  const auto started = std::chrono::steady_clock::now();
  reducer_->wait(ticket_);
  context_->count_wait(started);
  std::vector<std::optional<at::Tensor>> grads;
  for (std::size_t i = 0; i < shard_views_.size(); ++i) {
    if (!any_grad_.empty() && any_grad_[i]) {
      grads.push_back(
          sharded_grad_buffer_.narrow(0, shard_offsets_[i], shard_views_[i].numel()).view(shard_views_[i].sizes()));
    } else {
      grads.push_back(std::nullopt);
    }
  }
  return grads;
}

void CpuParamGroup::release() {
  reducer_->wait(ticket_);
  communicator_->node().acquire(compute_ ? *compute_ : params_);
}

void CpuParamGroup::discard_held() {
  reducer_->wait(ticket_);
  drop_held();
  any_grad_.clear();
}

CpuParamGroup::~CpuParamGroup() {
  try {
    reducer_->wait(ticket_);
  } catch (...) {
    // The error was raised where the reduction was awaited; nothing to add.
  }
}

}  // namespace

std::shared_ptr<ParamGroup> make_cpu_group(std::shared_ptr<Context> context, const std::vector<at::Tensor>& params,
                                           GroupOptions options) {
  return std::make_shared<CpuParamGroup>(std::move(context), params, std::move(options));
}

}  // namespace hp::fsdp
