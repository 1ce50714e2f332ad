// Where a read's bytes come from (read_policy.h).
#include "datapath/read_policy.h"

#include <fcntl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <iterator>
#include <limits>

namespace dnvme::datapath {
namespace {

constexpr int64_t kPage = 4096;
// MemAvailable is read again after this long (a read asks for every large file it meets).
constexpr int64_t kMemoryRefreshNs = 200'000'000;

// cachestat(2): Linux 6.5; the number is the same on every architecture (the unified table).
#ifdef __NR_cachestat
constexpr long kCachestat = __NR_cachestat;
#else
constexpr long kCachestat = 451;
#endif
struct CachestatRange {
  uint64_t off;
  uint64_t len;
};
struct Cachestat {
  uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted;
};

class CachestatResidency final : public Residency {
 public:
  int64_t Resident(int fd, int64_t off, int64_t len) const override {
    if (len <= 0) return 0;
    if (unavailable_.load(std::memory_order_relaxed)) return -1;
    CachestatRange range{static_cast<uint64_t>(off), static_cast<uint64_t>(len)};
    Cachestat cs{};
    if (syscall(kCachestat, fd, &range, &cs, 0) != 0) {
      // ENOSYS: the kernel has none, for good. EPERM (a file the caller may not write), EBADF,
      // EOPNOTSUPP: this file only.
      if (errno == ENOSYS) unavailable_.store(true, std::memory_order_relaxed);
      return -1;
    }
    const int64_t pages = (off + len - 1) / kPage - off / kPage + 1;
    if (static_cast<int64_t>(cs.nr_cache) >= pages) return len;
    return std::min(len, static_cast<int64_t>(cs.nr_cache) * kPage);
  }

 private:
  mutable std::atomic<bool> unavailable_{false};
};

int64_t NowNs() {
  struct timespec t {};
  clock_gettime(CLOCK_MONOTONIC_COARSE, &t);
  return static_cast<int64_t>(t.tv_sec) * 1'000'000'000 + t.tv_nsec;
}

// The whole of a small file (a /proc or cgroup file), or "" when it cannot be read.
std::string ReadSmallFile(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return {};
  std::string out;
  char buf[4096];
  for (;;) {
    const ssize_t got = read(fd, buf, sizeof buf);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break;
    out.append(buf, static_cast<size_t>(got));
    if (out.size() > (1 << 20)) break;  // none of ours is this large
  }
  close(fd);
  return out;
}

// The number after `key` at the start of a line of `text` ("MemAvailable:", "anon "), or -1.
int64_t Field(const std::string& text, std::string_view key) {
  size_t at = 0;
  while (at < text.size()) {
    if (text.compare(at, key.size(), key) == 0) {
      size_t p = at + key.size();
      while (p < text.size() && text[p] == ' ') ++p;
      int64_t v = -1;
      const auto [end, ec] = std::from_chars(text.data() + p, text.data() + text.size(), v);
      return ec == std::errc() ? v : -1;
    }
    const size_t nl = text.find('\n', at);
    if (nl == std::string::npos) break;
    at = nl + 1;
  }
  return -1;
}

// The cgroup path of `pid` (0: this process) in the hierarchy a line of /proc/PID/cgroup names:
// v2's "0::/path", or v1's "N:...memory...:/path" (`v1_memory`). "" when there is none.
std::string CgroupPath(const std::string& table, bool v1_memory) {
  size_t at = 0;
  while (at < table.size()) {
    const size_t nl = std::min(table.find('\n', at), table.size());
    const std::string line = table.substr(at, nl - at);
    at = nl + 1;
    const size_t c1 = line.find(':'), c2 = c1 == std::string::npos ? c1 : line.find(':', c1 + 1);
    if (c2 == std::string::npos) continue;
    const std::string controllers = "," + line.substr(c1 + 1, c2 - c1 - 1) + ",";
    const bool match = v1_memory ? controllers.find(",memory,") != std::string::npos
                                 : line.compare(0, 3, "0::") == 0;
    if (match) return line.substr(c2 + 1);
  }
  return {};
}

// The tightest memory cgroup limit of the process whose /proc/PID/cgroup reads `table`, less that
// cgroup's anonymous memory, over the cgroup and its ancestors, in cgroup v2 (memory.max,
// memory.stat's anon) or v1 (memory.limit_in_bytes, memory.stat's total_rss); max() when none is
// set.
int64_t CgroupHeadroom(const std::string& table) {
  int64_t best = std::numeric_limits<int64_t>::max();
  struct Hierarchy {
    bool v1;
    const char* root;
    const char* limit;
    std::string_view anon;
  };
  // v2 where it is the only hierarchy, or under "unified" beside v1's; v1's memory controller.
  static const Hierarchy kHierarchies[] = {
      {false, "/sys/fs/cgroup", "/memory.max", "anon "},
      {false, "/sys/fs/cgroup/unified", "/memory.max", "anon "},
      {true, "/sys/fs/cgroup/memory", "/memory.limit_in_bytes", "total_rss "}};
  for (const Hierarchy& h : kHierarchies) {
    std::string path = CgroupPath(table, h.v1);
    if (path.empty() || path[0] != '/' || path.find("..") != std::string::npos) continue;
    // A container's or a slice's limit sits on an ancestor as often as on the leaf.
    for (int depth = 0; depth < 16 && !path.empty() && path != "/"; ++depth) {
      const std::string dir = h.root + path;
      const std::string max = ReadSmallFile(dir + h.limit);
      int64_t limit = -1;
      if (!max.empty() && max.compare(0, 3, "max") != 0) {
        std::from_chars(max.data(), max.data() + max.size(), limit);
      }
      // v1 says "no limit" with a number near 2^63.
      if (limit >= 0 && limit < (int64_t{1} << 60)) {
        const int64_t anon =
            std::max<int64_t>(0, Field(ReadSmallFile(dir + "/memory.stat"), h.anon));
        best = std::min(best, std::max<int64_t>(0, limit - anon));
      }
      path.resize(path.rfind('/'));
    }
  }
  return best;
}

class SystemMemoryBudget final : public MemoryBudget {
 public:
  int64_t Available(pid_t pid) const override {
    int64_t avail = MemAvailable();
    return std::min(avail, pid == 0 ? SelfHeadroom() : OpenerHeadroom(pid));
  }

