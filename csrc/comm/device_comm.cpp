#include "hyperparallel/comm/device_comm.h"

#include <algorithm>
#include <stdexcept>

namespace hp::comm {
namespace {

constexpr std::size_t kMinScratch = 1 << 20;

std::shared_ptr<fabric::DeviceSignal> signal(fabric::Fabric& fabric, int device) {
  return std::make_shared<fabric::DeviceSignal>(fabric, device);
}

}  // namespace

DeviceNodeComm::DeviceNodeComm(std::shared_ptr<fabric::Fabric> fabric, int device)
    : fabric_(std::move(fabric)), device_(device) {
  inputs_.ready = signal(*fabric_, device);
  inputs_.done = signal(*fabric_, device);
  results_.ready = signal(*fabric_, device);
  results_.done = signal(*fabric_, device);
}

DeviceNodeComm::~DeviceNodeComm() = default;

DeviceWindow DeviceNodeComm::window(std::size_t bytes) {
  DeviceWindow window;
  window.memory = std::make_shared<fabric::PeerMemory>(*fabric_, device_, bytes);
  window.ready = signal(*fabric_, device_);
  window.done = signal(*fabric_, device_);
  return window;
}

void DeviceNodeComm::acquire(DeviceWindow& window, fabric::StreamHandle stream) {
  const uint64_t last = window.done->posted();
  if (last > 0) window.done->wait_all(last, stream, "acquire (peers finishing reading the last round)");
}

void DeviceNodeComm::drain(DeviceWindow& window, fabric::StreamHandle stream) {
  const uint64_t last = window.done->posted();
  if (last == 0) return;
  window.done->wait_all(last, stream, "freeing a symmetric tensor (peers finishing reading it)");
  fabric::device::synchronize(stream);
}

void DeviceNodeComm::reduce_window(DeviceWindow& window, DType dtype, const std::vector<ReduceSegment>& segments,
                                   float scale, void* out, DType out_dtype, fabric::StreamHandle stream) {
  // A caller that skipped acquire() raced its own writes, but must not stall
  // the signal's slot reuse on a round it will never wait for.
  window.done->acknowledge(window.done->posted());
  const uint64_t round = window.ready->post(stream);
  window.ready->wait_all(round, stream, "reduce-scatter (waiting for peers' inputs)");
  std::vector<const void*> inputs(window.memory->peers().begin(), window.memory->peers().end());
  device_reduce(out, out_dtype, inputs, dtype, segments, scale, stream);
  for (const ReduceSegment& segment : segments) bytes_reduced_ += uint64_t(size()) * segment.count * dtype_size(dtype);
  window.done->post(stream);
}

void DeviceNodeComm::acquire(DeviceWindow& scratch, std::size_t bytes, fabric::StreamHandle stream) {
  acquire(scratch, stream);
  if (scratch.memory && scratch.memory->bytes() >= bytes) return;
  // Every rank grows at the same call. Peers have finished reading the old
  // buffer once this stream passed their `done` events: wait for that on the
  // host before freeing it.
  const std::size_t old = scratch.memory ? scratch.memory->bytes() : 0;
  if (scratch.memory) fabric::device::synchronize(stream);
  scratch.memory.reset();
  const std::size_t grown = std::max({bytes, kMinScratch, 2 * old});
  scratch.memory = std::make_shared<fabric::PeerMemory>(*fabric_, device_, grown);
}

void DeviceNodeComm::broadcast(void* data, std::size_t bytes, int root, fabric::StreamHandle stream) {
  if (root < 0 || root >= size()) throw std::out_of_range("broadcast: root is not a local rank");
  DeviceWindow& s = inputs_;
  acquire(s, bytes, stream);
  fabric::CopyBatch copies;
  if (rank() == root) {
    copies.add(s.memory->local(), data, bytes);
    copies.run(stream);
  }
  const uint64_t round = s.ready->post(stream);
  if (rank() == root) {
    s.ready->acknowledge(round);
  } else {
    s.ready->wait(root, round, stream, "broadcast (waiting for the root's data)");
    copies.add(data, s.peer(root), bytes);
    copies.run(stream);
  }
  bytes_copied_ += bytes;
  s.done->post(stream);
}

void DeviceNodeComm::all_gather(const void* in, void* out, const std::vector<Range>& rows, std::size_t row_bytes,
                                fabric::StreamHandle stream) {
  if (int(rows.size()) != size()) throw std::invalid_argument("all_gather: one row range per local rank");
  DeviceWindow& s = inputs_;
  const std::size_t mine = rows[rank()].size() * row_bytes;
  std::size_t largest = 0;
  for (const Range& r : rows) largest = std::max(largest, r.size() * row_bytes);
  acquire(s, largest, stream);
  fabric::CopyBatch copies;
  copies.add(s.memory->local(), in, mine);
  copies.run(stream);
  const uint64_t round = s.ready->post(stream);
  s.ready->wait_all(round, stream, "all_gather (waiting for peers' rows)");
  // Each peer's rows straight into place; this rank's own from its input.
  copies.clear();
  for (int r = 0; r < size(); ++r) {
    void* dst = static_cast<char*>(out) + rows[r].begin * row_bytes;
    copies.add(dst, r == rank() ? in : s.peer(r), rows[r].size() * row_bytes);
    bytes_copied_ += rows[r].size() * row_bytes;
  }
  copies.run(stream);
  s.done->post(stream);
}

void DeviceNodeComm::reduce(const void* in, std::size_t n, DType dtype, const std::vector<ReduceSegment>& segments,
                            float scale, void* out, DType out_dtype, fabric::StreamHandle stream) {
  DeviceWindow& s = inputs_;
  const std::size_t bytes = n * dtype_size(dtype);
  acquire(s, bytes, stream);
  fabric::CopyBatch copies;
  copies.add(s.memory->local(), in, bytes);
  copies.run(stream);
  bytes_copied_ += bytes;
  reduce_window(s, dtype, segments, scale, out, out_dtype, stream);
}

void DeviceNodeComm::all_reduce(void* data, std::size_t n, DType dtype, float scale, fabric::StreamHandle stream) {
  // Reduce-scatter this rank's chunk into its results buffer, then every rank
  // pulls every chunk: each element is read once from each rank and copied
  // once to each rank.
  const std::size_t esize = dtype_size(dtype);
  const Range mine = chunk(n, size(), rank());
  DeviceWindow& r = results_;
  acquire(r, n * esize, stream);
  reduce(data, n, dtype, {ReduceSegment{mine.begin, mine.begin, mine.size()}}, scale, r.memory->local(), dtype,
         stream);
  const uint64_t round = r.ready->post(stream);
  r.ready->wait_all(round, stream, "all_reduce (waiting for peers' sums)");
  fabric::CopyBatch copies;
  for (int p = 0; p < size(); ++p) {
    const Range theirs = chunk(n, size(), p);
    copies.add(static_cast<char*>(data) + theirs.begin * esize, r.peer(p, theirs.begin * esize), theirs.size() * esize);
    bytes_copied_ += theirs.size() * esize;
  }
  copies.run(stream);
  r.done->post(stream);
}

}  // namespace hp::comm
