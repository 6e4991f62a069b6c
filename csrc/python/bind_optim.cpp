// Bindings of hp::optim. Bindings only: the logic lives in csrc/optim.
#include <torch/extension.h>

#include "hyperparallel/optim/assignment.h"
#include "hyperparallel/optim/muon.h"
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
  // The owner of each item, as hp.optim.Muon's plan assigns matrices; for cost models (bench/model.py).
  m.def(
      "assign_owners",
      [](const std::vector<int64_t>& costs, const std::vector<std::vector<int>>& homes, int ranks) {
        return optim::assign_owners(costs, homes, ranks).owner;
      },
      py::arg("costs"), py::arg("homes"), py::arg("ranks"));
  m.def("optim_stats", [] {
    auto stats = optim::ns_stats();
    return py::dict(py::arg("ns_calls") = stats.calls, py::arg("ns_matrices") = stats.matrices,
                    py::arg("muon_peer_bytes") = optim::muon_peer_bytes());
  });
  m.def("reset_optim_stats", [] {
    optim::reset_ns_stats();
    optim::reset_muon_peer_bytes();
  });

  py::enum_<optim::AdjustLr>(m, "AdjustLr")
      .value("ORIGINAL", optim::AdjustLr::Original)
      .value("MATCH_RMS_ADAMW", optim::AdjustLr::MatchRmsAdamw);
  py::class_<optim::ParamSpec>(m, "MuonParam")
      .def(py::init([](std::vector<int64_t> shape, bool sharded, optim::NsOptions ns) {
             return optim::ParamSpec{std::move(shape), sharded, ns};
           }),
           py::arg("shape"), py::arg("sharded"), py::arg("ns"));
  py::class_<optim::StepOptions>(m, "MuonStepOptions")
      .def(py::init([](double lr, double weight_decay, double momentum, bool nesterov, optim::AdjustLr adjust_lr) {
             return optim::StepOptions{lr, weight_decay, momentum, nesterov, adjust_lr};
           }),
           py::arg("lr"), py::arg("weight_decay"), py::arg("momentum"), py::arg("nesterov"), py::arg("adjust_lr"));
  py::class_<optim::MeshLayout>(m, "MeshLayout")
      .def(py::init([](std::vector<int64_t> shard, std::vector<int64_t> replica) {
             return optim::MeshLayout{std::move(shard), std::move(replica)};
           }),
           py::arg("shard"), py::arg("replica"));
  py::class_<optim::MuonPlan, std::shared_ptr<optim::MuonPlan>>(m, "Muon")
      .def(py::init(&optim::MuonPlan::create), py::arg("params"), py::arg("comm"), py::arg("mesh"),
           py::arg("counterparts"), py::arg("device") = c10::Device(c10::kCPU),
           py::keep_alive<1, 3>(),  // the plan uses the communicator
           py::call_guard<py::gil_scoped_release>())
      .def("step", &optim::MuonPlan::step, py::arg("params"), py::arg("grads"), py::arg("momentum"),
           py::arg("options"), py::call_guard<py::gil_scoped_release>())
      .def("owned", &optim::MuonPlan::owned)
      .def_property_readonly("balance", &optim::MuonPlan::balance);
}

hp::python::Registrar registrar("optim", &bind_optim);

}  // namespace
