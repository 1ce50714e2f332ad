// The daemon's multi-threaded FUSE request loop, in place of libfuse's fuse_session_loop_mt.
//
// Why our own: libfuse 3.14 splices requests out of /dev/fuse only into pipes it creates lazily
// on each worker thread, after the daemon has dropped CAP_SYS_RESOURCE, and a pipe for a 1 MiB
// request (2 MiB, 512 slots) is above the default pipe-max-size, so libfuse silently falls back
// to read(2) and every write payload is copied into the daemon. This loop creates its threads'
// pipes up front (call Create before dropping capabilities), splices every request into them and
// hands libfuse the pipe as a FUSE_BUF_IS_FD buffer (fuse_session_process_buf), so write_buf
// sees the payload still in the pipe: page references the data path can move to the disk
// without copying. Where the pipes cannot be sized (an unprivileged daemon) it reads requests
// with read(2), as libfuse would. Requests that are read land in pool buffers at an offset that
// page-aligns a WRITE's payload, and write-behind may keep that buffer instead of copying the
// payload out of it (fs/transport/request_buffer.h).
//
// Thread contract: Create and Run on the main thread. Run blocks until the session ends (a
// SIGTERM/SIGINT/SIGHUP handled by libfuse's handlers, an unmount, or a fatal /dev/fuse error)
// and joins every loop thread before it returns. Loop threads block SIGTERM/SIGINT/SIGHUP so
// those reach the main thread; they are woken for shutdown with kWakeSignal.
#pragma once

#include <fuse_lowlevel.h>
#include <signal.h>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "dnvme/status.h"
#include "fs/transport/pipe.h"
#include "fs/transport/request_buffer.h"

namespace dnvme::fs {

class SessionLoop {
 public:
  // Signal used to interrupt loop threads blocked in /dev/fuse at shutdown (its handler does
  // nothing; the interrupted splice/read returns EINTR).
  static constexpr int kWakeSignal = SIGUSR1;

  // Asked before each receive: splice this one (true) or read(2) it. Splicing pays off only
  // for WRITEs from the kernel's page cache (their pages move without a copy); the caller's own
  // pages (O_DIRECT, direct_io) are copied into fresh pipe pages by the kernel and then read out
  // again, which costs more than one read(2). The data path knows which kind it has been seeing.
  using SpliceHint = std::function<bool()>;

  // `threads` loop threads; `splice` asks for spliced receives (falls back to read(2), with a
  // log line, when the pipes cannot be sized), steered by `hint` (null: always splice).
  // `adoptable` request buffers beyond one per thread may be held by write-behind at a time.
  static Result<std::unique_ptr<SessionLoop>> Create(fuse_session* se, int threads, bool splice,
                                                     SpliceHint hint = nullptr,
                                                     size_t adoptable = 0);
  ~SessionLoop();

  // Returns 0 when the session ended normally (signal, unmount), else -errno of the failure.
  int Run();

  bool splicing() const { return !pipes_.empty(); }

 private:
  SessionLoop(fuse_session* se, int threads) : se_(se), threads_(threads) {}
  void Worker(size_t index);

  fuse_session* se_;
  const int threads_;
  std::vector<std::unique_ptr<Pipe>> pipes_;  // one per thread; empty in read(2) mode
  // One small pipe per thread beside each of pipes_: a large spliced request's headers are
  // read through it (Pipe::Peek) while libfuse still finds them in the request pipe.
  std::vector<std::unique_ptr<Pipe>> peeks_;
  std::shared_ptr<RequestBufferPool>
      buffers_;  // read(2) receive buffers (fs/transport/request_buffer.h)
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_;
  int running_ = 0;  // guarded by mu_
  std::atomic<int> error_{0};
  SpliceHint hint_;
};

}  // namespace dnvme::fs
