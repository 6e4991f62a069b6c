// CRC-32 (zip's polynomial): carry-less multiplication (PCLMULQDQ) for bulk
// bytes where simd::isa() is AVX2 or better (that tier includes CLMUL),
// slicing-by-8 tables otherwise and for tails, and zlib's
// GF(2) polynomial arithmetic to combine the CRCs of adjacent pieces, so that
// pieces written by different threads still give one checksum per record and
// per file.
#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "hyperparallel/checkpoint/io.h"
#include "simd/isa.h"

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

// The CRC register (pre-inverted) over n bytes, n a multiple of 16 and >= 64,
// by carry-less multiplication: four 128-bit lanes fold 64 bytes per round,
// then fold to one lane and Barrett-reduce to 32 bits. Constants and steps
// are those of Intel's "Fast CRC Computation Using PCLMULQDQ" for the
// reflected polynomial 0xEDB88320 (as in Linux's crc32-pclmul_asm.S).
#if defined(__x86_64__)
#define HP_PCLMUL HP_SIMD_TARGET(HP_SIMD_AVX2)
HP_PCLMUL inline __m128i load(const unsigned char* q) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)); }
HP_PCLMUL inline __m128i fold(__m128i x, __m128i k) {
  return _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11));
}

HP_PCLMUL uint32_t crc32_pclmul(uint32_t c, const unsigned char* p, size_t n) {
  const __m128i r2r1 = _mm_set_epi64x(0x00000001c6e41596ll, 0x0000000154442bd4ll);
  const __m128i r4r3 = _mm_set_epi64x(0x00000000ccaa009ell, 0x00000001751997d0ll);
  const __m128i r5 = _mm_set_epi64x(0, 0x0000000163cd6124ll);
  const __m128i poly = _mm_set_epi64x(0x00000001F7011641ll, 0x00000001DB710641ll);
  const __m128i mask32 = _mm_set_epi32(0, 0, 0, -1);
  __m128i x1 = _mm_xor_si128(load(p), _mm_cvtsi32_si128(int(c)));
  __m128i x2 = load(p + 16), x3 = load(p + 32), x4 = load(p + 48);
  p += 64;
  n -= 64;
  for (; n >= 64; p += 64, n -= 64) {
    x1 = _mm_xor_si128(fold(x1, r2r1), load(p));
    x2 = _mm_xor_si128(fold(x2, r2r1), load(p + 16));
    x3 = _mm_xor_si128(fold(x3, r2r1), load(p + 32));
    x4 = _mm_xor_si128(fold(x4, r2r1), load(p + 48));
  }
  x1 = _mm_xor_si128(fold(x1, r4r3), x2);
  x1 = _mm_xor_si128(fold(x1, r4r3), x3);
  x1 = _mm_xor_si128(fold(x1, r4r3), x4);
  for (; n >= 16; p += 16, n -= 16) x1 = _mm_xor_si128(fold(x1, r4r3), load(p));
  // 128 -> 64 bits (appending 32 zero bits), 64 -> 32, then Barrett.
  x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), _mm_clmulepi64_si128(r4r3, x1, 0x01));
  __m128i x2b = _mm_srli_si128(x1, 4);
  x1 = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(x1, mask32), r5, 0x00), x2b);
  __m128i keep = x1;
  x1 = _mm_and_si128(_mm_clmulepi64_si128(_mm_and_si128(x1, mask32), poly, 0x10), mask32);
  x1 = _mm_xor_si128(_mm_clmulepi64_si128(x1, poly, 0x00), keep);
  return uint32_t(_mm_extract_epi32(x1, 1));
}

#endif

}  // namespace

uint32_t crc32(const void* data, size_t n, uint32_t crc) {
  const auto* p = static_cast<const unsigned char*>(data);
  const auto& t = kTables.t;
  uint32_t c = ~crc;
#if defined(__x86_64__)
  if (n >= 64 && simd::isa() >= simd::Isa::avx2) {
    size_t bulk = n & ~size_t(15);
    c = crc32_pclmul(c, p, bulk);
    p += bulk;
    n -= bulk;
  }
#endif
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
