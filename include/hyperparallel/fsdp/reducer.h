// A thread that runs gradient reductions in the order they were handed in, so
// that backward goes on while peers catch up and rows are summed.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

namespace hp::fsdp {

// Identifies one submitted task: wait(ticket) returns once it ran.
using ReduceTicket = uint64_t;

class Reducer {
 public:
  Reducer();
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  ReduceTicket submit(std::function<void()> task);
  // Blocks until the task with `ticket` (and every earlier one) has run.
  // Rethrows the first error a task raised; the reducer then refuses new work.
  void wait(ReduceTicket ticket);
  // Blocks until every submitted task has run.
  void drain();

 private:
  void loop();
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::function<void()>> queue_;
  ReduceTicket submitted_ = 0, finished_ = 0;
  std::exception_ptr error_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace hp::fsdp
