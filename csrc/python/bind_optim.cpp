// Bindings of hp::optim. Bindings only: the logic lives in csrc/optim.
#include <torch/extension.h>

#include "hyperparallel/optim/newton_schulz.h"
#include "module.h"

namespace py = pybind11;
using namespace hp;

namespace {

void bind_optim(py::module_& m) {
  py::class_<optim::NsOptions>(m, "NsOptions")
      .def(py::init([](double a, double b, double c, int64_t steps, double eps) {
             return optim::NsOptions{a, b, c, steps, eps};
           }),
           py::arg("a"), py::arg("b"), py::arg("c"), py::arg("steps"), py::arg("eps"));
  m.def("newton_schulz_", &optim::newton_schulz_, py::arg("batch"), py::arg("options"),
        py::call_guard<py::gil_scoped_release>());
  m.def("optim_stats", [] {
    auto stats = optim::ns_stats();
    return py::dict(py::arg("ns_calls") = stats.calls, py::arg("ns_matrices") = stats.matrices);
  });
  m.def("reset_optim_stats", &optim::reset_ns_stats);

}

hp::python::Registrar registrar("optim", &bind_optim);

}  // namespace