 private:
  // /proc/meminfo's MemAvailable, re-read at most every kMemoryRefreshNs; 0 when unreadable
  // (nothing fits: the engine reads, as before residency).
  int64_t MemAvailable() const {
    const int64_t now = NowNs();
    if (now - mem_at_.load(std::memory_order_acquire) < kMemoryRefreshNs) {
      return mem_.load(std::memory_order_relaxed);
    }
    const int64_t kb = Field(ReadSmallFile("/proc/meminfo"), "MemAvailable:");
    const int64_t v = kb < 0 ? 0 : kb * 1024;
    mem_.store(v, std::memory_order_relaxed);
    mem_at_.store(now, std::memory_order_release);
    return v;
  }
  int64_t SelfHeadroom() const {
    const int64_t now = NowNs();
    if (now - self_at_.load(std::memory_order_acquire) < kMemoryRefreshNs) {
      return self_.load(std::memory_order_relaxed);
    }
    const int64_t v = CgroupHeadroom(ReadSmallFile("/proc/self/cgroup"));
    self_.store(v, std::memory_order_relaxed);
    self_at_.store(now, std::memory_order_release);
    return v;
  }
  // Another process's: its answer kept per pid for kMemoryRefreshNs (the mount asks for every
  // READ, not only at the open: one /proc/PID/cgroup read each would cost a reader three system
  // calls a request), the walk once per membership and kMemoryRefreshNs (HeadroomCache). A pid
  // reused within that time gets the answer of the one before it, once.
  int64_t OpenerHeadroom(pid_t pid) const {
    return by_pid_.Get(std::to_string(pid), NowNs(), [&] {
      const std::string table = ReadSmallFile("/proc/" + std::to_string(pid) + "/cgroup");
      return openers_.Get(table, NowNs(), [&] { return CgroupHeadroom(table); });
    });
  }
  mutable HeadroomCache openers_{kMemoryRefreshNs, 256};
  mutable HeadroomCache by_pid_{kMemoryRefreshNs, 1024};
  // Two racing refreshes both store a fresh value: harmless.
  mutable std::atomic<int64_t> mem_{0}, mem_at_{std::numeric_limits<int64_t>::min() / 2};
  mutable std::atomic<int64_t> self_{0}, self_at_{std::numeric_limits<int64_t>::min() / 2};
};

void Append(std::vector<ResidentRun>* out, int64_t off, int64_t len, bool resident) {
  if (len <= 0) return;
  if (!out->empty() && out->back().resident == resident &&
      out->back().off + out->back().len == off) {
    out->back().len += len;
    return;
  }
  out->push_back({off, len, resident});
}

// Splits [lo, hi) by residency, halving at page multiples; a piece of `granule` bytes or less
// that is partly cached goes to the engine whole (O_DIRECT reads of cached pages are correct, and
// the number of probes stays bounded for a large read).
void Split(const Residency& probe, int fd, int64_t lo, int64_t hi, int64_t granule,
           std::vector<ResidentRun>* out) {
  const int64_t got = probe.Resident(fd, lo, hi - lo);
  if (got >= hi - lo) return Append(out, lo, hi - lo, true);
  if (got <= 0 || hi - lo <= granule) return Append(out, lo, hi - lo, false);
  int64_t mid = (lo + (hi - lo) / 2) / kPage * kPage;
  if (mid <= lo) mid = std::min(hi, (lo / kPage + 1) * kPage);
  if (mid >= hi) return Append(out, lo, hi - lo, false);
  Split(probe, fd, lo, mid, granule, out);
  Split(probe, fd, mid, hi, granule, out);
}

}  // namespace

Result<ReadCache> ParseReadCache(std::string_view s) {
  for (ReadCache c : {ReadCache::kAuto, ReadCache::kResident, ReadCache::kOff}) {
    if (s == ReadCacheName(c)) return c;
  }
  if (s == "0") return ReadCache::kOff;
  return Status::InvalidArgument("read cache policy '" + std::string(s) +
                                 "': expected auto, resident or off");
}

const Residency& KernelResidency() {
  static const CachestatResidency kernel;
  return kernel;
}

namespace {
class NoResidency final : public Residency {
 public:
  int64_t Resident(int, int64_t, int64_t) const override { return -1; }
};
}  // namespace

const Residency& UnknownResidency() {
  static const NoResidency none;
  return none;
}

int64_t HeadroomCache::Get(const std::string& key, int64_t now_ns,
                           const std::function<int64_t()>& compute) {
  {
    std::lock_guard lock(mu_);
    auto it = entries_.find(key);
    if (it != entries_.end() && now_ns - it->second.at_ns < ttl_ns_) return it->second.value;
  }
  const int64_t value = compute();
  std::lock_guard lock(mu_);
  if (entries_.size() >= capacity_ && entries_.find(key) == entries_.end()) {
    for (auto it = entries_.begin(); it != entries_.end();) {
      it = now_ns - it->second.at_ns >= ttl_ns_ ? entries_.erase(it) : std::next(it);
    }
    if (entries_.size() >= capacity_) entries_.clear();
  }
  entries_[key] = Entry{value, now_ns};
  return value;
}

size_t HeadroomCache::size() const {
  std::lock_guard lock(mu_);
  return entries_.size();
}

const MemoryBudget& SystemMemory() {
  static const SystemMemoryBudget system;
  return system;
}

bool ReadPolicy::Fits(int64_t size, pid_t pid) const {
  const auto budget = static_cast<double>(memory_budget().Available(pid));
  return static_cast<double>(size) <= fraction * budget;
}

std::vector<ResidentRun> ReadPolicy::Plan(int fd, int64_t off, int64_t len, int64_t file_size,
                                          pid_t pid) const {
  std::vector<ResidentRun> out;
  if (len <= 0) return out;
  if (mode == ReadCache::kOff) return {{off, len, false}};
  if (mode == ReadCache::kAuto && Fits(file_size, pid)) return {{off, len, true}};
  // At most about 64 leaves for a large read; page granularity for a small one.
  const int64_t granule = std::max(kPage, (len / 64 + kPage - 1) / kPage * kPage);
  Split(residency_probe(), fd, off, off + len, granule, &out);
  return out;
}

bool ReadPolicy::ColdReadsToEngine(int fd, int64_t size, pid_t pid, int64_t engine_from,
                                   bool may_probe) const {
  if (size < engine_from) return false;
  if (mode == ReadCache::kOff) return true;
  if (mode == ReadCache::kAuto && Fits(size, pid)) return false;
  constexpr int64_t kSample = 1 << 20;
  const int64_t samples = std::min<int64_t>(16, (size + kSample - 1) / kSample);
  int64_t asked = 0, cached = 0;
  for (int64_t i = 0; i < samples; ++i) {
    const int64_t at = (size - kSample) / std::max<int64_t>(1, samples - 1) * i / kPage * kPage;
    const int64_t len = std::min(kSample, size - at);
    const int64_t got = (may_probe ? residency_probe() : UnknownResidency()).Resident(fd, at, len);
    asked += len;
    cached += std::max<int64_t>(0, got);
  }
  return 2 * cached < asked;  // mostly cold
}

}  // namespace dnvme::datapath
