// The fused ops' matrix products (common.h): gemm.h's float32 kernel where it
// runs and MKL would not run AVX-512 code, ATen's mm/addmm otherwise;
// bfloat16 ones in float32 where the CPU has no bfloat16 dot products.
#include <ATen/Parallel.h>

#include <optional>
#include <utility>

#include "common.h"
#include "gemm.h"
#include "simd/isa.h"

namespace hp::ops::detail {
namespace {

// On Intel's CPUs ATen's float32 mm is MKL's AVX-512 sgemm, which beats the
// kernel there (docs/nn.md has the figures); the kernel is for the CPUs on
// which MKL takes its AVX2 path (gemm.h).
bool own_kernel() {
  static const bool yes = ops::gemm::available() && !simd::cpu_intel();
  return yes;
}

// torch's bfloat16 mm on x86 is oneDNN's. Without bfloat16 dot products
// (simd::cpu_native_bf16) oneDNN emulates them with two float32 FMAs, about
// 33 GF/s on an Ice Lake core against MKL's float32 127-152 (and on most AVX2
// CPUs ATen's own loops run them). There the products run in float32 on
// widened copies: a product of two bfloat16 numbers is exact in float32, so
// the result is a float32 sum of exact products rounded once, as oneDNN's
// is, in the float32 GEMM's order.
bool widen_bf16() {
  static const bool yes = !simd::cpu_native_bf16();
  return yes;
}

// A widened product runs in blocks: out's rows and columns up to
// kWidenSide at a time, k in slices that keep each float32 block (of a, of b,
// and the sums) within kWidenBlockBytes. That bounds the extra memory
// whatever the shapes (a Qwen3 LM head's weight, 151936 x 2048, would take
// 1.2 GB in float32) and keeps each block under glibc's 32 MiB ceiling for
// serving freed memory again: a larger one is mapped afresh and page-faulted
// on every call. Blocks are large because each GEMM call packs its operands
// again (and each block widens its slices of a and b again): on the LM
// head's products (Ice Lake, one core) 24 MiB blocks make the widened
// products as fast as float32 ones, 4 MiB blocks 10-30% slower.
constexpr int64_t kWidenBlockBytes = int64_t(24) << 20;
constexpr int64_t kWidenSide = 2048;

// Output columns or rows per thread come in multiples of this (the kernel's
// tile width), and a thread gets at least kMinWork multiply-adds: below
// that, waking threads costs more than it saves.
constexpr int64_t kSplitAlign = 32;
constexpr double kMinWork = 1 << 20;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// c (+)= op(a) op(b) with the kernel, c split into column (or row) slices
// over torch's intra-op threads; one thread inside a parallel region (the
// attention's heads are already spread over them).
void run(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
         int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  const auto fit = static_cast<int64_t>(static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) /
                                        kMinWork);
  const int64_t tasks = std::clamp<int64_t>(fit, 1, threads);
  if (tasks == 1) {
    ops::gemm::sgemm(trans_a, trans_b, m, n, k, a, lda, b, ldb, c, ldc, accumulate);
    return;
  }
  const bool by_columns = n >= m;
  const int64_t extent = by_columns ? n : m;
  const int64_t chunk = ceil_div(ceil_div(extent, tasks), kSplitAlign) * kSplitAlign;
  at::parallel_for(0, ceil_div(extent, chunk), 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t at = task * chunk, size = std::min(chunk, extent - at);
      if (by_columns) {
        ops::gemm::sgemm(trans_a, trans_b, m, size, k, a, lda, trans_b ? b + at * ldb : b + at, ldb, c + at, ldc,
                         accumulate);
      } else {
        ops::gemm::sgemm(trans_a, trans_b, size, n, k, trans_a ? a + at : a + at * lda, lda, b, ldb, c + at * ldc,
                         ldc, accumulate);
      }
    }
  });
}

// How a 2-D view sits in memory for the kernel: row-major (trans = false,
// rows ld apart) or column-major (trans = true, columns ld apart), without
// overlapping itself; nothing when neither (a general strided view).
struct Layout {
  bool trans;
  int64_t ld;
};
std::optional<Layout> layout(const at::Tensor& t) {
  const int64_t rows = t.size(0), cols = t.size(1), s0 = t.stride(0), s1 = t.stride(1);
  if ((s1 == 1 || cols == 1) && (rows == 1 || s0 >= cols)) return Layout{false, rows == 1 ? cols : s0};
  if ((s0 == 1 || rows == 1) && (cols == 1 || s1 >= rows)) return Layout{true, cols == 1 ? rows : s1};
  return std::nullopt;
}

