// The MLPs: hyperparallel::swiglu_mlp (dense) and the sparse MoE block's
// moe_router, moe_experts and moe_aux_loss.
//
// moe_experts sorts the (token, slot) pairs by expert with a counting sort,
// gathers their rows, and runs each expert's two GEMMs on a contiguous run of
// rows; SwiGLU, the routing weights and the sum over a token's experts are
// fused passes. The backward re-gathers rows instead of keeping them, and
// takes the routing weights' gradient from dot(da, a), so neither the gathered
// input nor the experts' outputs are stored between forward and backward.
#include <ATen/Parallel.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "common.h"
#include "hyperparallel/ops/fused.h"
#include "kernels.h"

namespace hp::ops {
namespace {

using detail::elem;
using detail::elem_mut;
using detail::product;
using detail::mm_into;

// Rows per task for row-wise passes over `width` elements.
int64_t row_grain(int64_t width) {
  return std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(width, 1));
}

// dst[i] = src[index[i]] for rows of `width` elements.
void gather_rows(const at::Tensor& src, const int64_t* index, int64_t rows, at::Tensor& dst) {
  const int64_t width = src.size(1);
  const int64_t bytes = width * src.element_size();
  at::parallel_for(0, rows, row_grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) std::memcpy(elem_mut(dst, i * width), elem(src, index[i] * width), bytes);
  });
}

// ---------------------------------------------------------------------------
// Dense SwiGLU MLP.

void check_mlp(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down) {
  for (const auto* t : {&x, &gate, &up, &down}) detail::check_float_or_bf16(*t, "swiglu_mlp", "an argument");
  detail::check_same_dtype(x, gate, "swiglu_mlp", "input", "gate_proj.weight");
  detail::check_same_dtype(x, up, "swiglu_mlp", "input", "up_proj.weight");
  detail::check_same_dtype(x, down, "swiglu_mlp", "input", "down_proj.weight");
  TORCH_CHECK(gate.dim() == 2 && gate.sym_sizes() == up.sym_sizes() && down.dim() == 2 &&
                  x.sym_size(-1) == gate.sym_size(1) && down.sym_size(1) == gate.sym_size(0),
              "hyperparallel::swiglu_mlp: weights gate ", gate.sym_sizes(), ", up ", up.sym_sizes(), ", down ",
              down.sym_sizes(), " do not chain from input ", x.sym_sizes());
}

std::vector<int64_t> mlp_out_shape(const at::Tensor& x, const at::Tensor& down) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = down.size(0);
  return shape;
}

