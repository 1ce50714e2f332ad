// Helpers shared by the engine test suites.
//
//   - ScratchTest: a fixture that gives every test its own directory under $DNVME_TEST_DIR
//     (fallback /var/tmp/dnvme-test), removed in TearDown.
//   - A deterministic data pattern keyed by absolute file offset (and a seed), so a byte found at a
//     file offset can be checked without keeping a copy of what was written.
//   - Plain POSIX file helpers (read a whole file, size, write a pattern file) that never go
//   through
//     the engine, so they can check it independently.
//   - AlignedBuffer: heap memory with a chosen misalignment and guard bytes on both sides, so an
//     engine that writes outside the caller's buffer is caught.
//   - Mount: RAII mount(2) / umount2(MNT_DETACH) for the tmpfs/ramfs tests.
//   - Watchdog: aborts the process with a message when a guarded step hangs (a deadlock in the
//     engine must fail the run, not stall it forever). It is a hang guard, never a timing
//     assertion.
//
// Thread safety: everything here is used from the test's main thread, except the pattern functions
// (pure) and Watchdog (owns its thread).
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "dnvme/status.h"

// ---- Status assertions --------------------------------------------------------------------------

#define DNVME_EXPECT_OK(expr)                                                   \
  do {                                                                          \
    const ::dnvme::Status _dnvme_t_st = (expr);                                 \
    EXPECT_TRUE(_dnvme_t_st.ok()) << #expr << " -> " << _dnvme_t_st.ToString(); \
  } while (0)

#define DNVME_ASSERT_OK(expr)                                                   \
  do {                                                                          \
    const ::dnvme::Status _dnvme_t_st = (expr);                                 \
    ASSERT_TRUE(_dnvme_t_st.ok()) << #expr << " -> " << _dnvme_t_st.ToString(); \
  } while (0)

#define DNVME_ASSERT_OK_AND_ASSIGN_IMPL(tmp, lhs, expr)                \
  auto tmp = (expr);                                                   \
  ASSERT_TRUE(tmp.ok()) << #expr << " -> " << tmp.status().ToString(); \
  lhs = std::move(tmp).value()

#define DNVME_ASSERT_OK_AND_ASSIGN(lhs, expr) \
  DNVME_ASSERT_OK_AND_ASSIGN_IMPL(DNVME_CONCAT(_dnvme_t_res_, __LINE__), lhs, expr)

// Checks a status's code and prints the whole status when it differs.
#define DNVME_EXPECT_CODE(status_expr, code_name)                     \
  do {                                                                \
    const ::dnvme::Status _dnvme_t_st = (status_expr);                \
    EXPECT_EQ(_dnvme_t_st.code(), ::dnvme::Status::Code::code_name)   \
        << "expected " #code_name ", got " << _dnvme_t_st.ToString(); \
  } while (0)

// The sanitizers' runtimes intercept mlock()/munlock() and turn them into no-ops, so under them
// RLIMIT_MEMLOCK never bites and tests about it must skip.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define DNVME_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define DNVME_TEST_SANITIZED 1
#endif
#endif
#ifndef DNVME_TEST_SANITIZED
#define DNVME_TEST_SANITIZED 0
#endif

