#include "hyperparallel/fabric/segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>
#include <stdexcept>

#include "sys.h"

namespace hp::fabric {
namespace {

std::size_t round_to_pages(std::size_t bytes) {
  std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  return bytes == 0 ? page : (bytes + page - 1) / page * page;
}

std::string user_prefix() { return "hp-" + std::to_string(getuid()) + "-"; }

// Unlinks the name and closes the descriptor of a half-made segment.
void discard(int fd, const std::string& name) {
  close(fd);
  shm_unlink(name.c_str());
}

}  // namespace

Segment::Segment(std::string name, void* data, std::size_t bytes, bool owns_name)
    : name_(std::move(name)), data_(data), size_(bytes), owns_name_(owns_name) {}

Segment Segment::create(const std::string& name, std::size_t bytes) {
  std::size_t size = round_to_pages(bytes);
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) throw std::runtime_error(sys::errno_message("hyperparallel: cannot create shared segment " + name));
  fchmod(fd, 0600);  // whatever the umask
  if (int err = posix_fallocate(fd, 0, static_cast<off_t>(size)); err != 0) {
    discard(fd, name);
    throw std::runtime_error("hyperparallel: cannot reserve " + std::to_string(size) +
                             " bytes in /dev/shm for " + name + ": " + std::strerror(err) +
                             ". Free space in /dev/shm (df -h /dev/shm) or enlarge it "
                             "(mount -o remount,size=... /dev/shm, or docker --shm-size).");
  }
  void* data = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (data == MAP_FAILED) {
    std::string message = sys::errno_message("hyperparallel: cannot map shared segment " + name);
    discard(fd, name);
    throw std::runtime_error(message);
  }
  close(fd);
  return Segment(name, data, size, true);
}

Segment Segment::open(const std::string& name, std::size_t bytes) {
  std::size_t size = round_to_pages(bytes);
  int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) throw std::runtime_error(sys::errno_message("hyperparallel: cannot open shared segment " + name));
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<std::size_t>(st.st_size) < size) {
    close(fd);
    throw std::runtime_error("hyperparallel: shared segment " + name + " is smaller than the " +
                             std::to_string(size) + " bytes expected");
  }
  void* data = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (data == MAP_FAILED) throw std::runtime_error(sys::errno_message("hyperparallel: cannot map shared segment " + name));
  return Segment(name, data, size, false);
}

Segment::Segment(Segment&& other) noexcept
    : name_(std::move(other.name_)), data_(other.data_), size_(other.size_), owns_name_(other.owns_name_) {
  other.data_ = nullptr;
  other.size_ = 0;
  other.owns_name_ = false;
}

Segment& Segment::operator=(Segment&& other) noexcept {
  // `other` takes our old mapping and releases it when it goes.
  std::swap(name_, other.name_);
  std::swap(data_, other.data_);
  std::swap(size_, other.size_);
  std::swap(owns_name_, other.owns_name_);
  return *this;
}

Segment::~Segment() {
  if (data_) munmap(data_, size_);
  unlink();
}

void Segment::unlink() {
  if (owns_name_) shm_unlink(name_.c_str());
  owns_name_ = false;
}

std::string segment_prefix() {
  static const std::string prefix = [] {
    std::random_device device;
    uint64_t nonce = (uint64_t(device()) << 32) ^ device();
    char hex[17];
    snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(nonce));
    // Appended piece by piece: GCC 12 warns falsely (-Wrestrict) on operator+ chains here.
    std::string name = "/";
    name += user_prefix();
    name += std::to_string(getpid());
    name += '-';
    name += hex;
    return name;
  }();
  return prefix;
}

int sweep_stale_segments() {
  DIR* dir = opendir("/dev/shm");
  if (!dir) return 0;
  const std::string mine = user_prefix();
  int removed = 0;
  while (dirent* entry = readdir(dir)) {
    std::string name = entry->d_name;
    if (name.rfind(mine, 0) != 0) continue;
    pid_t pid = static_cast<pid_t>(std::strtol(name.c_str() + mine.size(), nullptr, 10));
    if (pid > 0 && !sys::process_alive(pid) && shm_unlink(("/" + name).c_str()) == 0) ++removed;
  }
  closedir(dir);
  return removed;
}

}  // namespace hp::fabric
