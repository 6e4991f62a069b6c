// Collectives among the ranks of one node on GPU memory: NodeComm's
// counterpart for devices (see fabric/device.h for how ranks map each
// other's memory).
//
// Every rank keeps its own copy of everything (a GPU computes on its own
// HBM), so on a device all-gather is a pull of the peers' rows straight into
// place on the copy engines, and reduce-scatter is one kernel that reads this
// rank's rows from every peer's buffer. Calls only enqueue work on the given
// stream and return; the host blocks only while a peer has not yet reached
// the same call. Every call is collective over the node's ranks: all of them
// make the same calls in the same order with the same sizes.
//
// No torch and no CUDA headers here: streams are opaque handles.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "hyperparallel/comm/node_comm.h"
#include "hyperparallel/comm/reduce.h"
#include "hyperparallel/fabric/device.h"

namespace hp::comm {

// A run of elements to reduce over the node's ranks:
// out[dst + i] = scale * sum over ranks of that rank's in[src + i].
struct ReduceSegment {
  uint64_t src = 0, dst = 0, count = 0;
};

// out = the segments' sums over `inputs` (one pointer per rank, each 16-byte
// aligned), summed in rank order in fp32 and rounded once: the same bits as
// comm::reduce on the CPU. One launch per 48 segments.
void device_reduce(void* out, DType out_dtype, const std::vector<const void*>& inputs, DType dtype,
                   const std::vector<ReduceSegment>& segments, float scale, fabric::StreamHandle stream);

// Device memory on every local rank that every rank maps, with the signals
// that keep writers and readers apart: `ready` (a rank wrote its buffer) and
// `done` (a rank finished reading everyone's). Rounds of the two advance
// together, one per collective that uses the window: the device counterpart
// of a symmetric comm::Window.
struct DeviceWindow {
  std::shared_ptr<fabric::PeerMemory> memory;
  std::shared_ptr<fabric::DeviceSignal> ready, done;
  const void* peer(int rank, std::size_t offset = 0) const {
    return static_cast<const char*>(memory->peer(rank)) + offset;
  }
};

class DeviceNodeComm {
 public:
  // Collective: sets up signalling among the node's ranks for `device`.
  DeviceNodeComm(std::shared_ptr<fabric::Fabric> fabric, int device);
  ~DeviceNodeComm();

  fabric::Fabric& fabric() const { return *fabric_; }
  int rank() const { return fabric_->local_rank(); }
  int size() const { return fabric_->local_world(); }
  int device() const { return device_; }

  // `data` (bytes) from local rank `root` to every rank.
  void broadcast(void* data, std::size_t bytes, int root, fabric::StreamHandle stream);
  // In place: data = scale * the sum of every rank's data (n elements).
  void all_reduce(void* data, std::size_t n, DType dtype, float scale, fabric::StreamHandle stream);
  // `out` gets every rank's `in`: rank r's rows go to rows `rows[r]` of out
  // (rows of `row_bytes` bytes). The rows need not cover out.
  void all_gather(const void* in, void* out, const std::vector<Range>& rows, std::size_t row_bytes,
                  fabric::StreamHandle stream);
  // Every rank's `in` (n elements) is summed over the node's ranks along
  // `segments` into `out` (this rank's own out: ranks may ask for different
  // segments).
  void reduce(const void* in, std::size_t n, DType dtype, const std::vector<ReduceSegment>& segments, float scale,
              void* out, DType out_dtype, fabric::StreamHandle stream);

  // Zero-copy, on a window whose slots the ranks write in place (gradients).
  // Collective: a window of `bytes` per rank.
  DeviceWindow window(std::size_t bytes);
  // Makes `stream` wait until every peer has finished reading the window's
  // last round; then this rank may write its slot.
  void acquire(DeviceWindow& window, fabric::StreamHandle stream);
  // Blocks until every peer has finished reading the window's last round on
  // its GPU, so that this rank's slot may be freed: the ranks drop a
  // window's memory independently (a tensor's deleter), and a peer's stream
  // may still be reducing from it. Throws FabricError where a peer died.
  static void drain(DeviceWindow& window, fabric::StreamHandle stream);
  // Every rank wrote its slot: sums along `segments` over every slot into
  // `out` (one kernel), then marks this rank done reading.
  void reduce_window(DeviceWindow& window, DType dtype, const std::vector<ReduceSegment>& segments, float scale,
                     void* out, DType out_dtype, fabric::StreamHandle stream);

  // Bytes this rank copied on the copy engines and read while reducing.
  Stats stats() const { return Stats{bytes_copied_, bytes_reduced_}; }
  void reset_stats() { bytes_copied_ = bytes_reduced_ = 0; }

 private:
  // Makes `scratch` hold `bytes` per rank (collectively growing it) and
  // makes `stream` wait until every peer is done reading its last round.
  void acquire(DeviceWindow& scratch, std::size_t bytes, fabric::StreamHandle stream);

  std::shared_ptr<fabric::Fabric> fabric_;
  int device_;
  DeviceWindow inputs_;   // each rank's copy of its input
  DeviceWindow results_;  // each rank's reduced chunk (all-reduce)
  uint64_t bytes_copied_ = 0, bytes_reduced_ = 0;
};

}  // namespace hp::comm
