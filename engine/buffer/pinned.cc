#include "dnvme/pinned.h"

#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>

namespace dnvme {
namespace {

std::atomic<int64_t> g_pinned_bytes{0};

size_t PageSize() {
  static const size_t page = [] {
    long p = sysconf(_SC_PAGESIZE);
    return p > 0 ? static_cast<size_t>(p) : size_t{4096};
  }();
  return page;
}

std::string HumanBytes(int64_t n) {
  if (n < 0) return "unlimited";
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.1f %s", v, units[u]);
  return buf;
}

}  // namespace

int64_t PinnedBytesInUse() { return g_pinned_bytes.load(std::memory_order_relaxed); }

int64_t MemlockLimitBytes() {
  struct rlimit rl {};
  if (getrlimit(RLIMIT_MEMLOCK, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return -1;
  return static_cast<int64_t>(rl.rlim_cur);
}

PinnedBuffer::~PinnedBuffer() { Release(); }

PinnedBuffer::PinnedBuffer(PinnedBuffer&& other) noexcept
    : data_(other.data_), size_(other.size_), locked_(other.locked_) {
  other.data_ = nullptr;
  other.size_ = 0;
  other.locked_ = 0;
}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& other) noexcept {
  if (this != &other) {
    Release();
    data_ = other.data_;
    size_ = other.size_;
    locked_ = other.locked_;
    other.data_ = nullptr;
    other.size_ = 0;
    other.locked_ = 0;
  }
  return *this;
}

void PinnedBuffer::Release() {
  if (data_ == nullptr) return;
  if (locked_ > 0) {
    // munlock cannot fail for a range we locked ourselves; nothing to do if it did.
    (void)munlock(data_, locked_);
    g_pinned_bytes.fetch_sub(static_cast<int64_t>(locked_), std::memory_order_relaxed);
  }
  std::free(data_);
  data_ = nullptr;
  size_ = 0;
  locked_ = 0;
}

Result<PinnedBuffer> PinnedBuffer::Allocate(size_t size, size_t alignment) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
    return Status::InvalidArgument("pinned buffer alignment must be a power of two, got " +
                                   std::to_string(alignment));
  }
  PinnedBuffer buf;
  if (size == 0) return buf;
  if (alignment < PageSize()) alignment = PageSize();
  // Round the allocation to whole pages: mlock works on pages, and a neighbour allocation sharing
  // our last page would otherwise be locked (and unlocked) with us.
  size_t alloc = (size + PageSize() - 1) / PageSize() * PageSize();
  // Buffers of a huge page or more are placed on huge-page boundaries and asked to be backed by
  // transparent huge pages (a hint: without THP, or with memory too fragmented, they get small
  // pages and work the same). O_DIRECT pins a request's pages (get_user_pages) and the block layer
  // builds one segment per physically contiguous run: a 4 MiB request into small pages is 1024
  // pages and more segments than a loop or NVMe queue takes per request, so it is split, each
  // piece completed on its own. Measured (docs/performance-journal.md): `dnvme run` fio psync
  // reads through 4 MiB read-ahead buffers on the RAM ext4 went from 5.4 to 6.3 GiB/s and from
  // 1.22x to 1.01x raw fio's CPU per GiB.
  const bool huge = alloc >= kHugePage;
  if (huge && alignment < kHugePage) alignment = kHugePage;
  void* p = nullptr;
  int rc = posix_memalign(&p, alignment, alloc);
  if (rc != 0) {
    return Status::ResourceExhausted(rc, "cannot allocate " + HumanBytes(int64_t(alloc)) +
                                             " for a pinned buffer: " + std::strerror(rc));
  }
  // Before the first touch (memset), so the faults take huge pages. Failure (EINVAL: a kernel
  // without THP) only loses the hint.
  if (huge) (void)madvise(p, alloc / kHugePage * kHugePage, MADV_HUGEPAGE);
  std::memset(p, 0, alloc);
  if (mlock(p, alloc) != 0) {
    int err = errno;
    std::free(p);
    int64_t limit = MemlockLimitBytes();
    return Status::ResourceExhausted(
        err, "cannot pin " + HumanBytes(int64_t(alloc)) +
                 " of host memory (mlock: " + std::strerror(err) + "): RLIMIT_MEMLOCK is " +
                 HumanBytes(limit) + " and " + HumanBytes(PinnedBytesInUse()) +
                 " is already pinned by dnvme. Raise the limit with `ulimit -l unlimited` (or a "
                 "'memlock' line in /etc/security/limits.conf, or LimitMEMLOCK=infinity in a "
                 "systemd unit), or grant the process CAP_IPC_LOCK");
  }
  g_pinned_bytes.fetch_add(static_cast<int64_t>(alloc), std::memory_order_relaxed);
  buf.data_ = p;
  buf.size_ = size;
  buf.locked_ = alloc;
  return buf;
}

PinnedPool::Lease& PinnedPool::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    Reset();
    pool_ = other.pool_;
    index_ = other.index_;
    other.pool_ = nullptr;
  }
  return *this;
}

char* PinnedPool::Lease::data() const { return pool_ ? pool_->buffers_[index_].bytes() : nullptr; }

size_t PinnedPool::Lease::size() const { return pool_ ? pool_->buffer_size_ : 0; }

void PinnedPool::Lease::Reset() {
  if (pool_ != nullptr) {
    pool_->Return(index_);
    pool_ = nullptr;
  }
}

PinnedPool::PinnedPool(size_t buffer_size, std::vector<PinnedBuffer> buffers)
    : buffer_size_(buffer_size), buffers_(std::move(buffers)) {
  free_.reserve(buffers_.size());
  for (size_t i = buffers_.size(); i > 0; --i) free_.push_back(i - 1);
}

Result<std::unique_ptr<PinnedPool>> PinnedPool::Create(size_t buffer_size, size_t count,
                                                       size_t alignment) {
  if (buffer_size == 0 || count == 0) {
    return Status::InvalidArgument("a pinned pool needs a non-zero buffer size and count");
  }
  std::vector<PinnedBuffer> buffers;
  buffers.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    auto b = PinnedBuffer::Allocate(buffer_size, alignment);
    if (!b.ok()) return b.status().WithContext("pinned bounce pool");
    buffers.push_back(std::move(b).value());
  }
  return std::unique_ptr<PinnedPool>(new PinnedPool(buffer_size, std::move(buffers)));
}

PinnedPool::Lease PinnedPool::TryAcquire() {
  std::lock_guard lock(mu_);
  if (free_.empty()) return Lease();
  size_t idx = free_.back();
  free_.pop_back();
  return Lease(this, idx);
}

PinnedPool::Lease PinnedPool::Acquire() {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return !free_.empty(); });
  size_t idx = free_.back();
  free_.pop_back();
  return Lease(this, idx);
}

size_t PinnedPool::available() const {
  std::lock_guard lock(mu_);
  return free_.size();
}

void PinnedPool::Return(size_t index) {
  {
    std::lock_guard lock(mu_);
    free_.push_back(index);
  }
  cv_.notify_one();
}

}  // namespace dnvme
