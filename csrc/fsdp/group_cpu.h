// The CPU's parameter groups (see param_group.h): full parameters once per
// node in shared memory.
#pragma once

#include "hyperparallel/fsdp/param_group.h"

namespace hp::fsdp {

std::shared_ptr<ParamGroup> make_cpu_group(std::shared_ptr<Context> context, const std::vector<at::Tensor>& params,
                                           GroupOptions options);

}  // namespace hp::fsdp
