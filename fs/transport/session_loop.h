// The daemon's own multi-threaded FUSE request loop, in place of libfuse's fuse_session_loop_mt:
// the base of the kRead and kSplice transports (fs/transport/transport.h).
//
// Why our own: libfuse 3.14 splices requests out of /dev/fuse only into pipes it creates lazily
// on each worker thread, after the daemon has dropped CAP_SYS_RESOURCE, and a pipe for a 1 MiB
// request (2 MiB, 512 slots) is above the default pipe-max-size, so libfuse silently falls back
// to read(2) and every write payload is copied into the daemon; and its read(2) buffers are its
// own, so write-behind could not keep a payload without copying it. This loop receives into
// buffers lent from a RequestBufferPool (fs/transport/request_buffer.h) or into pipes made up
// front, and hands libfuse each request with fuse_session_process_buf.
//
// SessionLoop runs the threads, their Receivers and the shutdown; a subclass says how one
// request is received (Receive). ReadLoop reads every request; SpliceLoop
// (fs/transport/splice_loop.h) splices.
//
// Thread contract: Run on the main thread. Run blocks until the session ends (a
// SIGTERM/SIGINT/SIGHUP handled by libfuse's handlers, an unmount, or a fatal /dev/fuse error)
// and joins every loop thread before it returns. Loop threads block SIGTERM/SIGINT/SIGHUP so
// those reach the main thread; they are woken for shutdown with kWakeSignal. Receive runs on
// loop thread `index` only; WriteFlags and payload_pool from the handler of a request.
#pragma once

#include <fuse_lowlevel.h>
#include <signal.h>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "dnvme/status.h"
#include "fs/transport/request_buffer.h"
#include "fs/transport/transport.h"

namespace dnvme::fs {

// Blocks SIGTERM/SIGINT/SIGHUP in the calling loop thread, so libfuse's handlers see them on the
// main thread.
void BlockShutdownSignals();

// A WRITE's fuse_write_in, when the first `n` bytes of a request at `head` hold one.
std::optional<fuse_write_in> WriteHeaderOf(const char* head, size_t n);

class SessionLoop : public Transport {
 public:
  // Signal used to interrupt loop threads blocked in /dev/fuse at shutdown (its handler does
  // nothing; the interrupted splice/read returns EINTR).
  static constexpr int kWakeSignal = SIGUSR1;

  ~SessionLoop() override;
  int Run() final;
  std::optional<uint32_t> WriteFlags(const fuse_bufvec& bufv) const override;
  RequestBufferPool* payload_pool() final { return buffers_.get(); }
  std::string StatsJson() const override;
  // A request whose uid (not root) occupies threads - reserve loop threads or more is handed to
  // `overflow` with its buffer (adopted from the pool, so the thread goes on with a replacement;
  // a large WRITE still in a splice pipe is read into the buffer first); where no buffer is
  // spare or `overflow` refuses, it runs here after all. `reserve` <= 0 turns it off.
  void ShareLoopThreads(int reserve, Overflow overflow) override;

 protected:
  // What Receive got.
  enum class Received {
    kRequest,  // `buf` describes a request for fuse_session_process_buf
    kAgain,    // nothing after all (a signal, an interrupted request): look again
    kEnded,    // the session ended (unmounted, aborted)
  };

  // `threads` loop threads; each thread's buffer plus `adoptable` more may be out at a time.
  // Requests carry up to `max_request` bytes of data (max_write).
  SessionLoop(fuse_session* se, int threads, size_t adoptable, int64_t max_request);
  // Installs the wake-up handler and creates the pool: subclasses call it from their factory.
  Status Init();

  // Receives the next request on loop thread `index` into its Receiver `r` (whose buffer, at
  // kRequestReadOffset, is where a read(2) request goes) and describes it in `buf`. An error
  // ends the session.
  virtual Result<Received> Receive(size_t index, Receiver& r, fuse_buf* buf) = 0;
  // Moves a request whose payload is still in a pipe (FUSE_BUF_IS_FD) into `r`'s buffer, so it
  // can be handed over with it (ShareLoopThreads); false (errno set) when reading it out
  // failed, which ends the session.
  virtual bool ToMemory(size_t /*index*/, Receiver& /*r*/, fuse_buf* /*buf*/) { return false; }
  // After the handler returned: anything left of the request must be dropped before the next.
  virtual Status AfterDispatch(size_t /*index*/, const fuse_buf& /*buf*/) { return Status::Ok(); }
  // What a read(2) or splice of /dev/fuse that returned `n` (errno set when negative) means when
  // it brought no request: kAgain, kEnded or the error; nullopt when it brought one.
  static std::optional<Result<Received>> NoRequest(ssize_t n);
  // The read(2) receive both forms use: the whole request into `r`'s buffer, write flags noted.
  Result<Received> ReadRequest(Receiver& r, fuse_buf* buf);

  fuse_session* const se_;
  const int threads_;
  // The kernel refuses a read buffer smaller than one request of max_write bytes plus its
  // headers; libfuse sizes its own the same way (max pages + one page for headers).
  const size_t receive_bytes_;
  std::vector<std::unique_ptr<Receiver>> receivers_;  // one per thread, made by Run
  std::atomic<uint64_t> requests_read_{0};

 private:
  void Worker(size_t index);
  // ShareLoopThreads: the uid of a request that may be counted and handed over, or nullopt
  // (root, the session's own requests: INIT, DESTROY, INTERRUPT, FORGET). A request still in a
  // pipe is a WRITE: its uid is the one its Receiver peeked.
  std::optional<uid_t> SharedUidOf(const Receiver& r, const fuse_buf& buf) const;
  // Hands `buf` (a request of `uid`, whose threads are all taken; moved into memory first when it
  // is still in a pipe) to overflow_: true when it was handled (taken, or run here because
  // overflow_ refused it), false when it is left to the caller, untouched.
  bool HandOver(size_t index, Receiver& r, uid_t uid, fuse_buf* buf);
  std::atomic<int>& Busy(uid_t uid) { return busy_[uid % kBusyBuckets]; }
  // Handles `buf` on this thread, counted in `uid`'s share while it runs (nullopt: not counted).
  void Process(std::optional<uid_t> uid, fuse_buf* buf);

  // Loop threads in handlers, per uid bucket: uids that share a bucket share a count, which can
  // only hand a request over early, never let a uid take more.
  static constexpr size_t kBusyBuckets = 1024;
  int share_ = 0;  // the most a uid may occupy (threads - reserve); 0: no sharing
  Overflow overflow_;
  std::unique_ptr<std::atomic<int>[]> busy_;
  std::atomic<uint64_t> handed_over_{0};

  const size_t adoptable_;
  std::shared_ptr<RequestBufferPool> buffers_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_;
  int running_ = 0;  // guarded by mu_
  std::atomic<int> error_{0};
};

// Every request read(2) into the thread's pool buffer (the kRead transport).
class ReadLoop final : public SessionLoop {
 public:
  static Result<std::unique_ptr<ReadLoop>> Create(fuse_session* se, int threads, size_t adoptable,
                                                  int64_t max_request);
  Kind kind() const override { return Kind::kRead; }
  std::string Describe() const override;

 private:
  using SessionLoop::SessionLoop;
  Result<Received> Receive(size_t index, Receiver& r, fuse_buf* buf) override;
};

}  // namespace dnvme::fs
