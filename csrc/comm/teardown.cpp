#include "hyperparallel/comm/teardown.h"

#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

namespace hp::comm {
namespace {

constexpr const char* kGlooWorker = "pt_gloo_runloop";
// Looks in a row that must find every worker asleep, and the pause between
// them: together several of Python's 5 ms GIL switch intervals, so that a
// worker asleep waiting for the GIL (held by another Python thread) gets it,
// and is seen runnable, before the looks are done.
constexpr int kQuietLooks = 5;
constexpr std::chrono::milliseconds kLookInterval{5};

// Whether every Gloo worker thread is asleep (state S in /proc).
bool gloo_workers_asleep() {
  std::error_code error;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task", error)) {
    std::string name;
    std::ifstream(task.path() / "comm") >> name;
    if (name != kGlooWorker) continue;
    std::string stat;
    std::getline(std::ifstream(task.path() / "stat"), stat);
    // "tid (comm) S ...": the state follows the last ')'.
    const auto close = stat.rfind(')');
    if (close == std::string::npos || close + 2 >= stat.size()) continue;  // the thread just ended
    if (stat[close + 2] != 'S') return false;
  }
  return true;
}

}  // namespace

bool wait_gloo_workers_idle(std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  int quiet = 0;
  // At exit only: a short poll, there is nothing to be signalled by.
  while (quiet < kQuietLooks) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(kLookInterval);
    quiet = gloo_workers_asleep() ? quiet + 1 : 0;
  }
  return true;
}

}  // namespace hp::comm
