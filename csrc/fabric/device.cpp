// The fabric on NVIDIA GPUs (see device.h): CUDA IPC for memory and events,
// the fabric's host channels for knowing when an event is worth waiting on.
#include "hyperparallel/fabric/device.h"

#include <cuda_runtime.h>

#include <atomic>
#include <cstring>

namespace hp::fabric {
namespace {

void check(cudaError_t status, const char* call, const std::string& fix = "") {
  if (status == cudaSuccess) return;
  cudaGetLastError();  // clear a non-sticky error so that the next call is judged on its own
  std::string message = std::string("hyperparallel: ") + call + " failed: " + cudaGetErrorName(status) + " (" +
                        cudaGetErrorString(status) + ")";
  if (!fix.empty()) message += "; " + fix;
  throw DeviceError(message);
}

cudaStream_t as_stream(StreamHandle stream) { return static_cast<cudaStream_t>(stream); }

// Makes `device` current for the scope: the caller's thread may be issuing
// to another device, and CUDA keeps the current device per thread.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceScope() { cudaSetDevice(previous_); }

 private:
  int previous_ = 0;
};

template <typename Handle>
std::string to_bytes(const Handle& handle) {
  return std::string(reinterpret_cast<const char*>(&handle), sizeof handle);
}

template <typename Handle>
Handle from_bytes(const std::string& bytes) {
  Handle handle;
  if (bytes.size() != sizeof handle) throw std::logic_error("hyperparallel: malformed IPC handle from a peer");
  std::memcpy(&handle, bytes.data(), sizeof handle);
  return handle;
}

}  // namespace

namespace device {

bool available() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return count > 0;
}

int count() {
  int n = 0;
  check(cudaGetDeviceCount(&n), "cudaGetDeviceCount", "is an NVIDIA driver installed and a GPU visible?");
  return n;
}

void set_current(int device) { check(cudaSetDevice(device), "cudaSetDevice"); }

int current() {
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  return device;
}

void synchronize(StreamHandle stream) { check(cudaStreamSynchronize(as_stream(stream)), "cudaStreamSynchronize"); }

void check_launch(const char* what) { check(cudaGetLastError(), (std::string("the ") + what + " kernel's launch").c_str()); }

}  // namespace device

PeerMemory::PeerMemory(Fabric& fabric, int device, std::size_t bytes)
    : device_(device), rank_(fabric.local_rank()), bytes_(bytes), peers_(fabric.local_world(), nullptr) {
  DeviceScope scope(device);
  // cudaMalloc's 256-byte alignment is what the kernels' 16-byte loads need.
  void* mine = nullptr;
  check(cudaMalloc(&mine, allocated()), "cudaMalloc",
        "the GPU is out of memory: shard over more ranks, or free memory first");
  peers_[rank_] = mine;
  device::held_bytes_counter += allocated();
  std::vector<std::string> handles;
  try {  // a constructor that throws runs no destructor: ours is freed here
    cudaIpcMemHandle_t handle;
    check(cudaIpcGetMemHandle(&handle, mine), "cudaIpcGetMemHandle",
          "CUDA IPC is unavailable here (a container without the IPC namespace, or MPS)");
    handles = fabric.exchange(to_bytes(handle));  // a dead peer throws FabricError
  } catch (...) {
    release();
    throw;
  }
  for (int r = 0; r < fabric.local_world(); ++r) {
    if (r == rank_) continue;
    void* theirs = nullptr;
    cudaError_t status = cudaIpcOpenMemHandle(&theirs, from_bytes<cudaIpcMemHandle_t>(handles[r]),
                                              cudaIpcMemLazyEnablePeerAccess);
    if (status != cudaSuccess) {
      release();  // unmaps what was mapped, frees ours
      check(status, "cudaIpcOpenMemHandle",
            "this rank cannot map local rank " + std::to_string(r) +
                "'s device memory; every rank of a node needs a GPU it can reach by peer access");
    }
    peers_[r] = theirs;
  }
}

PeerMemory::~PeerMemory() { release(); }

void PeerMemory::release() noexcept {
  // Never throws: also runs at exit, possibly after the CUDA runtime unloaded.
  int previous = 0;
  if (cudaGetDevice(&previous) != cudaSuccess) return;
  cudaSetDevice(device_);
  for (int r = 0; r < int(peers_.size()); ++r) {
    if (!peers_[r]) continue;
    if (r == rank_) {
      cudaFree(peers_[r]);
      device::held_bytes_counter -= allocated();
    } else
      cudaIpcCloseMemHandle(peers_[r]);
    peers_[r] = nullptr;
  }
  cudaGetLastError();
  cudaSetDevice(previous);
}

DeviceEvent::DeviceEvent(int device) {
  DeviceScope scope(device);
  cudaEvent_t event;
  check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  event_ = event;
}

DeviceEvent::~DeviceEvent() {
  if (event_) cudaEventDestroy(static_cast<cudaEvent_t>(event_));
}

void DeviceEvent::record(StreamHandle stream) {
  check(cudaEventRecord(static_cast<cudaEvent_t>(event_), as_stream(stream)), "cudaEventRecord");
  recorded_ = true;
}

void DeviceEvent::wait(StreamHandle stream) const {
  if (!recorded_) return;
  check(cudaStreamWaitEvent(as_stream(stream), static_cast<cudaEvent_t>(event_), 0), "cudaStreamWaitEvent");
}

