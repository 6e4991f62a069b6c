// hyperparallel::attention: q/k RMSNorm + RoPE + causal attention with grouped
// kv heads, flash-style: the forward keeps only each row's log-sum-exp and
// the backward recomputes the scores block by block.
//
// Work is split by (batch, kv head). The query heads sharing a kv head are
// stored next to each other (q_rope is (batch, kv_heads, seq, group, d)), so
// one GEMM serves the whole group with K and V read once, and causality is
// exploited per block of queries: a block of rows [s0, s1) only meets keys
// [0, s1).
#include <ATen/Parallel.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <limits>
#include <vector>

#include "common.h"
#include "hyperparallel/ops/fused.h"
#include "kernels.h"

namespace hp::ops {
namespace {

using detail::elem;
using detail::elem_mut;
using detail::gemm;

struct Shape {
  int64_t batch, seq, heads, kv_heads, d, group;
  int64_t cos_batch;   // 1 or batch
  int64_t mask_batch;  // 1 or batch; 0 without a mask
  // Query positions per block: about 128 GEMM rows (positions x group), and
  // blocks short enough that causality skips most of the upper triangle.
  int64_t block() const { return std::clamp<int64_t>(128 / group, 16, 64); }
};

// Shapes and dtypes; symbolic sizes (torch.compile) are compared through guards.
void check(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& q_norm_weight,
           const at::Tensor& k_norm_weight, const at::Tensor& cos, const at::Tensor& sin,
           const std::optional<at::Tensor>& mask) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "hyperparallel::attention: q, k, v must be (batch, seq, heads, head_dim), the projections' outputs "
              "viewed per head; got q ",
              q.sym_sizes(), ", k ", k.sym_sizes(), ", v ", v.sym_sizes());
  const auto batch = q.sym_size(0), seq = q.sym_size(1), heads = q.sym_size(2), d = q.sym_size(3);
  TORCH_CHECK(k.sym_sizes() == v.sym_sizes() && k.sym_size(0) == batch && k.sym_size(1) == seq && k.sym_size(3) == d,
              "hyperparallel::attention: k ", k.sym_sizes(), " and v ", v.sym_sizes(), " must match q ", q.sym_sizes(),
              " in batch, seq and head_dim");
  TORCH_CHECK(k.sym_size(2) > 0 && heads % k.sym_size(2) == 0, "hyperparallel::attention: ", heads,
              " query heads do not split into groups over ", k.sym_size(2), " kv heads");
  TORCH_CHECK(d % 2 == 0 && d <= cpu::kMaxHeadDim, "hyperparallel::attention: head_dim ", d,
              " must be even (rotate-half RoPE) and at most ", cpu::kMaxHeadDim);
  for (const auto* t : {&q, &k, &v, &q_norm_weight, &k_norm_weight}) {
    detail::check_float_or_bf16(*t, "attention", "q/k/v or a norm weight");
  }
  detail::check_same_dtype(q, k, "attention", "q", "k");
  detail::check_same_dtype(q, v, "attention", "q", "v");
  detail::check_same_dtype(q, q_norm_weight, "attention", "q", "q_norm.weight");
  detail::check_same_dtype(q, k_norm_weight, "attention", "q", "k_norm.weight");
  TORCH_CHECK(q_norm_weight.sym_numel() == d && k_norm_weight.sym_numel() == d,
              "hyperparallel::attention: q_norm and k_norm weights must have head_dim = ", d, " elements");
  TORCH_CHECK(cos.dim() == 3 && cos.sym_sizes() == sin.sym_sizes() &&
                  (cos.sym_size(0) == 1 || cos.sym_size(0) == batch) && cos.sym_size(1) == seq && cos.sym_size(2) == d,
              "hyperparallel::attention: cos and sin must be (1 or batch, seq, head_dim) = (", batch, ", ", seq, ", ",
              d, "); got ", cos.sym_sizes(), " and ", sin.sym_sizes());
  if (mask.has_value() && mask->defined()) {
    const auto& m = *mask;
    TORCH_CHECK(m.dim() == 4 && (m.sym_size(0) == 1 || m.sym_size(0) == batch) && m.sym_size(1) == 1 &&
                    m.sym_size(2) == seq && m.sym_size(3) == seq,
                "hyperparallel::attention: the mask must be (1 or batch, 1, seq, seq) with seq = ", seq,
                " (no KV cache); got ", m.sym_sizes());
    TORCH_CHECK(m.scalar_type() == at::kBool || at::isFloatingType(m.scalar_type()),
                "hyperparallel::attention: the mask must be bool (true = attend) or additive floating point; got ",
                m.scalar_type());
  }
}

