// The MoE block's ops and the gated MLP on CUDA (the schemas, autograd and
// CPU kernels are moe.cpp's). The GEMMs are cuBLAS's / CUTLASS's through
// ATen: the experts as torch._grouped_mm over tokens sorted by expert, no
// loop over experts and no host synchronisation; between them one kernel
// each for SwiGLU (forward; backward with the routing weight's gradient) and
// for the weighted sum of a token's k expert rows (kernels.cu).
//
// The experts' backward needs no second pass over the down projection's
// output: the routing weight's gradient dot(grad_t, y_tk) equals
// dot(grad_t down_e, a_tk), a row sum the SwiGLU backward kernel forms anyway.
// Linked where torch has CUDA; reaches CUDA through c10.
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include "common.h"
#include "cuda_glue.h"

namespace hp::ops {
namespace {

using detail::cuda_dtype;
using detail::check_same_device;
using detail::cuda_stream;

at::Tensor swiglu(const at::Tensor& gu_in) {
  // torch._grouped_mm may pad its output's rows; the kernel reads dense ones.
  const at::Tensor gu = gu_in.contiguous();
  const int64_t rows = gu.size(0), inter = gu.size(1) / 2;
  at::Tensor a = at::empty({rows, inter}, gu.options());
  cuda::swiglu_forward(cuda_dtype(gu), gu.const_data_ptr(), a.mutable_data_ptr(), rows, inter, cuda_stream(gu));
  return a;
}

// out[t] = sum_j w[t, j] * rows[positions[t * k + j]] (w undefined: all ones).
at::Tensor gather_sum(const at::Tensor& rows, const at::Tensor& positions, const at::Tensor& w, int64_t tokens,
                      int64_t k) {
  const at::Tensor src = rows.contiguous();
  const int64_t hidden = src.size(1);
  at::Tensor out = at::empty({tokens, hidden}, src.options());
  cuda::gather_sum(cuda_dtype(src), src.const_data_ptr(), positions.const_data_ptr<int64_t>(),
                   w.defined() ? cuda_dtype(w) : cuda::DType::F32, w.defined() ? w.const_data_ptr() : nullptr, tokens,
                   k, hidden, out.mutable_data_ptr(), cuda_stream(src));
  return out;
}

// ---------------------------------------------------------------------------
// Gated MLP: [gate | up] as one GEMM against the two weights stacked.

std::tuple<at::Tensor, at::Tensor> mlp_forward_cuda(const at::Tensor& input, const at::Tensor& gate,
                                                    const at::Tensor& up, const at::Tensor& down) {
  detail::check_float_or_bf16(input, "swiglu_mlp", "input");
  check_same_device({&input, &gate, &up, &down}, "swiglu_mlp");
  c10::DeviceGuard guard(input.device());
  const at::Tensor x = input.reshape({-1, input.size(-1)});
  const at::Tensor gu = at::mm(x, at::cat({gate, up}, 0).t());
  auto out_shape = input.sizes().vec();
  out_shape.back() = down.size(0);
  return {at::mm(swiglu(gu), down.t()).view(out_shape), gu};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> mlp_backward_cuda(const at::Tensor& grad,
                                                                             const at::Tensor& input,
                                                                             const at::Tensor& gate,
                                                                             const at::Tensor& up,
                                                                             const at::Tensor& down,
                                                                             const at::Tensor& gu_in) {
  c10::DeviceGuard guard(input.device());
  const at::Tensor x = input.reshape({-1, input.size(-1)});
  const at::Tensor dy = grad.reshape({-1, grad.size(-1)}).to(x.scalar_type());
  const at::Tensor gu = gu_in.contiguous(), da = at::mm(dy, down).contiguous();
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  at::Tensor dgu = at::empty_like(gu), a = at::empty({T, I}, gu.options());
  cuda::swiglu_backward(cuda_dtype(gu), gu.const_data_ptr(), da.const_data_ptr(), nullptr, dgu.mutable_data_ptr(),
                        a.mutable_data_ptr(), nullptr, T, I, cuda_stream(gu));
  const at::Tensor d_stacked = at::mm(dgu.t(), x);  // (2I, hidden): gate's rows, then up's
  return {at::mm(dgu, at::cat({gate, up}, 0)).view(input.sizes()), d_stacked.narrow(0, 0, I),
          d_stacked.narrow(0, I, I), at::mm(dy.t(), a)};
}

// ---------------------------------------------------------------------------
// Router: HF's arithmetic (float32 softmax, top k, renormalised), as ATen ops.

std::tuple<at::Tensor, at::Tensor, at::Tensor> router_cuda(const at::Tensor& input, const at::Tensor& weight,
                                                           int64_t top_k, bool norm) {
  detail::check_float_or_bf16(input, "moe_router", "input");
  detail::check_same_dtype(input, weight, "moe_router", "input", "gate.weight");
  check_same_device({&input, &weight}, "moe_router");
  TORCH_CHECK(top_k >= 1 && weight.size(0) >= top_k, "hyperparallel::moe_router: top_k = ", top_k,
              " must lie in [1, experts = ", weight.size(0), "]");
  c10::DeviceGuard guard(input.device());
  at::Tensor logits = at::mm(input, weight.t());
  auto [values, index] = at::topk(at::softmax(logits, -1, at::kFloat), top_k, -1);
  if (norm) values = values / values.sum(-1, /*keepdim=*/true);
  return {logits, values.to(logits.scalar_type()), index};
}

std::tuple<at::Tensor, at::Tensor> router_backward_cuda(const at::Tensor& grad_logits, const at::Tensor& grad_scores,
                                                        const at::Tensor& input, const at::Tensor& weight,
                                                        const at::Tensor& logits, const at::Tensor& index,
                                                        bool norm) {
  c10::DeviceGuard guard(input.device());
  const at::Tensor p = at::softmax(logits, -1, at::kFloat);
  const at::Tensor chosen = p.gather(-1, index);
  at::Tensor dv = grad_scores.defined() ? grad_scores.to(at::kFloat) : at::zeros_like(chosen);
  if (norm) {
    // s_j = v_j / sum(v): dv_j <- (ds_j - sum_i ds_i s_i) / sum(v).
    const at::Tensor sum = chosen.sum(-1, /*keepdim=*/true);
    dv = (dv - (dv * chosen / sum).sum(-1, /*keepdim=*/true)) / sum;
  }
  const at::Tensor dp = at::zeros_like(p).scatter_(-1, index, dv);
  at::Tensor dlogits = p * (dp - (chosen * dv).sum(-1, /*keepdim=*/true));
  if (grad_logits.defined()) dlogits = dlogits + grad_logits.to(at::kFloat);
  dlogits = dlogits.to(logits.scalar_type());
  return {at::mm(dlogits, weight), at::mm(dlogits.t(), input)};
}

// ---------------------------------------------------------------------------
// HF's load-balancing loss over stacked router logits (layers, tokens,
// experts): loss = E * sum_e (count_e / rows) (prob_e / rows), where count_e
// counts the rows that chose e among their top k, prob_e sums softmax(logits)
// in the logits' dtype, and rows are the unmasked (layer, token) pairs.
// Returns the loss and d loss / d prob_e (per unmasked row), which is all the
// backward needs besides the logits.

at::Tensor row_mask(const std::optional<at::Tensor>& mask, int64_t tokens) {
  if (!mask.has_value() || !mask->defined()) return {};
  TORCH_CHECK(mask->numel() == tokens, "hyperparallel::moe_aux_loss: attention_mask has ", mask->numel(),
              " elements but the router saw ", tokens, " tokens; pass the (batch, seq) padding mask");
  return mask->reshape({1, tokens, 1}).to(at::kFloat);
}

std::tuple<at::Tensor, at::Tensor> aux_forward_cuda(const at::Tensor& logits, int64_t top_k,
                                                    const std::optional<at::Tensor>& attention_mask) {
  detail::check_float_or_bf16(logits, "moe_aux_loss", "router_logits");
  TORCH_CHECK(logits.dim() == 3 && logits.size(0) > 0 && top_k >= 1 && logits.size(2) >= top_k,
              "hyperparallel::moe_aux_loss: router_logits must be (layers, tokens, experts) and top_k = ", top_k,
              " in [1, experts]; got ", logits.sizes());
  c10::DeviceGuard guard(logits.device());
  const int64_t L = logits.size(0), T = logits.size(1), E = logits.size(2);
  const at::Tensor p = at::softmax(logits, -1);
  at::Tensor chosen = at::zeros(logits.sizes(), logits.options().dtype(at::kFloat))
                          .scatter_(-1, std::get<1>(at::topk(p, top_k, -1)), 1.0);
  at::Tensor probs = p.to(at::kFloat);
  const at::Tensor mask = row_mask(attention_mask, T);
  at::Tensor rows = at::scalar_tensor(double(L * T), probs.options());
  if (mask.defined()) {
    chosen = chosen * mask;
    probs = probs * mask;
    rows = mask.sum() * double(L);
  }
  const std::vector<int64_t> rows_dims{0, 1};
  const at::Tensor counts = chosen.sum(rows_dims), prob_sums = probs.sum(rows_dims);
  const at::Tensor coef = counts * (double(E) / (rows * rows));
  return {(coef * prob_sums).sum(), coef};
}

at::Tensor aux_backward_cuda(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& coef,
                             const std::optional<at::Tensor>& attention_mask) {
  c10::DeviceGuard guard(logits.device());
  const at::Tensor p = at::softmax(logits, -1).to(at::kFloat);
  at::Tensor dp = (coef * grad.to(at::kFloat)).expand_as(p);
  const at::Tensor mask = row_mask(attention_mask, logits.size(1));
  if (mask.defined()) dp = dp * mask;
  return (p * (dp - (p * dp).sum(-1, /*keepdim=*/true))).to(logits.scalar_type());
}

// ---------------------------------------------------------------------------
// Experts. Rows are (token, slot) pairs sorted by expert (stable: a token's
// pairs keep their order within an expert); positions[n] is the sorted row of
// pair n, offsets[e] the first row of expert e (offsets[E] = rows), as on the
// CPU. torch._grouped_mm takes each expert's last row + 1 as int32.

at::Tensor group_ends(const at::Tensor& offsets) { return offsets.narrow(0, 1, offsets.size(0) - 1).to(at::kInt); }

// An expert without rows sums nothing, and not every architecture's grouped
// GEMM writes an empty group: its weight gradient is zeroed here, without a
// host sync and without touching the other experts' (a mask would read and
// write the whole stack).
at::Tensor& zero_idle(at::Tensor& grads, const at::Tensor& offsets) {
  const int64_t E = grads.size(0);
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.dim() == 1 && offsets.numel() == E + 1 &&
                  offsets.device() == grads.device(),
              "hyperparallel::moe_experts_backward: offsets must be the forward's (int64, experts + 1 of them, on ",
              grads.device(), "); got ", offsets.scalar_type(), " ", offsets.sizes(), " on ", offsets.device());
  if (!grads.is_contiguous() || E > 65535)  // a padded output (torch's, never seen here) or a grid too tall
    return grads.masked_fill_(offsets.narrow(0, 1, E).eq(offsets.narrow(0, 0, E)).view({E, 1, 1}), 0);
  const at::Tensor bounds = offsets.contiguous();
  cuda::zero_idle_groups(grads.mutable_data_ptr(), bounds.const_data_ptr<int64_t>(), E,
                         grads.numel() / std::max<int64_t>(E, 1) * grads.element_size(), cuda_stream(grads));
  return grads;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> experts_forward_cuda(const at::Tensor& input,
                                                                                const at::Tensor& gate_up,
                                                                                const at::Tensor& down,
                                                                                const at::Tensor& index,
                                                                                const at::Tensor& weights) {
  detail::check_float_or_bf16(input, "moe_experts", "input");
  detail::check_same_dtype(input, gate_up, "moe_experts", "input", "experts.gate_up_proj");
  detail::check_same_dtype(input, down, "moe_experts", "input", "experts.down_proj");
  detail::check_float_or_bf16(weights, "moe_experts", "top_k_weights");
  check_same_device({&input, &gate_up, &down, &index, &weights}, "moe_experts");
  TORCH_CHECK(input.dim() == 2 && gate_up.dim() == 3 && down.dim() == 3 && gate_up.size(2) == input.size(1) &&
                  down.size(1) == input.size(1) && down.size(2) * 2 == gate_up.size(1) &&
                  down.size(0) == gate_up.size(0) && index.scalar_type() == at::kLong && index.dim() == 2 &&
                  index.size(0) == input.size(0) && weights.sizes() == index.sizes(),
              "hyperparallel::moe_experts: expects input (tokens, hidden), gate_up_proj (experts, 2 * inter, hidden), "
              "down_proj (experts, hidden, inter), top_k_index (int64) and top_k_weights (tokens, top_k); got ",
              input.sizes(), ", ", gate_up.sizes(), ", ", down.sizes(), ", ", index.sizes(), ", ", weights.sizes());
  // torch._grouped_mm reads rows 16 bytes at a time (and pads its outputs'
  // rows to 16 bytes otherwise, which the meta kernels do not declare).
  const int64_t per_16_bytes = 16 / int64_t(input.element_size());
  TORCH_CHECK(input.size(1) % per_16_bytes == 0 && down.size(2) % per_16_bytes == 0,
              "hyperparallel::moe_experts on CUDA: torch._grouped_mm needs hidden_size and moe_intermediate_size to "
              "be multiples of ", per_16_bytes, " for ", input.scalar_type(), "; got ", input.size(1), " and ",
              down.size(2), ". Run HF's experts for this model instead: model.set_experts_implementation(\"eager\")");
  c10::DeviceGuard guard(input.device());
  const int64_t T = input.size(0), K = index.size(1), E = gate_up.size(0);
  // int32 keys: the radix sort passes over 32 bits, not 64 (experts < 2^31).
  const at::Tensor flat = index.reshape(-1).to(at::kInt);
  auto [sorted, order] = at::sort(flat, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  at::Tensor positions = at::empty_like(order).scatter_(0, order, at::arange(order.size(0), order.options()));
  // Expert boundaries without a host sync: the first sorted row of each
  // expert. Indices must lie in [0, E) (checking would cost a sync; the CPU
  // kernel refuses others, and patch() leaves expert-parallel experts, whose
  // sentinels lie outside, to HF).
  const at::Tensor offsets = at::searchsorted(sorted, at::arange(E + 1, sorted.options()));
  const at::Tensor ends = group_ends(offsets);
  const at::Tensor rows = input.index_select(0, at::floor_divide(order, K));
  const at::Tensor gu = at::_grouped_mm(rows, gate_up.transpose(1, 2), ends);
  const at::Tensor y = at::_grouped_mm(swiglu(gu), down.transpose(1, 2), ends);
  return {gather_sum(y, positions, weights.contiguous(), T, K), gu, positions, offsets};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> experts_backward_cuda(
    const at::Tensor& grad, const at::Tensor& input, const at::Tensor& gate_up, const at::Tensor& down,
    const at::Tensor& weights, const at::Tensor& gu_in, const at::Tensor& positions, const at::Tensor& offsets) {
  c10::DeviceGuard guard(input.device());
  const at::Tensor gu = gu_in.contiguous();
  const int64_t T = input.size(0), N = positions.numel(), K = N / std::max<int64_t>(T, 1), I = down.size(2);
  const at::Tensor ends = group_ends(offsets);
  // order[row] = the pair in sorted row `row`: positions inverted.
  const at::Tensor order = at::empty_like(positions).scatter_(0, positions, at::arange(N, positions.options()));
  const at::Tensor token = at::floor_divide(order, K);
  const at::Tensor row_weight = weights.reshape(-1).to(at::kFloat).index_select(0, order).contiguous();
  const at::Tensor g_rows = grad.to(input.scalar_type()).index_select(0, token);
  const at::Tensor da = at::_grouped_mm(g_rows, down, ends).contiguous();
  at::Tensor dgu = at::empty_like(gu), a_w = at::empty({N, I}, gu.options());
  at::Tensor row_dot = at::empty({N}, gu.options().dtype(at::kFloat));
  cuda::swiglu_backward(cuda_dtype(gu), gu.const_data_ptr(), da.const_data_ptr(), row_weight.const_data_ptr<float>(),
                        dgu.mutable_data_ptr(), a_w.mutable_data_ptr(), row_dot.mutable_data_ptr<float>(), N, I,
                        cuda_stream(gu));
  // The weights' gradients group the sums by expert (torch._grouped_mm's
  // 2-D x 2-D form).
  at::Tensor d_down = at::_grouped_mm(g_rows.t(), a_w, ends);
  zero_idle(d_down, offsets);
  const at::Tensor rows = input.index_select(0, token);
  at::Tensor d_gate_up = at::_grouped_mm(dgu.t(), rows, ends);
  zero_idle(d_gate_up, offsets);
  const at::Tensor dx_rows = at::_grouped_mm(dgu, gate_up, ends);
  at::Tensor dx = gather_sum(dx_rows, positions, at::Tensor(), T, K);
  at::Tensor d_weights = row_dot.index_select(0, positions).view(weights.sizes()).to(weights.scalar_type());
  return {dx, d_gate_up, d_down, d_weights};
}

}  // namespace
}  // namespace hp::ops

TORCH_LIBRARY_IMPL(hyperparallel, CUDA, m) {
  m.impl("swiglu_mlp", [](const at::Tensor& x, const at::Tensor& g, const at::Tensor& u, const at::Tensor& d) {
    return std::get<0>(hp::ops::mlp_forward_cuda(x, g, u, d));
  });
  m.impl("swiglu_mlp_forward", &hp::ops::mlp_forward_cuda);
  m.impl("swiglu_mlp_backward", &hp::ops::mlp_backward_cuda);
  m.impl("moe_router", &hp::ops::router_cuda);
  m.impl("moe_router_backward", &hp::ops::router_backward_cuda);
  m.impl("moe_experts", [](const at::Tensor& x, const at::Tensor& gu, const at::Tensor& d, const at::Tensor& i,
                           const at::Tensor& w) { return std::get<0>(hp::ops::experts_forward_cuda(x, gu, d, i, w)); });
  m.impl("moe_experts_forward", &hp::ops::experts_forward_cuda);
  m.impl("moe_experts_backward", &hp::ops::experts_backward_cuda);
  m.impl("moe_aux_loss", [](const at::Tensor& l, int64_t k, const std::optional<at::Tensor>& mask) {
    return std::get<0>(hp::ops::aux_forward_cuda(l, k, mask));
  });
  m.impl("moe_aux_loss_forward", &hp::ops::aux_forward_cuda);
  m.impl("moe_aux_loss_backward", &hp::ops::aux_backward_cuda);
}
