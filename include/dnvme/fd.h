// File descriptors for the engine and the components built on it (the mount daemon, the preload
// library): UniqueFd, the owner of one descriptor, and ReopenNoWait, a reopen that never sleeps on
// a file lease. Implemented in dnvme_engine (engine/posix/file.cc).
//
// Thread contract: UniqueFd has no lock of its own: Reset, Release and moves need the exclusion of
// any other write to an object; get() from several threads is safe while none of those runs.
// ReopenNoWait is thread-safe.
#pragma once

namespace dnvme {

// Owns one fd (-1: none) and closes it when destroyed or reset. Move-only.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { Reset(); }
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.Release()) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) Reset(o.Release());
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  // Gives the fd up without closing it: the caller owns it now.
  int Release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }
  // Closes the held fd. close() errors are not reported here: an fd that is written through is
  // made durable (and its errors seen) by fsync/fdatasync, never by close.
  void Reset(int fd = -1);

 private:
  int fd_ = -1;
};

// Opens the file `fd` is open on again, through /proc/self/fd/`fd` (a new open file description
// with `flags`), without ever waiting: an open that conflicts with a file lease would sleep until
// the lease's holder lets go (up to lease-break-time, 45 s) -- in the daemon, on a thread other
// users' requests need. With O_NONBLOCK the kernel answers EWOULDBLOCK instead; the flag is
// cleared again afterwards unless `flags` has it. Returns the descriptor, or -1 with errno.
int ReopenNoWait(int fd, int flags);

}  // namespace dnvme
