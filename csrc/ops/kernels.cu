// The fused ops' CUDA kernels (kernels_cuda.h): the elementwise and
// reduction work between cuBLAS's GEMMs, with the CPU kernels' arithmetic
// (kernels_isa.h; device_math.h holds the shared per-element formulas).
//
// RMSNorm: one pass forward and one backward (two passes for the weight's
// gradient, which sums over rows): float32 sums, rstd = 1 / sqrt(mean(x^2) +
// eps) (correctly rounded: no fast math), y = w * round_to_input_dtype(x *
// rstd). A block owns a row.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>

#include "device_math.h"
#include "hyperparallel/fabric/device.h"
#include "kernels_cuda.h"
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

// Calls f with a value of the C++ type of `dtype` (a tag).
template <typename F>
void with_type(DType dtype, F&& f) {
  if (dtype == DType::F32)
    f(float{});
  else
    f(bf16_bits{});
}

// The same for three dtypes: f(x, w, y).
template <typename F>
void with_types(DType xt, DType wt, DType yt, F&& f) {
  with_type(xt, [&](auto x) { with_type(wt, [&](auto w) { with_type(yt, [&](auto y) { f(x, w, y); }); }); });
}

unsigned blocks_for(int64_t work, int64_t per_block) {
  // Grid-stride loops cover the rest: a few waves of blocks are enough.
  const int64_t blocks = (work + per_block - 1) / per_block;
  return unsigned(blocks < 65536 ? (blocks > 0 ? blocks : 1) : 65536);
}

// ---------------------------------------------------------------------------
// q/k RMSNorm + rotate-half RoPE. A warp owns a head row of d; lane l handles
// the rotate-half pairs (j, j + d/2) for j = l, l + 32, ...

struct RowAt {
  int64_t x, out, cos;  // element offsets of the row in x, out and cos/sin
};

__device__ RowAt row_at(const NormRope& s, int64_t r) {
  const int64_t head = r % s.heads, pos = (r / s.heads) % s.seq, b = r / (s.heads * s.seq);
  return {r * s.d, ((b * s.heads + head) * s.seq + pos) * s.d, ((s.cos_batch == 1 ? 0 : b) * s.seq + pos) * s.d};
}

// Kernels that give a warp each row walk the rows by these: this warp's
// index in the grid, and the grid's number of warps.
__device__ int64_t grid_warp() { return (int64_t(blockIdx.x) * kThreads + threadIdx.x) / 32; }
__device__ int64_t grid_warps() { return int64_t(gridDim.x) * kWarps; }