// Returns (out, [gate | up] activations).
std::tuple<at::Tensor, at::Tensor> mlp_forward_cpu(const at::Tensor& input, const at::Tensor& gate,
                                                   const at::Tensor& up, const at::Tensor& down) {
  check_mlp(input, gate, up, down);
  const at::Tensor x = input.reshape({-1, input.size(-1)}).contiguous();
  const int64_t T = x.size(0), I = gate.size(0);
  at::Tensor gu = at::empty({T, 2 * I}, x.options());
  mm_into(gu.narrow(1, 0, I), x, gate.t());
  mm_into(gu.narrow(1, I, I), x, up.t());
  at::Tensor a = at::empty({T, I}, x.options());
  const auto& k = cpu::kernels();
  at::parallel_for(0, T, row_grain(I), [&](int64_t begin, int64_t end) {
    k.swiglu_forward(x.scalar_type(), elem(gu, begin * 2 * I), elem_mut(a, begin * I), end - begin, I);
  });
  return {product(a, down.t()).view(mlp_out_shape(input, down)), gu};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> mlp_backward_cpu(
    const at::Tensor& grad, const at::Tensor& input, const at::Tensor& gate, const at::Tensor& up,
    const at::Tensor& down, const at::Tensor& gu_in) {
  const at::Tensor x = input.reshape({-1, input.size(-1)}).contiguous();
  const at::Tensor dy = grad.reshape({-1, grad.size(-1)}).contiguous();
  const at::Tensor gu = gu_in.contiguous();
  const int64_t T = x.size(0), I = gate.size(0);
  const at::Tensor da = product(dy, down);
  at::Tensor dgu = at::empty_like(gu), a = at::empty({T, I}, x.options());
  const auto& k = cpu::kernels();
  at::parallel_for(0, T, row_grain(I), [&](int64_t begin, int64_t end) {
    k.swiglu_backward(x.scalar_type(), elem(gu, begin * 2 * I), elem(da, begin * I), nullptr,
                      elem_mut(dgu, begin * 2 * I), elem_mut(a, begin * I), nullptr, end - begin, I);
  });
  const at::Tensor dg = dgu.narrow(1, 0, I), du = dgu.narrow(1, I, I);
  at::Tensor dx = product(dg, gate);
  mm_into(dx, du, up, /*accumulate=*/true);
  return {dx.view(input.sizes()), product(dg.t(), x), product(du.t(), x), product(dy.t(), a)};
}

std::tuple<at::Tensor, at::Tensor> mlp_forward_meta(const at::Tensor& input, const at::Tensor& gate,
                                                    const at::Tensor& up, const at::Tensor& down) {
  check_mlp(input, gate, up, down);
  auto out_shape = input.sym_sizes().vec();
  out_shape.back() = down.sym_size(0);
  c10::SymInt rows = 1;
  for (int64_t d = 0; d + 1 < input.dim(); ++d) rows = rows * input.sym_size(d);
  return {at::empty_symint(out_shape, input.options()),
          at::empty_symint({rows, gate.sym_size(0) * 2}, input.options())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> mlp_backward_meta(
    const at::Tensor& grad, const at::Tensor& input, const at::Tensor& gate, const at::Tensor& up,
    const at::Tensor& down, const at::Tensor& gu) {
  return {at::empty_symint(input.sym_sizes(), input.options()), at::empty_symint(gate.sym_sizes(), gate.options()),
          at::empty_symint(up.sym_sizes(), up.options()), at::empty_symint(down.sym_sizes(), down.options())};
}

using MlpForwardOp = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                        const at::Tensor&);
using MlpBackwardOp = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                                 const at::Tensor&, const at::Tensor&,
                                                                                 const at::Tensor&, const at::Tensor&);

class SwigluMlpFunction : public torch::autograd::Function<SwigluMlpFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input, const at::Tensor& gate,
                            const at::Tensor& up, const at::Tensor& down) {
    static const auto op = detail::op_handle<MlpForwardOp>("swiglu_mlp_forward");
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, gu] = op.call(input, gate, up, down);
    ctx->save_for_backward({input, gate, up, down, gu});
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    static const auto op = detail::op_handle<MlpBackwardOp>("swiglu_mlp_backward");
    const auto s = ctx->get_saved_variables();
    auto [dx, dg, du, dd] = op.call(grads[0], s[0], s[1], s[2], s[3], s[4]);
    return {dx, dg, du, dd};
  }
};

at::Tensor mlp_autograd(const at::Tensor& input, const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down) {
  return SwigluMlpFunction::apply(input, gate, up, down);
}

// ---------------------------------------------------------------------------
// Router.

void check_router(const at::Tensor& x, const at::Tensor& weight, int64_t top_k) {
  detail::check_float_or_bf16(x, "moe_router", "input");
  detail::check_same_dtype(x, weight, "moe_router", "input", "gate.weight");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.sym_size(1) == weight.sym_size(1),
              "hyperparallel::moe_router: input must be (tokens, hidden) and weight (experts, hidden); got ",
              x.sym_sizes(), " and ", weight.sym_sizes());
  TORCH_CHECK(top_k >= 1 && weight.sym_size(0) >= top_k, "hyperparallel::moe_router: top_k = ", top_k,
              " must lie in [1, experts = ", weight.sym_size(0), "]");
}

using RouterOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

RouterOutputs router_cpu(const at::Tensor& input, const at::Tensor& weight, int64_t top_k, bool norm) {
  check_router(input, weight, top_k);
  const at::Tensor logits = product(input, weight.t());
  const int64_t T = logits.size(0), E = logits.size(1);
  at::Tensor scores = at::empty({T, top_k}, input.options());
  at::Tensor index = at::empty({T, top_k}, input.options().dtype(at::kLong));
  const auto& k = cpu::kernels();
  at::parallel_for(0, T, row_grain(E * 8), [&](int64_t begin, int64_t end) {
    k.router_forward(logits.scalar_type(), elem(logits, begin * E), end - begin, E, top_k, norm,
                     elem_mut(scores, begin * top_k), index.mutable_data_ptr<int64_t>() + begin * top_k);
  });
  return {logits, scores, index};
}

