// torch.save's bytes for one contiguous CPU tensor, and the parser of any
// torch.save archive (ours or torch's).
//
// torch.save writes, through caffe2's PyTorchStreamWriter and miniz, an
// uncompressed zip whose every record has a 30-byte local header with zero
// CRC and sizes, an extra field "FB" padding the data to a 64-byte boundary,
// the data, and a data descriptor carrying the CRC and sizes; then a central
// directory and (always) zip64 end records. `.data/serialization_id` is a
// deterministic hash of the record names and CRCs. See
// caffe2/serialize/inline_container.cc in the PyTorch sources.
#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <iomanip>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "checkpoint_internal.h"
#include "hyperparallel/checkpoint/io.h"

namespace hp::ckpt {
namespace {

constexpr uint64_t kMax32 = 0xFFFFFFFFull;
constexpr uint64_t kAlignment = 64;  // torch's kFieldAlignment

void put16(std::string& out, uint16_t v) {
  char b[2] = {char(v & 0xff), char(v >> 8)};
  out.append(b, 2);
}
void put32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(char((v >> (8 * i)) & 0xff));
}
void put64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(char((v >> (8 * i)) & 0xff));
}
uint16_t get16(const char* p) { return uint16_t(uint8_t(p[0]) | (uint8_t(p[1]) << 8)); }
uint32_t get32(const char* p) { return uint32_t(get16(p)) | (uint32_t(get16(p + 2)) << 16); }
uint64_t get64(const char* p) { return uint64_t(get32(p)) | (uint64_t(get32(p + 4)) << 32); }

// c10::hash_combine, as PyTorchStreamWriter combines names and CRCs.
uint64_t hash_combine(uint64_t seed, uint64_t value) {
  return seed ^ (value + 0x9e3779b9 + (seed << 6u) + (seed >> 2u));
}

// --- pickle (protocol 2), only what torch.save emits for a tensor ---------
class Pickler {
 public:
  std::string out;
  void proto() { out += "\x80\x02"; }
  void global(const std::string& module, const std::string& name) {
    out += 'c';
    out += module + "\n" + name + "\n";
  }
  void unicode(const std::string& s) {
    out += 'X';
    put32(out, uint32_t(s.size()));
    out += s;
  }
  void integer(int64_t v) {  // pickle.Pickler.save_long, protocol 2
    if (v >= 0 && v <= 0xff) {
      out += 'K';
      out += char(v);
    } else if (v >= 0 && v <= 0xffff) {
      out += 'M';
      put16(out, uint16_t(v));
    } else if (v >= -0x80000000ll && v <= 0x7fffffffll) {
      out += 'J';
      put32(out, uint32_t(int32_t(v)));
    } else {  // LONG1: little-endian two's complement, (bit_length >> 3) + 1 bytes
      uint64_t magnitude = v < 0 ? ~uint64_t(v) : uint64_t(v);
      int bits = 64 - __builtin_clzll(magnitude | 1);
      if (magnitude == 0) bits = 0;
      int n = (bits >> 3) + 1;
      out += '\x8a';
      out += char(n);
      for (int i = 0; i < n; ++i) out += char(i < 8 ? (uint64_t(v) >> (8 * i)) & 0xff : (v < 0 ? 0xff : 0));
    }
  }
  void memoize() {
    if (memo_ < 256) {
      out += 'q';
      out += char(memo_);
    } else {
      out += 'r';
      put32(out, memo_);
    }
    ++memo_;
  }
  void tuple_of(const std::vector<int64_t>& values) {  // pickle.Pickler.save_tuple
    if (values.empty()) {
      out += ')';
      return;
    }
    if (values.size() > 3) out += '(';
    for (int64_t v : values) integer(v);
    static const char* kTupleN[] = {"", "\x85", "\x86", "\x87"};
    out += values.size() > 3 ? std::string("t") : std::string(kTupleN[values.size()]);
    memoize();
  }

 private:
  uint32_t memo_ = 0;
};

