// Pieces shared by csrc/checkpoint's files; not part of the public API.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace hp::ckpt {

// Builds a torch.save-style zip archive in order. Small records go through
// add(); a large one is begin() (its header), skip(size) (its bytes, written
// elsewhere), end(crc) (its data descriptor). take() hands over the bytes
// produced since the last take(); offsets are relative to the archive start.
class ZipWriter {
 public:
  explicit ZipWriter(std::string archive = "archive") : archive_(std::move(archive)) {}
  void add(const std::string& name, const std::string& data);
  uint64_t begin(const std::string& name, uint64_t size);  // returns the data's offset
  void skip(uint64_t n);
  void end(uint32_t crc);
  // The version and serialization-id records, central directory, end records.
  void finish();
  std::string take();

 private:
  struct Entry {
    std::string name;
    uint64_t size = 0;
    uint32_t crc = 0;
    uint64_t local_offset = 0;
  };
  std::string zip64_extra(const Entry& e) const;
  static uint16_t flags(const Entry& e);

  std::string archive_;
  std::string out_;
  uint64_t cursor_ = 0;
  std::vector<Entry> entries_;
  std::vector<std::string> names_;
  uint64_t combined_crc_ = 0;
};

// torch.save's archive for one contiguous tensor, split around the tensor's
// bytes: prefix() (everything before them, known up front) and suffix(crc)
// (everything after, which depends on their CRC; its length does not).
class TensorItemLayout {
 public:
  TensorItemLayout(const std::string& storage_type, const std::vector<int64_t>& shape, uint64_t nbytes);
  const std::string& prefix() const { return prefix_; }
  uint64_t length() const { return prefix_.size() + nbytes_ + suffix_length_; }
  std::string suffix(uint32_t data_crc);

 private:
  ZipWriter zip_;
  std::string prefix_;
  uint64_t nbytes_ = 0, data_offset_ = 0, suffix_length_ = 0;
};

}  // namespace hp::ckpt
