// hyperparallel::linear: nn.Linear's x Wᵀ + b on the fused ops' matrix
// products (common.h), so that a model's projections and LM head run on the
// same float32 kernel as its experts and attention instead of torch's mm.
#include <torch/autograd.h>
#include <torch/library.h>

#include "common.h"
#include "hyperparallel/ops/fused.h"

namespace hp::ops {
namespace {

void check(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  detail::check_same_dtype(input, weight, "linear", "input", "weight");
  TORCH_CHECK(input.dim() >= 1 && weight.dim() == 2 && input.sym_size(-1) == weight.sym_size(1),
              "hyperparallel::linear: input ", input.sym_sizes(), " and weight ", weight.sym_sizes(),
              " must be (..., in) and (out, in)");
  if (bias) {
    detail::check_same_dtype(input, *bias, "linear", "input", "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->sym_size(0) == weight.sym_size(0), "hyperparallel::linear: bias ",
                bias->sym_sizes(), " must be (out,) for weight ", weight.sym_sizes());
  }
}

template <class Sizes>
auto out_shape(const Sizes& input, const Sizes& weight) {
  auto shape = input.vec();
  shape.back() = weight[0];
  return shape;
}

at::Tensor forward_cpu(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  check(input, weight, bias);
  const at::Tensor x = input.reshape({-1, input.size(-1)});
  at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options());
  if (bias) y.copy_(bias->unsqueeze(0).expand_as(y));
  detail::mm_into(y, x, weight.t(), /*accumulate=*/bias.has_value());
  return y.view(out_shape(input.sizes(), weight.sizes()));
}

using Grads = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// Only the gradients output_mask asks for (input, weight, bias); the others
// are undefined: a frozen weight (LoRA) costs no weight-gradient GEMM.
Grads backward_cpu(const at::Tensor& grad, const at::Tensor& input, const at::Tensor& weight,
                   std::array<bool, 3> output_mask) {
  const at::Tensor dy = grad.reshape({-1, grad.size(-1)});
  Grads out;
  if (output_mask[0]) std::get<0>(out) = detail::product(dy, weight).view(input.sizes());
  if (output_mask[1]) std::get<1>(out) = detail::product(dy.t(), input.reshape({-1, input.size(-1)}));
  if (output_mask[2]) std::get<2>(out) = dy.sum(0);
  return out;
}

at::Tensor forward_meta(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  check(input, weight, bias);
  return at::empty_symint(out_shape(input.sym_sizes(), weight.sym_sizes()), input.options());
}

Grads backward_meta(const at::Tensor& grad, const at::Tensor& input, const at::Tensor& weight,
                    std::array<bool, 3> output_mask) {
  Grads out;
  if (output_mask[0]) std::get<0>(out) = at::empty_symint(input.sym_sizes(), input.options());
  if (output_mask[1]) std::get<1>(out) = at::empty_symint(weight.sym_sizes(), weight.options());
  if (output_mask[2]) std::get<2>(out) = at::empty_symint({weight.sym_size(0)}, weight.options());
  return out;
}

using ForwardOp = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&);
using BackwardOp = Grads(const at::Tensor&, const at::Tensor&, const at::Tensor&, std::array<bool, 3>);

class LinearFunction : public torch::autograd::Function<LinearFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias) {
    static const auto op = detail::op_handle<ForwardOp>("linear");
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({input, weight});
    ctx->saved_data["has_bias"] = bias.has_value();
    return op.call(input, weight, bias);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    static const auto op = detail::op_handle<BackwardOp>("linear_backward");
    const auto saved = ctx->get_saved_variables();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    auto [dx, dw, db] = op.call(grads[0], saved[0], saved[1],
                                {ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                 has_bias && ctx->needs_input_grad(2)});
    return {dx, dw, db};
  }
};

at::Tensor linear_autograd(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return LinearFunction::apply(input, weight, bias);
}

}  // namespace

at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  static const auto op = detail::op_handle<ForwardOp>("linear");
  return op.call(input, weight, bias);
}

}  // namespace hp::ops

TORCH_LIBRARY_FRAGMENT(hyperparallel, m) {
  m.def("linear(Tensor input, Tensor weight, Tensor? bias) -> Tensor");
  m.def("linear_backward(Tensor grad, Tensor input, Tensor weight, bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(hyperparallel, CPU, m) {
  m.impl("linear", &hp::ops::forward_cpu);
  m.impl("linear_backward", &hp::ops::backward_cpu);
}

TORCH_LIBRARY_IMPL(hyperparallel, Meta, m) {
  m.impl("linear", &hp::ops::forward_meta);
  m.impl("linear_backward", &hp::ops::backward_meta);
}

TORCH_LIBRARY_IMPL(hyperparallel, Autograd, m) { m.impl("linear", &hp::ops::linear_autograd); }