// torch's pickle of `_rebuild_tensor_v2(storage, 0, shape, stride, False, OrderedDict())`
// over a typed storage (`storage_type` torch.FloatStorage ...). The dtypes that have no typed
// storage (float8s, uint16/32/64: `storage_type` is then the dtype's name) are pickled as
// torch does, `_rebuild_tensor_v3(..., torch.<dtype>)` over an UntypedStorage of `nbytes`.
std::string tensor_pickle(const std::string& storage_type, const std::vector<int64_t>& shape, uint64_t nbytes) {
  const bool typed = storage_type.ends_with("Storage");
  int64_t numel = 1;
  std::vector<int64_t> stride(shape.size());
  for (size_t i = shape.size(); i-- > 0;) {
    stride[i] = numel;
    numel *= shape[i];
  }
  Pickler p;
  p.proto();
  p.global("torch._utils", typed ? "_rebuild_tensor_v2" : "_rebuild_tensor_v3");
  p.memoize();
  p.out += "((";
  p.unicode("storage");
  p.memoize();
  if (typed)
    p.global("torch", storage_type);
  else
    p.global("torch.storage", "UntypedStorage");
  p.memoize();
  p.unicode("0");
  p.memoize();
  p.unicode("cpu");
  p.memoize();
  p.integer(typed ? numel : int64_t(nbytes));
  p.out += 't';
  p.memoize();
  p.out += 'Q';  // BINPERSID
  p.integer(0);  // storage offset
  p.tuple_of(shape);
  p.tuple_of(stride);
  p.out += '\x89';  // requires_grad=False
  p.global("collections", "OrderedDict");
  p.memoize();
  p.out += ")R";
  p.memoize();
  if (!typed) {
    p.global("torch", storage_type);  // the dtype
    p.memoize();
  }
  p.out += 't';
  p.memoize();
  p.out += 'R';
  p.memoize();
  p.out += '.';
  return p.out;
}

}  // namespace

// --- the zip archive ------------------------------------------------------
void ZipWriter::add(const std::string& name, const std::string& data) {
  begin(name, data.size());
  out_ += data;
  cursor_ += data.size();
  end(crc32(data.data(), data.size()));
}

// Bit 3: a data descriptor follows (miniz omits it for empty records);
// bit 11: UTF-8 names.
uint16_t ZipWriter::flags(const Entry& e) { return e.size == 0 ? 0x0800 : 0x0808; }

std::string ZipWriter::zip64_extra(const Entry& e) const {
  std::string extra;
  bool big = e.size >= kMax32;
  bool far = e.local_offset >= kMax32;
  if (!big && !far) return extra;
  put16(extra, 0x0001);
  put16(extra, uint16_t((big ? 16 : 0) + (far ? 8 : 0)));
  if (big) {
    put64(extra, e.size);
    put64(extra, e.size);
  }
  if (far) put64(extra, e.local_offset);
  return extra;
}

uint64_t ZipWriter::begin(const std::string& name, uint64_t size) {
  Entry e{archive_ + "/" + name, size, 0, cursor_};
  names_.push_back(name);
  std::string extra = zip64_extra(e);
  // detail::getPadding: FB extra field up to the next 64-byte boundary.
  uint64_t start = cursor_ + 30 + e.name.size() + 4 + extra.size();
  uint64_t padding = (kAlignment - start % kAlignment) % kAlignment;
  extra += "FB";
  put16(extra, uint16_t(padding));
  extra.append(padding, 'Z');
  std::string header;
  put32(header, 0x04034b50);
  put16(header, 0);       // version needed: stored
  put16(header, flags(e));
  put16(header, 0);       // stored
  put32(header, 0);       // time, date
  put32(header, 0);       // crc: in the descriptor
  put32(header, 0);
  put32(header, 0);
  put16(header, uint16_t(e.name.size()));
  put16(header, uint16_t(extra.size()));
  header += e.name;
  header += extra;
  out_ += header;
  cursor_ += header.size();
  entries_.push_back(e);
  return cursor_;
}

void ZipWriter::skip(uint64_t n) { cursor_ += n; }

