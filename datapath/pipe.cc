#include "datapath/pipe.h"

#include <fcntl.h>
#include <sys/ioctl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <string>

#include "dnvme/log.h"

namespace dnvme::datapath {

Result<std::unique_ptr<Pipe>> Pipe::Create(int64_t bytes) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return Status::FromErrno(errno, "pipe2");
  UniqueFd r(fds[0]), w(fds[1]);
  int got = fcntl(w.get(), F_GETPIPE_SZ);
  if (got < 0) return Status::FromErrno(errno, "F_GETPIPE_SZ");
  if (got < bytes) {
    got = fcntl(w.get(), F_SETPIPE_SZ, static_cast<int>(bytes));
    if (got < 0) {
      return Status::FromErrno(errno, "F_SETPIPE_SZ " + std::to_string(bytes) +
                                          " (above /proc/sys/fs/pipe-max-size without "
                                          "CAP_SYS_RESOURCE?)");
    }
  }
  return std::unique_ptr<Pipe>(new Pipe(std::move(r), std::move(w), got));
}

int64_t Pipe::Pending() const {
  int n = 0;
  if (ioctl(read_.get(), FIONREAD, &n) != 0) return -errno;
  return n;
}

Status Pipe::ReadExactly(char* dst, size_t n) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = read(read_.get(), dst + got, n - got);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return Status::FromErrno(errno, "reading from a pipe");
    if (r == 0) {
      return Status::Internal("pipe ran dry with " + std::to_string(n - got) + " bytes still owed");
    }
    got += static_cast<size_t>(r);
  }
  return Status::Ok();
}

Result<size_t> Pipe::Peek(Pipe& via, char* dst, size_t n) {
  ssize_t t;
  do {
    t = tee(read_.get(), via.write_fd(), n, SPLICE_F_NONBLOCK);
  } while (t < 0 && errno == EINTR);
  if (t < 0) return Status::FromErrno(errno, "tee from a pipe");
  DNVME_RETURN_IF_ERROR(via.ReadExactly(dst, static_cast<size_t>(t)));
  return static_cast<size_t>(t);
}

Result<int64_t> Pipe::Discard() {
  int64_t dropped = 0;
  char sink[16384];
  static const int dev_null = open("/dev/null", O_WRONLY | O_CLOEXEC);
  for (;;) {
    const int64_t pending = Pending();
    if (pending < 0) return Status::FromErrno(static_cast<int>(-pending), "FIONREAD on pipe");
    if (pending == 0) return dropped;
    // Splicing to /dev/null drops page references without touching the bytes; read(2) is the
    // fallback.
    ssize_t n = dev_null >= 0 ? splice(read_.get(), nullptr, dev_null, nullptr,
                                       static_cast<size_t>(pending), SPLICE_F_NONBLOCK)
                              : -1;
    if (n > 0) {
      dropped += n;
      continue;
    }
    n = read(read_.get(), sink, std::min<int64_t>(pending, sizeof(sink)));
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::FromErrno(errno, "draining pipe");
    }
    if (n == 0) return dropped;  // no writer left; nothing more can be there
    dropped += n;
  }
}

PipePool::Lease& PipePool::Lease::operator=(Lease&& o) noexcept {
  if (this != &o) {
    Reset();
    pool_ = o.pool_;
    pipe_ = o.pipe_;
    o.pool_ = nullptr;
  }
  return *this;
}

void PipePool::Lease::Reset() {
  if (pool_ != nullptr) pool_->Return(pipe_);
  pool_ = nullptr;
  pipe_ = nullptr;
}

PipePool::PipePool(std::vector<std::unique_ptr<Pipe>> pipes, int64_t capacity)
    : pipes_(std::move(pipes)), capacity_(capacity) {
  for (auto& p : pipes_) free_.push_back(p.get());
}

Result<std::unique_ptr<PipePool>> PipePool::Create(int64_t total, int64_t bytes,
                                                   int64_t min_bytes) {
  std::vector<std::unique_ptr<Pipe>> pipes;
  auto first = Pipe::Create(bytes);
  if (!first.ok() && first.status().error_number() == EPERM) {
    // Unprivileged: the largest pipe anyone may have.
    int64_t max = 0;
    UniqueFd f(open("/proc/sys/fs/pipe-max-size", O_RDONLY | O_CLOEXEC));
    char buf[32] = {};
    ssize_t n = f.valid() ? read(f.get(), buf, sizeof(buf) - 1) : -1;
    if (n > 0) max = std::strtoll(buf, nullptr, 10);
    if (max < min_bytes) return first.status();
    first = Pipe::Create(max);
  }
  if (!first.ok()) return first.status();
  const int64_t capacity = first.value()->capacity();
  if (capacity < min_bytes) {
    return Status::ResourceExhausted(ENOMEM, "pipe of " + std::to_string(capacity) +
                                                 " bytes is smaller than " +
                                                 std::to_string(min_bytes));
  }
  pipes.push_back(std::move(first).value());
  const size_t count = static_cast<size_t>(std::max<int64_t>(1, total / capacity));
  while (pipes.size() < count) {
    auto p = Pipe::Create(capacity);
    // The per-user pipe page budget (pipe-user-pages-soft) can run out before `count`: keep
    // what we have, it only lowers how many extents are in flight at once.
    if (!p.ok() || p.value()->capacity() < capacity) break;
    pipes.push_back(std::move(p).value());
  }
  return std::unique_ptr<PipePool>(new PipePool(std::move(pipes), capacity));
}

PipePool::Lease PipePool::TryAcquire() {
  std::lock_guard lock(mu_);
  if (free_.empty()) return Lease();
  Pipe* p = free_.back();
  free_.pop_back();
  return Lease(this, p);
}

void PipePool::Return(Pipe* p) {
  // A pipe comes back empty from a finished splice; after an error it may still hold pages. One
  // that cannot be emptied is retired: stale pages must never reach the next extent's file.
  if (p->Pending() != 0) {
    auto dropped = p->Discard();
    if (!dropped.ok() || p->Pending() != 0) {
      DNVME_LOG_THROTTLED(
          err, "pipe retired: {}",
          dropped.ok() ? std::string("still not empty") : dropped.status().ToString());
      return;
    }
  }
  std::lock_guard lock(mu_);
  free_.push_back(p);
}

}  // namespace dnvme::datapath
