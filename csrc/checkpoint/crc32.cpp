// CRC-32 (zip's polynomial): slicing-by-8 tables for the bytes, and zlib's
// GF(2) polynomial arithmetic to combine the CRCs of adjacent pieces, so that
// pieces written by different threads still give one checksum per record and
// per file.
#include <array>
#include <cstring>

#include "hyperparallel/checkpoint/io.h"

namespace hp::ckpt {
namespace {

constexpr uint32_t kPoly = 0xEDB88320u;

struct Tables {
  std::array<std::array<uint32_t, 256>, 8> t{};
  constexpr Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
  }
};
constexpr Tables kTables;

// a(x) * b(x) mod p(x), bit-reflected (zlib's multmodp).
uint32_t multmodp(uint32_t a, uint32_t b) {
  uint32_t m = 1u << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return p;
}

// x^(2^k) mod p(x) for k = 0..31.
struct PowerTable {
  std::array<uint32_t, 32> x2n{};
  PowerTable() {
    uint32_t p = 1u << 30;  // x^1
    x2n[0] = p;
    for (int n = 1; n < 32; ++n) x2n[n] = p = multmodp(p, p);
  }
};

// x^(n * 2^k) mod p(x).
uint32_t x2nmodp(uint64_t n, unsigned k) {
  static const PowerTable table;
  uint32_t p = 1u << 31;  // x^0
  while (n) {
    if (n & 1) p = multmodp(table.x2n[k & 31], p);
    n >>= 1;
    ++k;
  }
  return p;
}

}  // namespace

uint32_t crc32(const void* data, size_t n, uint32_t crc) {
  const auto* p = static_cast<const unsigned char*>(data);
  const auto& t = kTables.t;
  uint32_t c = ~crc;
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    c = t[0][(c ^ *p++) & 0xff] ^ (c >> 8);
    --n;
  }
  while (n >= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;
    c = t[7][lo & 0xff] ^ t[6][(lo >> 8) & 0xff] ^ t[5][(lo >> 16) & 0xff] ^ t[4][lo >> 24] ^ t[3][hi & 0xff] ^
        t[2][(hi >> 8) & 0xff] ^ t[1][(hi >> 16) & 0xff] ^ t[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n--) c = t[0][(c ^ *p++) & 0xff] ^ (c >> 8);
  return ~c;
}

uint32_t crc32_combine(uint32_t crc_a, uint32_t crc_b, uint64_t length_b) {
  return multmodp(x2nmodp(length_b, 3), crc_a) ^ crc_b;
}

}  // namespace hp::ckpt
