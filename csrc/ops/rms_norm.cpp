// hyperparallel::rms_norm: HF's RMSNorm in one pass forward and one backward.
#include <ATen/Parallel.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "common.h"
#include "hyperparallel/ops/fused.h"
#include "kernels.h"

namespace hp::ops {
namespace {

using detail::elem;
using detail::elem_mut;

// Rows per task: enough elements that a task outweighs its scheduling.
int64_t row_grain(int64_t n) { return std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(n, 1)); }

at::ScalarType output_type(const at::Tensor& input, const at::Tensor& weight) {
  return at::promote_types(input.scalar_type(), weight.scalar_type());
}

void check(const at::Tensor& input, const at::Tensor& weight) {
  detail::check_float_or_bf16(input, "rms_norm", "input");
  detail::check_float_or_bf16(weight, "rms_norm", "weight");
  TORCH_CHECK(
      input.dim() >= 1 && weight.dim() == 1 && input.sym_size(-1) == weight.sym_size(0) && weight.sym_size(0) > 0,
      "hyperparallel::rms_norm: weight ", weight.sym_sizes(), " must be 1-D and match input ", input.sym_sizes(),
      " in its last dimension");
}

std::tuple<at::Tensor, at::Tensor> forward_cpu(const at::Tensor& input, const at::Tensor& weight, double eps) {
  check(input, weight);
  const at::Tensor x = input.contiguous();
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0);
  const int64_t rows = x.numel() / n;
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(output_type(x, w)));
  at::Tensor rstd = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat));
  const auto& k = cpu::kernels();
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    k.rms_norm_forward(x.scalar_type(), elem(x, begin * n), w.scalar_type(), w.const_data_ptr(), y.scalar_type(),
                       elem_mut(y, begin * n), rstd.mutable_data_ptr<float>() + begin, end - begin, n,
                       static_cast<float>(eps));
  });
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> backward_cpu(const at::Tensor& grad, const at::Tensor& input,
                                                const at::Tensor& weight, const at::Tensor& rstd) {
  const at::Tensor dy = grad.contiguous();
  const at::Tensor x = input.contiguous();
  const at::Tensor w = weight.contiguous();
  const at::Tensor rs = rstd.contiguous();
  const int64_t n = w.size(0);
  const int64_t rows = x.numel() / n;
  at::Tensor dx = at::empty_like(x);
  // One float32 weight-gradient row per thread, summed at the end.
  at::Tensor partial = at::zeros({at::get_num_threads(), n}, x.options().dtype(at::kFloat));
  const auto& k = cpu::kernels();
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    float* acc = partial.mutable_data_ptr<float>() + at::get_thread_num() * n;
    k.rms_norm_backward(dy.scalar_type(), elem(dy, begin * n), x.scalar_type(), elem(x, begin * n), w.scalar_type(),
                        w.const_data_ptr(), rs.const_data_ptr<float>() + begin, elem_mut(dx, begin * n), acc,
                        end - begin, n);
  });
  return {dx, partial.sum(0).to(w.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor> forward_meta(const at::Tensor& input, const at::Tensor& weight, double eps) {
  check(input, weight);
  return {at::empty_symint(input.sym_sizes(), input.options().dtype(output_type(input, weight))),
          at::empty_symint(input.sym_sizes().slice(0, input.dim() - 1), input.options().dtype(at::kFloat))};
}

std::tuple<at::Tensor, at::Tensor> backward_meta(const at::Tensor& grad, const at::Tensor& input,
                                                 const at::Tensor& weight, const at::Tensor& rstd) {
  return {at::empty_symint(input.sym_sizes(), input.options()), at::empty_symint(weight.sym_sizes(), weight.options())};
}

using ForwardOp = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, double);
using BackwardOp = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                      const at::Tensor&);

class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            double eps) {
    static const auto op = detail::op_handle<ForwardOp>("rms_norm_forward");
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, rstd] = op.call(input, weight, eps);
    ctx->save_for_backward({input, weight, rstd});
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    static const auto op = detail::op_handle<BackwardOp>("rms_norm_backward");
    const auto saved = ctx->get_saved_variables();
    auto [dx, dw] = op.call(grads[0], saved[0], saved[1], saved[2]);
    return {dx, dw, at::Tensor()};
  }
};

at::Tensor rms_norm_autograd(const at::Tensor& input, const at::Tensor& weight, double eps) {
  return RmsNormFunction::apply(input, weight, eps);
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps) {
  static const auto op = detail::op_handle<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("rms_norm");
  return op.call(input, weight, eps);
}

}  // namespace hp::ops

TORCH_LIBRARY_FRAGMENT(hyperparallel, m) {
  m.def("rms_norm(Tensor input, Tensor weight, float eps) -> Tensor");
  m.def("rms_norm_forward(Tensor input, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rms_norm_backward(Tensor grad, Tensor input, Tensor weight, Tensor rstd) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(hyperparallel, CPU, m) {
  m.impl("rms_norm", [](const at::Tensor& x, const at::Tensor& w, double eps) {
    return std::get<0>(hp::ops::forward_cpu(x, w, eps));
  });
  m.impl("rms_norm_forward", &hp::ops::forward_cpu);
  m.impl("rms_norm_backward", &hp::ops::backward_cpu);
}

TORCH_LIBRARY_IMPL(hyperparallel, Meta, m) {
  m.impl("rms_norm", [](const at::Tensor& x, const at::Tensor& w, double eps) {
    return std::get<0>(hp::ops::forward_meta(x, w, eps));
  });
  m.impl("rms_norm_forward", &hp::ops::forward_meta);
  m.impl("rms_norm_backward", &hp::ops::backward_meta);
}

TORCH_LIBRARY_IMPL(hyperparallel, Autograd, m) { m.impl("rms_norm", &hp::ops::rms_norm_autograd); }
