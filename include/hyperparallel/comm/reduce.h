// Element kinds and the vectorised kernels every collective is made of.
#pragma once

#include <cstddef>
#include <cstdint>

namespace hp::comm {

enum class DType : uint8_t { F32, BF16 };
enum class ReduceOp : uint8_t { Sum, Avg };

std::size_t dtype_size(DType dtype);

// torch.chunk on `rows` rows split `parts` ways: every part has
// ceil(rows/parts) rows except the tail, and trailing parts may be empty.
// The same rows FSDP2 gives each rank, so shards and checkpoints line up.
struct Range {
  std::size_t begin = 0, end = 0;
  std::size_t size() const { return end - begin; }
};
Range chunk(std::size_t rows, int parts, int index);

// out[i] = scale * (srcs[0][i] + srcs[1][i] + ... + srcs[count-1][i]),
// summed in source order in fp32 (bf16 inputs are widened, the sum rounded
// once to nearest-even). Reads each source element once. `out` may alias a
// source. `out_dtype` is `dtype`; F32 keeps a bf16 sum unrounded (for sums
// that continue elsewhere, e.g. across nodes); BF16 rounds an fp32 sum once
// (bf16 parameters whose gradients are reduced in fp32).
void reduce(void* out, const void* const* srcs, int count, std::size_t n, DType dtype, float scale);
void reduce(void* out, DType out_dtype, const void* const* srcs, int count, std::size_t n, DType dtype, float scale);

}  // namespace hp::comm
