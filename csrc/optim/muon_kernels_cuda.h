// hp.optim.Muon's elementwise passes on a GPU (muon_kernels.cu), torch-free:
// raw pointers to contiguous float32 / bfloat16 elements and an opaque stream
// (a cudaStream_t). The same passes as the CPU's (muon_kernels.h), each
// element computed by muon_math.h: one pass where ATen's ops take two or
// three: bandwidth, which on 768 x 2048 experts is, by an estimate of bytes
// against the GEMMs' FLOPs, a quarter to a third of a batched torch Muon step.
#pragma once

#include <cstdint>

namespace hp::optim::cuda {

// Momentum on n floats: buf = lerp(buf, grad, 1 - momentum) and the update
// (nesterov: lerp(grad, buf, momentum), else buf) rounded to bfloat16 into
// out (its bits).
void momentum(float* buf, const float* grad, uint16_t* out, int64_t n, double momentum, bool nesterov, void* stream);
// param = param * decay + alpha * float(update): torch's mul_ then
// add_(update, alpha=alpha).
void apply(float* param, const uint16_t* update, int64_t n, float decay, float alpha, void* stream);

}  // namespace hp::optim::cuda
