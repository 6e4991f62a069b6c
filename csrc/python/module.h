// Each layer's bindings live in their own csrc/python/bind_<layer>.cpp and
// register themselves here, so that adding a layer touches no shared file.
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace hp::python {

using Binder = void (*)(pybind11::module_& module);

// Adds `binder` to the list run when hyperparallel._C is imported. Use as
//   static hp::python::Registrar registrar("fsdp", &bind_fsdp);
struct Registrar {
  Registrar(const char* name, Binder binder);
};

// Runs every registered binder, in name order.
void bind_all(pybind11::module_& module);

}  // namespace hp::python
