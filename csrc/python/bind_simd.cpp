// Bindings of hp::simd: which instruction-set tier this CPU offers, so that
// tests (tests/python/test_simd.py) run each lesser tier and not the default
// one again. The policy itself lives in csrc/simd.
#include "module.h"
#include "simd/isa.h"

namespace py = pybind11;

namespace {

void bind_simd(py::module_& m) {
  m.def(
      "cpu_isa", [] { return std::string(hp::simd::name(hp::simd::cpu_isa())); },
      "The best instruction-set tier this CPU runs, before HP_SIMD's cap: 'avx512', 'avx2' or 'baseline'.");
}

hp::python::Registrar registrar("simd", &bind_simd);

}  // namespace
