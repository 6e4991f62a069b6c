// The fabric on NVIDIA GPUs: device memory every local rank maps, and signals
// that order one rank's stream after another rank's.
//
// On the CPU a node's ranks share one copy of a buffer. A GPU computes on its
// own HBM (about ten times NVLink's bandwidth), so here every rank allocates
// its buffers on its own device and hands the node's other ranks a CUDA IPC
// handle; every rank maps every peer's buffer and copies or reduces straight
// from it. Nothing spins on the GPU: a stream that must wait for a peer waits
// on the peer's IPC event, and the host learns that the event was recorded
// through the fabric's channels, which also turn a dead or frozen peer into a
// FabricError instead of a hang.
//
// This header needs neither torch nor the CUDA headers: streams are opaque
// handles (a cudaStream_t), so torch-facing code built against a CPU-only
// torch can include it. The implementation is linked only into builds whose
// torch has CUDA (HP_CUDA).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "hyperparallel/fabric/fabric.h"

namespace hp::fabric {

// A cudaStream_t.
using StreamHandle = void*;

// A CUDA call failed. The message names the call, CUDA's error and, where we
// know it, the fix.
class DeviceError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace device {
// Whether this process can use CUDA: a driver and at least one device.
bool available();
int count();
// The device this thread issues work to. CUDA keeps it per thread, so every
// thread that touches device memory (the reducer's too) sets it first.
void set_current(int device);
int current();
// Blocks the host until `stream` has done everything enqueued so far.
void synchronize(StreamHandle stream);
// Throws DeviceError if this thread's last kernel launch failed (no image
// for this GPU, a grid CUDA refuses, an earlier fault): every launcher calls
// it after its launches. `what` names the kernel in the message.
void check_launch(const char* what);

// Device memory this process holds in PeerMemory buffers now (its own
// allocations; its mappings of peers' are theirs): what a rank holds beside
// torch's caching allocator. Zero in a build without the CUDA part, which
// allocates none. Inline, so that code without CUDA can read it.
inline std::atomic<std::size_t> held_bytes_counter{0};
inline std::size_t held_bytes() { return held_bytes_counter.load(std::memory_order_relaxed); }
}  // namespace device

// Memory on this rank's device that every local rank has mapped (RAII).
// Rank r's buffer is peer(r) on every rank: local() here, a CUDA IPC mapping
// elsewhere.
class PeerMemory {
 public:
  // Collective over the fabric's local ranks: every rank allocates `bytes`
  // (the same on all) on `device` and maps everyone else's.
  PeerMemory(Fabric& fabric, int device, std::size_t bytes);
  ~PeerMemory();
  PeerMemory(const PeerMemory&) = delete;
  PeerMemory& operator=(const PeerMemory&) = delete;

  void* local() const { return peers_[rank_]; }
  void* peer(int local_rank) const { return peers_[local_rank]; }
  const std::vector<void*>& peers() const { return peers_; }
  std::size_t bytes() const { return bytes_; }
  int device() const { return device_; }

 private:
  void release() noexcept;
  std::size_t allocated() const { return bytes_ == 0 ? 256 : bytes_; }  // cudaMalloc takes no 0
  int device_ = 0;
  int rank_ = 0;
  std::size_t bytes_ = 0;
  std::vector<void*> peers_;
};

// An event of this process: record on one stream, make another wait (RAII).
class DeviceEvent {
 public:
  // An event belongs to the device current at its creation, and a stream of
  // another device cannot record it: it is created on `device`, whatever the
  // calling thread's current device.
  explicit DeviceEvent(int device);
  ~DeviceEvent();
  DeviceEvent(const DeviceEvent&) = delete;
  DeviceEvent& operator=(const DeviceEvent&) = delete;
  void record(StreamHandle stream);
  // `stream` waits for the last record (nothing, if never recorded).
  void wait(StreamHandle stream) const;
  // The host waits for the last record (returns at once if never recorded).
  void synchronize() const;

 private:
  void* event_ = nullptr;
  bool recorded_ = false;
};

// Orders streams of different ranks. Every rank posts rounds 1, 2, 3, ... on
// its own stream; a rank's stream can then wait until a peer's round r has
// completed on the peer's stream.
//
// A round is a host counter (a fabric Channel, so a dead peer raises) plus an
// IPC event, one of kSlots per rank used in turn. A stream waits on the event
// only after the host saw the round posted, and a rank re-records a slot only
// once every rank has acknowledged the round that last used it (waited for it,
// or declared it does not need it), so a wait never lands on a later round.
class DeviceSignal {
 public:
  static constexpr int kSlots = 8;

  // Collective over the fabric's local ranks.
  DeviceSignal(Fabric& fabric, int device);
  ~DeviceSignal();
  DeviceSignal(const DeviceSignal&) = delete;
  DeviceSignal& operator=(const DeviceSignal&) = delete;

  // Records this rank's next round on `stream` and posts it; returns the round.
  uint64_t post(StreamHandle stream);
  // Makes `stream` wait for local rank `peer`'s round (host-waits until it is
  // posted) and acknowledges the round. `what` names the wait in errors.
  void wait(int peer, uint64_t round, StreamHandle stream, const char* what);
  // wait() on every local rank (this one included: `stream` may differ from
  // the one this rank posted on).
  void wait_all(uint64_t round, StreamHandle stream, const char* what);
  // Acknowledges a round this rank does not wait for (a broadcast's root).
  void acknowledge(uint64_t round);
  uint64_t posted() const { return posted_; }

 private:
  Fabric& fabric_;
  int rank_ = 0;
  Channel rounds_;  // per rank: the last round posted
  Channel acks_;    // per rank: the last round waited for or skipped
  std::vector<void*> mine_;                 // kSlots events of this rank
  std::vector<std::vector<void*>> theirs_;  // [local rank][slot], opened from IPC handles
  uint64_t posted_ = 0, acked_ = 0;
};

// Many device-to-device copies issued as one batch on the copy engines (no
// SMs), so that a compute kernel beside them keeps the whole GPU.
class CopyBatch {
 public:
  void add(void* dst, const void* src, std::size_t bytes);
  bool empty() const { return dst_.empty(); }
  std::size_t size() const { return dst_.size(); }
  // Enqueues every copy on `stream` (not the legacy default stream).
  void run(StreamHandle stream) const;
  void clear();

 private:
  std::vector<void*> dst_;
  std::vector<const void*> src_;
  std::vector<std::size_t> bytes_;
};

}  // namespace hp::fabric
