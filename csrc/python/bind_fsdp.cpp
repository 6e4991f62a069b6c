// Bindings of the FSDP parameter group. Bindings only: the logic lives in
// csrc/fsdp.
#include <torch/extension.h>

#include "hyperparallel/fsdp/param_group.h"
#include "module.h"

namespace py = pybind11;
using namespace hp;

namespace {

void bind_fsdp(py::module_& m) {
  using fsdp::ParamGroup;
  py::class_<fsdp::Context, std::shared_ptr<fsdp::Context>>(m, "FSDPContext")
      .def(py::init<std::shared_ptr<comm::Communicator>>(), py::arg("communicator"))
      .def(
          "stop", [](fsdp::Context& context) { context.reducer()->stop(); },
          py::call_guard<py::gil_scoped_release>())
      .def("wait_seconds", &fsdp::Context::wait_seconds, py::arg("reset") = false);
  py::class_<ParamGroup, std::shared_ptr<ParamGroup>>(m, "ParamGroup")
      .def(py::init([](std::shared_ptr<fsdp::Context> context, const std::vector<at::Tensor>& params,
                       std::optional<at::ScalarType> param_dtype, std::optional<at::ScalarType> reduce_dtype,
                       c10::intrusive_ptr<c10d::ProcessGroup> replicate) {
             py::gil_scoped_release no_gil;
             return ParamGroup::create(context, params, fsdp::GroupOptions{param_dtype, reduce_dtype, replicate});
           }),
           py::arg("context"), py::arg("params"), py::arg("param_dtype") = py::none(),
           py::arg("reduce_dtype") = py::none(), py::arg("replicate") = nullptr)
      .def_property_readonly("full", &ParamGroup::full)
      .def_property_readonly("shards", &ParamGroup::shards)
      .def("publish", &ParamGroup::publish, py::call_guard<py::gil_scoped_release>())
      .def("begin_unshard", &ParamGroup::begin_unshard, py::call_guard<py::gil_scoped_release>())
      .def("wait_unshard", &ParamGroup::wait_unshard, py::call_guard<py::gil_scoped_release>())
      .def("reshard", &ParamGroup::reshard, py::call_guard<py::gil_scoped_release>())
      .def("reduce", &ParamGroup::reduce, py::arg("grads"),
           py::call_guard<py::gil_scoped_release>())
      .def("sharded_grads", &ParamGroup::sharded_grads, py::call_guard<py::gil_scoped_release>())
      .def("sharded_grad_buffer", &ParamGroup::sharded_grad_buffer)
      .def("release", &ParamGroup::release, py::call_guard<py::gil_scoped_release>())
      .def("discard_held", &ParamGroup::discard_held, py::call_guard<py::gil_scoped_release>())
      .def("set_gradient_divide_factor", &ParamGroup::set_gradient_divide_factor, py::arg("factor"))
      .def("set_requires_all_reduce", &ParamGroup::set_requires_all_reduce, py::arg("required"));
}

hp::python::Registrar registrar("fsdp", &bind_fsdp);

}  // namespace