Shape shape_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& mask) {
  return Shape{.batch = q.size(0),
               .seq = q.size(1),
               .heads = q.size(2),
               .kv_heads = k.size(2),
               .d = q.size(3),
               .group = q.size(2) / k.size(2),
               .cos_batch = cos.size(0),
               .mask_batch = mask.defined() ? mask.size(0) : 0};
}

// The mask as float32 scores to add: 0 / -inf for a bool mask.
at::Tensor additive_mask(const std::optional<at::Tensor>& mask) {
  if (!mask.has_value() || !mask->defined()) return {};
  if (mask->scalar_type() == at::kBool) {
    return at::where(*mask, 0.0f, -std::numeric_limits<float>::infinity()).to(at::kFloat).contiguous();
  }
  return mask->to(at::kFloat).contiguous();
}

// Views of one (batch, kv head) as float32 matrices: the tensor itself when
// it is float32, else a converted copy in `scratch`.
struct Slab {
  const float* data;
  int64_t ld;
};
Slab float_rows(const at::Tensor& t, int64_t offset, int64_t rows, int64_t cols, int64_t ld,
                std::vector<float>& scratch) {
  if (t.scalar_type() == at::kFloat) return {t.const_data_ptr<float>() + offset, ld};
  scratch.resize(rows * cols);
  const auto& k = cpu::kernels();
  for (int64_t r = 0; r < rows; ++r)
    k.to_float(t.scalar_type(), elem(t, offset + r * ld), scratch.data() + r * cols, cols);
  return {scratch.data(), cols};
}

using Outputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// Returns (out, k_rope, q_rope, lse, q_rstd, k_rstd).
Outputs forward_cpu(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                    const at::Tensor& q_norm_weight, const at::Tensor& k_norm_weight, const at::Tensor& cos_in,
                    const at::Tensor& sin_in, const std::optional<at::Tensor>& mask_in, double q_eps, double k_eps,
                    double scale) {
  check(q_in, k_in, v_in, q_norm_weight, k_norm_weight, cos_in, sin_in, mask_in);
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  const at::Tensor qw = q_norm_weight.contiguous(), kw = k_norm_weight.contiguous();
  const at::Tensor cos = cos_in.to(at::kFloat).contiguous(), sin = sin_in.to(at::kFloat).contiguous();
  const at::Tensor mask = additive_mask(mask_in);
  const Shape sh = shape_of(q, k, cos, mask);
  const auto [B, S, H, G, D, R, CB, MB] = sh;
  const auto dt = q.scalar_type();
  const auto opts = q.options();
  at::Tensor out = at::empty({B, S, H, D}, opts);
  at::Tensor k_rope = at::empty({B, G, S, D}, opts);
  at::Tensor q_rope = at::empty({B, G, S, R, D}, opts);
  at::Tensor lse = at::empty({B, G, S, R}, opts.dtype(at::kFloat));
  at::Tensor q_rstd = at::empty({B, S, H}, opts.dtype(at::kFloat));
  at::Tensor k_rstd = at::empty({B, S, G}, opts.dtype(at::kFloat));
  const int64_t bs = sh.block();
  const auto& kern = cpu::kernels();
  const float* cos_p = cos.const_data_ptr<float>();
  const float* sin_p = sin.const_data_ptr<float>();
  const float* mask_p = mask.defined() ? mask.const_data_ptr<float>() : nullptr;
  float* lse_p = lse.mutable_data_ptr<float>();
  float* q_rstd_p = q_rstd.mutable_data_ptr<float>();
  float* k_rstd_p = k_rstd.mutable_data_ptr<float>();

  at::parallel_for(0, B * G, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> row(D), k_f, v_f, q_f, scores(bs * R * S), o(bs * R * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / G, g = task % G;
      const int64_t cb = CB == 1 ? 0 : b;
      const int64_t slab = (b * G + g) * S;  // first row of this (b, g) in k_rope / q_rope
      for (int64_t s = 0; s < S; ++s) {
        const float* c = cos_p + (cb * S + s) * D;
        const float* sn = sin_p + (cb * S + s) * D;
        k_rstd_p[(b * S + s) * G + g] = kern.norm_rope(dt, elem(k, ((b * S + s) * G + g) * D), kw.const_data_ptr(), c,
                                                       sn, static_cast<float>(k_eps), D, row.data());
        kern.from_float(dt, row.data(), elem_mut(k_rope, (slab + s) * D), D);
        for (int64_t r = 0; r < R; ++r) {
          const int64_t h = g * R + r;
          q_rstd_p[(b * S + s) * H + h] = kern.norm_rope(dt, elem(q, ((b * S + s) * H + h) * D), qw.const_data_ptr(), c,
                                                         sn, static_cast<float>(q_eps), D, row.data());
          kern.from_float(dt, row.data(), elem_mut(q_rope, ((slab + s) * R + r) * D), D);
        }
      }
      const Slab K = float_rows(k_rope, slab * D, S, D, D, k_f);
      const Slab V = float_rows(v, (b * S * G + g) * D, S, D, G * D, v_f);
      for (int64_t s0 = 0; s0 < S; s0 += bs) {
        const int64_t s1 = std::min(S, s0 + bs), rows = (s1 - s0) * R;
        const Slab Q = float_rows(q_rope, (slab + s0) * R * D, rows, D, D, q_f);
        gemm(false, true, rows, s1, D, Q.data, Q.ld, K.data, K.ld, scores.data(), s1, false);
        for (int64_t s = s0; s < s1; ++s) {
          const float* add = mask_p ? mask_p + ((MB == 1 ? 0 : b) * S + s) * S : nullptr;
          for (int64_t r = 0; r < R; ++r) {
            lse_p[(slab + s) * R + r] =
                kern.softmax_row(scores.data() + ((s - s0) * R + r) * s1, s + 1, s1, static_cast<float>(scale), add);
          }
        }
        gemm(false, false, rows, D, s1, scores.data(), s1, V.data, V.ld, o.data(), D, false);
        for (int64_t s = s0; s < s1; ++s) {
          kern.from_float(dt, o.data() + (s - s0) * R * D, elem_mut(out, ((b * S + s) * H + g * R) * D), R * D);
        }
      }
    }
  });
  return {out, k_rope, q_rope, lse, q_rstd, k_rstd};
}

