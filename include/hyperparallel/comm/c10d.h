// c10d calls whose names changed between the torch releases hyperparallel
// supports (2.11 and newer): 2.12 renamed the single-tensor collectives and
// kept the old names only as deprecated aliases.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/headeronly/version.h>

#include <vector>

#if TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 12
#define HP_C10D_RENAMED 1
#else
#define HP_C10D_RENAMED 0
#endif

namespace hp::comm::c10d_compat {

inline c10::intrusive_ptr<c10d::Work> all_gather_single(c10d::ProcessGroup& group, at::Tensor& out, at::Tensor& in) {
#if HP_C10D_RENAMED
  return group.all_gather_single(out, in);
#else
  return group._allgather_base(out, in);
#endif
}

inline c10::intrusive_ptr<c10d::Work> reduce_scatter_single(c10d::ProcessGroup& group, at::Tensor& out,
                                                            at::Tensor& in) {
#if HP_C10D_RENAMED
  return group.reduce_scatter_single(out, in);
#else
  return group._reduce_scatter_base(out, in);
#endif
}

inline c10::intrusive_ptr<c10d::Work> all_to_all_single(c10d::ProcessGroup& group, at::Tensor& out, at::Tensor& in,
                                                        std::vector<int64_t>& out_sizes,
                                                        std::vector<int64_t>& in_sizes) {
#if HP_C10D_RENAMED
  return group.all_to_all_single(out, in, out_sizes, in_sizes);
#else
  return group.alltoall_base(out, in, out_sizes, in_sizes);
#endif
}

}  // namespace hp::comm::c10d_compat
