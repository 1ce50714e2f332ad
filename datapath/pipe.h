// Pipes for the zero-copy write path: the pool of pipes that hold a write-behind extent's pages
// until a splice writer thread moves them to the backing file (datapath/splice_io.h), and the
// receive pipe a session-loop thread splices each FUSE request into (fs/transport/request_pipe.h
// sizes those and sends replies through them).
//
// Why pipes: a FUSE WRITE of page-cache-backed data, spliced out of /dev/fuse, arrives as
// references to the FUSE inode's page-cache pages, not as a copy. Moving those references from
// pipe to pipe is also copy-free, and splicing a pipe into an O_DIRECT file hands the same pages
// to the block layer. The daemon never touches the bytes.
//
// Sizing: a pipe holds one page reference per slot. A 1 MiB request needs 257+ slots (2 MiB of
// pipe), more than /proc/sys/fs/pipe-max-size (1 MiB by default) allows without
// CAP_SYS_RESOURCE, so every pipe is created and sized while the daemon still holds its
// capabilities, before it drops them.
#pragma once

#include <sys/uio.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "dnvme/fd.h"
#include "dnvme/status.h"

namespace dnvme::datapath {

// Thread contract: one owner at a time (a session-loop thread, or the holder of a pool lease).
class Pipe {
 public:
  // A pipe of at least `bytes` capacity (rounded up by the kernel to a power of two of pages).
  // EPERM when that is above pipe-max-size and the caller lacks CAP_SYS_RESOURCE.
  static Result<std::unique_ptr<Pipe>> Create(int64_t bytes);

  int read_fd() const { return read_.get(); }
  int write_fd() const { return write_.get(); }
  // Bytes the kernel granted (F_GETPIPE_SZ): at 4 KiB per slot, the most page-aligned data the
  // pipe can hold.
  int64_t capacity() const { return capacity_; }
  // Bytes waiting in the pipe (FIONREAD); -errno on failure.
  int64_t Pending() const;
  // Reads exactly `n` bytes out of the pipe into `dst` (EINTR retried). An error when the pipe
  // holds fewer or the read fails.
  Status ReadExactly(char* dst, size_t n);
  // Copies up to `n` of the bytes at the head of the pipe into `dst` without taking them out:
  // tee(2) duplicates their page references into the empty pipe `via`, which is then read.
  // Returns the bytes copied (fewer than `n` only when the pipe holds fewer).
  Result<size_t> Peek(Pipe& via, char* dst, size_t n);
  // Reads and throws away whatever is in the pipe (after a failed or abandoned transfer), so the
  // next user starts empty. Returns the bytes dropped or the error.
  Result<int64_t> Discard();

 private:
  Pipe(UniqueFd r, UniqueFd w, int64_t capacity)
      : read_(std::move(r)), write_(std::move(w)), capacity_(capacity) {}
  UniqueFd read_, write_;
  int64_t capacity_;
};

// A fixed set of equally sized pipes. Thread-safe. Leases return their pipe (emptied) when
// destroyed; the pool must outlive them.
class PipePool {
 public:
  class Lease {
   public:
    Lease() = default;
    Lease(PipePool* pool, Pipe* pipe) : pool_(pool), pipe_(pipe) {}
    ~Lease() { Reset(); }
    Lease(Lease&& o) noexcept : pool_(o.pool_), pipe_(o.pipe_) { o.pool_ = nullptr; }
    Lease& operator=(Lease&& o) noexcept;
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    explicit operator bool() const { return pool_ != nullptr; }
    Pipe* operator->() const { return pipe_; }
    Pipe& operator*() const { return *pipe_; }
    void Reset();

   private:
    PipePool* pool_ = nullptr;
    Pipe* pipe_ = nullptr;
  };

  // Pipes of `bytes` each, `total` bytes in all. With less privilege than that size needs, falls
  // back to the largest size allowed (pipe-max-size), still `total` bytes in all; fails only
  // when not even one pipe of `min_bytes` can be had.
  static Result<std::unique_ptr<PipePool>> Create(int64_t total, int64_t bytes, int64_t min_bytes);

  Lease TryAcquire();
  // Capacity of each pipe (all equal).
  int64_t capacity() const { return capacity_; }
  size_t count() const { return pipes_.size(); }

 private:
  PipePool(std::vector<std::unique_ptr<Pipe>> pipes, int64_t capacity);
  void Return(Pipe* p);

  std::vector<std::unique_ptr<Pipe>> pipes_;
  const int64_t capacity_;
  std::mutex mu_;
  std::vector<Pipe*> free_;  // guarded by mu_
};

}  // namespace dnvme::datapath