__device__ float warp_sum(float value) {
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    norm_rope_forward_kernel(NormRope s, const T* __restrict__ x, const T* __restrict__ w,
                             const float* __restrict__ cos, const float* __restrict__ sin, T* __restrict__ out,
                             float* __restrict__ rstd, int64_t rows) {
  const int lane = threadIdx.x % 32;
  const int64_t h = s.d / 2;
  for (int64_t r = grid_warp(); r < rows; r += grid_warps()) {
    const RowAt at = row_at(s, r);
    const T* xr = x + at.x;
    float acc = 0.f;
    for (int64_t j = lane; j < s.d; j += 32) {
      const float v = to_float(xr[j]);
      acc += v * v;
    }
    const float rs = 1.0f / sqrtf(warp_sum(acc) / float(s.d) + s.eps);
    if (lane == 0) rstd[r] = rs;
    for (int64_t j = lane; j < h; j += 32) {
      const float a = to_float(from_float<T>(to_float(w[j]) * to_float(from_float<T>(to_float(xr[j]) * rs))));
      const float b =
          to_float(from_float<T>(to_float(w[j + h]) * to_float(from_float<T>(to_float(xr[j + h]) * rs))));
      const math::Pair o = math::rope(a, b, cos[at.cos + j], sin[at.cos + j], cos[at.cos + j + h], sin[at.cos + j + h]);
      out[at.out + j] = from_float<T>(o.lo);
      out[at.out + j + h] = from_float<T>(o.hi);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    norm_rope_backward_kernel(NormRope s, const T* __restrict__ g, const T* __restrict__ x, const T* __restrict__ w,
                              const float* __restrict__ cos, const float* __restrict__ sin,
                              const float* __restrict__ rstd, T* __restrict__ dx, int64_t rows) {
  const int lane = threadIdx.x % 32;
  const int64_t h = s.d / 2;
  for (int64_t r = grid_warp(); r < rows; r += grid_warps()) {
    const RowAt at = row_at(s, r);
    const T* xr = x + at.x;
    const float rs = rstd[r];
    // c = mean(gn * w * x_hat), gn the gradient before RoPE.
    float acc = 0.f;
    for (int64_t j = lane; j < h; j += 32) {
      const math::Pair gn = math::rope_backward(to_float(g[at.out + j]), to_float(g[at.out + j + h]), cos[at.cos + j],
                                                sin[at.cos + j], cos[at.cos + j + h], sin[at.cos + j + h]);
      acc += gn.lo * to_float(w[j]) * (to_float(xr[j]) * rs) + gn.hi * to_float(w[j + h]) * (to_float(xr[j + h]) * rs);
    }
    const float c = warp_sum(acc) / float(s.d);
    for (int64_t j = lane; j < h; j += 32) {
      const math::Pair gn = math::rope_backward(to_float(g[at.out + j]), to_float(g[at.out + j + h]), cos[at.cos + j],
                                                sin[at.cos + j], cos[at.cos + j + h], sin[at.cos + j + h]);
      dx[at.x + j] = from_float<T>((gn.lo * to_float(w[j]) - to_float(xr[j]) * rs * c) * rs);
      dx[at.x + j + h] = from_float<T>((gn.hi * to_float(w[j + h]) - to_float(xr[j + h]) * rs * c) * rs);
    }
  }
}

// The norm weight's gradient: block p sums gn * round(x * rstd) over its share
// of the rows, thread t over columns t, t + kThreads, ...
template <typename T>
__global__ void __launch_bounds__(kThreads)
    norm_rope_weight_grad_kernel(NormRope s, const T* __restrict__ g, const T* __restrict__ x,
                                 const float* __restrict__ cos, const float* __restrict__ sin,
                                 const float* __restrict__ rstd, float* __restrict__ partial, int64_t rows) {
  const int64_t h = s.d / 2;
  const int64_t per = (rows + gridDim.x - 1) / gridDim.x;
  const int64_t first = int64_t(blockIdx.x) * per, last = first + per < rows ? first + per : rows;
  for (int64_t j = threadIdx.x; j < s.d; j += kThreads) {
    const int64_t lo = j < h ? j : j - h;
    float acc = 0.f;
    for (int64_t r = first; r < last; ++r) {
      const RowAt at = row_at(s, r);
      const math::Pair gn = math::rope_backward(to_float(g[at.out + lo]), to_float(g[at.out + lo + h]),
                                                cos[at.cos + lo], sin[at.cos + lo], cos[at.cos + lo + h],
                                                sin[at.cos + lo + h]);
      acc += (j < h ? gn.lo : gn.hi) * to_float(from_float<T>(to_float(x[at.x + j]) * rstd[r]));
    }
    partial[int64_t(blockIdx.x) * s.d + j] = acc;
  }
}

// ---------------------------------------------------------------------------
// SwiGLU and the weighted gather of the experts' rows. These are bandwidth's:
// each thread moves 16 bytes per access (a Pack) where the rows allow it
// (widths a multiple of a Pack, 16-byte aligned: what torch._grouped_mm's
// outputs are), one element otherwise, with the same arithmetic per element.

// The elements of T in one 16-byte access.
template <typename T>
struct alignas(16) Pack {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

template <typename T>
__device__ Pack<T> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T>*>(p);
}

template <typename T>
__device__ void store_pack(T* p, const Pack<T>& value) {
  *reinterpret_cast<Pack<T>*>(p) = value;
}

// Whether rows of `width` elements starting at each pointer are whole packs.
template <typename T>
bool packs(int64_t width, std::initializer_list<const void*> pointers) {
  if (width % Pack<T>::kSize != 0) return false;
  for (const void* p : pointers)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

// V: elements per thread per access (1, or a Pack's).
template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    swiglu_forward_kernel(const T* __restrict__ gu, T* __restrict__ a, int64_t rows, int64_t inter) {
  const int64_t per_row = inter / V, n = rows * per_row;
  for (int64_t e = int64_t(blockIdx.x) * kThreads + threadIdx.x; e < n; e += int64_t(gridDim.x) * kThreads) {
    const int64_t row = e / per_row, i = e % per_row * V;
    const T* gr = gu + row * 2 * inter;
    if constexpr (V == 1) {
      a[row * inter + i] = from_float<T>(math::swiglu(to_float(gr[i]), to_float(gr[inter + i])));
    } else {
      const Pack<T> g = load_pack(gr + i), u = load_pack(gr + inter + i);
      Pack<T> out;
#pragma unroll
      for (int q = 0; q < V; ++q) out.v[q] = from_float<T>(math::swiglu(to_float(g.v[q]), to_float(u.v[q])));
      store_pack(a + row * inter + i, out);
    }
  }
}

// A warp per row: the row's dot(da, a) is one warp sum. Each lane takes V
// consecutive elements at a time (V: 1, or a Pack's).
template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    swiglu_backward_kernel(const T* __restrict__ gu, const T* __restrict__ da, const float* __restrict__ row_weight,
                           T* __restrict__ dgu, T* __restrict__ a_w, float* __restrict__ row_dot, int64_t rows,
                           int64_t inter) {
  const int lane = threadIdx.x % 32;
  for (int64_t r = grid_warp(); r < rows; r += grid_warps()) {
    const T* gr = gu + r * 2 * inter;
    const T* dar = da + r * inter;
    T* dgr = dgu + r * 2 * inter;
    const float weight = row_weight ? row_weight[r] : 1.0f;
    float acc = 0.f;
    for (int64_t i = int64_t(lane) * V; i < inter; i += 32 * V) {
      if constexpr (V == 1) {
        const float dav = to_float(dar[i]);
        const math::SwigluGrad grad = math::swiglu_grad(to_float(gr[i]), to_float(gr[inter + i]), dav, weight);
        dgr[i] = from_float<T>(grad.dg);
        dgr[inter + i] = from_float<T>(grad.du);
        if (a_w) a_w[r * inter + i] = from_float<T>(grad.a * weight);
        acc += dav * grad.a;
      } else {
        const Pack<T> g = load_pack(gr + i), u = load_pack(gr + inter + i), d = load_pack(dar + i);
        Pack<T> dg, du, aw;
#pragma unroll
        for (int q = 0; q < V; ++q) {
          const float dav = to_float(d.v[q]);
          const math::SwigluGrad grad = math::swiglu_grad(to_float(g.v[q]), to_float(u.v[q]), dav, weight);
          dg.v[q] = from_float<T>(grad.dg);
          du.v[q] = from_float<T>(grad.du);
          aw.v[q] = from_float<T>(grad.a * weight);
          acc += dav * grad.a;
        }
        store_pack(dgr + i, dg);
        store_pack(dgr + inter + i, du);
        if (a_w) store_pack(a_w + r * inter + i, aw);
      }
    }
    if (row_dot) {
      acc = warp_sum(acc);
      if (lane == 0) row_dot[r] = acc;
    }
  }
}

// blockIdx.y is the group; an active group's blocks return at once. 16-byte
// stores where the group starts on 16 bytes, then bytes for the rest.
__global__ void __launch_bounds__(kThreads)
    zero_idle_groups_kernel(char* __restrict__ data, const int64_t* __restrict__ offsets, int64_t group_bytes) {
  const int64_t g = blockIdx.y;
  if (offsets[g + 1] != offsets[g]) return;
  char* base = data + g * group_bytes;
  const int64_t stride = int64_t(gridDim.x) * kThreads, first = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t words = reinterpret_cast<uintptr_t>(base) % 16 == 0 ? group_bytes / 16 : 0;
  for (int64_t i = first; i < words; i += stride) reinterpret_cast<uint4*>(base)[i] = make_uint4(0, 0, 0, 0);
  for (int64_t i = words * 16 + first; i < group_bytes; i += stride) base[i] = 0;
}

template <typename T, typename Tw, int V>
__global__ void __launch_bounds__(kThreads)
    gather_sum_kernel(const T* __restrict__ src, const int64_t* __restrict__ pos, const Tw* __restrict__ w,
                      int64_t tokens, int64_t k, int64_t hidden, T* __restrict__ out) {
  const int64_t per_row = hidden / V, n = tokens * per_row;
  for (int64_t e = int64_t(blockIdx.x) * kThreads + threadIdx.x; e < n; e += int64_t(gridDim.x) * kThreads) {
    const int64_t t = e / per_row, i = e % per_row * V;
    float acc[V];
#pragma unroll
    for (int q = 0; q < V; ++q) acc[q] = 0.f;
    for (int64_t j = 0; j < k; ++j) {
      const float wj = w ? to_float(w[t * k + j]) : 1.0f;
      const T* row = src + pos[t * k + j] * hidden + i;
      if constexpr (V == 1) {
        acc[0] += to_float(row[0]) * wj;
      } else {
        const Pack<T> x = load_pack(row);
#pragma unroll
        for (int q = 0; q < V; ++q) acc[q] += to_float(x.v[q]) * wj;
      }
    }
    if constexpr (V == 1) {
      out[t * hidden + i] = from_float<T>(acc[0]);
    } else {
      Pack<T> o;
#pragma unroll
      for (int q = 0; q < V; ++q) o.v[q] = from_float<T>(acc[q]);
      store_pack(out + t * hidden + i, o);
    }
  }
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
  fabric::device::check_launch("rms_norm forward");
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
  fabric::device::check_launch("rms_norm backward");
}

void norm_rope_forward(DType t, const NormRope& shape, const void* x, const void* w, const float* cos,
                       const float* sin, void* out, float* rstd, void* stream) {
  const int64_t rows = shape.batch * shape.seq * shape.heads;
  if (rows == 0) return;
  with_type(t, [&](auto tag) {
    using T = decltype(tag);
    norm_rope_forward_kernel<T><<<blocks_for(rows, kWarps), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        shape, static_cast<const T*>(x), static_cast<const T*>(w), cos, sin, static_cast<T*>(out), rstd, rows);
  });
  fabric::device::check_launch("norm_rope forward");
}

void norm_rope_backward(DType t, const NormRope& shape, const void* g, const void* x, const void* w, const float* cos,
                        const float* sin, const float* rstd, void* dx, float* dw_partial, int64_t partials,
                        void* stream) {
  const int64_t rows = shape.batch * shape.seq * shape.heads;
  if (rows == 0) return;
  auto st = static_cast<cudaStream_t>(stream);
  with_type(t, [&](auto tag) {
    using T = decltype(tag);
    norm_rope_backward_kernel<T><<<blocks_for(rows, kWarps), kThreads, 0, st>>>(
        shape, static_cast<const T*>(g), static_cast<const T*>(x), static_cast<const T*>(w), cos, sin, rstd,
        static_cast<T*>(dx), rows);
    norm_rope_weight_grad_kernel<T><<<unsigned(partials), kThreads, 0, st>>>(
        shape, static_cast<const T*>(g), static_cast<const T*>(x), cos, sin, rstd, dw_partial, rows);
  });
  fabric::device::check_launch("norm_rope backward");
}

void swiglu_forward(DType t, const void* gu, void* a, int64_t rows, int64_t inter, void* stream) {
  if (rows * inter == 0) return;
  with_type(t, [&](auto tag) {
    using T = decltype(tag);
    auto launch = [&](auto kernel, int64_t per_access) {
      kernel<<<blocks_for(rows * inter / per_access, kThreads), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
          static_cast<const T*>(gu), static_cast<T*>(a), rows, inter);
    };
    constexpr int V = Pack<T>::kSize;
    if (packs<T>(inter, {gu, a}))
      launch(swiglu_forward_kernel<T, V>, V);
    else
      launch(swiglu_forward_kernel<T, 1>, 1);
  });
  fabric::device::check_launch("swiglu forward");
}

void swiglu_backward(DType t, const void* gu, const void* da, const float* row_weight, void* dgu, void* a_w,
                     float* row_dot, int64_t rows, int64_t inter, void* stream) {
  if (rows == 0) return;
  with_type(t, [&](auto tag) {
    using T = decltype(tag);
    auto s = static_cast<cudaStream_t>(stream);
    auto launch = [&](auto kernel) {
      kernel<<<blocks_for(rows, kWarps), kThreads, 0, s>>>(static_cast<const T*>(gu), static_cast<const T*>(da),
                                                           row_weight, static_cast<T*>(dgu), static_cast<T*>(a_w),
                                                           row_dot, rows, inter);
    };
    if (packs<T>(inter, {gu, da, dgu, a_w ? a_w : dgu}))
      launch(swiglu_backward_kernel<T, Pack<T>::kSize>);
    else
      launch(swiglu_backward_kernel<T, 1>);
  });
  fabric::device::check_launch("swiglu backward");
}

void zero_idle_groups(void* data, const int64_t* offsets, int64_t groups, int64_t group_bytes, void* stream) {
  if (groups == 0 || group_bytes == 0) return;
  if (groups > 65535) throw std::invalid_argument("hyperparallel: zero_idle_groups takes at most 65535 groups");
  // A few blocks a group: an idle expert's gradient is megabytes, an active one's blocks only read two offsets.
  const dim3 grid(std::min(blocks_for(group_bytes / 16 + 1, kThreads), 64u), unsigned(groups));
  zero_idle_groups_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(static_cast<char*>(data), offsets,
                                                                                     group_bytes);
  fabric::device::check_launch("zero_idle_groups");
}

void gather_sum(DType t, const void* src, const int64_t* pos, DType wt, const void* w, int64_t tokens, int64_t k,
                int64_t hidden, void* out, void* stream) {
  if (tokens * hidden == 0) return;
  with_type(t, [&](auto tag) {
    with_type(wt, [&](auto wtag) {
      using T = decltype(tag);
      using Tw = decltype(wtag);
      auto launch = [&](auto kernel, int64_t per_access) {
        kernel<<<blocks_for(tokens * hidden / per_access, kThreads), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
            static_cast<const T*>(src), pos, static_cast<const Tw*>(w), tokens, k, hidden, static_cast<T*>(out));
      };
      constexpr int V = Pack<T>::kSize;
      if (packs<T>(hidden, {src, out}))
        launch(gather_sum_kernel<T, Tw, V>, V);
      else
        launch(gather_sum_kernel<T, Tw, 1>, 1);
    });
  });
  fabric::device::check_launch("gather_sum");
}

}  // namespace hp::ops::cuda