using Grads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// Returns (dq, dk, dv, d q_norm_weight, d k_norm_weight).
Grads backward_cpu(const at::Tensor& grad_out, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                   const at::Tensor& q_norm_weight, const at::Tensor& k_norm_weight, const at::Tensor& cos_in,
                   const at::Tensor& sin_in, const std::optional<at::Tensor>& mask_in, const at::Tensor& out_in,
                   const at::Tensor& q_rope_in, const at::Tensor& k_rope_in, const at::Tensor& lse_in,
                   const at::Tensor& q_rstd_in, const at::Tensor& k_rstd_in, double scale) {
  const at::Tensor d_out = grad_out.contiguous(), out = out_in.contiguous();
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  const at::Tensor qw = q_norm_weight.contiguous(), kw = k_norm_weight.contiguous();
  const at::Tensor q_rope = q_rope_in.contiguous(), k_rope = k_rope_in.contiguous();
  const at::Tensor lse = lse_in.contiguous(), q_rstd = q_rstd_in.contiguous(), k_rstd = k_rstd_in.contiguous();
  const at::Tensor cos = cos_in.to(at::kFloat).contiguous(), sin = sin_in.to(at::kFloat).contiguous();
  const at::Tensor mask = additive_mask(mask_in);
  const Shape sh = shape_of(q, k, cos, mask);
  const auto [B, S, H, G, D, R, CB, MB] = sh;
  const auto dt = q.scalar_type();
  at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  // Float32 norm-weight gradients, one row per thread.
  at::Tensor dqw = at::zeros({at::get_num_threads(), D}, q.options().dtype(at::kFloat));
  at::Tensor dkw = at::zeros_like(dqw);
  const int64_t bs = sh.block();
  const auto& kern = cpu::kernels();
  const float* cos_p = cos.const_data_ptr<float>();
  const float* sin_p = sin.const_data_ptr<float>();
  const float* mask_p = mask.defined() ? mask.const_data_ptr<float>() : nullptr;
  const float* lse_p = lse.const_data_ptr<float>();
  const float* q_rstd_p = q_rstd.const_data_ptr<float>();
  const float* k_rstd_p = k_rstd.const_data_ptr<float>();

  at::parallel_for(0, B * G, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> k_f, v_f, q_f, scores(bs * R * S), d_scores(bs * R * S);
    std::vector<float> d_o(bs * R * D), o(bs * R * D), dot(bs * R), d_q(bs * R * D), d_k(S * D), d_v(S * D);
    float* dqw_acc = dqw.mutable_data_ptr<float>() + at::get_thread_num() * D;
    float* dkw_acc = dkw.mutable_data_ptr<float>() + at::get_thread_num() * D;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / G, g = task % G;
      const int64_t cb = CB == 1 ? 0 : b;
      const int64_t slab = (b * G + g) * S;
      const Slab K = float_rows(k_rope, slab * D, S, D, D, k_f);
      const Slab V = float_rows(v, (b * S * G + g) * D, S, D, G * D, v_f);
      std::fill(d_k.begin(), d_k.end(), 0.f);
      std::fill(d_v.begin(), d_v.end(), 0.f);
      for (int64_t s0 = 0; s0 < S; s0 += bs) {
        const int64_t s1 = std::min(S, s0 + bs), rows = (s1 - s0) * R;
        const Slab Q = float_rows(q_rope, (slab + s0) * R * D, rows, D, D, q_f);
        for (int64_t s = s0; s < s1; ++s) {
          const int64_t at_row = (s - s0) * R * D, at_out = ((b * S + s) * H + g * R) * D;
          kern.to_float(dt, elem(d_out, at_out), d_o.data() + at_row, R * D);
          kern.to_float(dt, elem(out, at_out), o.data() + at_row, R * D);
        }
        for (int64_t i = 0; i < rows; ++i) dot[i] = kern.dot(d_o.data() + i * D, o.data() + i * D, D);
        gemm(false, true, rows, s1, D, Q.data, Q.ld, K.data, K.ld, scores.data(), s1, false);
        gemm(false, true, rows, s1, D, d_o.data(), D, V.data, V.ld, d_scores.data(), s1, false);
        for (int64_t s = s0; s < s1; ++s) {
          const float* add = mask_p ? mask_p + ((MB == 1 ? 0 : b) * S + s) * S : nullptr;
          for (int64_t r = 0; r < R; ++r) {
            const int64_t i = (s - s0) * R + r;
            kern.softmax_backward_row(scores.data() + i * s1, d_scores.data() + i * s1, s + 1, s1,
                                      static_cast<float>(scale), add, lse_p[(slab + s) * R + r], dot[i]);
          }
        }
        // scores now hold P and d_scores dS (scaled): dV += P^T dO, dK += dS^T Q, dQ = dS K.
        gemm(true, false, s1, D, rows, scores.data(), s1, d_o.data(), D, d_v.data(), D, true);
        gemm(true, false, s1, D, rows, d_scores.data(), s1, Q.data, Q.ld, d_k.data(), D, true);
        gemm(false, false, rows, D, s1, d_scores.data(), s1, K.data, K.ld, d_q.data(), D, false);
        for (int64_t s = s0; s < s1; ++s) {
          const float* c = cos_p + (cb * S + s) * D;
          const float* sn = sin_p + (cb * S + s) * D;
          for (int64_t r = 0; r < R; ++r) {
            const int64_t h = g * R + r, at_q = ((b * S + s) * H + h) * D;
            kern.norm_rope_backward(dt, d_q.data() + ((s - s0) * R + r) * D, elem(q, at_q), qw.const_data_ptr(), c, sn,
                                    q_rstd_p[(b * S + s) * H + h], D, elem_mut(dq, at_q), dqw_acc);
          }
        }
      }
      for (int64_t s = 0; s < S; ++s) {
        const int64_t at_k = ((b * S + s) * G + g) * D;
        kern.norm_rope_backward(dt, d_k.data() + s * D, elem(k, at_k), kw.const_data_ptr(), cos_p + (cb * S + s) * D,
                                sin_p + (cb * S + s) * D, k_rstd_p[(b * S + s) * G + g], D, elem_mut(dk, at_k),
                                dkw_acc);
        kern.from_float(dt, d_v.data() + s * D, elem_mut(dv, at_k), D);
      }
    }
  });
  return {dq, dk, dv, dqw.sum(0).to(qw.scalar_type()), dkw.sum(0).to(kw.scalar_type())};
}

