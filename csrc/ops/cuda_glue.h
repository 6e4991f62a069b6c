// What the fused ops' CUDA glue (*_cuda.cpp) needs from torch to call the
// kernels of kernels_cuda.h: a tensor's kernel dtype, its device's current
// stream (reached through c10's device interfaces: the glue compiles against
// the CPU torch wheel, which has no CUDA headers) and the one-device check.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <initializer_list>

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

// Refuses tensors on different devices before a kernel reads one of them
// through another device's (or the host's) pointer: a fault there would
// poison the CUDA context instead of raising.
inline void check_same_device(std::initializer_list<const at::Tensor*> tensors, const char* op) {
  const auto device = (*tensors.begin())->device();
  for (const at::Tensor* t : tensors)
    TORCH_CHECK(!t->defined() || t->device() == device, "hyperparallel::", op, ": its tensors are on ", device,
                " and ", t->device(), "; move the module to its input's device");
}

}  // namespace hp::ops::detail
