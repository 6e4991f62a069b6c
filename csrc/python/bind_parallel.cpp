// Bindings of the CPU threads hp's kernels share with torch: how many threads
// one of their parallel_for loops runs on. at::parallel_for is inline, its
// OpenMP region compiled into our code, so a build without OpenMP would run
// every kernel's loop on one thread whatever torch.get_num_threads() says;
// tests/python/test_nn_ops.py checks this build does not.
#include <ATen/Parallel.h>

#include <atomic>
#include <bit>
#include <cstdint>

#include "module.h"

namespace py = pybind11;

namespace {

int parallel_threads() {
  std::atomic<uint64_t> seen{0};
  at::parallel_for(0, 4 * int64_t(at::get_num_threads()), 1, [&](int64_t, int64_t) {
    seen.fetch_or(uint64_t(1) << (at::get_thread_num() % 64), std::memory_order_relaxed);
  });
  return std::popcount(seen.load());
}

void bind_parallel(py::module_& m) {
  m.def("parallel_threads", &parallel_threads,
        "How many threads a parallel loop of hyperparallel's CPU kernels runs on now (torch.get_num_threads(), at "
        "most 64).");
}

hp::python::Registrar registrar("parallel", &bind_parallel);

}  // namespace
