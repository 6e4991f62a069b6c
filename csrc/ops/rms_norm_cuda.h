// The RMSNorm kernels on CUDA (rms_norm.cu), torch-free: raw pointers to
// contiguous rows, an opaque stream (a cudaStream_t).
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

}  // namespace hp::ops::cuda