namespace dnvme::test {

inline constexpr bool kMlockIsReal = !DNVME_TEST_SANITIZED;
inline constexpr const char* kMlockSkipReason =
    "built with a sanitizer, whose runtime intercepts mlock() as a no-op: RLIMIT_MEMLOCK cannot "
    "bite";

inline constexpr int64_t kKiB = 1024;
inline constexpr int64_t kMiB = 1024 * 1024;

// ---- Deterministic data pattern -----------------------------------------------------------------

inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// The byte that belongs at `file_offset` for `seed`: byte (offset % 8) of splitmix64 of the 8-byte
// word index, so data is position-dependent and a shifted copy never matches.
inline uint8_t PatternByte(int64_t file_offset, uint64_t seed = 0) {
  const uint64_t word =
      SplitMix64((static_cast<uint64_t>(file_offset) >> 3) ^ (seed * 0xd6e8feb86659fd93ULL));
  return static_cast<uint8_t>(word >> ((file_offset & 7) * 8));
}

// Fills `len` bytes with the pattern of the file range starting at `file_offset`.
inline void FillPattern(void* buf, size_t len, int64_t file_offset, uint64_t seed = 0) {
  auto* p = static_cast<uint8_t*>(buf);
  for (size_t i = 0; i < len; ++i) p[i] = PatternByte(file_offset + static_cast<int64_t>(i), seed);
}

// Index of the first byte that differs from the pattern, or -1.
inline int64_t FirstPatternMismatch(const void* buf, size_t len, int64_t file_offset,
                                    uint64_t seed = 0) {
  const auto* p = static_cast<const uint8_t*>(buf);
  for (size_t i = 0; i < len; ++i) {
    if (p[i] != PatternByte(file_offset + static_cast<int64_t>(i), seed)) {
      return static_cast<int64_t>(i);
    }
  }
  return -1;
}

// EXPECT_TRUE(MatchesPattern(...)): says where and how the data differs.
inline ::testing::AssertionResult MatchesPattern(const void* buf, size_t len, int64_t file_offset,
                                                 uint64_t seed = 0) {
  const int64_t bad = FirstPatternMismatch(buf, len, file_offset, seed);
  if (bad < 0) return ::testing::AssertionSuccess();
  const auto* p = static_cast<const uint8_t*>(buf);
  return ::testing::AssertionFailure()
         << "data differs from pattern (seed " << seed << ") first at buffer index " << bad
         << " = file offset " << file_offset + bad << ": got 0x" << std::hex
         << static_cast<int>(p[bad]) << ", want 0x"
         << static_cast<int>(PatternByte(file_offset + bad, seed)) << std::dec << " (range of "
         << len << " bytes)";
}

// EXPECT_TRUE(AllBytesAre(...)).
inline ::testing::AssertionResult AllBytesAre(const void* buf, size_t len, uint8_t value,
                                              int64_t report_base = 0) {
  const auto* p = static_cast<const uint8_t*>(buf);
  for (size_t i = 0; i < len; ++i) {
    if (p[i] != value) {
      return ::testing::AssertionFailure()
             << "byte at offset " << report_base + static_cast<int64_t>(i) << " is 0x" << std::hex
             << static_cast<int>(p[i]) << ", want 0x" << static_cast<int>(value);
    }
  }
  return ::testing::AssertionSuccess();
}

// ---- Plain POSIX file helpers (independent of the engine) ---------------------------------------

// Size of the file, or -1 (with errno) when it cannot be stat'ed.
inline int64_t FileSize(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return -1;
  return static_cast<int64_t>(st.st_size);
}

inline bool FileExists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

// The whole file through the page cache. On failure records a test failure and returns empty.
inline std::vector<uint8_t> ReadWholeFile(const std::string& path) {
  std::vector<uint8_t> out;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    ADD_FAILURE() << "open(" << path << "): " << std::strerror(errno);
    return out;
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ADD_FAILURE() << "fstat(" << path << "): " << std::strerror(errno);
    ::close(fd);
    return out;
  }
  out.resize(static_cast<size_t>(st.st_size));
  size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = ::pread(fd, out.data() + done, out.size() - done, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ADD_FAILURE() << "pread(" << path << ") at " << done << ": "
                    << (n == 0 ? "unexpected EOF" : std::strerror(errno));
      out.resize(done);
      break;
    }
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  return out;
}

