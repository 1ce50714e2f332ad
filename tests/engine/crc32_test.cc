// Crc32 against a bit-at-a-time reference and zlib's published check value, over every length
// and start offset the folding code treats differently (short, around 128/256, odd tails).
#include "dnvme/crc32.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace dnvme {
namespace {

// The definition, one bit at a time (reflected, init and final XOR ~0), as zlib computes it.
uint32_t Reference(uint32_t crc, const unsigned char* p, size_t len) {
  crc = ~crc;
  for (size_t i = 0; i < len; ++i) {
    crc ^= p[i];
    for (int b = 0; b < 8; ++b) crc = (crc >> 1) ^ ((crc & 1) ? 0xEDB88320u : 0);
  }
  return ~crc;
}

std::vector<unsigned char> RandomBytes(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<unsigned char> v(n);
  for (auto& c : v) c = static_cast<unsigned char>(rng());
  return v;
}

TEST(Crc32Test, CheckValue) {
  const char* s = "123456789";  // the catalogue's check input for CRC-32/ISO-HDLC
  EXPECT_EQ(Crc32(0, s, 9), 0xCBF43926u);
  EXPECT_EQ(internal::Crc32Table(0, s, 9), 0xCBF43926u);
  EXPECT_EQ(Crc32(0, nullptr, 0), 0u);
  EXPECT_EQ(Crc32(0x12345678u, nullptr, 0), 0x12345678u);
}

TEST(Crc32Test, EveryLengthAndOffsetMatchesReference) {
  auto data = RandomBytes(1100, 1);
  for (size_t offset = 0; offset < 16; ++offset) {
    for (size_t len = 0; offset + len <= data.size(); ++len) {
      uint32_t want = Reference(0, data.data() + offset, len);
      ASSERT_EQ(Crc32(0, data.data() + offset, len), want) << "offset " << offset << " len " << len;
      ASSERT_EQ(internal::Crc32Table(0, data.data() + offset, len), want)
          << "offset " << offset << " len " << len;
    }
  }
}

TEST(Crc32Test, ContinuesFromAnyState) {
  auto data = RandomBytes(1 << 16, 2);
  uint32_t whole = Reference(0, data.data(), data.size());
  for (size_t cut : {0ul, 1ul, 15ul, 128ul, 255ul, 256ul, 4097ul, 65535ul}) {
    uint32_t first = Crc32(0, data.data(), cut);
    EXPECT_EQ(Crc32(first, data.data() + cut, data.size() - cut), whole) << "cut " << cut;
  }
  EXPECT_EQ(Crc32(0xDEADBEEFu, data.data(), data.size()),
            Reference(0xDEADBEEFu, data.data(), data.size()));
}

TEST(Crc32Test, LargeBufferAndSpecialPatterns) {
  auto data = RandomBytes((8 << 20) + 77, 3);
  EXPECT_EQ(Crc32(0, data.data(), data.size()), Reference(0, data.data(), data.size()));
  std::vector<unsigned char> zeros(1 << 20, 0), ones(1 << 20, 0xFF);
  EXPECT_EQ(Crc32(0, zeros.data(), zeros.size()), Reference(0, zeros.data(), zeros.size()));
  EXPECT_EQ(Crc32(0, ones.data(), ones.size()), Reference(0, ones.data(), ones.size()));
  // A single flipped bit anywhere changes the result.
  uint32_t before = Crc32(0, zeros.data(), zeros.size());
  zeros[777777] ^= 0x10;
  EXPECT_NE(Crc32(0, zeros.data(), zeros.size()), before);
}

TEST(Crc32Test, ReportsImplementation) {
  std::string impl = Crc32Implementation();
  EXPECT_TRUE(impl == "pclmul" || impl == "table") << impl;
#if defined(__x86_64__)
  if (__builtin_cpu_supports("pclmul")) {
    EXPECT_EQ(impl, "pclmul");
  }
#endif
}

}  // namespace
}  // namespace dnvme
