// What the fused ops' CUDA glue (*_cuda.cpp) needs from torch to call the
// kernels of kernels_cuda.h: a tensor's kernel dtype and its device's current
// stream, reached through c10's device interfaces (the glue compiles against
// the CPU torch wheel, which has no CUDA headers).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include "kernels_cuda.h"

namespace hp::ops::detail {

inline cuda::DType cuda_dtype(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat ? cuda::DType::F32 : cuda::DType::BF16;
}

// The current CUDA stream of t's device, as a cudaStream_t.
inline void* cuda_stream(const at::Tensor& t) {
  c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
  return impl.getStream(t.device()).native_handle();
}

}  // namespace hp::ops::detail
