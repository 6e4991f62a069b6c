// The fused ops' CUDA kernels (rms_norm.cu, attention.cu, moe.cu), torch-free:
// raw pointers to contiguous rows, an opaque stream (a cudaStream_t). The
// torch-facing glue (*_cuda.cpp) allocates, and the GEMMs around these
// kernels are cuBLAS's through ATen. Storage is float32 or bfloat16;
// arithmetic is float32, the CPU kernels' (kernels.h) formulas.
#pragma once

#include <cstdint>

namespace hp::ops::cuda {

enum class DType : uint8_t { F32, BF16 };

// rows x n: y = w * round_to_x's_dtype(x * rstd), rstd per row.
void rms_norm_forward(DType xt, const void* x, DType wt, const void* w, DType yt, void* y, float* rstd, int64_t rows,
                      int64_t n, float eps, void* stream);
// dx, and the weight's gradient as `partials` float32 rows of n to be summed.
void rms_norm_backward(DType yt, const void* dy, DType xt, const void* x, DType wt, const void* w, const float* rstd,
                       void* dx, float* dw_partial, int64_t partials, int64_t rows, int64_t n, void* stream);

// q or k as the projection leaves it, (batch, seq, heads, d), to (batch,
// heads, seq, d) after HF's per-head RMSNorm and rotate-half RoPE: what SDPA
// takes. cos, sin: float32 (cos_batch, seq, d), cos_batch 1 or batch. Every
// tensor has the one dtype `t` except cos/sin and rstd (float32, per row of x).
struct NormRope {
  int64_t batch, seq, heads, d, cos_batch;
  float eps;
};
void norm_rope_forward(DType t, const NormRope& shape, const void* x, const void* w, const float* cos,
                       const float* sin, void* out, float* rstd, void* stream);
// dx (x's layout) from g (out's layout), and the weight's gradient as
// `partials` float32 rows of d to be summed.
void norm_rope_backward(DType t, const NormRope& shape, const void* g, const void* x, const void* w, const float* cos,
                        const float* sin, const float* rstd, void* dx, float* dw_partial, int64_t partials,
                        void* stream);

// SwiGLU on rows x [gate | up] (2 * inter wide): a = silu(gate) * up.
void swiglu_forward(DType t, const void* gu, void* a, int64_t rows, int64_t inter, void* stream);
// Given da (a's gradient before the row's routing weight; weight 1 where
// row_weight is null): dgu, and where asked a_w = weight * a and
// row_dot = dot(da, a), the routing weight's gradient.
void swiglu_backward(DType t, const void* gu, const void* da, const float* row_weight, void* dgu, void* a_w,
                     float* row_dot, int64_t rows, int64_t inter, void* stream);

// Zeroes the groups of `data` (groups x group_bytes, contiguous) that no row
// reached, offsets[g] == offsets[g + 1] (int64, groups + 1 of them): the
// experts' weight gradients of experts no token chose. Reads only the
// offsets and writes only those groups, where a mask over the whole tensor
// would read and write all of it.
void zero_idle_groups(void* data, const int64_t* offsets, int64_t groups, int64_t group_bytes, void* stream);

// out[t] = sum_j w[t, j] * src[pos[t * k + j]] over `hidden` columns, summed
// in float32 in j order and rounded once (w may be null: all ones).
void gather_sum(DType t, const void* src, const int64_t* pos, DType wt, const void* w, int64_t tokens, int64_t k,
                int64_t hidden, void* out, void* stream);

}  // namespace hp::ops::cuda