std::tuple<at::Tensor, at::Tensor> router_backward_cpu(const at::Tensor& grad_logits, const at::Tensor& grad_scores,
                                                       const at::Tensor& input, const at::Tensor& weight,
                                                       const at::Tensor& logits_in, const at::Tensor& index_in,
                                                       bool norm) {
  const at::Tensor logits = logits_in.contiguous(), index = index_in.contiguous();
  const at::Tensor gl = grad_logits.contiguous();
  const at::Tensor gs = grad_scores.contiguous();
  const int64_t T = logits.size(0), E = logits.size(1), top_k = index.size(1);
  at::Tensor dlogits = at::empty_like(logits);
  const auto& k = cpu::kernels();
  at::parallel_for(0, T, row_grain(E * 8), [&](int64_t begin, int64_t end) {
    k.router_backward(logits.scalar_type(), elem(logits, begin * E), index.const_data_ptr<int64_t>() + begin * top_k,
                      gs.scalar_type(), elem(gs, begin * top_k), elem(gl, begin * E), end - begin, E, top_k, norm,
                      elem_mut(dlogits, begin * E));
  });
  return {product(dlogits, weight), product(dlogits.t(), input)};
}

RouterOutputs router_meta(const at::Tensor& input, const at::Tensor& weight, int64_t top_k, bool norm) {
  check_router(input, weight, top_k);
  const auto T = input.sym_size(0);
  return {at::empty_symint({T, weight.sym_size(0)}, input.options()), at::empty_symint({T, top_k}, input.options()),
          at::empty_symint({T, top_k}, input.options().dtype(at::kLong))};
}

std::tuple<at::Tensor, at::Tensor> router_backward_meta(const at::Tensor& grad_logits, const at::Tensor& grad_scores,
                                                        const at::Tensor& input, const at::Tensor& weight,
                                                        const at::Tensor& logits, const at::Tensor& index, bool norm) {
  return {at::empty_symint(input.sym_sizes(), input.options()), at::empty_symint(weight.sym_sizes(), weight.options())};
}

using RouterOp = RouterOutputs(const at::Tensor&, const at::Tensor&, int64_t, bool);
using RouterBackwardOp = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                            const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                            bool);

class RouterFunction : public torch::autograd::Function<RouterFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                                                const at::Tensor& weight, int64_t top_k, bool norm) {
    // The CPU kernel computes everything; the backward needs no extra output.
    static const auto op = detail::op_handle<RouterOp>("moe_router");
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [logits, scores, index] = op.call(input, weight, top_k, norm);
    ctx->save_for_backward({input, weight, logits, index});
    ctx->saved_data["norm"] = norm;
    ctx->mark_non_differentiable({index});
    return {logits, scores, index};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    static const auto op = detail::op_handle<RouterBackwardOp>("moe_router_backward");
    const auto s = ctx->get_saved_variables();
    auto [dx, dw] = op.call(grads[0], grads[1], s[0], s[1], s[2], s[3], ctx->saved_data["norm"].toBool());
    return {dx, dw, at::Tensor(), at::Tensor()};
  }
};

RouterOutputs router_autograd(const at::Tensor& input, const at::Tensor& weight, int64_t top_k, bool norm) {
  auto outs = RouterFunction::apply(input, weight, top_k, norm);
  return {outs[0], outs[1], outs[2]};
}

// ---------------------------------------------------------------------------
// Experts.

void check_experts(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down, const at::Tensor& index,
                   const at::Tensor& weights) {
  detail::check_float_or_bf16(x, "moe_experts", "input");
  detail::check_same_dtype(x, gate_up, "moe_experts", "input", "experts.gate_up_proj");
  detail::check_same_dtype(x, down, "moe_experts", "input", "experts.down_proj");
  detail::check_float_or_bf16(weights, "moe_experts", "top_k_weights");
  TORCH_CHECK(x.dim() == 2 && gate_up.dim() == 3 && down.dim() == 3 && gate_up.sym_size(2) == x.sym_size(1) &&
                  gate_up.sym_size(1) % 2 == 0 && down.sym_size(0) == gate_up.sym_size(0) &&
                  down.sym_size(1) == x.sym_size(1) && down.sym_size(2) * 2 == gate_up.sym_size(1),
              "hyperparallel::moe_experts: expects input (tokens, hidden), gate_up_proj (experts, 2 * inter, hidden) "
              "and down_proj (experts, hidden, inter) (transformers 5.x layout); got ",
              x.sym_sizes(), ", ", gate_up.sym_sizes(), ", ", down.sym_sizes());
  TORCH_CHECK(index.scalar_type() == at::kLong && index.dim() == 2 && index.sym_size(0) == x.sym_size(0) &&
                  weights.sym_sizes() == index.sym_sizes(),
              "hyperparallel::moe_experts: top_k_index (int64) and top_k_weights must both be (tokens, top_k); got ",
              index.sym_sizes(), " ", index.scalar_type(), " and ", weights.sym_sizes());
}

