// Compiles kernels_isa.h once per instruction-set tier and picks one.
#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#define HP_SIMD_BODY "ops/kernels_isa.h"
#define HP_SIMD_NAMESPACE hp::ops::cpu
#include "simd/foreach_isa.h"

namespace hp::ops::cpu {

const Kernels& kernels() {
  static const Kernels chosen = HP_SIMD_PICK(cpu, table)();
  return chosen;
}

}  // namespace hp::ops::cpu