Outputs forward_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& q_norm_weight,
                     const at::Tensor& k_norm_weight, const at::Tensor& cos, const at::Tensor& sin,
                     const std::optional<at::Tensor>& mask, double q_eps, double k_eps, double scale) {
  check(q, k, v, q_norm_weight, k_norm_weight, cos, sin, mask);
  const auto B = q.sym_size(0), S = q.sym_size(1), H = q.sym_size(2), D = q.sym_size(3), G = k.sym_size(2);
  const auto R = H / G;
  const auto f32 = q.options().dtype(at::kFloat);
  return {at::empty_symint({B, S, H, D}, q.options()),
          at::empty_symint({B, G, S, D}, q.options()),
          at::empty_symint({B, G, S, R, D}, q.options()),
          at::empty_symint({B, G, S, R}, f32),
          at::empty_symint({B, S, H}, f32),
          at::empty_symint({B, S, G}, f32)};
}

Grads backward_meta(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& q_norm_weight, const at::Tensor& k_norm_weight, const at::Tensor& cos,
                    const at::Tensor& sin, const std::optional<at::Tensor>& mask, const at::Tensor& out,
                    const at::Tensor& q_rope, const at::Tensor& k_rope, const at::Tensor& lse, const at::Tensor& q_rstd,
                    const at::Tensor& k_rstd, double scale) {
  return {at::empty_symint(q.sym_sizes(), q.options()), at::empty_symint(k.sym_sizes(), k.options()),
          at::empty_symint(v.sym_sizes(), v.options()),
          at::empty_symint(q_norm_weight.sym_sizes(), q_norm_weight.options()),
          at::empty_symint(k_norm_weight.sym_sizes(), k_norm_weight.options())};
}

using ForwardOp = Outputs(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, double, double,
                          double);
using BackwardOp = Grads(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                         const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, double);