// Each expert's run of rows [offsets[e], offsets[e + 1]) in the sorted order.
template <class F>
void for_each_expert(const at::Tensor& offsets, F&& f) {
  const int64_t* off = offsets.const_data_ptr<int64_t>();
  for (int64_t e = 0; e + 1 < offsets.numel(); ++e) f(e, off[e], off[e + 1] - off[e]);
}

using ExpertOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// Returns (out, gate_up activations in sorted order, positions, offsets):
// positions[t * top_k + j] is the sorted row of token t's j-th expert.
ExpertOutputs experts_forward_cpu(const at::Tensor& input, const at::Tensor& gate_up_in, const at::Tensor& down_in,
                                  const at::Tensor& index_in, const at::Tensor& weights_in) {
  check_experts(input, gate_up_in, down_in, index_in, weights_in);
  const at::Tensor x = input.contiguous(), gate_up = gate_up_in.contiguous(), down = down_in.contiguous();
  const int64_t T = x.size(0), H = x.size(1), E = gate_up.size(0), I = down.size(2), K = index_in.size(1);
  const at::Tensor index = index_in.contiguous(), weights = weights_in.contiguous();
  const int64_t N = T * K;
  const int64_t* idx = index.const_data_ptr<int64_t>();

  // Counting sort by expert; within an expert, tokens keep their order.
  at::Tensor offsets = at::zeros({E + 1}, index.options());
  at::Tensor positions = at::empty({N}, index.options());
  int64_t* off = offsets.mutable_data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n) {
    TORCH_CHECK(idx[n] >= 0 && idx[n] < E, "hyperparallel::moe_experts: expert index ", idx[n], " is outside [0, ", E,
                "); expert-parallel sentinels are not supported");
    ++off[idx[n] + 1];
  }
  for (int64_t e = 0; e < E; ++e) off[e + 1] += off[e];
  std::vector<int64_t> cursor(off, off + E), token_of_row(N);
  int64_t* pos = positions.mutable_data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n) {
    pos[n] = cursor[idx[n]]++;
    token_of_row[pos[n]] = n / K;
  }

  at::Tensor rows = at::empty({N, H}, x.options());
  gather_rows(x, token_of_row.data(), N, rows);
  at::Tensor gu = at::empty({N, 2 * I}, x.options());
  for_each_expert(offsets, [&](int64_t e, int64_t o, int64_t c) {
    if (c > 0) mm_into(gu.narrow(0, o, c), rows.narrow(0, o, c), gate_up[e].t());
  });
  at::Tensor a = at::empty({N, I}, x.options());
  const auto& k = cpu::kernels();
  at::parallel_for(0, N, row_grain(I), [&](int64_t begin, int64_t end) {
    k.swiglu_forward(x.scalar_type(), elem(gu, begin * 2 * I), elem_mut(a, begin * I), end - begin, I);
  });
  // The gathered input has been used: rows now take each (token, expert)'s output.
  for_each_expert(offsets, [&](int64_t e, int64_t o, int64_t c) {
    if (c > 0) mm_into(rows.narrow(0, o, c), a.narrow(0, o, c), down[e].t());
  });
  at::Tensor out = at::empty({T, H}, x.options());
  at::parallel_for(0, T, row_grain(H * K), [&](int64_t begin, int64_t end) {
    k.gather_sum(x.scalar_type(), rows.const_data_ptr(), pos + begin * K, weights.scalar_type(),
                 elem(weights, begin * K), end - begin, K, H, elem_mut(out, begin * H));
  });
  return {out, gu, positions, offsets};
}

