// Row kernels of the fused modules: the elementwise and reduction work that
// sits between the GEMMs. Each is compiled once per instruction-set tier
// (simd/foreach_isa.h) and the tier simd::isa() names runs, so the extension
// needs no -march flags. Storage is float32 or bfloat16 (`type`); arithmetic
// is always float32.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

namespace hp::ops::cpu {

// norm_rope keeps a head row on the stack.
constexpr int64_t kMaxHeadDim = 1024;

struct Kernels {
  // dst = float(src) / dst = round-to-nearest-even(src) for n elements.
  void (*to_float)(c10::ScalarType type, const void* src, float* dst, int64_t n);
  void (*from_float)(c10::ScalarType type, const float* src, void* dst, int64_t n);
  float (*dot)(const float* a, const float* b, int64_t n);

  // HF's RMSNorm on `rows` rows of n: y = w * cast_x(x * rstd), rstd = 1/sqrt(mean(x^2) + eps).
  void (*rms_norm_forward)(c10::ScalarType xt, const void* x, c10::ScalarType wt, const void* w, c10::ScalarType yt,
                           void* y, float* rstd, int64_t rows, int64_t n, float eps);
  // dx for those rows; dw_acc (n floats) accumulates sum(dy * cast_x(x * rstd)).
  void (*rms_norm_backward)(c10::ScalarType yt, const void* dy, c10::ScalarType xt, const void* x, c10::ScalarType wt,
                            const void* w, const float* rstd, void* dx, float* dw_acc, int64_t rows, int64_t n);

  // One head row of q or k: RMSNorm (as above) then HF's rotate-half RoPE with
  // this position's cos/sin; out is float32. Returns rstd.
  float (*norm_rope)(c10::ScalarType t, const void* x, const void* w, const float* cos, const float* sin, float eps,
                     int64_t d, float* out);
  // The row's gradient: g (float32, w.r.t. norm_rope's out) -> dx (type t); dw_acc += the weight's share.
  void (*norm_rope_backward)(c10::ScalarType t, const float* g, const void* x, const void* w, const float* cos,
                             const float* sin, float rstd, int64_t d, void* dx, float* dw_acc);

  // Attention row of n_total scores of which the first n_valid may be seen:
  // s <- softmax(s * scale + add) over those (add may be null), zeros after.
  // Returns the log-sum-exp, or +inf when every score is masked (row of zeros).
  float (*softmax_row)(float* s, int64_t n_valid, int64_t n_total, float scale, const float* add);
  // Backward of that row from its scores: s <- p, dp <- scale * p * (dp - dot(dO, O)).
  void (*softmax_backward_row)(float* s, float* dp, int64_t n_valid, int64_t n_total, float scale, const float* add,
                               float lse, float d_o_dot_o);

  // SwiGLU on rows of [gate | up] (2 * inter wide): a = silu(gate) * up.
  void (*swiglu_forward)(c10::ScalarType t, const void* gu, void* a, int64_t rows, int64_t inter);
  // Given da (the gradient of a, before the row's routing weight w; w = 1 when
  // row_weight is null): dgu, a_w = w * a, and row_dot = dot(da, a).
  void (*swiglu_backward)(c10::ScalarType t, const void* gu, const void* da, const float* row_weight, void* dgu,
                          void* a_w, float* row_dot, int64_t rows, int64_t inter);

  // out[t] = sum_j w[t, j] * src[pos[t * k + j]] over H columns (w may be null: all ones).
  void (*gather_sum)(c10::ScalarType t, const void* src, const int64_t* pos, c10::ScalarType wt, const void* w,
                     int64_t tokens, int64_t k, int64_t hidden, void* out);

  // Router rows: p = softmax(float(logits)), the top k of p (largest first, the
  // lower expert on ties), divided by their sum when norm.
  void (*router_forward)(c10::ScalarType t, const void* logits, int64_t rows, int64_t experts, int64_t k, bool norm,
                         void* scores, int64_t* index);
  // dlogits = d(scores)/d(logits)^T grad_scores + grad_logits (which may be null).
  void (*router_backward)(c10::ScalarType t, const void* logits, const int64_t* index, c10::ScalarType st,
                          const void* grad_scores, const void* grad_logits, int64_t rows, int64_t experts, int64_t k,
                          bool norm, void* dlogits);

  // HF's load-balancing statistics of one layer: p = cast_t(softmax(logits)),
  // counts[e] += mask * (e in top k of p), probs[e] += mask * p[e].
  void (*aux_loss_accumulate)(c10::ScalarType t, const void* logits, int64_t rows, int64_t experts, int64_t k,
                              const float* mask, double* counts, double* probs);
  // dlogits of sum_e coef[e] * sum_rows mask * p[e].
  void (*aux_loss_backward)(c10::ScalarType t, const void* logits, int64_t rows, int64_t experts, const float* coef,
                            const float* mask, void* dlogits);
};

// The kernels of the tier simd::isa() chose.
const Kernels& kernels();

}  // namespace hp::ops::cpu