void ZipWriter::end(uint32_t crc) {
  Entry& e = entries_.back();
  e.crc = crc;
  if (e.size == 0) return;  // miniz writes no descriptor for an empty record
  std::string dd;
  put32(dd, 0x08074b50);
  put32(dd, crc);
  if (zip64_extra(e).empty()) {
    put32(dd, uint32_t(e.size));
    put32(dd, uint32_t(e.size));
  } else {
    put64(dd, e.size);
    put64(dd, e.size);
  }
  out_ += dd;
  cursor_ += dd.size();
  combined_crc_ = hash_combine(combined_crc_, crc);
}

void ZipWriter::finish() {
  // PyTorchStreamWriter::writeEndOfFile: version, then the serialization id.
  add("version", "3\n");
  // PyTorchStreamWriter keeps the names in an unordered_set; for the records
  // of one tensor libstdc++ iterates it in reverse insertion order.
  uint64_t name_hash = 0;
  for (const std::string& name : std::vector<std::string>(names_.rbegin(), names_.rend()))
    name_hash = hash_combine(name_hash, std::hash<std::string>{}(name));
  std::ostringstream id;
  id << std::setfill('0') << std::setw(20) << name_hash << std::setfill('0') << std::setw(20) << combined_crc_;
  add(".data/serialization_id", id.str());

  uint64_t cd_offset = cursor_;
  std::string cd;
  for (const Entry& e : entries_) {
    std::string extra = zip64_extra(e);
    put32(cd, 0x02014b50);
    put16(cd, 0);  // made by
    put16(cd, 0);  // needed
    put16(cd, flags(e));
    put16(cd, 0);
    put32(cd, 0);
    put32(cd, e.crc);
    put32(cd, uint32_t(std::min(e.size, kMax32)));
    put32(cd, uint32_t(std::min(e.size, kMax32)));
    put16(cd, uint16_t(e.name.size()));
    put16(cd, uint16_t(extra.size()));
    put16(cd, 0);  // comment
    put16(cd, 0);  // disk
    put16(cd, 0);  // internal attributes
    put32(cd, 0);  // external attributes
    put32(cd, uint32_t(std::min(e.local_offset, kMax32)));
    cd += e.name;
    cd += extra;
  }
  uint64_t cd_size = cd.size();
  uint64_t zip64_end = cd_offset + cd_size;
  put32(cd, 0x06064b50);
  put64(cd, 44);
  put16(cd, 0x031e);
  put16(cd, 0x002d);
  put32(cd, 0);
  put32(cd, 0);
  put64(cd, entries_.size());
  put64(cd, entries_.size());
  put64(cd, cd_size);
  put64(cd, cd_offset);
  put32(cd, 0x07064b50);
  put32(cd, 0);
  put64(cd, zip64_end);
  put32(cd, 1);
  put32(cd, 0x06054b50);
  put16(cd, 0);
  put16(cd, 0);
  put16(cd, uint16_t(std::min<uint64_t>(entries_.size(), 0xFFFF)));
  put16(cd, uint16_t(std::min<uint64_t>(entries_.size(), 0xFFFF)));
  put32(cd, uint32_t(std::min(cd_size, kMax32)));
  put32(cd, uint32_t(std::min(cd_offset, kMax32)));
  put16(cd, 0);
  out_ += cd;
  cursor_ += cd.size();
}

std::string ZipWriter::take() { return std::exchange(out_, std::string()); }

TensorItemLayout::TensorItemLayout(const std::string& storage_type, const std::vector<int64_t>& shape,
                                   uint64_t nbytes)
    : nbytes_(nbytes) {
  zip_.add("data.pkl", tensor_pickle(storage_type, shape, nbytes));
  zip_.add(".format_version", "1");
  zip_.add(".storage_alignment", "64");
  zip_.add("byteorder", "little");
  data_offset_ = zip_.begin("data/0", nbytes);
  prefix_ = zip_.take();
  zip_.skip(nbytes);
  // The suffix's length does not depend on the CRC: measure it with a dummy.
  ZipWriter probe = zip_;
  probe.end(0);
  probe.finish();
  suffix_length_ = probe.take().size();
}

