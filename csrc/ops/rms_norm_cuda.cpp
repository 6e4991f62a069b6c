// hyperparallel::rms_norm's CUDA kernels registered with the dispatcher
// (the autograd function and the schema are rms_norm.cpp's). Reaches CUDA
// only through c10's device interfaces; linked where torch has CUDA.
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <algorithm>

#include "common.h"
#include "cuda_glue.h"

namespace hp::ops {
namespace {

using detail::cuda_dtype;
using detail::cuda_stream;

std::tuple<at::Tensor, at::Tensor> forward_cuda(const at::Tensor& input, const at::Tensor& weight, double eps) {
  detail::check_float_or_bf16(input, "rms_norm", "input");
  detail::check_float_or_bf16(weight, "rms_norm", "weight");
  TORCH_CHECK(input.dim() >= 1 && weight.dim() == 1 && input.size(-1) == weight.size(0) && weight.size(0) > 0,
              "hyperparallel::rms_norm: weight ", weight.sizes(), " must be 1-D and match input ", input.sizes(),
              " in its last dimension");
  TORCH_CHECK(weight.device() == input.device(), "hyperparallel::rms_norm: input is on ", input.device(),
              " but weight on ", weight.device(), "; move the module to the input's device");
  c10::DeviceGuard guard(input.device());
  const at::Tensor x = input.contiguous(), w = weight.contiguous();
  const int64_t n = w.size(0), rows = x.numel() / n;
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(at::promote_types(x.scalar_type(), w.scalar_type())));
  at::Tensor rstd = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat));
  cuda::rms_norm_forward(cuda_dtype(x), x.const_data_ptr(), cuda_dtype(w), w.const_data_ptr(), cuda_dtype(y), y.mutable_data_ptr(),
                         rstd.mutable_data_ptr<float>(), rows, n, float(eps), cuda_stream(x));
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> backward_cuda(const at::Tensor& grad, const at::Tensor& input,
                                                 const at::Tensor& weight, const at::Tensor& rstd) {
  TORCH_CHECK(grad.device() == input.device() && weight.device() == input.device() && rstd.device() == input.device(),
              "hyperparallel::rms_norm backward: its tensors are on different devices");
  c10::DeviceGuard guard(input.device());
  const at::Tensor dy = grad.contiguous(), x = input.contiguous(), w = weight.contiguous(), rs = rstd.contiguous();
  const int64_t n = w.size(0), rows = x.numel() / n;
  at::Tensor dx = at::empty_like(x);
  // Enough row blocks to fill the GPU with n / 32 column tiles, each summing
  // its rows once; the partial sums are added here.
  const int64_t partials = std::clamp<int64_t>(rows / 64, 1, 64);
  at::Tensor partial = at::empty({partials, n}, x.options().dtype(at::kFloat));
  cuda::rms_norm_backward(cuda_dtype(dy), dy.const_data_ptr(), cuda_dtype(x), x.const_data_ptr(), cuda_dtype(w), w.const_data_ptr(),
                          rs.const_data_ptr<float>(), dx.mutable_data_ptr(), partial.mutable_data_ptr<float>(),
                          partials, rows, n, cuda_stream(x));
  return {dx, rows == 0 ? at::zeros_like(w) : partial.sum(0).to(w.scalar_type())};
}

}  // namespace
}  // namespace hp::ops

TORCH_LIBRARY_IMPL(hyperparallel, CUDA, m) {
  m.impl("rms_norm", [](const at::Tensor& x, const at::Tensor& w, double eps) {
    return std::get<0>(hp::ops::forward_cuda(x, w, eps));
  });
  m.impl("rms_norm_forward", &hp::ops::forward_cuda);
  m.impl("rms_norm_backward", &hp::ops::backward_cuda);
}