using ExpertGrads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// Returns (d input, d gate_up_proj, d down_proj, d top_k_weights).
ExpertGrads experts_backward_cpu(const at::Tensor& grad_in, const at::Tensor& input, const at::Tensor& gate_up_in,
                                 const at::Tensor& down_in, const at::Tensor& weights_in, const at::Tensor& gu_in,
                                 const at::Tensor& positions, const at::Tensor& offsets) {
  const at::Tensor grad = grad_in.contiguous(), x = input.contiguous(), weights = weights_in.contiguous();
  const at::Tensor gate_up = gate_up_in.contiguous(), down = down_in.contiguous(), gu = gu_in.contiguous();
  const int64_t T = x.size(0), H = x.size(1), I = down.size(2), N = positions.numel(), K = N / std::max<int64_t>(T, 1);
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  std::vector<int64_t> token_of_row(N);
  at::Tensor row_weight = at::empty({N}, x.options().dtype(at::kFloat));
  {
    const at::Tensor w = weights.to(at::kFloat);
    const float* wp = w.const_data_ptr<float>();
    float* rw = row_weight.mutable_data_ptr<float>();
    for (int64_t n = 0; n < N; ++n) {
      token_of_row[pos[n]] = n / K;
      rw[pos[n]] = wp[n];
    }
  }
  const auto& k = cpu::kernels();
  const auto dt = x.scalar_type();

  // rows: first the output gradient per (token, expert), then the gathered
  // input, then the input's gradient per (token, expert).
  at::Tensor rows = at::empty({N, H}, x.options());
  gather_rows(grad, token_of_row.data(), N, rows);
  at::Tensor da = at::empty({N, I}, x.options());
  for_each_expert(offsets, [&](int64_t e, int64_t o, int64_t c) {
    if (c > 0) mm_into(da.narrow(0, o, c), rows.narrow(0, o, c), down[e]);
  });
  at::Tensor dgu = at::empty_like(gu), a_w = at::empty({N, I}, x.options());
  at::Tensor row_dot = at::empty({N}, x.options().dtype(at::kFloat));
  at::parallel_for(0, N, row_grain(I), [&](int64_t begin, int64_t end) {
    k.swiglu_backward(dt, elem(gu, begin * 2 * I), elem(da, begin * I), row_weight.const_data_ptr<float>() + begin,
                      elem_mut(dgu, begin * 2 * I), elem_mut(a_w, begin * I), row_dot.mutable_data_ptr<float>() + begin,
                      end - begin, I);
  });
  at::Tensor d_down = at::empty_like(down);
  for_each_expert(offsets, [&](int64_t e, int64_t o, int64_t c) {
    if (c > 0) {
      mm_into(d_down[e], rows.narrow(0, o, c).t(), a_w.narrow(0, o, c));
    } else {
      d_down[e].zero_();
    }
  });
  gather_rows(x, token_of_row.data(), N, rows);
  at::Tensor d_gate_up = at::empty_like(gate_up);
  for_each_expert(offsets, [&](int64_t e, int64_t o, int64_t c) {
    if (c > 0) {
      mm_into(d_gate_up[e], dgu.narrow(0, o, c).t(), rows.narrow(0, o, c));
      mm_into(rows.narrow(0, o, c), dgu.narrow(0, o, c), gate_up[e]);  // this expert's input rows are done
    } else {
      d_gate_up[e].zero_();
    }
  });
  at::Tensor dx = at::empty_like(x);
  at::parallel_for(0, T, row_grain(H * K), [&](int64_t begin, int64_t end) {
    k.gather_sum(dt, rows.const_data_ptr(), pos + begin * K, at::kFloat, nullptr, end - begin, K, H,
                 elem_mut(dx, begin * H));
  });
  at::Tensor d_weights = row_dot.index_select(0, positions).view(weights.sizes()).to(weights.scalar_type());
  return {dx, d_gate_up, d_down, d_weights};
}

ExpertOutputs experts_forward_meta(const at::Tensor& input, const at::Tensor& gate_up, const at::Tensor& down,
                                   const at::Tensor& index, const at::Tensor& weights) {
  check_experts(input, gate_up, down, index, weights);
  const auto N = index.sym_numel();
  return {at::empty_symint(input.sym_sizes(), input.options()),
          at::empty_symint({N, gate_up.sym_size(1)}, input.options()), at::empty_symint({N}, index.options()),
          at::empty_symint({gate_up.sym_size(0) + 1}, index.options())};
}

ExpertGrads experts_backward_meta(const at::Tensor& grad, const at::Tensor& input, const at::Tensor& gate_up,
                                  const at::Tensor& down, const at::Tensor& weights, const at::Tensor& gu,
                                  const at::Tensor& positions, const at::Tensor& offsets) {
  return {at::empty_symint(input.sym_sizes(), input.options()),
          at::empty_symint(gate_up.sym_sizes(), gate_up.options()), at::empty_symint(down.sym_sizes(), down.options()),
          at::empty_symint(weights.sym_sizes(), weights.options())};
}

using ExpertsForwardOp = ExpertOutputs(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                       const at::Tensor&);
using ExpertsBackwardOp = ExpertGrads(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&);

