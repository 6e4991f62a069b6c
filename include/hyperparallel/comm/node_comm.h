// Collectives among the ranks of one node, on the fabric.
//
// Two ways in:
// - Zero-copy, on Windows (memory every local rank maps). The data is already
//   where the peers read it, so all-gather is a wait and reduce-scatter is one
//   pass that reads each peer's rows once. FSDP and Muon use these.
// - Copying, on private memory (the c10d-style API): copy in, run the
//   zero-copy collective on internal scratch windows, copy out.
//
// Every call is collective over the node's ranks: all of them make the same
// calls in the same order with the same sizes.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "hyperparallel/comm/reduce.h"
#include "hyperparallel/fabric/fabric.h"

namespace hp::comm {

// Node-shared memory with its own signalling channel: `slots` regions of
// `slot_bytes` each. One slot: a buffer that exists once per node. One slot
// per local rank: each rank writes its own slot and reads everyone's.
//
// Rounds keep writers and readers apart: publish() ends a round of writes,
// acquire() waits until every rank is done reading the last round before
// this rank writes again.
class Window {
 public:
  Window() = default;
  void* data() const { return segment_ ? segment_->data() : nullptr; }
  void* slot(int index) const { return static_cast<char*>(data()) + std::size_t(index) * slot_bytes_; }
  std::size_t slot_bytes() const { return slot_bytes_; }
  int slots() const { return slots_; }
  // The slots' bytes (the segment holds the window's channel after them).
  std::size_t bytes() const { return slot_bytes_ * std::size_t(slots_); }
  // The mapping; keeps the memory alive for whoever holds it.
  const std::shared_ptr<fabric::Segment>& segment() const { return segment_; }

 private:
  friend class NodeComm;
  std::shared_ptr<fabric::Segment> segment_;
  fabric::Channel channel_;
  std::size_t slot_bytes_ = 0;
  int slots_ = 0;
  uint64_t round_ = 0;       // rounds published so far
  bool released_ = true;     // this rank is done reading round_
};

// Bytes this rank moved with memcpy, and bytes it read while reducing.
struct Stats {
  uint64_t bytes_copied = 0;
  uint64_t bytes_reduced = 0;
};

// Stats updated from several threads (a reducer thread and the main one).
struct AtomicStats {
  std::atomic<uint64_t> bytes_copied{0};
  std::atomic<uint64_t> bytes_reduced{0};
};

class NodeComm {
 public:
  explicit NodeComm(std::shared_ptr<fabric::Fabric> fabric);

  fabric::Fabric& fabric() const { return *fabric_; }
  int rank() const { return fabric_->local_rank(); }
  int size() const { return fabric_->local_world(); }

  // Collective: a window with one slot (shared) or one slot per rank
  // (symmetric) of `bytes` each.
  Window shared(std::size_t bytes);
  Window symmetric(std::size_t bytes);

  // Waits until every rank has finished reading the window's last round; then
  // this rank may write into it. Marks this rank done reading.
  void acquire(Window& window);
  // Ends a round of writes: returns when every rank has published it.
  // post() + wait(): post early and wait late to overlap.
  void publish(Window& window);
  void post(Window& window);
  void wait(Window& window);
  // Marks this rank done reading the last round without waiting.
  void release(Window& window);

  // Zero-copy all-gather: every rank wrote its rows (chunk(rows, size(),
  // rank())) of the shared window; returns when all rows are visible. Copies
  // nothing.
  void all_gather(Window& shared) { publish(shared); }
  // One-pass reduce-scatter: every rank wrote its full input of `n` elements
  // into its own slot of the symmetric window; this rank reduces its chunk of
  // the n elements across all slots into `out`.
  void reduce_scatter(Window& inputs, std::size_t n, DType dtype, ReduceOp op, void* out);

  // Copying collectives on private memory. Sizes in elements; all_gather and
  // reduce_scatter split `rows` rows of `row_elems` elements with chunk().
  void barrier() { fabric_->barrier(); }
  void broadcast(void* data, std::size_t n, DType dtype, int root);
  void all_reduce(void* data, std::size_t n, DType dtype, ReduceOp op);
  void all_gather(const void* in, void* out, std::size_t rows, std::size_t row_elems, DType dtype);
  void reduce_scatter(const void* in, void* out, std::size_t rows, std::size_t row_elems, DType dtype, ReduceOp op);

  // Building blocks for collectives that span nodes (see Communicator).
  // Internal scratch windows, grown to `bytes` per slot and acquired: this
  // rank may write its slot (inputs: one slot per rank; results: one shared
  // slot) until it publishes.
  Window& scratch_inputs(std::size_t bytes) { return scratch(inputs_, true, bytes); }
  Window& scratch_results(std::size_t bytes) { return scratch(results_, false, bytes); }
  // out = scale * sum over all slots of elements [range) of `window`, stored
  // as `out_dtype` (default: dtype).
  void reduce_rows(const Window& window, Range range, DType dtype, float scale, void* out);
  void reduce_rows(const Window& window, Range range, DType dtype, float scale, void* out, DType out_dtype);
  // memcpy that counts its bytes in stats().
  void copy(void* dst, const void* src, std::size_t bytes);

  Stats stats() const { return Stats{stats_.bytes_copied.load(), stats_.bytes_reduced.load()}; }
  void reset_stats() {
    stats_.bytes_copied = 0;
    stats_.bytes_reduced = 0;
  }

 private:
  // Grows a scratch window (collectively) to hold `bytes` per slot, and
  // acquires it.
  Window& scratch(Window& window, bool per_rank, std::size_t bytes);
  Window window(std::size_t slot_bytes, int slots);
  float scale_of(ReduceOp op) const { return op == ReduceOp::Avg ? 1.0f / float(size()) : 1.0f; }

  std::shared_ptr<fabric::Fabric> fabric_;
  Window inputs_;   // symmetric scratch: each rank's copy-in
  Window results_;  // shared scratch: reduced or gathered rows
  AtomicStats stats_;
};

}  // namespace hp::comm
