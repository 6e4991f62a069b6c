// Newton–Schulz orthogonalisation with torch.optim.Muon's numerics, on a
// batch of same-shape matrices.
//
// torch 2.13 orthogonalises one matrix at a time in bfloat16: transpose to the
// wide orientation, divide by the Frobenius norm, then `steps` rounds of
//   G = X Xᵀ;  H = b G + c G G;  X = a X + H X.
// Here one call takes a batch: small matrices share each GEMM call, large
// ones take turns so that their operands stay in cache. The two products
// whose results are symmetric (G, and G G) are computed only on the upper
// triangle and mirrored: with AVX-512 bfloat16 dot products by our own kernel
// (csrc/optim/gram.h), which sums each element as oneDNN's GEMM does, and
// otherwise one row panel of torch's own GEMM at a time. Either way every
// element is the same dot product in the same order as in torch's GEMM, so
// the results are bit for bit torch's (tests/python/test_muon.py checks it).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace hp::optim {

// torch.optim.Muon's defaults.
struct NsOptions {
  double a = 3.4445, b = -4.775, c = 2.0315;
  int64_t steps = 5;
  double eps = 1e-7;
  bool operator==(const NsOptions&) const = default;
};

// Orthogonalises every batch[i] in place. `batch`: [count, rows, cols],
// contiguous bfloat16. The result equals torch.optim.Muon's
// _zeropower_via_newtonschulz(batch[i]) for each i.
void newton_schulz_(const at::Tensor& batch, const NsOptions& options);

// Counted by every newton_schulz_ call of this process: the calls (one per
// batch) and the matrices they orthogonalised.
struct NsStats {
  uint64_t calls = 0;
  uint64_t matrices = 0;
};
NsStats ns_stats();
void reset_ns_stats();

}  // namespace hp::optim
