// Fused modules of HuggingFace Qwen3 / Qwen3-MoE as torch custom ops
// (torch.ops.hyperparallel.*), with autograd in C++: these functions go
// through the dispatcher, so they differentiate and compile like ATen ops.
// Storage is float32 or bfloat16; arithmetic between the GEMMs is float32.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace hp::ops {

// HF's RMSNorm: weight * cast(input * rsqrt(mean(input^2) + eps)) over the last
// dim, computed in float32, cast to input's dtype before the weight.
at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps);

// q/k RMSNorm, rotate-half RoPE and causal scaled-dot-product attention with
// grouped kv heads. q: (batch, seq, heads, head_dim); k, v: (batch, seq,
// kv_heads, head_dim), as the projections leave them; cos, sin: (1 or batch,
// seq, head_dim); mask: optional (1 or batch, 1, seq, seq), bool (true =
// attend) or additive, applied on top of causality. Returns the attention
// output (batch, seq, heads, head_dim) and k after norm and RoPE, laid out
// (batch, kv_heads, seq, head_dim) as a KV cache keeps it.
std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                             const at::Tensor& q_norm_weight, const at::Tensor& k_norm_weight,
                                             const at::Tensor& cos, const at::Tensor& sin,
                                             const std::optional<at::Tensor>& mask, double q_eps, double k_eps,
                                             double scale);

// nn.Linear: input weight^T + bias, input (..., in), weight (out, in). Float32
// runs on the fused ops' AVX-512 GEMM (torch's float32 mm is MKL's, which
// takes its AVX2 path on non-Intel CPUs); other dtypes on ATen's.
at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias);

// down(silu(input gate^T) * input up^T): HF's gated MLP.
at::Tensor swiglu_mlp(const at::Tensor& input, const at::Tensor& gate_weight, const at::Tensor& up_weight,
                      const at::Tensor& down_weight);

// HF's top-k router on (tokens, hidden): logits = input weight^T, softmax in
// float32, top k, renormalised when norm_topk_prob. Returns (logits, scores
// in input's dtype, expert indices).
std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_router(const at::Tensor& input, const at::Tensor& weight,
                                                          int64_t top_k, bool norm_topk_prob);

// The experts of a sparse MoE block, HF 5.x layout: gate_up_proj (experts,
// 2 * inter, hidden) with gate rows first, down_proj (experts, hidden, inter).
// Tokens are sorted by expert and each expert runs two GEMMs.
at::Tensor moe_experts(const at::Tensor& input, const at::Tensor& gate_up_proj, const at::Tensor& down_proj,
                       const at::Tensor& top_k_index, const at::Tensor& top_k_weights);

// HF's load-balancing loss (load_balancing_loss_func) over stacked router
// logits (layers, tokens, experts); attention_mask (batch, seq) excludes padding.
at::Tensor moe_aux_loss(const at::Tensor& router_logits, int64_t top_k,
                        const std::optional<at::Tensor>& attention_mask);

}  // namespace hp::ops
