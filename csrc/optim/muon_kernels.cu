// hp.optim.Muon's elementwise passes on a GPU (muon_kernels_cuda.h). Pure
// bandwidth: each thread takes four consecutive elements at a time (one
// 16-byte load per float32 operand where the pointers allow), the grid
// strides over the rest, and every element is muon_math.h's.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "hyperparallel/fabric/device.h"
#include "muon_kernels_cuda.h"
#include "muon_math.h"

namespace hp::optim::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWidth = 4;  // elements per thread per iteration

using simd::bf16_to_float;
using simd::float_to_bf16;

// Four bfloat16 values as the 8 bytes one store writes.
__device__ uint2 pack(uint16_t a, uint16_t b, uint16_t c, uint16_t d) {
  return make_uint2(uint32_t(a) | uint32_t(b) << 16, uint32_t(c) | uint32_t(d) << 16);
}

// `wide`: every pointer is aligned for the vector loads, so the first n / 4
// groups go four at a time; the rest (all of it otherwise) one at a time.
__global__ void __launch_bounds__(kThreads)
    momentum_kernel(float* __restrict__ buf, const float* __restrict__ grad, uint16_t* __restrict__ out, int64_t n,
                    float to_grad, float to_buf, bool nesterov, bool wide) {
  const int64_t stride = int64_t(gridDim.x) * kThreads, first = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t groups = wide ? n / kWidth : 0;
  for (int64_t q = first; q < groups; q += stride) {
    const float4 b = reinterpret_cast<const float4*>(buf)[q], g = reinterpret_cast<const float4*>(grad)[q];
    const math::Momentum x = math::momentum(b.x, g.x, to_grad, to_buf, nesterov);
    const math::Momentum y = math::momentum(b.y, g.y, to_grad, to_buf, nesterov);
    const math::Momentum z = math::momentum(b.z, g.z, to_grad, to_buf, nesterov);
    const math::Momentum w = math::momentum(b.w, g.w, to_grad, to_buf, nesterov);
    reinterpret_cast<float4*>(buf)[q] = make_float4(x.buf, y.buf, z.buf, w.buf);
    reinterpret_cast<uint2*>(out)[q] = pack(float_to_bf16(x.update), float_to_bf16(y.update),
                                            float_to_bf16(z.update), float_to_bf16(w.update));
  }
  for (int64_t i = groups * kWidth + first; i < n; i += stride) {
    const math::Momentum m = math::momentum(buf[i], grad[i], to_grad, to_buf, nesterov);
    buf[i] = m.buf;
    out[i] = float_to_bf16(m.update);
  }
}

__global__ void __launch_bounds__(kThreads)
    apply_kernel(float* __restrict__ param, const uint16_t* __restrict__ update, int64_t n, float decay, float alpha,
                 bool wide) {
  const int64_t stride = int64_t(gridDim.x) * kThreads, first = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t groups = wide ? n / kWidth : 0;
  for (int64_t q = first; q < groups; q += stride) {
    const float4 p = reinterpret_cast<const float4*>(param)[q];
    const uint2 u = reinterpret_cast<const uint2*>(update)[q];
    reinterpret_cast<float4*>(param)[q] =
        make_float4(math::apply(p.x, bf16_to_float(uint16_t(u.x)), decay, alpha),
                    math::apply(p.y, bf16_to_float(uint16_t(u.x >> 16)), decay, alpha),
                    math::apply(p.z, bf16_to_float(uint16_t(u.y)), decay, alpha),
                    math::apply(p.w, bf16_to_float(uint16_t(u.y >> 16)), decay, alpha));
  }
  for (int64_t i = groups * kWidth + first; i < n; i += stride)
    param[i] = math::apply(param[i], bf16_to_float(update[i]), decay, alpha);
}

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Enough blocks to fill the GPU several times over; beyond that the threads
// stride (a launch per pass, whatever n).
int blocks_for(int64_t n) {
  int device = 0, sms = 132;
  if (cudaGetDevice(&device) == cudaSuccess) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const int64_t wanted = (n / kWidth + kThreads - 1) / kThreads;
  return int(std::clamp<int64_t>(wanted, 1, int64_t(sms) * 8));
}

}  // namespace

void momentum(float* buf, const float* grad, uint16_t* out, int64_t n, double momentum, bool nesterov, void* stream) {
  if (n <= 0) return;
  const bool wide = aligned(buf, 16) && aligned(grad, 16) && aligned(out, 8);
  momentum_kernel<<<blocks_for(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      buf, grad, out, n, float(1.0 - momentum), float(momentum), nesterov, wide);
  fabric::device::check_launch("hp.optim.Muon momentum");
}

void apply(float* param, const uint16_t* update, int64_t n, float decay, float alpha, void* stream) {
  if (n <= 0) return;
  const bool wide = aligned(param, 16) && aligned(update, 8);
  apply_kernel<<<blocks_for(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(param, update, n, decay, alpha,
                                                                                 wide);
  fabric::device::check_launch("hp.optim.Muon apply");
}

}  // namespace hp::optim::cuda
