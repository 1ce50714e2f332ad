// A worker: one thread, one libaio context with a ring of queue_depth request slots, a bounded
// queue of slices, a lazily created pool of pinned bounce buffers. Up to kMaxActiveRuns slices are
// active at once and share the ring, so small operations from many callers overlap on the disk.
//
// With overlap_events (a sliding window) the worker sleeps, while requests are in flight, on an
// eventfd that both their completions and Post() signal: a slice posted then is started at once,
// not after the next completion (a caller waiting for its write's Submitted notice would otherwise
// wait for the previous write to complete, and a writer of one request per call would keep one
// request in flight). Lock-step batches (the default) wait for the whole batch as before.
//
// Thread contract: Post() may be called from any thread (the queue is mutex-guarded and blocks when
// full, so a burst of async submissions is throttled instead of growing memory without bound).
// Everything else (the libaio backend, the request ring, the bounce pool) is touched only by the
// worker's own thread, so the hot path takes no lock. The destructor drains the queue and joins.
#pragma once

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "dnvme/aio_backend.h"
#include "dnvme/config.h"
#include "dnvme/identity.h"
#include "dnvme/pinned.h"
#include "engine/handle/op.h"
#include "engine/posix/file.h"

namespace dnvme {

class Worker {
 public:
  // Creates the libaio context up front so a handle that cannot get one fails at creation.
  static Result<std::unique_ptr<Worker>> Create(int index, const HandleConfig& config,
                                                std::shared_ptr<AioBackendFactory> factory,
                                                HandleCounters* counters);
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  void Post(Slice slice);

 private:
  struct Request;
  class SliceRun;

  Worker(int index, const HandleConfig& config, std::shared_ptr<AioBackendFactory> factory,
         HandleCounters* counters);
  void Loop();
  bool TakeSlice(bool block, Slice* out);
  bool Stopping();
  void StartSlice(Slice slice);
  void CompleteSlice(const Slice& slice, Status st, int64_t err_off, int64_t tail_from);
  Status Buffered(const Slice& slice, int64_t from, int64_t to, int64_t* err_off);
  bool SubmitBatch();
  struct IdentityRun {
    size_t count = 0;
    bool any = true;                  // only reads: no identity needed
    const FsIdentity* who = nullptr;  // else the writers' (null: the worker's own)
  };
  IdentityRun NextIdentityRun(size_t from) const;
  void Backoff();
  Status Reap(long min_nr, struct timespec* timeout = nullptr);
  Status ReapOrWake();
  void FinishDoneRuns();
  void Release(Request& r);
  Status Validate(const Slice& slice, OpState& op, int64_t* err_off);
  void Finish(OpState& op);
  Status EnsureBackend();
  // The per-worker bounce pool, (re)built when a file needs bigger or more aligned buffers; null
  // (not an error) while a rebuild must wait for buffers other runs still hold.
  Result<PinnedPool*> BouncePool(int64_t req_size, uint32_t mem_align);

  const int index_;
  const HandleConfig config_;
  const std::shared_ptr<AioBackendFactory> factory_;
  HandleCounters* const counters_;

  // Worker-thread only.
  std::unique_ptr<AioBackend> aio_;
  std::unique_ptr<PinnedPool> bounce_;
  size_t bounce_align_ = 0;
  std::vector<Request> requests_;
  std::vector<int> free_;  // indices of free request slots
  std::vector<struct io_event> events_;
  std::vector<struct iocb*> batch_;
  std::deque<std::unique_ptr<SliceRun>> active_;
  size_t inflight_ = 0;
  int idle_retries_ = 0;
  static constexpr size_t kMaxActiveRuns = 64;

  static constexpr size_t kQueueCapacity = 1024;
  std::mutex mu_;
  std::condition_variable not_empty_, not_full_;
  std::deque<Slice> queue_;  // guarded by mu_
  bool stopping_ = false;    // guarded by mu_
  // overlap_events: signalled by every request's completion (io_set_eventfd) and by Post().
  // Invalid in lock-step mode, or when no eventfd could be made (then Reap(1) as before).
  UniqueFd wake_;
  std::thread thread_;
};

}  // namespace dnvme
