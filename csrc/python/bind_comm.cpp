// Bindings of the fabric and the communicator. Bindings only: the logic lives
// in csrc/fabric and csrc/comm.
#include <torch/extension.h>

#include "hyperparallel/comm/communicator.h"
#include "hyperparallel/comm/teardown.h"
#include "hyperparallel/fabric/device.h"
#include "hyperparallel/fabric/fabric.h"
#include "module.h"

namespace py = pybind11;
using namespace hp;

namespace {

void bind_comm(py::module_& m) {
  // Peer failures surface as hyperparallel.FabricError (a RuntimeError).
  static py::exception<fabric::FabricError> fabric_error(m, "FabricError", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr error) {
    try {
      if (error) std::rethrow_exception(error);
    } catch (const fabric::FabricError& e) {
      py::set_error(fabric_error, e.what());
    }
  });

  py::class_<fabric::Topology>(m, "Topology")
      .def_static("from_env", &fabric::Topology::from_env)
      .def_readonly("rank", &fabric::Topology::rank)
      .def_readonly("world_size", &fabric::Topology::world_size)
      .def_readonly("local_rank", &fabric::Topology::local_rank)
      .def_readonly("local_world_size", &fabric::Topology::local_world_size)
      .def_readonly("node", &fabric::Topology::node)
      .def_readonly("num_nodes", &fabric::Topology::num_nodes)
      .def("__repr__", &fabric::Topology::describe);

  py::enum_<comm::ReduceOp>(m, "ReduceOp").value("SUM", comm::ReduceOp::Sum).value("AVG", comm::ReduceOp::Avg);

  m.def("sweep_stale_segments", &fabric::sweep_stale_segments);
  m.def("device_backends", &comm::device_backends);
  m.def("device_held_bytes", &fabric::device::held_bytes);
  m.def(
      "wait_gloo_workers_idle",
      [](double seconds) { return comm::wait_gloo_workers_idle(std::chrono::milliseconds(int64_t(seconds * 1000))); },
      py::arg("seconds"), py::call_guard<py::gil_scoped_release>());

  using comm::Communicator;
  py::class_<Communicator, std::shared_ptr<Communicator>>(m, "Communicator")
      .def(py::init<fabric::Topology, c10::intrusive_ptr<c10d::Store>, c10::intrusive_ptr<c10d::ProcessGroup>>(),
           py::arg("topology"), py::arg("store"), py::arg("cross_node") = nullptr,
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("topology", &Communicator::topology)
      .def("barrier", &Communicator::barrier, py::call_guard<py::gil_scoped_release>())
      .def("broadcast", &Communicator::broadcast, py::call_guard<py::gil_scoped_release>())
      .def("all_reduce", &Communicator::all_reduce, py::call_guard<py::gil_scoped_release>())
      .def("all_gather", &Communicator::all_gather, py::call_guard<py::gil_scoped_release>())
      .def("reduce_scatter", &Communicator::reduce_scatter, py::call_guard<py::gil_scoped_release>())
      .def("shared_empty", &Communicator::shared_empty, py::call_guard<py::gil_scoped_release>())
      .def("symmetric_empty", &Communicator::symmetric_empty, py::arg("sizes"), py::arg("dtype"),
           py::arg("device") = c10::Device(c10::kCPU), py::call_guard<py::gil_scoped_release>())
      .def("acquire", &Communicator::acquire, py::call_guard<py::gil_scoped_release>())
      .def("all_gather_shared", &Communicator::all_gather_shared, py::call_guard<py::gil_scoped_release>())
      .def("reduce_scatter_symmetric", &Communicator::reduce_scatter_symmetric,
           py::call_guard<py::gil_scoped_release>())
      .def("stats",
           [](const Communicator& self) {
             return py::dict(py::arg("bytes_copied") = self.stats().bytes_copied,
                             py::arg("bytes_reduced") = self.stats().bytes_reduced);
           })
      .def("reset_stats", &Communicator::reset_stats)
      .def("shutdown", &Communicator::shutdown, py::call_guard<py::gil_scoped_release>());
}

hp::python::Registrar registrar("comm", &bind_comm);

}  // namespace
