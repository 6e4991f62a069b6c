#include "hyperparallel/fabric/bootstrap.h"

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>

namespace hp::fabric {

FileBootstrap::FileBootstrap(std::string directory) : directory_(std::move(directory)) {
  std::filesystem::create_directories(directory_);
}

std::string FileBootstrap::path_of(const std::string& key) const {
  std::string file = key;
  for (char& c : file)
    if (c == '/') c = '_';
  return directory_ + "/" + file;
}

void FileBootstrap::set(const std::string& key, const std::string& value) {
  std::string path = path_of(key);
  std::string temp = path + ".tmp." + std::to_string(getpid());
  {
    std::ofstream out(temp, std::ios::binary | std::ios::trunc);
    out << value;
    if (!out) throw std::runtime_error("FileBootstrap: cannot write " + temp);
  }
  std::filesystem::rename(temp, path);  // readers see all of it or nothing
}

std::string FileBootstrap::get(const std::string& key, std::chrono::milliseconds timeout) {
  std::string path = path_of(key);
  auto deadline = std::chrono::steady_clock::now() + timeout;
  // Start-up only: a short poll is fine here, never on the hot path.
  while (true) {
    std::ifstream in(path, std::ios::binary);
    if (in) {
      std::stringstream buffer;
      buffer << in.rdbuf();
      return buffer.str();
    }
    if (std::chrono::steady_clock::now() > deadline)
      throw std::runtime_error("FileBootstrap: key '" + key + "' did not appear in " + directory_ +
                               " in time; is local rank 0 running?");
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

}  // namespace hp::fabric
