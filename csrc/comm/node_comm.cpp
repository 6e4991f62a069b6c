#include "hyperparallel/comm/node_comm.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace hp::comm {
namespace {

constexpr std::size_t kAlign = 64;
constexpr std::size_t kMinScratch = 1 << 20;

std::size_t align_up(std::size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

}  // namespace

NodeComm::NodeComm(std::shared_ptr<fabric::Fabric> fabric) : fabric_(std::move(fabric)) {}

Window NodeComm::shared(std::size_t bytes) { return window(align_up(bytes), 1); }

Window NodeComm::symmetric(std::size_t bytes) { return window(align_up(bytes), size()); }

// One segment: the slots, then the window's channel (its counters need no
// segment of their own).
Window NodeComm::window(std::size_t slot_bytes, int slots) {
  Window window;
  window.slot_bytes_ = slot_bytes;
  window.slots_ = slots;
  window.segment_ = fabric_->allocate(window.bytes() + fabric_->channel_bytes());
  window.channel_ = fabric_->channel(window.segment_, window.bytes());
  return window;
}

// A round r is published at counter 2r-1 and released at 2r.
void NodeComm::acquire(Window& window) {
  if (window.round_ == 0) return;
  release(window);
  window.channel_.wait_all(2 * window.round_, "acquire (waiting for peers to finish reading)");
}

void NodeComm::publish(Window& window) {
  post(window);
  wait(window);
}

void NodeComm::post(Window& window) {
  ++window.round_;
  window.released_ = false;
  window.channel_.post(2 * window.round_ - 1);
}

void NodeComm::wait(Window& window) {
  window.channel_.wait_all(2 * window.round_ - 1, "publish (waiting for peers' writes)");
}

void NodeComm::release(Window& window) {
  if (window.released_) return;
  window.released_ = true;
  window.channel_.post(2 * window.round_);
}

void NodeComm::copy(void* dst, const void* src, std::size_t bytes) {
  if (dst == src || bytes == 0) return;
  std::memcpy(dst, src, bytes);
  stats_.bytes_copied += bytes;
}

Window& NodeComm::scratch(Window& window, bool per_rank, std::size_t bytes) {
  // Peers may still read the last round, of this window or of the one it
  // replaces.
  if (window.segment_) acquire(window);
  if (window.segment_ && window.slot_bytes_ >= bytes) return window;
  // Every rank grows at the same call (same sizes, same order).
  std::size_t grown = std::max({bytes, kMinScratch, 2 * window.slot_bytes_});
  window = per_rank ? symmetric(grown) : shared(grown);
  return window;
}

void NodeComm::reduce_rows(const Window& window, Range range, DType dtype, float scale, void* out) {
  reduce_rows(window, range, dtype, scale, out, dtype);
}

void NodeComm::reduce_rows(const Window& window, Range range, DType dtype, float scale, void* out, DType out_dtype) {
  if (range.size() == 0) return;
  const std::size_t esize = dtype_size(dtype);
  std::vector<const void*> srcs(window.slots_);
  for (int s = 0; s < window.slots_; ++s) srcs[s] = static_cast<const char*>(window.slot(s)) + range.begin * esize;
  reduce(out, out_dtype, srcs.data(), window.slots_, range.size(), dtype, scale);
  stats_.bytes_reduced += uint64_t(window.slots_) * range.size() * esize;
}

void NodeComm::reduce_scatter(Window& inputs, std::size_t n, DType dtype, ReduceOp op, void* out) {
  publish(inputs);
  reduce_rows(inputs, chunk(n, size(), rank()), dtype, scale_of(op), out);
  release(inputs);
}

void NodeComm::broadcast(void* data, std::size_t n, DType dtype, int root) {
  const std::size_t bytes = n * dtype_size(dtype);
  Window& results = scratch_results(bytes);
  if (rank() == root) copy(results.slot(0), data, bytes);
  publish(results);
  if (rank() != root) copy(data, results.slot(0), bytes);
  release(results);
}

void NodeComm::all_reduce(void* data, std::size_t n, DType dtype, ReduceOp op) {
  const std::size_t esize = dtype_size(dtype), bytes = n * esize;
  Window& results = scratch_results(bytes);
  Window& inputs = scratch_inputs(bytes);
  copy(inputs.slot(rank()), data, bytes);
  publish(inputs);
  Range mine = chunk(n, size(), rank());
  reduce_rows(inputs, mine, dtype, scale_of(op), static_cast<char*>(results.slot(0)) + mine.begin * esize);
  release(inputs);
  publish(results);
  copy(data, results.slot(0), bytes);
  release(results);
}

void NodeComm::all_gather(const void* in, void* out, std::size_t rows, std::size_t row_elems, DType dtype) {
  const std::size_t row_bytes = row_elems * dtype_size(dtype);
  Window& results = scratch_results(rows * row_bytes);
  Range mine = chunk(rows, size(), rank());
  copy(static_cast<char*>(results.slot(0)) + mine.begin * row_bytes, in, mine.size() * row_bytes);
  publish(results);
  copy(out, results.slot(0), rows * row_bytes);
  release(results);
}

void NodeComm::reduce_scatter(const void* in, void* out, std::size_t rows, std::size_t row_elems, DType dtype,
                              ReduceOp op) {
  Window& inputs = scratch_inputs(rows * row_elems * dtype_size(dtype));
  copy(inputs.slot(rank()), in, rows * row_elems * dtype_size(dtype));
  publish(inputs);
  Range mine = chunk(rows, size(), rank());
  reduce_rows(inputs, Range{mine.begin * row_elems, mine.end * row_elems}, dtype, scale_of(op), out);
  release(inputs);
}

}  // namespace hp::comm
