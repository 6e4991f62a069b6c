// One POSIX shared-memory segment mapped into this process (RAII).
#pragma once

#include <cstddef>
#include <string>

namespace hp::fabric {

class Segment {
 public:
  // Creates a new segment `name` (mode 0600, exclusive) of `bytes`, backed
  // by reserved memory: a full /dev/shm is reported here, not as a SIGBUS
  // later. The name stays until unlink().
  static Segment create(const std::string& name, std::size_t bytes);
  // Maps an existing segment.
  static Segment open(const std::string& name, std::size_t bytes);

  Segment(Segment&& other) noexcept;
  Segment& operator=(Segment&& other) noexcept;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  ~Segment();

  void* data() const { return data_; }
  std::size_t size() const { return size_; }
  const std::string& name() const { return name_; }
  // Removes the name; the mapping stays valid. Idempotent.
  void unlink();

 private:
  Segment(std::string name, void* data, std::size_t bytes, bool owns_name);
  std::string name_;
  void* data_ = nullptr;
  std::size_t size_ = 0;
  bool owns_name_ = false;
};

// Segment names are /hp-<uid>-<pid of creator>-<nonce>-<n>. Removes every
// segment of this user whose creating process no longer exists: what a
// killed job left behind. Returns how many were removed.
int sweep_stale_segments();
// The prefix for names created by this process.
std::string segment_prefix();

}  // namespace hp::fabric