class AttentionFunction : public torch::autograd::Function<AttentionFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                                                const at::Tensor& k, const at::Tensor& v,
                                                const at::Tensor& q_norm_weight, const at::Tensor& k_norm_weight,
                                                const at::Tensor& cos, const at::Tensor& sin,
                                                const std::optional<at::Tensor>& mask, double q_eps, double k_eps,
                                                double scale) {
    static const auto op = detail::op_handle<ForwardOp>("attention_forward");
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, k_rope, q_rope, lse, q_rstd, k_rstd] =
        op.call(q, k, v, q_norm_weight, k_norm_weight, cos, sin, mask, q_eps, k_eps, scale);
    ctx->save_for_backward({q, k, v, q_norm_weight, k_norm_weight, cos, sin, mask.value_or(at::Tensor()), out, q_rope,
                            k_rope, lse, q_rstd, k_rstd});
    ctx->saved_data["scale"] = scale;
    // k after norm and RoPE is for the KV cache, not for differentiation.
    ctx->mark_non_differentiable({k_rope});
    return {out, k_rope};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    static const auto op = detail::op_handle<BackwardOp>("attention_backward");
    const auto s = ctx->get_saved_variables();
    const std::optional<at::Tensor> mask = s[7].defined() ? std::optional<at::Tensor>(s[7]) : std::nullopt;
    auto [dq, dk, dv, dqw, dkw] = op.call(grads[0], s[0], s[1], s[2], s[3], s[4], s[5], s[6], mask, s[8], s[9], s[10],
                                          s[11], s[12], s[13], ctx->saved_data["scale"].toDouble());
    return {dq, dk, dv, dqw, dkw, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> attention_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                      const at::Tensor& q_norm_weight, const at::Tensor& k_norm_weight,
                                                      const at::Tensor& cos, const at::Tensor& sin,
                                                      const std::optional<at::Tensor>& mask, double q_eps, double k_eps,
                                                      double scale) {
  auto outs = AttentionFunction::apply(q, k, v, q_norm_weight, k_norm_weight, cos, sin, mask, q_eps, k_eps, scale);
  return {outs[0], outs[1]};
}

template <Outputs (*Forward)(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                             double, double, double)>
std::tuple<at::Tensor, at::Tensor> attention_only(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  const at::Tensor& q_norm_weight, const at::Tensor& k_norm_weight,
                                                  const at::Tensor& cos, const at::Tensor& sin,
                                                  const std::optional<at::Tensor>& mask, double q_eps, double k_eps,
                                                  double scale) {
  auto outs = Forward(q, k, v, q_norm_weight, k_norm_weight, cos, sin, mask, q_eps, k_eps, scale);
  return {std::get<0>(outs), std::get<1>(outs)};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                             const at::Tensor& q_norm_weight, const at::Tensor& k_norm_weight,
                                             const at::Tensor& cos, const at::Tensor& sin,
                                             const std::optional<at::Tensor>& mask, double q_eps, double k_eps,
                                             double scale) {
  static const auto op = detail::op_handle<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      const at::Tensor&, const std::optional<at::Tensor>&, double, double, double)>("attention");
  return op.call(q, k, v, q_norm_weight, k_norm_weight, cos, sin, mask, q_eps, k_eps, scale);
}

}  // namespace hp::ops

TORCH_LIBRARY_FRAGMENT(hyperparallel, m) {
  m.def(
      "attention(Tensor q, Tensor k, Tensor v, Tensor q_norm_weight, Tensor k_norm_weight, Tensor cos, Tensor sin, "
      "Tensor? mask, float q_eps, float k_eps, float scale) -> (Tensor, Tensor)");
  m.def(
      "attention_forward(Tensor q, Tensor k, Tensor v, Tensor q_norm_weight, Tensor k_norm_weight, Tensor cos, "
      "Tensor sin, Tensor? mask, float q_eps, float k_eps, float scale) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor q_norm_weight, Tensor k_norm_weight, "
      "Tensor cos, Tensor sin, Tensor? mask, Tensor out, Tensor q_rope, Tensor k_rope, Tensor lse, Tensor q_rstd, "
      "Tensor k_rstd, float scale) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(hyperparallel, CPU, m) {
  m.impl("attention", &hp::ops::attention_only<&hp::ops::forward_cpu>);
  m.impl("attention_forward", &hp::ops::forward_cpu);
  m.impl("attention_backward", &hp::ops::backward_cpu);
}

TORCH_LIBRARY_IMPL(hyperparallel, Meta, m) {
  m.impl("attention", &hp::ops::attention_only<&hp::ops::forward_meta>);
  m.impl("attention_forward", &hp::ops::forward_meta);
  m.impl("attention_backward", &hp::ops::backward_meta);
}

TORCH_LIBRARY_IMPL(hyperparallel, Autograd, m) { m.impl("attention", &hp::ops::attention_autograd); }
