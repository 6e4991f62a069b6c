// hyperparallel::attention on CUDA: HF's q/k RMSNorm + RoPE as one kernel on
// each side of torch's scaled_dot_product_attention, which runs the attention
// itself on the best backend it has for the call (flash, cuDNN, efficient)
// and differentiates it. On the CPU the whole op is one flash-style kernel
// (attention.cpp); on a GPU SDPA's kernels are already at the hardware's
// limit, and what HF leaves on the table is the dozen elementwise launches of
// its norm, transposes and rotate-half around them.
//
// hyperparallel::norm_rope is the fused piece: (batch, seq, heads, d) as the
// projection leaves it -> (batch, heads, seq, d) as SDPA takes it, HF's
// RMSNorm then rotate-half RoPE, with its own forward and backward kernels
// (kernels.cu). Linked where torch has CUDA; reaches CUDA through c10.
#include <c10/core/DeviceGuard.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>

#include "common.h"
#include "cuda_glue.h"
#include "hyperparallel/ops/fused.h"

namespace hp::ops {
namespace {

using detail::cuda_dtype;
using detail::check_same_device;
using detail::cuda_stream;

void check_norm_rope(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& cos, const at::Tensor& sin) {
  check_same_device({&x, &weight, &cos, &sin}, "norm_rope");
  detail::check_float_or_bf16(x, "norm_rope", "q or k");
  detail::check_same_dtype(x, weight, "norm_rope", "q or k", "its norm's weight");
  const auto d = x.sym_size(-1);
  TORCH_CHECK(x.dim() == 4 && d % 2 == 0 && weight.sym_numel() == d,
              "hyperparallel::norm_rope: expects (batch, seq, heads, head_dim) with an even head_dim and a norm "
              "weight of head_dim; got ",
              x.sym_sizes(), " and ", weight.sym_sizes());
  TORCH_CHECK(cos.dim() == 3 && cos.sym_sizes() == sin.sym_sizes() && cos.sym_size(1) == x.sym_size(1) &&
                  cos.sym_size(2) == d && (cos.sym_size(0) == 1 || cos.sym_size(0) == x.sym_size(0)),
              "hyperparallel::norm_rope: cos and sin must be (1 or batch, seq, head_dim) for ", x.sym_sizes(),
              "; got ", cos.sym_sizes(), " and ", sin.sym_sizes());
}

cuda::NormRope shape_of(const at::Tensor& x, const at::Tensor& cos, double eps) {
  return {x.size(0), x.size(1), x.size(2), x.size(3), cos.size(0), float(eps)};
}

std::tuple<at::Tensor, at::Tensor> norm_rope_forward_cuda(const at::Tensor& input, const at::Tensor& weight,
                                                          const at::Tensor& cos, const at::Tensor& sin, double eps) {
  check_norm_rope(input, weight, cos, sin);
  c10::DeviceGuard guard(input.device());
  const at::Tensor x = input.contiguous(), w = weight.contiguous();
  const at::Tensor c = cos.to(at::kFloat).contiguous(), s = sin.to(at::kFloat).contiguous();
  const cuda::NormRope shape = shape_of(x, c, eps);
  at::Tensor out = at::empty({shape.batch, shape.heads, shape.seq, shape.d}, x.options());
  at::Tensor rstd = at::empty({shape.batch, shape.seq, shape.heads}, x.options().dtype(at::kFloat));
  cuda::norm_rope_forward(cuda_dtype(x), shape, x.const_data_ptr(), w.const_data_ptr(), c.const_data_ptr<float>(),
                          s.const_data_ptr<float>(), out.mutable_data_ptr(), rstd.mutable_data_ptr<float>(),
                          cuda_stream(x));
  return {out, rstd};
}

std::tuple<at::Tensor, at::Tensor> norm_rope_backward_cuda(const at::Tensor& grad, const at::Tensor& input,
                                                           const at::Tensor& weight, const at::Tensor& cos,
                                                           const at::Tensor& sin, const at::Tensor& rstd) {
  c10::DeviceGuard guard(input.device());
  const at::Tensor g = grad.to(input.scalar_type()).contiguous(), x = input.contiguous(), w = weight.contiguous();
  const at::Tensor c = cos.to(at::kFloat).contiguous(), s = sin.to(at::kFloat).contiguous();
  const cuda::NormRope shape = shape_of(x, c, 0.0);
  const int64_t rows = shape.batch * shape.seq * shape.heads;
  at::Tensor dx = at::empty_like(x);
  // Row blocks for the weight's gradient, each summing 32 rows (a thread
  // walks its column down them one after another, so fewer, longer blocks
  // leave the GPU idle: seq 4096 x 16 heads would be 32 blocks of 2048 rows);
  // at most 4096 partial rows (2 MiB at head_dim 128), added here.
  const int64_t partials = std::clamp<int64_t>((rows + 31) / 32, 1, 4096);
  at::Tensor partial = at::empty({partials, shape.d}, x.options().dtype(at::kFloat));
  cuda::norm_rope_backward(cuda_dtype(x), shape, g.const_data_ptr(), x.const_data_ptr(), w.const_data_ptr(),
                           c.const_data_ptr<float>(), s.const_data_ptr<float>(), rstd.contiguous().const_data_ptr<float>(),
                           dx.mutable_data_ptr(), partial.mutable_data_ptr<float>(), partials, cuda_stream(x));
  return {dx, rows == 0 ? at::zeros_like(w) : partial.sum(0).to(w.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor> norm_rope_forward_meta(const at::Tensor& x, const at::Tensor& weight,
                                                          const at::Tensor& cos, const at::Tensor& sin, double eps) {
  check_norm_rope(x, weight, cos, sin);
  return {at::empty_symint({x.sym_size(0), x.sym_size(2), x.sym_size(1), x.sym_size(3)}, x.options()),
          at::empty_symint({x.sym_size(0), x.sym_size(1), x.sym_size(2)}, x.options().dtype(at::kFloat))};
}

std::tuple<at::Tensor, at::Tensor> norm_rope_backward_meta(const at::Tensor& grad, const at::Tensor& x,
                                                           const at::Tensor& weight, const at::Tensor& cos,
                                                           const at::Tensor& sin, const at::Tensor& rstd) {
  return {at::empty_symint(x.sym_sizes(), x.options()), at::empty_symint(weight.sym_sizes(), weight.options())};
}

using NormRopeForwardOp = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                              const at::Tensor&, double);
using NormRopeBackwardOp = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                               const at::Tensor&, const at::Tensor&, const at::Tensor&);

class NormRopeFunction : public torch::autograd::Function<NormRopeFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& cos, const at::Tensor& sin, double eps) {
    static const auto op = detail::op_handle<NormRopeForwardOp>("norm_rope_forward");
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, rstd] = op.call(x, weight, cos, sin, eps);
    ctx->save_for_backward({x, weight, cos, sin, rstd});
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    static const auto op = detail::op_handle<NormRopeBackwardOp>("norm_rope_backward");
    const auto s = ctx->get_saved_variables();
    auto [dx, dw] = op.call(grads[0], s[0], s[1], s[2], s[3], s[4]);
    return {dx, dw, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor norm_rope_autograd(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& cos,
                              const at::Tensor& sin, double eps) {
  return NormRopeFunction::apply(x, weight, cos, sin, eps);
}

at::Tensor norm_rope(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& cos, const at::Tensor& sin,
                     double eps) {
  static const auto op =
      detail::op_handle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>(
          "norm_rope");
  return op.call(x, weight, cos, sin, eps);
}

// The attention op (fused.h's contract) from norm_rope and SDPA; both carry
// their own autograd, so this serves the AutogradCUDA key as it is.
std::tuple<at::Tensor, at::Tensor> attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  const at::Tensor& q_norm_weight, const at::Tensor& k_norm_weight,
                                                  const at::Tensor& cos, const at::Tensor& sin,
                                                  const std::optional<at::Tensor>& mask, double q_eps, double k_eps,
                                                  double scale) {
  // Sizes are read as SymInts: under torch.compile this very function traces
  // the graph (it serves AutogradCUDA), and a dynamic shape has no int size.
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k.sym_sizes() == v.sym_sizes() &&
                  k.sym_size(2) > 0 && q.sym_size(2) % k.sym_size(2) == 0,
              "hyperparallel::attention: q (batch, seq, heads, head_dim) and k, v (batch, seq, kv_heads, head_dim) "
              "with kv_heads dividing heads; got q ",
              q.sym_sizes(), ", k ", k.sym_sizes(), ", v ", v.sym_sizes());
  // The kernels read cos and sin in float32: convert them once here, not in
  // each of q's and k's passes both ways.
  const at::Tensor c = cos.to(at::kFloat).contiguous(), s = sin.to(at::kFloat).contiguous();
  const at::Tensor q_rope = norm_rope(q, q_norm_weight, c, s, q_eps);
  const at::Tensor k_rope = norm_rope(k, k_norm_weight, c, s, k_eps);
  at::Tensor keys = k_rope, values = v.transpose(1, 2);
  const c10::SymInt group = q.sym_size(2) / k.sym_size(2), seq = q.sym_size(1);
  // The op's mask applies on top of causality; SDPA takes one or the other.
  std::optional<at::Tensor> attn_mask;
  if (mask) {
    TORCH_CHECK((mask->scalar_type() == at::kBool || at::isFloatingType(mask->scalar_type())) && mask->dim() == 4 &&
                    (mask->sym_size(0) == 1 || mask->sym_size(0) == q.sym_size(0)) && mask->sym_size(1) == 1 &&
                    mask->sym_size(2) == seq && mask->sym_size(3) == seq,
                "hyperparallel::attention: the mask must be bool (true = attend) or additive floating point, shaped "
                "(1 or batch, 1, seq, seq); got ",
                mask->scalar_type(), " ", mask->sym_sizes());
    const at::Tensor causal = at::ones_symint({seq, seq}, mask->options().dtype(at::kBool)).tril();
    attn_mask = mask->scalar_type() == at::kBool
                    ? mask->logical_and(causal)
                    : mask->to(q.scalar_type()).masked_fill(causal.logical_not(), -std::numeric_limits<double>::infinity());
  }
  // Flash and cuDNN read grouped kv heads in place; where neither can serve
  // the call (float32, an explicit mask) the math/efficient kernels need the
  // heads repeated, as HF's repeat_kv does.
  const bool native_groups = group == 1 || (!mask && q.scalar_type() != at::kFloat);
  if (!native_groups) {
    keys = keys.repeat_interleave_symint(group, 1);
    values = values.repeat_interleave_symint(group, 1);
  }
  at::Tensor out = at::scaled_dot_product_attention(q_rope, keys, values, attn_mask, 0.0, !mask.has_value(), scale,
                                                    group > 1 && native_groups);
  // k after norm and RoPE is for the KV cache, not for differentiation.
  return {out.transpose(1, 2), k_rope.detach()};
}

}  // namespace
}  // namespace hp::ops