class ExpertsFunction : public torch::autograd::Function<ExpertsFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input, const at::Tensor& gate_up,
                            const at::Tensor& down, const at::Tensor& index, const at::Tensor& weights) {
    static const auto op = detail::op_handle<ExpertsForwardOp>("moe_experts_forward");
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, gu, positions, offsets] = op.call(input, gate_up, down, index, weights);
    ctx->save_for_backward({input, gate_up, down, weights, gu, positions, offsets});
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    static const auto op = detail::op_handle<ExpertsBackwardOp>("moe_experts_backward");
    const auto s = ctx->get_saved_variables();
    auto [dx, d_gate_up, d_down, d_weights] = op.call(grads[0], s[0], s[1], s[2], s[3], s[4], s[5], s[6]);
    return {dx, d_gate_up, d_down, at::Tensor(), d_weights};
  }
};

at::Tensor experts_autograd(const at::Tensor& input, const at::Tensor& gate_up, const at::Tensor& down,
                            const at::Tensor& index, const at::Tensor& weights) {
  return ExpertsFunction::apply(input, gate_up, down, index, weights);
}

// ---------------------------------------------------------------------------
// Load-balancing loss.

// The attention mask as one float per token, or undefined.
at::Tensor token_mask(const std::optional<at::Tensor>& mask, int64_t tokens) {
  if (!mask.has_value() || !mask->defined()) return {};
  TORCH_CHECK(mask->numel() == tokens, "hyperparallel::moe_aux_loss: attention_mask has ", mask->numel(),
              " elements but the router saw ", tokens, " tokens; pass the (batch, seq) padding mask");
  return mask->reshape({-1}).to(at::kFloat).contiguous();
}

void check_aux(const at::Tensor& logits, int64_t top_k) {
  detail::check_float_or_bf16(logits, "moe_aux_loss", "router_logits");
  TORCH_CHECK(logits.dim() == 3 && logits.sym_size(0) > 0,
              "hyperparallel::moe_aux_loss: router_logits must be (layers, tokens, experts) with at least one layer; "
              "got ",
              logits.sym_sizes());
  TORCH_CHECK(top_k >= 1 && logits.sym_size(2) >= top_k, "hyperparallel::moe_aux_loss: top_k = ", top_k,
              " must lie in [1, experts = ", logits.sym_size(2), "]");
}

// Returns (loss, coef) with coef[e] = d loss / d (a token's probability of e),
// before the token's mask weight.
std::tuple<at::Tensor, at::Tensor> aux_forward_cpu(const at::Tensor& logits_in, int64_t top_k,
                                                   const std::optional<at::Tensor>& attention_mask) {
  check_aux(logits_in, top_k);
  const at::Tensor logits = logits_in.contiguous();
  const int64_t L = logits.size(0), T = logits.size(1), E = logits.size(2);
  const at::Tensor mask = token_mask(attention_mask, T);
  const float* m = mask.defined() ? mask.const_data_ptr<float>() : nullptr;
  std::vector<double> counts(E, 0.0), probs(E, 0.0);
  const auto& k = cpu::kernels();
  for (int64_t l = 0; l < L; ++l) {
    k.aux_loss_accumulate(logits.scalar_type(), elem(logits, l * T * E), T, E, top_k, m, counts.data(), probs.data());
  }
  const double rows = static_cast<double>(L) * (mask.defined() ? mask.sum().item<double>() : static_cast<double>(T));
  double loss = 0.0;
  at::Tensor coef = at::empty({E}, logits.options().dtype(at::kFloat));
  for (int64_t e = 0; e < E; ++e) {
    loss += (counts[e] / rows) * (probs[e] / rows);
    coef.mutable_data_ptr<float>()[e] = static_cast<float>(E * counts[e] / (rows * rows));
  }
  return {at::scalar_tensor(static_cast<float>(loss * E), logits.options().dtype(at::kFloat)), coef};
}

at::Tensor aux_backward_cpu(const at::Tensor& grad, const at::Tensor& logits_in, const at::Tensor& coef_in,
                            const std::optional<at::Tensor>& attention_mask) {
  const at::Tensor logits = logits_in.contiguous();
  const int64_t L = logits.size(0), T = logits.size(1), E = logits.size(2);
  const at::Tensor mask = token_mask(attention_mask, T);
  const at::Tensor coef = (coef_in * grad.to(at::kFloat)).contiguous();
  at::Tensor dlogits = at::empty_like(logits);
  const auto& k = cpu::kernels();
  at::parallel_for(0, L * T, row_grain(E * 8), [&](int64_t begin, int64_t end) {
    // Row ranges may span layers; the mask repeats per layer.
    for (int64_t r = begin; r < end;) {
      const int64_t t = r % T, n = std::min(end - r, T - t);
      k.aux_loss_backward(logits.scalar_type(), elem(logits, r * E), n, E, coef.const_data_ptr<float>(),
                          mask.defined() ? mask.const_data_ptr<float>() + t : nullptr, elem_mut(dlogits, r * E));
      r += n;
    }
  });
  return dlogits;
}

