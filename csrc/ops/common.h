// Helpers shared by the fused ops: argument checks, raw pointers into
// contiguous tensors, the matrix products, op handles.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <string>

namespace hp::ops::detail {

// The element `offset` of a contiguous tensor.
inline const void* elem(const at::Tensor& t, int64_t offset) {
  return static_cast<const char*>(t.const_data_ptr()) + offset * t.element_size();
}
inline void* elem_mut(const at::Tensor& t, int64_t offset) {
  return static_cast<char*>(t.mutable_data_ptr()) + offset * t.element_size();
}

inline void check_float_or_bf16(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, "hyperparallel::", op, ": ", name,
              " is ", t.scalar_type(),
              "; the fused ops run float32 and bfloat16 only (cast the model with .float() or .bfloat16())");
}

inline void check_same_dtype(const at::Tensor& a, const at::Tensor& b, const char* op, const char* a_name,
                             const char* b_name) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "hyperparallel::", op, ": ", a_name, " is ", a.scalar_type(), " but ",
              b_name, " is ", b.scalar_type(), "; cast them to one dtype");
}

// The fused ops' matrix products (matmul.cpp): float32 through gemm.h's
// AVX-512 kernel where it runs and MKL would take its AVX2 path (threads
// split the output), everything else through ATen's mm/addmm; bfloat16
// through float32 on CPUs whose bfloat16 mm is emulated (simd::cpu_native_bf16).
//
// out (+)= a b, out a 2-D view (e.g. a slice of a larger tensor's rows or
// columns); a and b any 2-D views of one dtype with out.
void mm_into(at::Tensor out, const at::Tensor& a, const at::Tensor& b, bool accumulate = false);
// a b as a new contiguous tensor.
at::Tensor product(const at::Tensor& a, const at::Tensor& b);

// c (m x n, row stride ldc) = op(a) op(b), or += when accumulate; op(a) is
// m x k (a stored k x m when trans_a), op(b) is k x n (b stored n x k when
// trans_b). Float32 buffers.
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
          int64_t ldb, float* c, int64_t ldc, bool accumulate);

// The dispatcher's handle of hyperparallel::<name>, so that autograd
// functions call their forward and backward ops where torch.compile sees them.
template <typename Signature>
c10::TypedOperatorHandle<Signature> op_handle(const char* name) {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow((std::string("hyperparallel::") + name).c_str(), "")
      .template typed<Signature>();
}

}  // namespace hp::ops::detail
