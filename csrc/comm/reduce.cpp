#include "hyperparallel/comm/reduce.h"

#include <algorithm>
#include <stdexcept>

#define HP_SIMD_BODY "comm/reduce_isa.h"
#define HP_SIMD_NAMESPACE hp::comm::kernels
#include "simd/foreach_isa.h"

namespace hp::comm {
namespace kernels {

// The kernels of the tier simd::isa() chose.
struct Table {
  decltype(&baseline::reduce_rows<float, float>) f32;
  decltype(&baseline::reduce_rows<simd::bf16, simd::bf16>) bf16;
  decltype(&baseline::reduce_rows<simd::bf16, float>) bf16_to_f32;
  decltype(&baseline::reduce_rows<float, simd::bf16>) f32_to_bf16;
};

const Table& table() {
  static const Table chosen{HP_SIMD_PICK(kernels, reduce_rows<float, float>),
                            HP_SIMD_PICK(kernels, reduce_rows<simd::bf16, simd::bf16>),
                            HP_SIMD_PICK(kernels, reduce_rows<simd::bf16, float>),
                            HP_SIMD_PICK(kernels, reduce_rows<float, simd::bf16>)};
  return chosen;
}

}  // namespace kernels

std::size_t dtype_size(DType dtype) { return dtype == DType::F32 ? 4 : 2; }

Range chunk(std::size_t rows, int parts, int index) {
  if (parts <= 0 || index < 0 || index >= parts) throw std::out_of_range("chunk: index outside [0, parts)");
  const std::size_t per = (rows + parts - 1) / parts;
  Range range;
  range.begin = std::min(rows, per * index);
  range.end = std::min(rows, range.begin + per);
  return range;
}

void reduce(void* out, DType out_dtype, const void* const* srcs, int count, std::size_t n, DType dtype,
            float scale) {
  if (count < 1) throw std::invalid_argument("reduce: needs at least one source");
  const kernels::Table& k = kernels::table();
  if (dtype == DType::F32) {
    auto* f32_srcs = reinterpret_cast<const float* const*>(srcs);
    if (out_dtype == DType::F32)
      k.f32(static_cast<float*>(out), f32_srcs, count, n, scale);
    else
      k.f32_to_bf16(static_cast<simd::bf16*>(out), f32_srcs, count, n, scale);
    return;
  }
  auto* bf16_srcs = reinterpret_cast<const simd::bf16* const*>(srcs);
  if (out_dtype == DType::F32)
    k.bf16_to_f32(static_cast<float*>(out), bf16_srcs, count, n, scale);
  else
    k.bf16(static_cast<simd::bf16*>(out), bf16_srcs, count, n, scale);
}

void reduce(void* out, const void* const* srcs, int count, std::size_t n, DType dtype, float scale) {
  reduce(out, dtype, srcs, count, n, dtype, scale);
}

}  // namespace hp::comm
