// Page-locked (pinned) host memory: single buffers and a fixed pool of bounce buffers.
//
// A PinnedBuffer is allocated with posix_memalign and locked with mlock so the kernel never pages
// it out while libaio (or, later, a GPU DMA engine) reads or writes it. It owns its memory:
// destroying it (or moving over it) munlocks and frees. Every pinned byte is counted process-wide
// so a refusal can say how much dnvme already holds; when mlock is refused the Status says the
// RLIMIT_MEMLOCK in force and how to raise it.
//
// Thread safety: a PinnedBuffer is not shared; move it between threads freely. PinnedPool is safe
// to use from several threads at once (its free list is guarded by a mutex).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "dnvme/status.h"

namespace dnvme {

class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer();
  PinnedBuffer(PinnedBuffer&& other) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  // `size` bytes (0 is allowed and pins nothing) aligned to `alignment` (a power of two, at least
  // the page size is used). The memory is zero-filled so a fresh buffer never leaks old data.
  // A buffer of kHugePage bytes or more is aligned to kHugePage and backed by transparent huge
  // pages where the kernel has them (fewer pages for O_DIRECT to pin, fewer block segments).
  static Result<PinnedBuffer> Allocate(size_t size, size_t alignment = 4096);
  static constexpr size_t kHugePage = 2 << 20;

  void* data() const { return data_; }
  char* bytes() const { return static_cast<char*>(data_); }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

 private:
  void Release();

  void* data_ = nullptr;
  size_t size_ = 0;
  size_t locked_ = 0;  // bytes actually mlocked (0 for size 0)
};

// Bytes currently pinned by PinnedBuffer objects in this process.
int64_t PinnedBytesInUse();

// The soft RLIMIT_MEMLOCK in bytes, or -1 for unlimited.
int64_t MemlockLimitBytes();

// A fixed number of equally sized pinned buffers, allocated up front, handed out and returned.
// Used for bounce buffers: misaligned user memory is copied through them so the disk still sees
// O_DIRECT requests.
class PinnedPool {
 public:
  // A lease on one buffer; returns it to the pool when destroyed. The pool must outlive it.
  class Lease {
   public:
    Lease() = default;
    ~Lease() { Reset(); }
    Lease(Lease&& other) noexcept : pool_(other.pool_), index_(other.index_) {
      other.pool_ = nullptr;
    }
    Lease& operator=(Lease&& other) noexcept;
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;

    explicit operator bool() const { return pool_ != nullptr; }
    char* data() const;
    size_t size() const;
    void Reset();

   private:
    friend class PinnedPool;
    Lease(PinnedPool* pool, size_t index) : pool_(pool), index_(index) {}
    PinnedPool* pool_ = nullptr;
    size_t index_ = 0;
  };

  static Result<std::unique_ptr<PinnedPool>> Create(size_t buffer_size, size_t count,
                                                    size_t alignment = 4096);

  // Returns an empty Lease when every buffer is out.
  Lease TryAcquire();
  // Blocks until a buffer is free.
  Lease Acquire();

  size_t buffer_size() const { return buffer_size_; }
  size_t count() const { return buffers_.size(); }
  size_t available() const;

 private:
  PinnedPool(size_t buffer_size, std::vector<PinnedBuffer> buffers);
  void Return(size_t index);

  const size_t buffer_size_;
  std::vector<PinnedBuffer> buffers_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<size_t> free_;  // guarded by mu_
};

}  // namespace dnvme
