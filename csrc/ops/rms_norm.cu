// hyperparallel::rms_norm on CUDA: HF's RMSNorm in one pass forward and one
// backward (two passes for the weight's gradient, which sums over rows).
//
// The arithmetic is the CPU kernel's (kernels_isa.h): float32 sums,
// rstd = 1 / sqrt(mean(x^2) + eps) (correctly rounded: no fast math),
// y = w * round_to_input_dtype(x * rstd). A block owns a row; each thread
// loads 16 bytes at a time where the row allows it.
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "rms_norm_cuda.h"
#include "simd/bf16.h"

namespace hp::ops::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

using bf16_bits = uint16_t;

using simd::from_float;
using simd::to_float;

// The sum over the block, the same on every thread.
__device__ float block_sum(float value, float* shared) {
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) shared[warp] = value;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += shared[w];
  __syncthreads();  // shared is reused by the next sum
  return total;
}

template <typename Tx, typename Tw, typename Ty>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(const Tx* __restrict__ x, const Tw* __restrict__ w, Ty* __restrict__ y, float* __restrict__ rstd,
                   int64_t n, float eps) {
  __shared__ float shared[kWarps];
  const int64_t row = blockIdx.x;
  const Tx* xr = x + row * n;
  Ty* yr = y + row * n;
  float acc = 0.f;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) {
    const float v = to_float(xr[i]);
    acc += v * v;
  }
  const float rs = 1.0f / sqrtf(block_sum(acc, shared) / float(n) + eps);
  if (threadIdx.x == 0) rstd[row] = rs;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) {
    const float normed = to_float(from_float<Tx>(to_float(xr[i]) * rs));
    yr[i] = from_float<Ty>(to_float(w[i]) * normed);
  }
}

template <typename Tx, typename Tw, typename Ty>
__global__ void __launch_bounds__(kThreads)
    backward_kernel(const Ty* __restrict__ dy, const Tx* __restrict__ x, const Tw* __restrict__ w,
                    const float* __restrict__ rstd, Tx* __restrict__ dx, int64_t n) {
  __shared__ float shared[kWarps];
  const int64_t row = blockIdx.x;
  const Ty* dyr = dy + row * n;
  const Tx* xr = x + row * n;
  Tx* dxr = dx + row * n;
  const float rs = rstd[row];
  float acc = 0.f;
  for (int64_t i = threadIdx.x; i < n; i += kThreads)
    acc += to_float(dyr[i]) * to_float(w[i]) * (to_float(xr[i]) * rs);
  const float c = block_sum(acc, shared) / float(n);
  for (int64_t i = threadIdx.x; i < n; i += kThreads) {
    const float xh = to_float(xr[i]) * rs;
    dxr[i] = from_float<Tx>((to_float(dyr[i]) * to_float(w[i]) - xh * c) * rs);
  }
}

// The weight's gradient, by columns: block (c, r) sums column tile c over its
// share of the rows into partial[r]; the caller adds the partials.
constexpr int kColumns = 32;
template <typename Tx, typename Ty>
__global__ void __launch_bounds__(kThreads)
    weight_grad_kernel(const Ty* __restrict__ dy, const Tx* __restrict__ x, const float* __restrict__ rstd,
                       float* __restrict__ partial, int64_t rows, int64_t n) {
  __shared__ float sums[kWarps][kColumns];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t column = int64_t(blockIdx.x) * kColumns + lane;
  const int64_t per = (rows + gridDim.y - 1) / gridDim.y;
  const int64_t first = int64_t(blockIdx.y) * per, last = first + per < rows ? first + per : rows;
  float acc = 0.f;
  if (column < n)
    for (int64_t r = first + warp; r < last; r += kWarps) {
      const float xh = to_float(from_float<Tx>(to_float(x[r * n + column]) * rstd[r]));
      acc += to_float(dy[r * n + column]) * xh;
    }
  sums[warp][lane] = acc;
  __syncthreads();
  if (warp == 0 && column < n) {
    float total = 0.f;
#pragma unroll
    for (int k = 0; k < kWarps; ++k) total += sums[k][lane];
    partial[int64_t(blockIdx.y) * n + column] = total;
  }
}

void check_launch(const char* what) {
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess)
    throw std::runtime_error(std::string("hyperparallel::rms_norm: ") + what + " launch failed: " +
                             cudaGetErrorString(status));
}

// Calls f(x, w, y) with values of the C++ types of the three dtypes (tags).
template <typename F>
void with_types(DType xt, DType wt, DType yt, F&& f) {
  auto one = [](DType dtype, auto&& next) {
    if (dtype == DType::F32)
      next(float{});
    else
      next(bf16_bits{});
  };
  one(xt, [&](auto x) { one(wt, [&](auto w) { one(yt, [&](auto y) { f(x, w, y); }); }); });
}

}  // namespace

void rms_norm_forward(DType xt, const void* x, DType wt, const void* w, DType yt, void* y, float* rstd, int64_t rows,
                      int64_t n, float eps, void* stream) {
  if (rows == 0) return;
  with_types(xt, wt, yt, [&](auto xtag, auto wtag, auto ytag) {
    using Tx = decltype(xtag);
    using Tw = decltype(wtag);
    using Ty = decltype(ytag);
    forward_kernel<Tx, Tw, Ty><<<unsigned(rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const Tx*>(x), static_cast<const Tw*>(w), static_cast<Ty*>(y), rstd, n, eps);
  });
  check_launch("forward");
}

void rms_norm_backward(DType yt, const void* dy, DType xt, const void* x, DType wt, const void* w, const float* rstd,
                       void* dx, float* dw_partial, int64_t partials, int64_t rows, int64_t n, void* stream) {
  if (rows == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  with_types(xt, wt, yt, [&](auto xtag, auto wtag, auto ytag) {
    using Tx = decltype(xtag);
    using Tw = decltype(wtag);
    using Ty = decltype(ytag);
    backward_kernel<Tx, Tw, Ty><<<unsigned(rows), kThreads, 0, s>>>(
        static_cast<const Ty*>(dy), static_cast<const Tx*>(x), static_cast<const Tw*>(w), rstd, static_cast<Tx*>(dx),
        n);
    const dim3 grid(unsigned((n + kColumns - 1) / kColumns), unsigned(partials));
    weight_grad_kernel<Tx, Ty><<<grid, kThreads, 0, s>>>(static_cast<const Ty*>(dy), static_cast<const Tx*>(x), rstd,
                                                         dw_partial, rows, n);
  });
  check_launch("backward");
}

}  // namespace hp::ops::cuda
