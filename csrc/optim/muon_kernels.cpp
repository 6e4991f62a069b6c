// Compiles muon_kernels_isa.h once per instruction-set tier and picks one.
#include "muon_kernels.h"

#define HP_SIMD_BODY "optim/muon_kernels_isa.h"
#define HP_SIMD_NAMESPACE hp::optim::muon_passes
#include "simd/foreach_isa.h"

namespace hp::optim {

const MuonKernels& muon_kernels() {
  static const MuonKernels chosen = HP_SIMD_PICK(muon_passes, table)();
  return chosen;
}

}  // namespace hp::optim
