// Exchanges a few small strings between the ranks of one node while the
// fabric starts up. After start-up every signal goes through shared memory.
#pragma once

#include <chrono>
#include <string>

namespace hp::fabric {

class Bootstrap {
 public:
  virtual ~Bootstrap() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // Blocks until `key` is set; raises std::runtime_error after `timeout`.
  virtual std::string get(const std::string& key, std::chrono::milliseconds timeout) = 0;
};

// A bootstrap over a directory every rank can see (each key one file, written
// atomically by rename). For programs without a c10d store; the torch layer
// uses the job's c10d store instead.
class FileBootstrap : public Bootstrap {
 public:
  explicit FileBootstrap(std::string directory);
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key, std::chrono::milliseconds timeout) override;

 private:
  std::string path_of(const std::string& key) const;
  std::string directory_;
};

}  // namespace hp::fabric
