#include "tools/dnvme/cli_util.h"

#include <fcntl.h>
#include <spdlog/fmt/fmt.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

#include "dnvme/config.h"
#include "dnvme/status.h"
#include "tools/dnvme/commands.h"

namespace dnvme::cli {

namespace {

// splitmix64 of the word index: cheap, and no two nearby words alike.
uint64_t PatternWord(uint64_t index) {
  uint64_t z = index + 0x9E3779B97F4A7C15ULL;  // splitmix64
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

}  // namespace

void FillPattern(char* data, size_t size) {
  const size_t words = size / sizeof(uint64_t);
  for (size_t i = 0; i < words; ++i) {
    const uint64_t w = PatternWord(i);
    std::memcpy(data + i * sizeof(uint64_t), &w, sizeof(w));
  }
  const uint64_t last = PatternWord(words);
  std::memcpy(data + words * sizeof(uint64_t), &last, size % sizeof(uint64_t));
}

size_t FirstPatternMismatch(const char* data, size_t size) {
  const size_t words = size / sizeof(uint64_t);
  for (size_t i = 0; i < words; ++i) {
    const uint64_t w = PatternWord(i);
    if (std::memcmp(data + i * sizeof(uint64_t), &w, sizeof(w)) != 0) {
      for (size_t b = 0; b < sizeof(w); ++b) {
        if (data[i * sizeof(w) + b] != reinterpret_cast<const char*>(&w)[b]) {
          return i * sizeof(w) + b;
        }
      }
    }
  }
  const uint64_t last = PatternWord(words);
  for (size_t b = 0; b < size % sizeof(uint64_t); ++b) {
    if (data[words * sizeof(uint64_t) + b] != reinterpret_cast<const char*>(&last)[b]) {
      return words * sizeof(uint64_t) + b;
    }
  }
  return size;
}

void CheckDirFlag(const std::string& flag, const std::string& dir, DirAccess access) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) {
    throw UsageError(fmt::format("{} {}: {}", flag, dir, std::strerror(errno)));
  }
  if (!S_ISDIR(st.st_mode)) throw UsageError(fmt::format("{} {}: not a directory", flag, dir));
  if (access == DirAccess::kAny) return;
  const bool write = access == DirAccess::kWrite;
  if (::access(dir.c_str(), write ? (W_OK | X_OK) : (R_OK | X_OK)) != 0) {
    throw UsageError(fmt::format("{} {}: not {}: {}", flag, dir, write ? "writable" : "readable",
                                 std::strerror(errno)));
  }
}

// Best effort: a timed read must come from the disk, not from pages a buffered fallback or the
// unaligned edges left in the page cache.
void DropPageCache() {
  static std::atomic<bool> warned{false};
  ::sync();
  const int fd = ::open("/proc/sys/vm/drop_caches", O_WRONLY | O_CLOEXEC);
  const int err = fd < 0 ? errno : (::write(fd, "3", 1) == 1 ? 0 : errno);
  if (fd >= 0) ::close(fd);
  if (err != 0 && !warned.exchange(true)) {
    spdlog::debug(
        "cannot drop the page cache (/proc/sys/vm/drop_caches: {}); not root? reads may "
        "be served from cache where O_DIRECT is not used",
        std::strerror(err));
  }
}

std::string FormatBytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (bytes >= (int64_t{1} << 30)) return fmt::format("{:.2f} GiB", b / kGiB);
  if (bytes >= (int64_t{1} << 20)) return fmt::format("{:.2f} MiB", b / (1 << 20));
  if (bytes >= (int64_t{1} << 10)) return fmt::format("{:.2f} KiB", b / (1 << 10));
  return fmt::format("{} B", bytes);
}

std::string FormatSizeSuffix(int64_t bytes) {
  if (bytes > 0 && bytes % (int64_t{1} << 30) == 0) return fmt::format("{}G", bytes >> 30);
  if (bytes > 0 && bytes % (int64_t{1} << 20) == 0) return fmt::format("{}M", bytes >> 20);
  if (bytes > 0 && bytes % (int64_t{1} << 10) == 0) return fmt::format("{}K", bytes >> 10);
  return std::to_string(bytes);
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2.0;
}
int64_t ParseSizeFlag(const std::string& flag, const std::string& text) {
  Result<int64_t> r = ParseSize(text);
  if (!r.ok()) throw UsageError(fmt::format("{} '{}': {}", flag, text, r.status().message()));
  if (*r <= 0) throw UsageError(fmt::format("{} must be positive, got '{}'", flag, text));
  return *r;
}

}  // namespace dnvme::cli
