// ReadPolicy: where a read's bytes come from -- the backing file's page cache, or the device
// through the engine's O_DIRECT reads -- decided once, here, for both users of the data path (the
// mount's READs and OPENs, `dnvme run`'s reads).
//
// Why: O_DIRECT never reads from nor fills the page cache. A file read a second time, read by
// several processes at once, or read back right after it was written is served by plain ext4 from
// memory at memcpy speed, and through an O_DIRECT-only path from the device every time (measured
// 0.27-0.31x plain ext4: docs/performance.md). And on both reference devices a cold buffered read
// of a file that fits in memory ran as fast as raw O_DIRECT (docs/performance-journal.md, "Issue
// 47"). O_DIRECT keeps its reason to exist for files larger than memory, which through the page
// cache evict everything else (and each other) for bytes read once.
//
// The rule (ReadCache):
//   kAuto      a range the page cache holds is read from it; a file that fits in `fraction` of the
//              memory available (MemAvailable, and the memory cgroup's limit less its anonymous
//              memory) is read through the page cache even when cold, so the kernel's read-ahead
//              fills it for the next reader; the cold ranges of a larger file go O_DIRECT.
//   kResident  only what the page cache holds is read from it; cold ranges go O_DIRECT and are
//              never cached (FlashPack's rule: a checkpoint read once, in a job that needs its
//              memory).
//   kOff       every read O_DIRECT through the engine (the data path before residency).
// Residency is asked of the kernel with cachestat(2) (Linux 6.5+; 0.3-0.5 us per 1 MiB range here,
// against mincore's 10-15 us on a mapping, and preadv2(RWF_NOWAIT), which starts read-ahead on a
// miss, so it is no probe). The kernel refuses cachestat (EPERM) on a file the caller could not
// open for writing (the page-cache side channel rule, as for mincore), and older kernels lack it:
// residency is then unknown and counts as nothing cached.
//
// Thread contract: ReadPolicy is read-only once its user set it up (before the first FileData);
// every method is const and thread-safe. Residency and MemoryBudget implementations are
// thread-safe. SystemMemory() caches MemAvailable for kMemoryRefreshNs (an atomic pair).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "dnvme/status.h"

namespace dnvme::datapath {

enum class ReadCache { kAuto, kResident, kOff };
constexpr const char* ReadCacheName(ReadCache c) {
  switch (c) {
    case ReadCache::kAuto:
      return "auto";
    case ReadCache::kResident:
      return "resident";
    case ReadCache::kOff:
      return "off";
  }
  return "?";
}
// "auto", "resident", "off" (and "0" for off); anything else is InvalidArgument naming them.
Result<ReadCache> ParseReadCache(std::string_view s);

// The residency seam: tests answer from a model, the real one asks the kernel.
class Residency {
 public:
  virtual ~Residency() = default;
  // Bytes of [off, off + len) of the file `fd` that the page cache holds (whole pages counted,
  // the last one clipped to `len`), or -1 when the kernel cannot say (no cachestat, EPERM).
  virtual int64_t Resident(int fd, int64_t off, int64_t len) const = 0;
};
// cachestat(2).
const Residency& KernelResidency();
// Always -1 (unknown): for a reader the kernel would refuse cachestat of the file (one who could
// not open it for writing). The daemon asks as root; deciding with what only root may know would
// tell that reader whether the file is cached, through the decision's counters and its speed.
const Residency& UnknownResidency();

// The memory seam.
class MemoryBudget {
 public:
  virtual ~MemoryBudget() = default;
  // Bytes a file may take in the page cache without pushing out what else is cached: the
  // machine's MemAvailable, and for a process in a memory cgroup (v2) with a limit, that limit
  // less the cgroup's anonymous memory, whichever is smaller. `pid` 0: this process's cgroup;
  // otherwise that process's (the mount asks for its opener's: its page cache is charged there).
  virtual int64_t Available(pid_t pid) const = 0;
};
const MemoryBudget& SystemMemory();

// A number per key (SystemMemory: a cgroup membership, the text of /proc/PID/cgroup), worked out
// again at most every `ttl_ns`: the mount asks for every large read-only open's opener on a loop
// thread, and the walk up a cgroup's ancestors reads up to ~100 sysfs files, so a local user
// opening large files in a loop would cost every other user's requests that much per open.
// At most `capacity` keys: past it, the expired ones go, and all of them if none has expired.
// Thread contract: Get is thread-safe (one mutex; `compute` runs outside it, so two threads may
// both compute one key, and the later store wins).
class HeadroomCache {
 public:
  HeadroomCache(int64_t ttl_ns, size_t capacity) : ttl_ns_(ttl_ns), capacity_(capacity) {}
  int64_t Get(const std::string& key, int64_t now_ns, const std::function<int64_t()>& compute);
  size_t size() const;

