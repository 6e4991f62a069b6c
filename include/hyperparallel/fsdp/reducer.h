// A thread that runs gradient reductions in the order they were handed in, so
// that backward goes on while peers catch up and rows are summed.
//
// The thread never drops the last reference to what a task captured: a task's
// tensors may be Python's, and releasing one takes the GIL, which a thread
// must not do once the interpreter is finalising. Finished tasks are destroyed
// by the thread that waits for them (or by stop()).
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
  // stop().
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // Raises if stop() ran.
  ReduceTicket submit(std::function<void()> task);
  // Blocks until the task with `ticket` (and every earlier one) has run.
  // Rethrows the first error a task raised; the reducer then refuses new work.
  void wait(ReduceTicket ticket);
  // Runs what was submitted, joins the thread and destroys the finished tasks
  // here. Idempotent; later submits raise (hp.comm.shutdown()).
  void stop();

 private:
  void loop();
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::function<void()>> queue_;
  std::deque<std::function<void()>> finished_tasks_;  // ran; destroyed by the waiter
  ReduceTicket submitted_ = 0, finished_ = 0;
  std::exception_ptr error_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace hp::fsdp