std::string TensorItemLayout::suffix(uint32_t data_crc) {
  ZipWriter zip = zip_;
  zip.end(data_crc);
  zip.finish();
  return zip.take();
}

std::string torch_save_bytes(const std::string& storage_type, const std::vector<int64_t>& shape, const void* data,
                             uint64_t nbytes) {
  TensorItemLayout layout(storage_type, shape, nbytes);
  std::string out = layout.prefix();
  out.append(static_cast<const char*>(data), nbytes);
  out += layout.suffix(crc32(data, nbytes));
  return out;
}

// --- parsing ---------------------------------------------------------------
std::map<std::string, Record> torch_save_records(const std::string& path, uint64_t offset, uint64_t length) {
  auto bad = [&](const std::string& why) {
    return std::runtime_error("checkpoint file " + path + ": the item at offset " + std::to_string(offset) +
                              " (" + std::to_string(length) + " bytes) is not a torch.save archive: " + why +
                              ". The file is truncated or corrupted; restore it or save the checkpoint again.");
  };
  if (length < 22) throw bad("too short");
  uint64_t tail_n = std::min<uint64_t>(length, 22 + 20 + 56 + 4096);
  std::string tail = read_bytes(path, offset + length - tail_n, tail_n);
  // End of central directory: no comment, so it is the last 22 bytes.
  const char* eocd = tail.data() + tail.size() - 22;
  if (get32(eocd) != 0x06054b50) throw bad("no end-of-central-directory record");
  uint64_t entries = get16(eocd + 10), cd_size = get32(eocd + 12), cd_offset = get32(eocd + 16);
  if (tail.size() >= 22 + 20 && get32(eocd - 20) == 0x07064b50) {
    uint64_t z64 = get64(eocd - 20 + 8);
    if (z64 + 56 > length) throw bad("zip64 end record out of range");
    std::string rec = read_bytes(path, offset + z64, 56);
    if (get32(rec.data()) != 0x06064b50) throw bad("bad zip64 end record");
    entries = get64(rec.data() + 32);
    cd_size = get64(rec.data() + 40);
    cd_offset = get64(rec.data() + 48);
  }
  if (cd_offset + cd_size > length) throw bad("central directory out of range");
  std::string cd = read_bytes(path, offset + cd_offset, cd_size);
  std::map<std::string, Record> records;
  const char* p = cd.data();
  const char* end = cd.data() + cd.size();
  for (uint64_t i = 0; i < entries; ++i) {
    if (p + 46 > end || get32(p) != 0x02014b50) throw bad("bad central directory entry");
    uint32_t crc = get32(p + 16);
    uint64_t size = get32(p + 24);
    uint16_t name_len = get16(p + 28), extra_len = get16(p + 30), comment_len = get16(p + 32);
    uint64_t local = get32(p + 42);
    if (p + 46 + name_len + extra_len + comment_len > end) throw bad("central directory entry out of range");
    std::string name(p + 46, name_len);
    for (const char* x = p + 46 + name_len; x + 4 <= p + 46 + name_len + extra_len;) {
      uint16_t id = get16(x), n = get16(x + 2);
      const char* v = x + 4;
      if (id == 0x0001) {
        if (size == kMax32) {
          size = get64(v);  // uncompressed
          v += 8;
          v += 8;  // compressed
        }
        if (local == kMax32) local = get64(v);
      }
      x += 4 + n;
    }
    p += 46 + name_len + extra_len + comment_len;
    if (local + 30 > length) throw bad("local header of " + name + " out of range");
    std::string header = read_bytes(path, offset + local, 30);
    if (get32(header.data()) != 0x04034b50) throw bad("bad local header of " + name);
    uint64_t data = local + 30 + get16(header.data() + 26) + get16(header.data() + 28);
    if (data + size > length) throw bad("record " + name + " out of range");
    auto slash = name.find('/');
    records[slash == std::string::npos ? name : name.substr(slash + 1)] = Record{offset + data, size, crc};
  }
  return records;
}

}  // namespace hp::ckpt
