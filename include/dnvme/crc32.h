// CRC-32 (IEEE 802.3, the zip/gzip/zlib checksum) at memory speed.
//
// Checkpoints are written in torch's zip format, whose every record carries this CRC. zlib's
// table-driven crc32 runs at about 5 GiB/s here, so on a fast device the checksum, not the
// device, limits a save. Crc32 folds 128 bytes per step with carry-less multiplication
// (PCLMULQDQ) when the CPU has it, and falls back to a sliced table otherwise; both give zlib's
// result.
//
// Thread safety: pure functions, callable from any thread.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dnvme {

// zlib's crc32(crc, data, len): the CRC of `data` continued from the CRC `crc` of the bytes
// before it (0 to start), so Crc32(Crc32(0, a), b) == Crc32(0, a + b).
uint32_t Crc32(uint32_t crc, const void* data, size_t len);

// Which implementation Crc32 uses on this CPU: "pclmul" or "table".
const char* Crc32Implementation();

namespace internal {
// The table implementation alone (for tests that compare the two on a PCLMUL machine).
uint32_t Crc32Table(uint32_t crc, const void* data, size_t len);
}  // namespace internal

}  // namespace dnvme