TORCH_LIBRARY_FRAGMENT(hyperparallel, m) {
  m.def("norm_rope(Tensor x, Tensor weight, Tensor cos, Tensor sin, float eps) -> Tensor");
  m.def("norm_rope_forward(Tensor x, Tensor weight, Tensor cos, Tensor sin, float eps) -> (Tensor, Tensor)");
  m.def(
      "norm_rope_backward(Tensor grad, Tensor x, Tensor weight, Tensor cos, Tensor sin, Tensor rstd) "
      "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(hyperparallel, CUDA, m) {
  m.impl("norm_rope", [](const at::Tensor& x, const at::Tensor& w, const at::Tensor& c, const at::Tensor& s,
                         double eps) { return std::get<0>(hp::ops::norm_rope_forward_cuda(x, w, c, s, eps)); });
  m.impl("norm_rope_forward", &hp::ops::norm_rope_forward_cuda);
  m.impl("norm_rope_backward", &hp::ops::norm_rope_backward_cuda);
  m.impl("attention", &hp::ops::attention_cuda);
}

TORCH_LIBRARY_IMPL(hyperparallel, Meta, m) {
  m.impl("norm_rope", [](const at::Tensor& x, const at::Tensor& w, const at::Tensor& c, const at::Tensor& s,
                         double eps) { return std::get<0>(hp::ops::norm_rope_forward_meta(x, w, c, s, eps)); });
  m.impl("norm_rope_forward", &hp::ops::norm_rope_forward_meta);
  m.impl("norm_rope_backward", &hp::ops::norm_rope_backward_meta);
}

TORCH_LIBRARY_IMPL(hyperparallel, Autograd, m) { m.impl("norm_rope", &hp::ops::norm_rope_autograd); }

TORCH_LIBRARY_IMPL(hyperparallel, AutogradCUDA, m) { m.impl("attention", &hp::ops::attention_cuda); }