// Writes `size` bytes of pattern (offsets 0..size) to a new or truncated file; true on success.
inline bool WritePatternFile(const std::string& path, int64_t size, uint64_t seed = 0) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    ADD_FAILURE() << "open(" << path << "): " << std::strerror(errno);
    return false;
  }
  std::vector<uint8_t> chunk(static_cast<size_t>(std::min<int64_t>(size, 4 * kMiB)));
  int64_t done = 0;
  bool ok = true;
  while (done < size) {
    const size_t n = static_cast<size_t>(std::min<int64_t>(size - done, 4 * kMiB));
    FillPattern(chunk.data(), n, done, seed);
    size_t put = 0;
    while (put < n) {
      const ssize_t w = ::pwrite(fd, chunk.data() + put, n - put, done + static_cast<off_t>(put));
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        ADD_FAILURE() << "pwrite(" << path << "): " << std::strerror(errno);
        ok = false;
        break;
      }
      put += static_cast<size_t>(w);
    }
    if (!ok) break;
    done += static_cast<int64_t>(n);
  }
  ::close(fd);
  return ok;
}

// ---- Aligned heap buffer with deliberate misalignment and guard bytes ---------------------------

// `size` usable bytes starting `misalign` bytes after a 4096-aligned address. The bytes just before
// and after the usable range are filled with a guard value; GuardsIntact() says whether anything
// wrote outside the range.
class AlignedBuffer {
 public:
  static constexpr size_t kAlignment = 4096;
  static constexpr size_t kTailGuard = 4096;
  static constexpr uint8_t kGuard = 0xA5;

  explicit AlignedBuffer(size_t size, size_t misalign = 0) : size_(size), misalign_(misalign) {
    total_ = misalign_ + size_ + kTailGuard;
    void* p = nullptr;
    if (::posix_memalign(&p, kAlignment, total_) != 0) p = nullptr;
    base_ = static_cast<uint8_t*>(p);
    if (base_ == nullptr) {
      ADD_FAILURE() << "posix_memalign(" << total_ << ") failed";
      size_ = 0;
      return;
    }
    std::memset(base_, kGuard, total_);
    std::memset(data(), 0, size_);
  }
  ~AlignedBuffer() { std::free(base_); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;

  uint8_t* data() const { return base_ + misalign_; }
  char* bytes() const { return reinterpret_cast<char*>(data()); }
  size_t size() const { return size_; }
  int64_t ssize() const { return static_cast<int64_t>(size_); }
  size_t misalign() const { return misalign_; }

  void Fill(int64_t file_offset, uint64_t seed = 0) {
    FillPattern(data(), size_, file_offset, seed);
  }
  void Set(uint8_t value) { std::memset(data(), value, size_); }

  ::testing::AssertionResult GuardsIntact() const {
    for (size_t i = 0; i < misalign_; ++i) {
      if (base_[i] != kGuard) {
        return ::testing::AssertionFailure()
               << "byte " << (misalign_ - i) << " before the buffer was overwritten";
      }
    }
    for (size_t i = misalign_ + size_; i < total_; ++i) {
      if (base_[i] != kGuard) {
        return ::testing::AssertionFailure()
               << "byte " << (i - misalign_ - size_) << " past the end of the " << size_
               << "-byte buffer was overwritten";
      }
    }
    return ::testing::AssertionSuccess();
  }

 private:
  uint8_t* base_ = nullptr;
  size_t size_ = 0;
  size_t misalign_ = 0;
  size_t total_ = 0;
};

// ---- Scratch directory per test -----------------------------------------------------------------

inline std::string ScratchRoot() {
  const char* env = std::getenv("DNVME_TEST_DIR");
  return (env != nullptr && env[0] != '\0') ? std::string(env) : std::string("/var/tmp/dnvme-test");
}

// Creates a unique directory for the running test; removes it (recursively) on destruction.
class ScratchDir {
 public:
  ScratchDir() {
    const std::string root = ScratchRoot();
    std::error_code ec;
    std::filesystem::create_directories(root, ec);
    if (ec) {
      error_ = "cannot create scratch root " + root + ": " + ec.message();
      return;
    }
    std::string name = "test";
    if (const auto* info = ::testing::UnitTest::GetInstance()->current_test_info()) {
      name = std::string(info->test_suite_name()) + "." + info->name();
    }
    for (char& c : name) {
      if (c == '/' || c == ' ') c = '_';
    }
    if (name.size() > 150) name.resize(150);
    std::string tmpl = root + "/" + name + ".XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    if (::mkdtemp(buf.data()) == nullptr) {
      error_ = "mkdtemp(" + tmpl + "): " + std::strerror(errno);
      return;
    }
    path_ = buf.data();
  }
  ~ScratchDir() { (void)Remove(); }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  bool ok() const { return !path_.empty(); }
  const std::string& error() const { return error_; }
  const std::string& path() const { return path_; }

