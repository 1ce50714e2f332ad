// What a FUSE request must wait for, or tell the kernel, kept off the FUSE loop threads.
//
// Why: a loop thread that waits for something a user controls can be made to wait by that user,
// and when every loop thread waits, nobody's request is served -- not even the one that would
// end the wait (docs/security.md, "Nobody waits for another user"). Two such waits remain after
// every backing open became non-blocking (O_NONBLOCK: a lease is answered EWOULDBLOCK, never
// slept on):
//   - a `dnvme run` client's writes in flight (its lease word's counter, the client's to write):
//     an open, truncate or time change of its file must see them land first, for at most
//     PreloadLeases::kWriteWait. A gate polls every waiting request's leases on one thread, each
//     with its own deadline, so one holder's many waits never queue behind each other (the lane
//     of the holder did: 60 waits of 2 s, 27 s for root's open of one of those files);
//   - the kernel's invalidation of an inode's pages (fuse_lowlevel_notify_inval_inode, _store),
//     which locks each cached folio and so waits for any READ of that inode the kernel has in
//     flight (a page fault of a MAP_SHARED mapping, a read-ahead). That READ needs a free loop
//     thread: an invalidation on a loop thread, times the loop threads, is a permanent deadlock.
//     Here it runs on the notifier thread, which serves no request; the loop threads stay free
//     to serve the READs it waits for.
//
// Both end with the request's reply, sent from the notifier thread (libfuse lets any thread
// reply; FUSE over io_uring does not, and there the caller runs the work in place).
//
// Thread contract: AfterLeaseWrites from any thread. Work runs on the notifier thread,
// one item at a time, in the order it became ready. Shutdown (the daemon's Stop, before the
// session is destroyed) ends the waits at once, runs everything queued, and joins; afterwards
// work runs on the calling thread. The PreloadLeases a wait polls must outlive it: a pending
// request keeps its inode (the kernel forgets no inode with a request in flight).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <mutex>
#include <thread>
#include <vector>

#include "fs/broker/leases.h"

namespace dnvme::fs {

class OffLoop {
 public:
  // What happened to a wait: the holders' writes landed, or the limit passed (the holders that
  // kept it are not waited for again, PreloadLeases) or the daemon is stopping.
  using Work = std::function<void(bool landed)>;

  OffLoop() = default;
  ~OffLoop() { Shutdown(); }
  OffLoop(const OffLoop&) = delete;
  OffLoop& operator=(const OffLoop&) = delete;

  // Runs `work` on the notifier thread once no trusted writer holding `leases` has writes in
  // flight, or after `limit`. `share_if_busy`: PreloadLeases::WaitForWrites.
  void AfterLeaseWrites(PreloadLeases* leases, bool share_if_busy, Work work,
                        std::chrono::milliseconds limit = PreloadLeases::kWriteWait);
  void Shutdown();

  // Waits that ran to their limit (tests).
  uint64_t gave_up() const { return gave_up_.load(std::memory_order_relaxed); }

 private:
  struct Wait {
    PreloadLeases* leases;
    bool share_if_busy;
    std::chrono::steady_clock::time_point deadline;
    Work work;
  };
  struct Ready {
    Work work;
    bool landed;
  };
  void StartLocked();
  void Gate();
  void Notifier();

  std::mutex mu_;
  std::condition_variable gate_cv_, notify_cv_;
  std::list<Wait> waits_;    // guarded by mu_
  std::deque<Ready> ready_;  // guarded by mu_
  bool started_ = false;     // guarded by mu_
  bool stopping_ = false;    // guarded by mu_
  bool gate_done_ = false;   // guarded by mu_: the gate ended, its last waits are in ready_
  std::atomic<uint64_t> gave_up_{0};
  std::thread gate_, notifier_;
};

}  // namespace dnvme::fs
