#include "fs/transport/session_loop.h"

#include <fcntl.h>
#include <linux/fuse.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <optional>
#include <string>

#include "engine/common/log.h"
#include "fs/options.h"

namespace dnvme::fs {
namespace {

// The kernel refuses a read buffer smaller than one request of max_write bytes plus its headers;
// libfuse sizes its own the same way (max pages + one page for headers).
constexpr size_t kRequestBufferBytes = static_cast<size_t>(kMaxFuseRequestBytes) + 4096;
// Below this a request goes into memory whole: libfuse wants every request but a large WRITE in
// memory, and copying a few KiB costs less than the extra syscalls of leaving it in the pipe.
constexpr size_t kInlineBytes = sizeof(fuse_in_header) + sizeof(fuse_write_in) + 4096;

void WakeHandler(int) {}

// A WRITE's fuse_write_in::write_flags, for CurrentWriteFlags (libfuse reads them but does not
// hand them on); nullopt for any other request. `head` holds the first `n` bytes of the request.
std::optional<uint32_t> WriteFlagsOf(const char* head, size_t n) {
  if (n < kWriteHeaderBytes) return std::nullopt;
  fuse_in_header in;
  std::memcpy(&in, head, sizeof(in));
  if (in.opcode != FUSE_WRITE) return std::nullopt;
  fuse_write_in write;
  std::memcpy(&write, head + sizeof(in), sizeof(write));
  return write.write_flags;
}

}  // namespace

Result<std::unique_ptr<SessionLoop>> SessionLoop::Create(fuse_session* se, int threads, bool splice,
                                                         SpliceHint hint, size_t adoptable) {
  if (threads < 1) return Status::InvalidArgument("session loop needs at least one thread");
  std::unique_ptr<SessionLoop> loop(new SessionLoop(se, threads));
  loop->hint_ = std::move(hint);
  // Each buffer takes a request read at kRequestReadOffset.
  loop->buffers_ = RequestBufferPool::Create(kRequestReadOffset + kRequestBufferBytes,
                                             static_cast<size_t>(threads) + adoptable);
  if (splice) {
    // 512 slots take any 1 MiB request. Smaller pipes would need a smaller max_write, which
    // splits 1 MiB client writes in two and costs O_DIRECT clients far more than splicing
    // saves (measured: docs/performance-journal.md), so without them requests are read(2).
    for (int i = 0; i < threads; ++i) {
      auto p = Pipe::Create(kRequestPipeBytes);
      auto peek = Pipe::Create(static_cast<int64_t>(kWriteHeaderBytes));
      if (p.ok() && !peek.ok()) p = peek.status();
      if (!p.ok()) {
        Logger().warn(
            "receiving FUSE requests with read(2), not splice: {}. Page-cache writes are then "
            "copied once more; give the daemon CAP_SYS_RESOURCE or raise fs.pipe-max-size to "
            "{} (docs/tuning.md)",
            p.status().ToString(), kRequestPipeBytes);
        loop->pipes_.clear();
        loop->peeks_.clear();
        break;
      }
      loop->pipes_.push_back(std::move(p).value());
      loop->peeks_.push_back(std::move(peek).value());
    }
  }
  struct sigaction sa {};
  sa.sa_handler = WakeHandler;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;  // no SA_RESTART: the blocked splice/read must return EINTR
  if (sigaction(kWakeSignal, &sa, nullptr) != 0) {
    return Status::FromErrno(errno, "sigaction for the loop's wake signal");
  }
  return loop;
}

SessionLoop::~SessionLoop() {
  for (auto& t : workers_) {
    if (t.joinable()) t.join();
  }
}

void SessionLoop::Worker(size_t index) {
  // Process-directed SIGTERM/SIGINT/SIGHUP go to the main thread (or an engine thread); this
  // one only takes the targeted wake-up.
  sigset_t block;
  sigemptyset(&block);
  sigaddset(&block, SIGTERM);
  sigaddset(&block, SIGINT);
  sigaddset(&block, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &block, nullptr);
  sigset_t wake;
  sigemptyset(&wake);
  sigaddset(&wake, kWakeSignal);
  pthread_sigmask(SIG_UNBLOCK, &wake, nullptr);

  Pipe* const own_pipe = pipes_.empty() ? nullptr : pipes_[index].get();
  // A handler may adopt the buffer (AdoptRequestBuffer); the slot then holds its replacement.
  RequestSlot slot(buffers_->TryAcquire());
  RequestSlot::Install(&slot);
  const int dev = fuse_session_fd(se_);
  while (slot.buffer() && !fuse_session_exited(se_)) {
    char* const mem = slot.buffer().data() + kRequestReadOffset;
    Pipe* const pipe = own_pipe && (!hint_ || hint_()) ? own_pipe : nullptr;
    ssize_t n = pipe ? splice(dev, nullptr, pipe->write_fd(), nullptr, kRequestBufferBytes, 0)
                     : read(dev, mem, kRequestBufferBytes);
    if (n < 0) {
      const int err = errno;
      // EINTR: a signal (maybe our wake-up); ENOENT: the request was interrupted before we
      // got it; EAGAIN: nothing to read after all. All mean: look again.
      if (err == EINTR || err == ENOENT || err == EAGAIN) continue;
      if (err != ENODEV) {  // ENODEV: unmounted or aborted, the normal end
        Logger().error("receiving a FUSE request: {}", std::strerror(err));
        error_.store(-err);
      }
      fuse_session_exit(se_);
      break;
    }
    if (static_cast<size_t>(n) < sizeof(fuse_in_header)) {
      Logger().error("short FUSE request ({} bytes)", n);
      error_.store(-EIO);
      fuse_session_exit(se_);
      break;
    }
    fuse_buf buf{};
    buf.size = static_cast<size_t>(n);
    if (pipe && static_cast<size_t>(n) >= kInlineBytes) {
      buf.flags = FUSE_BUF_IS_FD;
      buf.fd = pipe->read_fd();
      char head[kWriteHeaderBytes];
      auto got = pipe->Peek(*peeks_[index], head, sizeof(head));
      if (got.ok()) {
        slot.set_write_flags(WriteFlagsOf(head, got.value()));
      } else {
        // The handler then decides without the flags (CurrentWriteFlags): logged, not fatal.
        Logger().error("reading a spliced request's headers: {}", got.status().ToString());
        slot.set_write_flags(std::nullopt);
        (void)peeks_[index]->Discard();
      }
    } else {
      if (pipe) {
        // Small requests go to libfuse in memory whole.
        Status st = pipe->ReadExactly(mem, static_cast<size_t>(n));
        if (!st.ok()) {
          Logger().error("reading a request back from its pipe: {}", st.ToString());
          error_.store(-EIO);
          fuse_session_exit(se_);
          break;
        }
      }
      buf.mem = mem;
      slot.set_write_flags(WriteFlagsOf(mem, static_cast<size_t>(n)));
    }
    fuse_session_process_buf(se_, &buf);
    // A handler that answered without consuming its payload (an error reply) leaves bytes that
    // would otherwise be taken for the next request. A request read out whole left nothing.
    if ((buf.flags & FUSE_BUF_IS_FD) && pipe->Pending() != 0) {
      auto dropped = pipe->Discard();
      if (!dropped.ok()) {
        Logger().error("request pipe: {}", dropped.status().ToString());
        error_.store(-EIO);
        fuse_session_exit(se_);
        break;
      }
    }
  }
  RequestSlot::Install(nullptr);
  if (!slot.buffer()) {
    Logger().error("loop thread {}: no memory for its request buffer", index);
    error_.store(-ENOMEM);
    fuse_session_exit(se_);
  }
  std::lock_guard lock(mu_);
  --running_;
  cv_.notify_all();
}

int SessionLoop::Run() {
  {
    std::lock_guard lock(mu_);
    running_ = threads_;
  }
  for (int i = 0; i < threads_; ++i) {
    workers_.emplace_back([this, i] { Worker(static_cast<size_t>(i)); });
  }
  // libfuse's signal handlers only set the session's exit flag, so poll it. A loop thread that
  // stops (unmount, error) notifies at once.
  {
    std::unique_lock lock(mu_);
    while (!fuse_session_exited(se_) && running_ == threads_) {
      cv_.wait_for(lock, std::chrono::milliseconds(100));
    }
  }
  fuse_session_exit(se_);
  // Threads blocked in /dev/fuse wake only for a request or a signal. Repeat the signal: one
  // that lands just before a thread enters splice/read is lost.
  for (;;) {
    {
      std::unique_lock lock(mu_);
      if (cv_.wait_for(lock, std::chrono::milliseconds(20), [&] { return running_ == 0; })) break;
    }
    for (auto& t : workers_) pthread_kill(t.native_handle(), kWakeSignal);
  }
  for (auto& t : workers_) t.join();
  workers_.clear();
  return error_.load();
}

}  // namespace dnvme::fs