 private:
  struct Entry {
    int64_t value;
    int64_t at_ns;
  };
  const int64_t ttl_ns_;
  const size_t capacity_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, Entry> entries_;  // guarded by mu_
};

// One run of a range: resident in the page cache or not.
struct ResidentRun {
  int64_t off = 0;
  int64_t len = 0;
  bool resident = false;
};

struct ReadPolicy {
  ReadCache mode =
      ReadCache::kOff;  // the users set theirs (-o read_cache, DNVME_PRELOAD_READ_CACHE)
  // kAuto: a file of at most this fraction of MemoryBudget::Available goes through the page cache.
  double fraction = 0.5;
  // Page-cache reads of at least this many bytes are cut among the engine's workers
  // (AioHandle::sync_pread_cached): one thread copying, and faulting in the caller's fresh pages,
  // is what bounds such a read. Smaller ones are one pread(2) on the caller's thread.
  int64_t parallel_from = 8 << 20;
  const Residency* residency = nullptr;  // null: KernelResidency()
  const MemoryBudget* memory = nullptr;  // null: SystemMemory()

  const Residency& residency_probe() const {
    return residency != nullptr ? *residency : KernelResidency();
  }
  const MemoryBudget& memory_budget() const { return memory != nullptr ? *memory : SystemMemory(); }
  // kAuto: whether a file of `size` bytes is read through the page cache whatever is cached.
  bool Fits(int64_t size, pid_t pid = 0) const;
  // How [off, off + len) of `fd` (a file of `file_size` bytes) is read: runs in file order that
  // cover it exactly, each from the page cache (`resident` true) or the engine. One run in the
  // common cases (everything cached, nothing cached, a file that fits); a partly cached range is
  // split where residency changes, found by halving with the probe down to granules of 1/64 of
  // the range (whole pages; single pages for a read of 256 KiB or less). A granule only partly
  // cached goes to the engine whole (O_DIRECT reads of cached pages are right), which bounds the
  // probes of a large read at a few hundred.
  // `pid`: the reader, whose memory a fill of the page cache takes (0: this process).
  std::vector<ResidentRun> Plan(int fd, int64_t off, int64_t len, int64_t file_size,
                                pid_t pid = 0) const;
  // Write-behind flushes of a file that fits go through the page cache instead of O_DIRECT, so
  // that a file read back right after it was written (a checkpoint saved, then validated or
  // loaded) comes from memory, as on plain ext4. Off by default: write + fsync then runs at the
  // kernel's writeback speed, measured 0.2-0.5x the O_DIRECT write-behind on the RAM ext4 for a
  // read back at most 1.3x faster (docs/performance.md, "Readers"); the mount's -o cache_writes,
  // `dnvme run --cache-writes`.
  bool cache_writes = false;
  // Whether a flush that leaves the file `file_end` bytes long (at least) goes through the page
  // cache: cache_writes and a file that fits. The bytes reach the disk by the kernel's writeback;
  // fsync waits for it as for write(2).
  bool CachesWrites(int64_t file_end) const {
    return cache_writes && mode != ReadCache::kOff && Fits(file_end);
  }
  // The mount's OPEN of a read-only file of `size` bytes by process `pid`: whether its cold
  // reads should come from the engine (the daemon serves it) rather than from the backing file's
  // page cache (passthrough). kOff: any file of at least `engine_from` bytes; kResident: such a
  // file unless most of it is cached; kAuto: such a file that does not fit and is not mostly
  // cached. Residency is sampled (at most 16 ranges of 1 MiB), not walked; `may_probe` false (an
  // opener who could not write the file) takes it as unknown (UnknownResidency).
  bool ColdReadsToEngine(int fd, int64_t size, pid_t pid, int64_t engine_from,
                         bool may_probe = true) const;
};

}  // namespace dnvme::datapath
