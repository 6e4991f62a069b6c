#include "module.h"

#include <map>
#include <string>

namespace hp::python {
namespace {

std::map<std::string, Binder>& binders() {
  static std::map<std::string, Binder> registered;  // built during static initialisation
  return registered;
}

}  // namespace

Registrar::Registrar(const char* name, Binder binder) { binders()[name] = binder; }

void bind_all(pybind11::module_& module) {
  for (auto& [name, binder] : binders()) binder(module);
}

}  // namespace hp::python

PYBIND11_MODULE(_C, m) {
  m.doc() = "hyperparallel's C++ core";
  hp::python::bind_all(m);
}
