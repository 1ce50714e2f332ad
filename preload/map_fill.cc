// Filling large read-only private mappings (map_fill.h).
#include "preload/map_fill.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <system_error>
#include <thread>
#include <vector>

#include "dnvme/log.h"
#include "preload/counters.h"
#include "preload/internal.h"
#include "preload/mounts.h"
#include "preload/settings.h"

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22  // Linux 5.14
#endif

namespace dnvme::preload {
namespace {

constexpr int64_t kPiece = 8 << 20;  // one madvise call: large enough for the device to stream
constexpr unsigned kFillThreads = 4;

// Whether `fd` is a regular file on a dnvmefs mount this process's engine may serve, and its size.
bool OnAllowedMount(int fd, int64_t* size) {
  struct stat st {};
  if (!Mounts().on_fuse(fd) || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) return false;
  MountInfo m;
  if (!Mounts().find_mount(st.st_dev, &m) || !MountAllowed(m.point)) return false;
  *size = st.st_size;
  return true;
}

int64_t HalfTheMemory() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page / 2 : 0;
}

}  // namespace

void AfterMap(void* addr, size_t len, int prot, int fd, off_t off) {
  if (fd < 0 || (prot & PROT_WRITE) != 0 || (prot & PROT_READ) == 0) return;
  const Settings& settings = PreloadSettings();
  if (!settings.enabled || settings.map_fill <= 0 ||
      static_cast<int64_t>(len) < settings.map_fill ||
      static_cast<int64_t>(len) > HalfTheMemory()) {
    return;
  }
  int64_t size = 0;
  if (!OnAllowedMount(fd, &size) || off >= size) return;
  // The part of the mapping inside the file (a page past the end would be SIGBUS, and here
  // EFAULT).
  const int64_t page = sysconf(_SC_PAGESIZE);
  const int64_t inside = std::min<int64_t>(static_cast<int64_t>(len), size - off);
  const int64_t bytes = (inside + page - 1) / page * page;
  // This process's writes of any file are in and announced: the pages read now hold them.
  AnnounceEverything();
  auto* base = static_cast<char*>(addr);
  std::atomic<int64_t> next{0};
  std::atomic<int> failed{0};
  auto fill = [&] {
    for (;;) {
      const int64_t at = next.fetch_add(kPiece, std::memory_order_relaxed);
      if (at >= bytes || failed.load(std::memory_order_relaxed) != 0) return;
      const auto n = static_cast<size_t>(std::min(kPiece, bytes - at));
      int rc;
      do {
        rc = madvise(base + at, n, MADV_POPULATE_READ);
      } while (rc != 0 && (errno == EINTR || errno == EAGAIN));
      if (rc != 0) {
        failed.store(errno, std::memory_order_relaxed);
        return;
      }
      ProcessCounters().map_filled.fetch_add(n, std::memory_order_relaxed);
    }
  };
  const int cpus = PreloadSettings().cpus;
  const auto helpers = static_cast<size_t>(
      std::min<int64_t>(std::min<int64_t>(kFillThreads, std::max(2, cpus)) - 1, bytes / kPiece));
  std::vector<std::thread> threads;
  threads.reserve(helpers);
  for (size_t i = 0; i < helpers; ++i) {
    try {
      threads.emplace_back(fill);
    } catch (const std::system_error&) {
      break;  // no thread to be had: the caller's own fills it all the same
    }
  }
  fill();
  for (std::thread& t : threads) t.join();
  if (int err = failed.load(); err != 0) {
    dnvme::Logger().debug("dnvme run: filling a mapping of {} bytes stopped: errno {}", bytes, err);
  } else {
    ProcessCounters().map_fills.fetch_add(1, std::memory_order_relaxed);
  }
}

}  // namespace dnvme::preload
