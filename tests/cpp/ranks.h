// Runs a function on N real processes, each a rank of one node with its own
// Fabric, and reports how each ended.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "hyperparallel/fabric/fabric.h"

namespace hp::testing {

// Throws from inside a rank; the rank exits non-zero and the parent test fails.
inline void check(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("check failed: " + what);
}

struct RankExit {
  int status = 0;      // exit code, or -signal
  std::string error;   // what the rank threw, if anything
};

// Forks `world` ranks. Each builds its Fabric over a FileBootstrap in a fresh
// directory and runs body(rank, fabric). A rank exits 0 when body returns.
inline std::vector<RankExit> run_ranks(int world, const std::function<void(int, std::shared_ptr<fabric::Fabric>)>& body,
                                       fabric::Options options = fabric::Options{}) {
  char dir_template[] = "/tmp/hp-test-XXXXXX";
  std::string dir = mkdtemp(dir_template);
  std::vector<pid_t> pids;
  std::vector<std::string> error_files;
  for (int rank = 0; rank < world; ++rank) {
    error_files.push_back(dir + "/error." + std::to_string(rank));
    pid_t pid = fork();
    if (pid == 0) {
      int code = 0;
      try {
        fabric::FileBootstrap bootstrap(dir + "/bootstrap");
        auto topology = fabric::Topology::make(rank, world, rank, world, 0);
        auto fab = std::make_shared<fabric::Fabric>(topology, bootstrap, options);
        body(rank, fab);
      } catch (const std::exception& error) {
        FILE* out = std::fopen(error_files.back().c_str(), "w");
        if (out) {
          std::fputs(error.what(), out);
          std::fclose(out);
        }
        code = 1;
      }
      std::fflush(nullptr);
      _exit(code);
    }
    pids.push_back(pid);
  }
  std::vector<RankExit> exits(world);
  for (int rank = 0; rank < world; ++rank) {
    int status = 0;
    waitpid(pids[rank], &status, 0);
    exits[rank].status = WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
    FILE* in = std::fopen(error_files[rank].c_str(), "r");
    if (in) {
      char buffer[2048] = {0};
      exits[rank].error = std::string(buffer, std::fread(buffer, 1, sizeof buffer - 1, in));
      std::fclose(in);
    }
  }
  std::filesystem::remove_all(dir);
  return exits;
}

// The names this user has in /dev/shm that belong to hyperparallel.
inline std::vector<std::string> leftover_segments() {
  std::vector<std::string> names;
  std::string prefix = "hp-" + std::to_string(getuid()) + "-";
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
    std::string name = entry.path().filename();
    if (name.rfind(prefix, 0) == 0) names.push_back(name);
  }
  return names;
}

}  // namespace hp::testing
