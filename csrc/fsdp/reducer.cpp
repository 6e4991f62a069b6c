#include "hyperparallel/fsdp/reducer.h"

#include <pthread.h>

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

namespace hp::fsdp {

Reducer::Reducer() : thread_([this] { loop(); }) {}

Reducer::~Reducer() { stop(); }

void Reducer::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  if (thread_.joinable()) thread_.join();
  std::deque<std::function<void()>> finished;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    finished.swap(finished_tasks_);
  }
}

ReduceTicket Reducer::submit(std::function<void()> task) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (error_) std::rethrow_exception(error_);
  TORCH_CHECK(!stopping_, "hyperparallel fsdp: hp.comm.shutdown() ran; a sharded module cannot run backward after it");
  queue_.push_back(std::move(task));
  changed_.notify_all();
  return ++submitted_;
}

void Reducer::wait(ReduceTicket ticket) {
  std::deque<std::function<void()>> finished;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return finished_ >= ticket || error_; });
    finished.swap(finished_tasks_);
    if (error_) std::rethrow_exception(error_);
  }
  // `finished` goes here, in the waiting thread.
}

void Reducer::loop() {
  pthread_setname_np(pthread_self(), "hp-reducer");  // in top, gdb, /proc/<pid>/task
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
    finished_tasks_.push_back(std::move(task));
    if (error && !error_) error_ = error;
    ++finished_;
    changed_.notify_all();
  }
}

}  // namespace hp::fsdp