std::tuple<at::Tensor, at::Tensor> aux_forward_meta(const at::Tensor& logits, int64_t top_k,
                                                    const std::optional<at::Tensor>& attention_mask) {
  check_aux(logits, top_k);
  const auto f32 = logits.options().dtype(at::kFloat);
  return {at::empty({}, f32), at::empty_symint({logits.sym_size(2)}, f32)};
}

at::Tensor aux_backward_meta(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& coef,
                             const std::optional<at::Tensor>& attention_mask) {
  return at::empty_symint(logits.sym_sizes(), logits.options());
}

using AuxForwardOp = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, int64_t, const std::optional<at::Tensor>&);
using AuxBackwardOp = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const std::optional<at::Tensor>&);

class AuxLossFunction : public torch::autograd::Function<AuxLossFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& logits, int64_t top_k,
                            const std::optional<at::Tensor>& attention_mask) {
    static const auto op = detail::op_handle<AuxForwardOp>("moe_aux_loss_forward");
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [loss, coef] = op.call(logits, top_k, attention_mask);
    ctx->save_for_backward({logits, coef, attention_mask.value_or(at::Tensor())});
    return loss;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    static const auto op = detail::op_handle<AuxBackwardOp>("moe_aux_loss_backward");
    const auto s = ctx->get_saved_variables();
    const std::optional<at::Tensor> mask = s[2].defined() ? std::optional<at::Tensor>(s[2]) : std::nullopt;
    return {op.call(grads[0], s[0], s[1], mask), at::Tensor(), at::Tensor()};
  }
};

at::Tensor aux_autograd(const at::Tensor& logits, int64_t top_k, const std::optional<at::Tensor>& attention_mask) {
  return AuxLossFunction::apply(logits, top_k, attention_mask);
}

}  // namespace

at::Tensor swiglu_mlp(const at::Tensor& input, const at::Tensor& gate_weight, const at::Tensor& up_weight,
                      const at::Tensor& down_weight) {
  static const auto op =
      detail::op_handle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>(
          "swiglu_mlp");
  return op.call(input, gate_weight, up_weight, down_weight);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_router(const at::Tensor& input, const at::Tensor& weight,
                                                          int64_t top_k, bool norm_topk_prob) {
  static const auto op = detail::op_handle<RouterOp>("moe_router");
  return op.call(input, weight, top_k, norm_topk_prob);
}

at::Tensor moe_experts(const at::Tensor& input, const at::Tensor& gate_up_proj, const at::Tensor& down_proj,
                       const at::Tensor& top_k_index, const at::Tensor& top_k_weights) {
  static const auto op = detail::op_handle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                      const at::Tensor&, const at::Tensor&)>("moe_experts");
  return op.call(input, gate_up_proj, down_proj, top_k_index, top_k_weights);
}

at::Tensor moe_aux_loss(const at::Tensor& router_logits, int64_t top_k,
                        const std::optional<at::Tensor>& attention_mask) {
  static const auto op =
      detail::op_handle<at::Tensor(const at::Tensor&, int64_t, const std::optional<at::Tensor>&)>("moe_aux_loss");
  return op.call(router_logits, top_k, attention_mask);
}

}  // namespace hp::ops

