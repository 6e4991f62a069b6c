// Checkpoint byte I/O: the files of torch.distributed.checkpoint's
// FileSystemWriter layout, written in one sequential pass of large pwrites and
// read with parallel preads, fsynced, and checksummed. No torch headers:
// tensors arrive as pointers.
//
// A DCP data file (`__<rank>_0.distcp`) is a concatenation of items. A
// "bytes" item is raw bytes (a pickled Python object). A tensor item is what
// `torch.save(tensor, stream)` writes for a contiguous CPU tensor: a small
// uncompressed zip archive with the records
//   archive/data.pkl, .format_version, .storage_alignment, byteorder,
//   data/0 (the tensor's bytes, 64-byte aligned), version, .data/serialization_id
// followed by the central directory and zip64 end records, all offsets
// relative to the item's start. We write exactly torch.save's bytes, so
// `torch.load` (and hence `torch.distributed.checkpoint.load`) reads our items
// and we read theirs.
//
// Integrity: every byte of a written file belongs to one segment whose CRC-32
// (IEEE, zip's polynomial) is computed while it is written; the file's CRC-32
// is the combination of its segments' in file order, so the tensor bytes are
// read once for both the zip records and the file checksum.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace hp::ckpt {

// CRC-32 (IEEE 802.3, reflected 0xEDB88320, as zlib and zip) of `n` bytes,
// continuing from `crc` (0 to start).
uint32_t crc32(const void* data, size_t n, uint32_t crc = 0);
// CRC-32 of A followed by B from crc32(A), crc32(B) and B's length.
uint32_t crc32_combine(uint32_t crc_a, uint32_t crc_b, uint64_t length_b);

// One item of a data file, in the order it is to appear.
struct WriteItem {
  // True: a tensor serialized as torch.save would; false: raw bytes.
  bool is_tensor = false;
  // The tensor's storage class as torch pickles it ("FloatStorage",
  // "BFloat16Storage", ...), or for a dtype without one the dtype's name
  // ("float8_e4m3fn", "uint16", ...); unused for bytes.
  std::string storage_type;
  std::vector<int64_t> shape;  // contiguous strides are implied
  const void* data = nullptr;  // must stay valid until FileWriter::append returns
  uint64_t nbytes = 0;
};

// Where an item landed: DCP's _StorageInfo(offset, length).
struct ItemExtent {
  uint64_t offset = 0, length = 0;
};

struct FileDigest {
  uint64_t size = 0;
  uint32_t crc32 = 0;
};

// A data file written item by item, in file order, as the items come: a
// save need only hold the items of one append() in memory, not the file's.
// Each item's bytes go out in pwrites of at most `piece_bytes`, straight from
// its memory, their CRC computed as they go. Throws std::runtime_error naming
// the path on any failure, after which the writer is closed (a later call
// throws); a writer dropped before finish() leaves a partial file, for the
// caller to remove.
class FileWriter {
 public:
  // Creates (or truncates) `path`, mode 0644.
  explicit FileWriter(const std::string& path, uint64_t piece_bytes = 32ull << 20);
  ~FileWriter();
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;

  // Writes `items` after everything appended before; returns where each
  // landed. The items' memory may be freed once it returns.
  std::vector<ItemExtent> append(const std::vector<WriteItem>& items);
  // fsyncs and closes the file; returns its size and CRC-32.
  FileDigest finish();

 private:
  struct File;
  std::unique_ptr<File> file_;
  uint64_t piece_bytes_;
  FileDigest digest_;  // of what is written so far
};

// The bytes torch.save writes for a contiguous tensor (for tests and small
// tensors; FileWriter does not build items in memory).
std::string torch_save_bytes(const std::string& storage_type, const std::vector<int64_t>& shape, const void* data,
                             uint64_t nbytes);

// A record of a torch.save archive: absolute file offset of its data.
struct Record {
  uint64_t offset = 0, size = 0;
  uint32_t crc32 = 0;
};

// Parses the zip archive of a torch.save item stored at [offset, offset +
// length) of `path`: record names (without the archive prefix) to where
// their bytes are. Throws naming the file if it is not a readable archive.
std::map<std::string, Record> torch_save_records(const std::string& path, uint64_t offset, uint64_t length);

// Reads [offset, offset + n) of `path`; throws naming the file on a short read.
std::string read_bytes(const std::string& path, uint64_t offset, uint64_t n);

// Copy file bytes straight into memory.
struct ReadRequest {
  std::string path;
  uint64_t offset = 0, nbytes = 0;
  void* dst = nullptr;
};
// Runs `requests` with up to `threads` threads (large preads, each file
// opened once per thread). Throws naming the file on a short read.
void read_into(const std::vector<ReadRequest>& requests, int threads, uint64_t piece_bytes = 32ull << 20);

// Size and CRC-32 of a whole file, read in parallel pieces.
// Pieces of 4 MiB: each thread reuses one buffer that stays in cache.
FileDigest digest_file(const std::string& path, int threads, uint64_t piece_bytes = 4ull << 20);

// fsync of a directory (after creating or renaming entries in it).
void fsync_dir(const std::string& path);

// Publishes directory `staged` as `target` atomically: rename(2) if `target`
// does not exist, else renameat2(RENAME_EXCHANGE) so that `target` is never
// missing (the old content then sits at `staged` for the caller to remove).
// fsyncs the parent. Returns true if an old `target` was swapped out.
bool publish_dir(const std::string& staged, const std::string& target);

}  // namespace hp::ckpt