void DeviceEvent::synchronize() const {
  if (!recorded_) return;
  check(cudaEventSynchronize(static_cast<cudaEvent_t>(event_)), "cudaEventSynchronize");
}

DeviceSignal::DeviceSignal(Fabric& fabric, int device)
    : fabric_(fabric), rank_(fabric.local_rank()), rounds_(fabric.channel()), acks_(fabric.channel()) {
  fabric.arm_watchdog();  // from now on this rank may block on the GPU for its peers
  DeviceScope scope(device);
  std::string handles;
  for (int slot = 0; slot < kSlots; ++slot) {
    cudaEvent_t event;
    check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming | cudaEventInterprocess),
          "cudaEventCreateWithFlags(interprocess)");
    mine_.push_back(event);
    cudaIpcEventHandle_t handle;
    check(cudaIpcGetEventHandle(&handle, event), "cudaIpcGetEventHandle");
    handles += to_bytes(handle);
  }
  static_assert(kSlots * sizeof(cudaIpcEventHandle_t) <= kExchangeBytes, "the event handles must fit one exchange");
  std::vector<std::string> all = fabric.exchange(handles);
  theirs_.resize(fabric.local_world());
  for (int r = 0; r < fabric.local_world(); ++r) {
    for (int slot = 0; slot < kSlots; ++slot) {
      if (r == rank_) {
        theirs_[r].push_back(mine_[slot]);
        continue;
      }
      cudaEvent_t event;
      check(cudaIpcOpenEventHandle(
                &event, from_bytes<cudaIpcEventHandle_t>(all[r].substr(slot * sizeof(cudaIpcEventHandle_t),
                                                                         sizeof(cudaIpcEventHandle_t)))),
            "cudaIpcOpenEventHandle");
      theirs_[r].push_back(event);
    }
  }
}

DeviceSignal::~DeviceSignal() {
  for (std::size_t r = 0; r < theirs_.size(); ++r) {
    if (int(r) == rank_) continue;
    for (void* event : theirs_[r]) cudaEventDestroy(static_cast<cudaEvent_t>(event));
  }
  for (void* event : mine_) cudaEventDestroy(static_cast<cudaEvent_t>(event));
  cudaGetLastError();
}

uint64_t DeviceSignal::post(StreamHandle stream) {
  const uint64_t round = posted_ + 1;
  // The slot's last round must be acknowledged by everyone before it is
  // recorded again (see the class comment).
  if (round > uint64_t(kSlots)) acks_.wait_all(round - kSlots, "device signal (peers acknowledging a round)");
  check(cudaEventRecord(static_cast<cudaEvent_t>(mine_[round % kSlots]), as_stream(stream)), "cudaEventRecord");
  posted_ = round;
  rounds_.post(round);
  return round;
}

void DeviceSignal::wait(int peer, uint64_t round, StreamHandle stream, const char* what) {
  rounds_.wait(peer, round, what);
  check(cudaStreamWaitEvent(as_stream(stream), static_cast<cudaEvent_t>(theirs_[peer][round % kSlots]), 0),
        "cudaStreamWaitEvent");
  acknowledge(round);
}

void DeviceSignal::wait_all(uint64_t round, StreamHandle stream, const char* what) {
  rounds_.wait_all(round, what);
  for (int r = 0; r < int(theirs_.size()); ++r)
    check(cudaStreamWaitEvent(as_stream(stream), static_cast<cudaEvent_t>(theirs_[r][round % kSlots]), 0),
          "cudaStreamWaitEvent");
  acknowledge(round);
}

void DeviceSignal::acknowledge(uint64_t round) {
  if (round <= acked_) return;
  acked_ = round;
  acks_.post(round);
}

void CopyBatch::add(void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0 || dst == src) return;
  dst_.push_back(dst);
  src_.push_back(src);
  bytes_.push_back(bytes);
}

void CopyBatch::clear() {
  dst_.clear();
  src_.clear();
  bytes_.clear();
}

void CopyBatch::run(StreamHandle stream) const {
  if (dst_.empty()) return;
  // Where the driver refuses batches (older than CUDA 12.8's), copy one by
  // one: the same copies, more launches.
  // The legacy default stream (torch's default, a null handle) is one the
  // batch API refuses outright: copy one by one there, and keep batching
  // for the other streams.
  static std::atomic<bool> batches_work{true};
  if (stream != nullptr && batches_work.load(std::memory_order_relaxed)) {
    // Sources are read in stream order (they were written earlier on this or
    // a waited-for stream); the hint asks for the copy engines, leaving the
    // SMs to compute.
    cudaMemcpyAttributes attributes{};
    attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attributes.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    std::size_t first = 0;
    cudaError_t status = cudaMemcpyBatchAsync(const_cast<void* const*>(dst_.data()), src_.data(), bytes_.data(),
                                              dst_.size(), &attributes, &first, 1, as_stream(stream));
    if (status == cudaSuccess) return;
    if (status != cudaErrorNotSupported && status != cudaErrorInvalidValue && status != cudaErrorCallRequiresNewerDriver)
      check(status, "cudaMemcpyBatchAsync");
    cudaGetLastError();
    batches_work = false;
  }
  for (std::size_t i = 0; i < dst_.size(); ++i)
    check(cudaMemcpyAsync(dst_[i], src_[i], bytes_[i], cudaMemcpyDeviceToDevice, as_stream(stream)),
          "cudaMemcpyAsync");
}

}  // namespace hp::fabric
