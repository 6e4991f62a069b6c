#include "hyperparallel/fsdp/param_group.h"

#include <c10/util/Exception.h>

#include <mutex>

#include "group_cpu.h"

namespace hp::fsdp {
namespace {

std::map<c10::DeviceType, GroupFactory>& factories() {
  static std::map<c10::DeviceType, GroupFactory> registered;
  return registered;
}

std::mutex& factories_mutex() {
  static std::mutex mutex;
  return mutex;
}

}  // namespace

Context::Context(std::shared_ptr<comm::Communicator> communicator)
    : communicator_(std::move(communicator)), reducer_(std::make_shared<Reducer>()) {}

double Context::wait_seconds(bool reset) {
  const int64_t ns = reset ? wait_ns_.exchange(0) : wait_ns_.load();
  return double(ns) / 1e9;
}

void Context::count_wait(std::chrono::steady_clock::time_point since) {
  wait_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - since).count();
}

void register_group_factory(c10::DeviceType type, GroupFactory factory) {
  std::lock_guard<std::mutex> lock(factories_mutex());
  factories()[type] = factory;
}

bool ParamGroup::all_reduce_across_nodes(at::Tensor& output, c10d::ProcessGroup& replicate, bool all_reduce) {
  if (held_.defined()) {
    output.add_(held_);
    held_ = at::Tensor();
  }
  if (!all_reduce) {
    held_ = output.clone();  // the output's memory may be handed out by a later reduction
    return false;
  }
  std::vector<at::Tensor> tensors{output};
  replicate.allreduce(tensors)->wait();
  return true;
}

std::shared_ptr<ParamGroup> ParamGroup::create(std::shared_ptr<Context> context, const std::vector<at::Tensor>& params,
                                               GroupOptions options) {
  TORCH_CHECK(!params.empty(), "hyperparallel fully_shard: the module has no parameters to shard");
  const c10::Device device = params[0].device();
  for (const auto& param : params)
    TORCH_CHECK(param.device() == device, "hyperparallel fully_shard: parameters on ", device, " and ", param.device(),
                "; all of a module's parameters must be on one device");
  if (device.is_cpu()) return make_cpu_group(std::move(context), params, std::move(options));
  GroupFactory factory = nullptr;
  {
    std::lock_guard<std::mutex> lock(factories_mutex());
    auto it = factories().find(device.type());
    if (it != factories().end()) factory = it->second;
  }
  TORCH_CHECK(factory, "hyperparallel fully_shard: parameters on ", device, ", but this build of hyperparallel has no ",
              c10::DeviceTypeName(device.type()), " backend; rebuild it against a torch with ",
              c10::DeviceTypeName(device.type()), " (and nvcc on PATH for CUDA), or move the module to the CPU");
  return factory(std::move(context), params, std::move(options));
}

}  // namespace hp::fsdp