TORCH_LIBRARY_FRAGMENT(hyperparallel, m) {
  m.def("swiglu_mlp(Tensor input, Tensor gate_weight, Tensor up_weight, Tensor down_weight) -> Tensor");
  m.def(
      "swiglu_mlp_forward(Tensor input, Tensor gate_weight, Tensor up_weight, Tensor down_weight) -> (Tensor, Tensor)");
  m.def(
      "swiglu_mlp_backward(Tensor grad, Tensor input, Tensor gate_weight, Tensor up_weight, Tensor down_weight, "
      "Tensor gate_up) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("moe_router(Tensor input, Tensor weight, int top_k, bool norm_topk_prob) -> (Tensor, Tensor, Tensor)");
  m.def(
      "moe_router_backward(Tensor grad_logits, Tensor grad_scores, Tensor input, Tensor weight, Tensor logits, "
      "Tensor index, bool norm_topk_prob) -> (Tensor, Tensor)");
  m.def(
      "moe_experts(Tensor input, Tensor gate_up_proj, Tensor down_proj, Tensor top_k_index, Tensor top_k_weights) "
      "-> Tensor");
  m.def(
      "moe_experts_forward(Tensor input, Tensor gate_up_proj, Tensor down_proj, Tensor top_k_index, "
      "Tensor top_k_weights) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "moe_experts_backward(Tensor grad, Tensor input, Tensor gate_up_proj, Tensor down_proj, Tensor top_k_weights, "
      "Tensor gate_up, Tensor positions, Tensor offsets) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("moe_aux_loss(Tensor router_logits, int top_k, Tensor? attention_mask) -> Tensor");
  m.def("moe_aux_loss_forward(Tensor router_logits, int top_k, Tensor? attention_mask) -> (Tensor, Tensor)");
  m.def("moe_aux_loss_backward(Tensor grad, Tensor router_logits, Tensor coef, Tensor? attention_mask) -> Tensor");
}

TORCH_LIBRARY_IMPL(hyperparallel, CPU, m) {
  m.impl("swiglu_mlp", [](const at::Tensor& x, const at::Tensor& g, const at::Tensor& u, const at::Tensor& d) {
    return std::get<0>(hp::ops::mlp_forward_cpu(x, g, u, d));
  });
  m.impl("swiglu_mlp_forward", &hp::ops::mlp_forward_cpu);
  m.impl("swiglu_mlp_backward", &hp::ops::mlp_backward_cpu);
  m.impl("moe_router", &hp::ops::router_cpu);
  m.impl("moe_router_backward", &hp::ops::router_backward_cpu);
  m.impl("moe_experts", [](const at::Tensor& x, const at::Tensor& gu, const at::Tensor& d, const at::Tensor& i,
                           const at::Tensor& w) { return std::get<0>(hp::ops::experts_forward_cpu(x, gu, d, i, w)); });
  m.impl("moe_experts_forward", &hp::ops::experts_forward_cpu);
  m.impl("moe_experts_backward", &hp::ops::experts_backward_cpu);
  m.impl("moe_aux_loss", [](const at::Tensor& l, int64_t k, const std::optional<at::Tensor>& mask) {
    return std::get<0>(hp::ops::aux_forward_cpu(l, k, mask));
  });
  m.impl("moe_aux_loss_forward", &hp::ops::aux_forward_cpu);
  m.impl("moe_aux_loss_backward", &hp::ops::aux_backward_cpu);
}

TORCH_LIBRARY_IMPL(hyperparallel, Meta, m) {
  m.impl("swiglu_mlp", [](const at::Tensor& x, const at::Tensor& g, const at::Tensor& u, const at::Tensor& d) {
    return std::get<0>(hp::ops::mlp_forward_meta(x, g, u, d));
  });
  m.impl("swiglu_mlp_forward", &hp::ops::mlp_forward_meta);
  m.impl("swiglu_mlp_backward", &hp::ops::mlp_backward_meta);
  m.impl("moe_router", &hp::ops::router_meta);
  m.impl("moe_router_backward", &hp::ops::router_backward_meta);
  m.impl("moe_experts", [](const at::Tensor& x, const at::Tensor& gu, const at::Tensor& d, const at::Tensor& i,
                           const at::Tensor& w) { return std::get<0>(hp::ops::experts_forward_meta(x, gu, d, i, w)); });
  m.impl("moe_experts_forward", &hp::ops::experts_forward_meta);
  m.impl("moe_experts_backward", &hp::ops::experts_backward_meta);
  m.impl("moe_aux_loss", [](const at::Tensor& l, int64_t k, const std::optional<at::Tensor>& mask) {
    return std::get<0>(hp::ops::aux_forward_meta(l, k, mask));
  });
  m.impl("moe_aux_loss_forward", &hp::ops::aux_forward_meta);
  m.impl("moe_aux_loss_backward", &hp::ops::aux_backward_meta);
}

TORCH_LIBRARY_IMPL(hyperparallel, Autograd, m) {
  m.impl("swiglu_mlp", &hp::ops::mlp_autograd);
  m.impl("moe_router", &hp::ops::router_autograd);
  m.impl("moe_experts", &hp::ops::experts_autograd);
  m.impl("moe_aux_loss", &hp::ops::aux_autograd);
}
