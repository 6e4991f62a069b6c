#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#define HP_SIMD_BODY "simd_tiers_isa.h"
#define HP_SIMD_NAMESPACE hp::simd::tiers
#include "simd/foreach_isa.h"

#include "bf16_reference.h"

using namespace hp::simd;
using hp::testing::to_bf16_reference;

namespace {

float from_bits(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

// Float bit patterns of every kind: a stride through all 2^32 (odd, so the
// low bits vary), and the ties, the NaNs, the infinities and the largest
// finite values around the rounding boundaries.
std::vector<float> patterns() {
  std::vector<float> values;
  for (uint64_t bits = 0; bits < (uint64_t(1) << 32); bits += 4099) values.push_back(from_bits(uint32_t(bits)));
  for (uint32_t upper : {0x0000u, 0x0001u, 0x3F80u, 0x3F81u, 0x7F7Fu, 0x7F80u, 0x7FC0u, 0xFF7Fu, 0xFF80u, 0xFFFFu})
    for (uint32_t lower : {0x0000u, 0x0001u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu})
      values.push_back(from_bits(upper << 16 | lower));
  return values;
}

// The tiers this CPU runs, each with its kernels.
struct Tier {
  Isa isa;
  void (*round)(const float*, bf16*, int64_t);
  void (*widen)(const bf16*, float*, int64_t);
};

std::vector<Tier> runnable_tiers() {
  std::vector<Tier> found = {{Isa::baseline, &tiers::baseline::round_to_bf16, &tiers::baseline::widen}};
#if defined(__x86_64__)
  if (cpu_isa() >= Isa::avx2) found.push_back({Isa::avx2, &tiers::avx2::round_to_bf16, &tiers::avx2::widen});
  if (cpu_isa() >= Isa::avx512) found.push_back({Isa::avx512, &tiers::avx512::round_to_bf16, &tiers::avx512::widen});
#endif
  return found;
}

// The value on /proc/cpuinfo's first line for `key` ("key<tabs>: value"),
// empty where there is none (not Linux on x86).
std::string cpuinfo(const char* key) {
  std::ifstream file("/proc/cpuinfo");
  for (std::string line; std::getline(file, line);)
    if (line.rfind(key, 0) == 0) return line.substr(line.find(':') + 2);
  return {};
}

}  // namespace

TEST(Simd, HpSimdCapsTheCpusTier) {
  EXPECT_EQ(capped(Isa::avx512, nullptr), Isa::avx512);
  EXPECT_EQ(capped(Isa::avx512, ""), Isa::avx512);
  EXPECT_EQ(capped(Isa::avx512, "avx2"), Isa::avx2);
  EXPECT_EQ(capped(Isa::avx512, "baseline"), Isa::baseline);
  EXPECT_EQ(capped(Isa::avx2, "avx512"), Isa::avx2);  // a cap never raises the tier
  EXPECT_EQ(capped(Isa::baseline, "avx2"), Isa::baseline);
  try {
    capped(Isa::avx512, "sse9");
    FAIL() << "an unknown HP_SIMD must throw";
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("use avx512, avx2 or baseline"), std::string::npos) << error.what();
  }
  // This process: whatever HP_SIMD ctest was run under.
  EXPECT_EQ(isa(), capped(cpu_isa(), std::getenv("HP_SIMD")));
  EXPECT_STREQ(name(Isa::avx2), "avx2");
}

TEST(Simd, CpuIntelAgreesWithProcCpuinfo) {
  const std::string vendor = cpuinfo("vendor_id");
  if (vendor.empty()) GTEST_SKIP() << "no vendor_id in /proc/cpuinfo (not Linux on x86)";
  EXPECT_EQ(cpu_intel(), vendor == "GenuineIntel") << vendor;
}

// Linux lists AVX-NE-CONVERT and AVX-VNNI-INT8 nowhere in /proc/cpuinfo, so
// where a CPU has avx_vnni and AVX2 without AVX-512 BF16, this checks the
// other flags only (and skips that case's verdict).
TEST(Simd, CpuNativeBf16AgreesWithProcCpuinfo) {
  const std::string listed = cpuinfo("flags");
  if (listed.empty()) GTEST_SKIP() << "no flags in /proc/cpuinfo (not Linux on x86)";
  // Words between spaces, appended rather than joined by operator+, on which
  // GCC 12 warns falsely (-Wrestrict).
  std::string flags = " ";
  flags += listed;
  flags += ' ';
  const auto has = [&](const char* flag) {
    std::string word = " ";
    word += flag;
    word += ' ';
    return flags.find(word) != std::string::npos;
  };
  if (has("avx512_bf16")) {
    EXPECT_TRUE(cpu_native_bf16());
  } else if (!has("avx2") || !has("avx_vnni")) {
    EXPECT_FALSE(cpu_native_bf16()) << flags;
  } else {
    GTEST_SKIP() << "AVX2 and AVX-VNNI: whether oneDNN's avx2_vnni_2 set is whole is not in /proc/cpuinfo";
  }
}

TEST(Simd, ScalarBFloat16RoundsToNearestEvenAsC10) {
  for (float value : patterns()) {
    uint32_t bits;
    std::memcpy(&bits, &value, 4);
    ASSERT_EQ(float_to_bf16(value), to_bf16_reference(value)) << std::hex << bits;
    ASSERT_EQ(bf16(value).bits, to_bf16_reference(value)) << std::hex << bits;
  }
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float wide = bf16_to_float(uint16_t(b));
    if (!std::isnan(wide)) {
      ASSERT_EQ(float_to_bf16(wide), b) << "bf16 -> float -> bf16 is exact";
    }
  }
}

TEST(Simd, EveryTiersVectorBFloat16MatchesTheScalarOne) {
  const std::vector<float> values = patterns();
  std::vector<uint16_t> all(0x10000);
  for (uint32_t b = 0; b < 0x10000; ++b) all[b] = uint16_t(b);
  for (const Tier& tier : runnable_tiers()) {
    std::vector<bf16> rounded(values.size());
    tier.round(values.data(), rounded.data(), int64_t(values.size()));
    for (std::size_t i = 0; i < values.size(); ++i)
      ASSERT_EQ(rounded[i].bits, float_to_bf16(values[i])) << name(tier.isa) << " element " << i;
    std::vector<float> widened(all.size());
    tier.widen(reinterpret_cast<const bf16*>(all.data()), widened.data(), int64_t(all.size()));
    for (uint32_t b = 0; b < 0x10000; ++b) {
      const float expected = bf16_to_float(uint16_t(b));
      ASSERT_EQ(std::memcmp(&widened[b], &expected, 4), 0) << name(tier.isa) << " bits " << b;
    }
  }
}