// t as the kernel reads it, with its layout: t itself, or a contiguous copy
// of a view it cannot read (rare: the callers pass rows, columns and
// transposes of contiguous tensors).
std::pair<at::Tensor, Layout> readable(const at::Tensor& t) {
  if (const auto l = layout(t)) return {t, *l};
  at::Tensor copy = t.contiguous();
  return {copy, *layout(copy)};
}

inline at::Tensor float_matrix(const float* p, int64_t rows, int64_t cols, int64_t ld) {
  return at::from_blob(const_cast<float*>(p), {rows, cols}, {ld, 1}, at::TensorOptions().dtype(at::kFloat));
}

// out (bfloat16) (+)= a b for bfloat16 a and b, in float32 (widen_bf16), in
// blocks (kWidenBlockBytes); each of out's blocks is rounded once.
void mm_widened(at::Tensor out, const at::Tensor& a, const at::Tensor& b, bool accumulate) {
  const int64_t m = out.size(0), n = out.size(1), k = a.size(1);
  if (m == 0 || n == 0) return;
  const int64_t rows = std::min(m, kWidenSide), cols = std::min(n, kWidenSide);
  const int64_t depth = std::max<int64_t>(1, kWidenBlockBytes / int64_t(sizeof(float)) / std::max(rows, cols));
  for (int64_t j = 0; j < n; j += cols)
    for (int64_t i = 0; i < m; i += rows) {
      at::Tensor part = out.narrow(0, i, std::min(rows, m - i)).narrow(1, j, std::min(cols, n - j));
      const auto floats = part.options().dtype(at::kFloat);
      at::Tensor sums = accumulate ? part.to(at::kFloat) : k == 0 ? at::zeros(part.sizes(), floats)
                                                                   : at::empty(part.sizes(), floats);
      for (int64_t p = 0; p < k; p += depth) {
        const int64_t d = std::min(depth, k - p);
        mm_into(sums, a.narrow(0, i, part.size(0)).narrow(1, p, d).to(at::kFloat),
                b.narrow(0, p, d).narrow(1, j, part.size(1)).to(at::kFloat), accumulate || p > 0);
      }
      part.copy_(sums);
    }
}

}  // namespace

void mm_into(at::Tensor out, const at::Tensor& a, const at::Tensor& b, bool accumulate) {
  const at::ScalarType type = out.scalar_type();
  const bool one_type = a.scalar_type() == type && b.scalar_type() == type;
  if (one_type && type == at::kBFloat16 && widen_bf16()) {
    mm_widened(std::move(out), a, b, accumulate);
    return;
  }
  const bool floats = one_type && type == at::kFloat;
  const auto c = floats && own_kernel() ? layout(out) : std::nullopt;
  if (c && !c->trans) {
    const auto [a_in, la] = readable(a);
    const auto [b_in, lb] = readable(b);
    run(la.trans, lb.trans, out.size(0), out.size(1), a.size(1), a_in.const_data_ptr<float>(), la.ld,
        b_in.const_data_ptr<float>(), lb.ld, out.mutable_data_ptr<float>(), c->ld, accumulate);
  } else if (accumulate) {
    out.addmm_(a, b);
  } else {
    at::mm_out(out, a, b);
  }
}

at::Tensor product(const at::Tensor& a, const at::Tensor& b) {
  at::Tensor out = at::empty({a.size(0), b.size(1)}, a.options());
  mm_into(out, a, b);
  return out;
}

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
          int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  if (own_kernel()) {
    run(trans_a, trans_b, m, n, k, a, lda, b, ldb, c, ldc, accumulate);
    return;
  }
  const at::Tensor A = trans_a ? float_matrix(a, k, m, lda).t() : float_matrix(a, m, k, lda);
  const at::Tensor B = trans_b ? float_matrix(b, n, k, ldb).t() : float_matrix(b, k, n, ldb);
  mm_into(float_matrix(c, m, n, ldc), A, B, accumulate);
}

}  // namespace hp::ops::detail
