// CRC-32 by carry-less multiplication folding, with a sliced-table fallback.
//
// The arithmetic, in the "reflected" bit order zip uses: a byte stream is a polynomial over
// GF(2) whose first byte's lowest bit is the highest-degree coefficient, and the CRC of a stream
// M with running state s is (s * x^(8 len) + M) * x^32 mod P, P = the IEEE polynomial. In that
// order a 16-byte block loaded little-endian into a 128-bit register X is the polynomial of
// those bytes, with the register's low 64 bits (Q0) as the high-degree half: X = Q0 x^64 + Q1.
// Moving X forward over F bits of later data means replacing X x^F by something congruent mod P
// and shorter than 128 bits:
//   X x^F = Q0 x^(F+64) + Q1 x^F == Q0 (x^(F+63) mod P) x + Q1 (x^(F-1) mod P) x.
// PCLMULQDQ of two reflected 64-bit operands yields their product times x (the reflected order
// shifts it by one place), so the constants are x^(F+63) mod P and x^(F-1) mod P, each bit-
// reversed into 64 bits. They are computed below from P itself, not copied from anywhere.
//
// The loop keeps eight 16-byte accumulators (128 bytes per step, F = 1024) so the multiplier's
// latency is hidden; they are then folded into one (F = 128), and the final 16 bytes, being
// just a 16-byte stream congruent to everything before, are finished by the table code.
#include "dnvme/crc32.h"

#include <array>
#include <bit>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define DNVME_CRC_PCLMUL 1
#else
#define DNVME_CRC_PCLMUL 0
#endif

namespace dnvme {
namespace {

constexpr uint32_t kReflectedPoly = 0xEDB88320u;  // P without x^32, bit-reversed
constexpr uint64_t kPoly = 0x104C11DB7ull;        // P in natural order (bit d = x^d)

using Tables = std::array<std::array<uint32_t, 256>, 8>;

// Slicing-by-8: table[k][b] is the CRC contribution of byte b followed by k zero bytes.
constexpr Tables MakeTables() {
  Tables t{};
  for (uint32_t b = 0; b < 256; ++b) {
    uint32_t c = b;
    for (int i = 0; i < 8; ++i) c = (c & 1) ? (c >> 1) ^ kReflectedPoly : c >> 1;
    t[0][b] = c;
  }
  for (int k = 1; k < 8; ++k) {
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t prev = t[k - 1][b];
      t[k][b] = (prev >> 8) ^ t[0][prev & 0xFF];
    }
  }
  return t;
}
constexpr Tables kTables = MakeTables();

// The state here is the running register (already inverted); callers invert at the edges.
uint32_t TableUpdate(uint32_t s, const unsigned char* p, size_t len) {
  if constexpr (std::endian::native == std::endian::little) {
    while (len >= 8) {
      uint64_t v;
      std::memcpy(&v, p, 8);
      v ^= s;
      s = kTables[7][v & 0xFF] ^ kTables[6][(v >> 8) & 0xFF] ^ kTables[5][(v >> 16) & 0xFF] ^
          kTables[4][(v >> 24) & 0xFF] ^ kTables[3][(v >> 32) & 0xFF] ^
          kTables[2][(v >> 40) & 0xFF] ^ kTables[1][(v >> 48) & 0xFF] ^ kTables[0][v >> 56];
      p += 8;
      len -= 8;
    }
  }
  while (len-- > 0) s = (s >> 8) ^ kTables[0][(s ^ *p++) & 0xFF];
  return s;
}

#if DNVME_CRC_PCLMUL

// x^n mod P, natural order.
constexpr uint64_t XPowModP(int n) {
  uint64_t r = 1;
  for (int i = 0; i < n; ++i) {
    r <<= 1;
    if (r & (1ull << 32)) r ^= kPoly;
  }
  return r;
}

constexpr uint64_t Reverse64(uint64_t v) {
  uint64_t r = 0;
  for (int i = 0; i < 64; ++i) r |= ((v >> i) & 1) << (63 - i);
  return r;
}

// The pair of multipliers that moves a 128-bit accumulator forward over `fold_bits` bits.
struct FoldConstants {
  uint64_t for_q0;  // multiplies the register's low 64 bits (the high-degree half)
  uint64_t for_q1;
};
constexpr FoldConstants Fold(int fold_bits) {
  return {Reverse64(XPowModP(fold_bits + 63)), Reverse64(XPowModP(fold_bits - 1))};
}
constexpr FoldConstants kFold1024 = Fold(1024);
constexpr FoldConstants kFold128 = Fold(128);

__attribute__((target("sse2,pclmul"))) inline __m128i FoldInto(__m128i acc, __m128i k,
                                                               __m128i data) {
  __m128i lo = _mm_clmulepi64_si128(acc, k, 0x00);  // Q0 * for_q0
  __m128i hi = _mm_clmulepi64_si128(acc, k, 0x11);  // Q1 * for_q1
  return _mm_xor_si128(_mm_xor_si128(lo, hi), data);
}

__attribute__((target("sse2,pclmul"))) inline __m128i Load(const unsigned char* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

// Needs len >= 128.
__attribute__((target("sse2,pclmul"))) uint32_t PclmulUpdate(uint32_t s, const unsigned char* p,
                                                             size_t len) {
  __m128i x[8];
  for (int i = 0; i < 8; ++i) x[i] = Load(p + 16 * i);
  x[0] = _mm_xor_si128(x[0], _mm_cvtsi32_si128(static_cast<int>(s)));  // state joins byte 0..3
  p += 128;
  len -= 128;

  const __m128i k1024 = _mm_set_epi64x(static_cast<long long>(kFold1024.for_q1),
                                       static_cast<long long>(kFold1024.for_q0));
  while (len >= 128) {
    for (int i = 0; i < 8; ++i) x[i] = FoldInto(x[i], k1024, Load(p + 16 * i));
    p += 128;
    len -= 128;
  }

  const __m128i k128 = _mm_set_epi64x(static_cast<long long>(kFold128.for_q1),
                                      static_cast<long long>(kFold128.for_q0));
  __m128i acc = x[0];
  for (int i = 1; i < 8; ++i) acc = FoldInto(acc, k128, x[i]);
  while (len >= 16) {
    acc = FoldInto(acc, k128, Load(p));
    p += 16;
    len -= 16;
  }

  unsigned char last[16];
  _mm_storeu_si128(reinterpret_cast<__m128i*>(last), acc);
  return TableUpdate(TableUpdate(0, last, sizeof last), p, len);
}

bool HavePclmul() {
  static const bool have = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse2");
  }();
  return have;
}

#endif  // DNVME_CRC_PCLMUL

}  // namespace

uint32_t Crc32(uint32_t crc, const void* data, size_t len) {
  const auto* p = static_cast<const unsigned char*>(data);
#if DNVME_CRC_PCLMUL
  // Below a few blocks the table is as fast and the vector set-up is not worth it.
  if (len >= 256 && HavePclmul()) return ~PclmulUpdate(~crc, p, len);
#endif
  return ~TableUpdate(~crc, p, len);
}

const char* Crc32Implementation() {
#if DNVME_CRC_PCLMUL
  if (HavePclmul()) return "pclmul";
#endif
  return "table";
}

namespace internal {
uint32_t Crc32Table(uint32_t crc, const void* data, size_t len) {
  return ~TableUpdate(~crc, static_cast<const unsigned char*>(data), len);
}
}  // namespace internal

}  // namespace dnvme
