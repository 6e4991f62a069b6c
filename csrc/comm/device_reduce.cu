// The reduce-scatter kernel (its arithmetic is device_reduce.h's, shared with
// the host tests) and its launcher.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "device_reduce.h"
#include "hyperparallel/comm/device_comm.h"

namespace hp::comm {
namespace {

namespace dr = kernel;

template <typename In, typename Out>
__global__ void __launch_bounds__(dr::kThreads) reduce_kernel(const __grid_constant__ dr::Args args) {
  dr::reduce_thread<In, Out>(args, blockIdx.x, threadIdx.x);
}

template <typename In, typename Out>
void launch(const dr::Args& args, uint64_t tiles, cudaStream_t stream) {
  reduce_kernel<In, Out><<<static_cast<unsigned>(tiles), dr::kThreads, 0, stream>>>(args);
}

}  // namespace

void device_reduce(void* out, DType out_dtype, const std::vector<const void*>& inputs, DType dtype,
                   const std::vector<ReduceSegment>& segments, float scale, fabric::StreamHandle stream) {
  if (inputs.empty() || int(inputs.size()) > dr::kMaxPeers)
    throw std::invalid_argument("device_reduce: " + std::to_string(inputs.size()) + " inputs; 1 to " +
                                std::to_string(dr::kMaxPeers) + " are supported");
  dr::Args args;
  args.peers = int(inputs.size());
  for (int p = 0; p < args.peers; ++p) {
    if (reinterpret_cast<uintptr_t>(inputs[p]) % 16 != 0)
      throw std::invalid_argument("device_reduce: input " + std::to_string(p) + " is not 16-byte aligned");
    args.in[p] = inputs[p];
  }
  // An output that starts inside 16 bytes is addressed from the boundary
  // before it, so that the kernel's alignment test sees its true phase.
  const std::size_t out_size = dtype_size(out_dtype);
  const uintptr_t address = reinterpret_cast<uintptr_t>(out);
  if (address % out_size != 0) throw std::invalid_argument("device_reduce: output not aligned to its dtype");
  const uint64_t shift = (address % 16) / out_size;
  args.out = reinterpret_cast<void*>(address - shift * out_size);
  args.scale = scale;
  const unsigned vector = dtype == DType::F32 ? dr::vector_width<float>() : dr::vector_width<dr::bf16_bits>();
  auto cuda_stream = static_cast<cudaStream_t>(stream);
  // A launch goes to the current device's context: make it the stream's.
  int device = 0, previous = 0;
  if (cudaStreamGetDevice(cuda_stream, &device) != cudaSuccess || cudaGetDevice(&previous) != cudaSuccess)
    throw fabric::DeviceError("hyperparallel: device_reduce got a stream CUDA does not know");
  if (device != previous) cudaSetDevice(device);
  struct Restore {
    int device;
    ~Restore() { cudaSetDevice(device); }
  } restore{previous};
  std::size_t next = 0;
  while (next < segments.size()) {
    args.segments = 0;
    for (; next < segments.size() && args.segments < dr::kMaxSegments; ++next) {
      const ReduceSegment& s = segments[next];
      if (s.count == 0) continue;
      args.segment[args.segments++] = dr::Segment{s.src, s.dst + shift, s.count};
    }
    if (args.segments == 0) break;
    const uint64_t tiles = dr::plan_tiles(args, vector);
    if (tiles > 0x7fffffffu) throw std::invalid_argument("device_reduce: too many elements for one launch");
    if (dtype == DType::F32 && out_dtype == DType::F32)
      launch<float, float>(args, tiles, cuda_stream);
    else if (dtype == DType::F32)
      launch<float, dr::bf16_bits>(args, tiles, cuda_stream);
    else if (out_dtype == DType::F32)
      launch<dr::bf16_bits, float>(args, tiles, cuda_stream);
    else
      launch<dr::bf16_bits, dr::bf16_bits>(args, tiles, cuda_stream);
    fabric::device::check_launch("reduce-scatter");
  }
}

}  // namespace hp::comm
