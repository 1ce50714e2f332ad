// The shared state of one operation while its slices run on the workers.
//
// Thread contract: created by the submitting thread; each worker that runs one of its slices calls
// SliceSubmitted exactly once (before that slice's SliceDone) and SliceDone exactly once; the last
// SliceSubmitted runs on_submitted, the last SliceDone finalises (optional fdatasync) and marks it
// done. The submitting thread reads the result only after WaitDone() returns, which orders every
// worker's writes before the read (the mutex in MarkDone/WaitDone).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "dnvme/handle.h"
#include "engine/posix/file.h"

namespace dnvme {

struct OpState {
  OpResult result;  // id, type, path, offsets filled at submission; the rest at completion
  std::shared_ptr<IoFile> file;
  char* buffer = nullptr;
  bool validate = false;
  bool fdatasync_at_end = false;
  Completion on_done;  // optional; runs after the op is marked done, on the finishing thread
  // Optional (writes): runs once every slice has all its bytes in the kernel (requests accepted by
  // io_submit, edges in the page cache) or has failed, on the thread of the last such slice.
  Submitted on_submitted;
  // Set with on_submitted: the tail edge is written before the direct part, so the notice need
  // not wait for the direct part to complete. Read-only once the op is posted.
  bool tail_first = false;
  // Every slice through the page cache (the buffered descriptor), O_DIRECT or not: a read the page
  // cache serves or should keep (AioHandle::sync_pread_cached). Read-only once the op is posted.
  bool page_cache = false;

  std::atomic<int> slices_left{0};
  std::atomic<int> slices_unsubmitted{0};
  std::atomic<int64_t> bytes_done{0};

  // The first error by file offset wins, so the report names the earliest failing byte.
  void RecordError(Status st, int64_t offset) {
    std::lock_guard lock(mu_);
    if (result.status.ok() || offset < result.error_offset) {
      result.status = std::move(st);
      result.error_offset = offset;
    }
  }

  // Called by a worker after its slice; returns true for the caller that finished the operation.
  bool SliceDone() { return slices_left.fetch_sub(1, std::memory_order_acq_rel) == 1; }

  // Called by a worker once a slice will hand nothing more to the kernel. The last caller runs
  // on_submitted; since every slice calls this before its SliceDone, it returns before on_done
  // runs.
  void SliceSubmitted() {
    if (slices_unsubmitted.fetch_sub(1, std::memory_order_acq_rel) != 1 || !on_submitted) return;
    Submitted notice = std::move(on_submitted);
    on_submitted = nullptr;
    notice();
  }

  void MarkDone() {
    {
      std::lock_guard lock(mu_);
      result.bytes_done = bytes_done.load(std::memory_order_relaxed);
      file.reset();  // close the fds now rather than when the caller collects the result
      done_ = true;
    }
    cv_.notify_all();
    // No lock held and nothing written to `result` after done_: the callback may read it freely.
    // It is destroyed as soon as it returns, not with the op, so what it captured (a pool's
    // buffer) goes back at once.
    if (on_done) {
      Completion done = std::move(on_done);
      on_done = nullptr;
      done(result);
    }
  }

  void WaitDone() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return done_; });
  }

  bool ok() {
    std::lock_guard lock(mu_);
    return result.status.ok();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;  // guarded by mu_
};

// A contiguous piece of one operation, run by one worker.
struct Slice {
  std::shared_ptr<OpState> op;
  int64_t offset = 0;  // file offset
  int64_t length = 0;
  char* buffer = nullptr;  // caller memory for `offset`
};

// Counters shared by a handle's workers; relaxed atomics (they are statistics, not sync).
struct HandleCounters {
  std::atomic<uint64_t> ops_read{0}, ops_written{0}, ops_failed{0};
  std::atomic<uint64_t> bytes_read{0}, bytes_written{0};
  std::atomic<uint64_t> bytes_direct{0}, bytes_bounce{0}, bytes_buffered{0};
  std::atomic<uint64_t> direct_fallbacks{0};
  std::atomic<uint64_t> requests{0}, submit_calls{0}, submit_retries{0}, short_transfers{0};
  std::atomic<uint64_t> validate_checks{0};
  // Gauges: libaio requests in flight now (all workers), and the most ever in flight at once.
  std::atomic<int64_t> inflight{0}, max_inflight{0};

  void AddInflight(int64_t n) {
    const int64_t now = inflight.fetch_add(n, std::memory_order_relaxed) + n;
    int64_t seen = max_inflight.load(std::memory_order_relaxed);
    while (now > seen &&
           !max_inflight.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
    }
  }
};

}  // namespace dnvme
