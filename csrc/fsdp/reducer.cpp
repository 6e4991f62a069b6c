#include "hyperparallel/fsdp/reducer.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

namespace hp::fsdp {

Reducer::Reducer() : thread_([this] { loop(); }) {}

Reducer::~Reducer() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  thread_.join();
}

ReduceTicket Reducer::submit(std::function<void()> task) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (error_) std::rethrow_exception(error_);
  queue_.push_back(std::move(task));
  changed_.notify_all();
  return ++submitted_;
}

void Reducer::wait(ReduceTicket ticket) {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [&] { return finished_ >= ticket || error_; });
  if (error_) std::rethrow_exception(error_);
}

void Reducer::drain() {
  ReduceTicket last;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    last = submitted_;
  }
  wait(last);
}

void Reducer::loop() {
  // Reductions are memory-bound passes: one thread, not the intra-op pool.
  at::set_num_threads(1);
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    changed_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, nothing left
    auto task = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    std::exception_ptr error;
    try {
      task();
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    if (error && !error_) error_ = error;
    ++finished_;
    changed_.notify_all();
  }
}

}  // namespace hp::fsdp