  // Removes the directory now; returns an error text or "".
  std::string Remove() {
    if (path_.empty()) return "";
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
    std::string err = ec ? "remove_all(" + path_ + "): " + ec.message() : "";
    path_.clear();
    return err;
  }

 private:
  std::string path_;
  std::string error_;
};

class ScratchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    scratch_ = std::make_unique<ScratchDir>();
    ASSERT_TRUE(scratch_->ok()) << scratch_->error();
  }
  void TearDown() override {
    if (scratch_) {
      const std::string err = scratch_->Remove();
      EXPECT_EQ(err, "") << "scratch directory not cleaned up";
      scratch_.reset();
    }
  }

  const std::string& dir() const { return scratch_->path(); }
  std::string Path(std::string_view name) const { return dir() + "/" + std::string(name); }

 private:
  std::unique_ptr<ScratchDir> scratch_;
};

// ---- Mount guard --------------------------------------------------------------------------------

// mount(2) in the constructor (creating the target directory), umount2(MNT_DETACH) in the
// destructor whenever the mount succeeded, even when the test failed half-way.
class Mount {
 public:
  Mount(std::string source, std::string target, std::string fstype, std::string options)
      : target_(std::move(target)) {
    if (::mkdir(target_.c_str(), 0755) != 0 && errno != EEXIST) {
      error_ = errno;
      what_ = "mkdir(" + target_ + "): " + std::strerror(error_);
      return;
    }
    if (::mount(source.c_str(), target_.c_str(), fstype.c_str(), 0,
                options.empty() ? nullptr : options.c_str()) != 0) {
      error_ = errno;
      what_ = "mount -t " + fstype + " -o '" + options + "' " + source + " " + target_ + ": " +
              std::strerror(error_);
      return;
    }
    mounted_ = true;
  }
  ~Mount() {
    if (mounted_) ::umount2(target_.c_str(), MNT_DETACH);
  }
  Mount(const Mount&) = delete;
  Mount& operator=(const Mount&) = delete;

  bool ok() const { return mounted_; }
  int error() const { return error_; }
  const std::string& what() const { return what_; }
  const std::string& path() const { return target_; }

 private:
  std::string target_;
  bool mounted_ = false;
  int error_ = 0;
  std::string what_;
};

// ---- Hang guard ---------------------------------------------------------------------------------

// Aborts the whole test binary with a message if not destroyed within `limit`. Use around engine
// calls that could deadlock (e.g. under fault injection) so a hang becomes a visible failure.
class Watchdog {
 public:
  Watchdog(std::chrono::seconds limit, std::string what) : what_(std::move(what)) {
    thread_ = std::thread([this, limit] {
      std::unique_lock<std::mutex> lock(mu_);
      if (!cv_.wait_for(lock, limit, [this] { return done_; })) {
        std::fprintf(stderr,
                     "WATCHDOG: '%s' did not finish within %lld s; aborting (engine hang?)\n",
                     what_.c_str(), static_cast<long long>(limit.count()));
        std::fflush(stderr);
        std::abort();
      }
    });
  }
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

 private:
  std::string what_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

}  // namespace dnvme::test
