// Per-uid lanes: a small executor that runs jobs on threads of their uid's own, so one user's
// slow work (a control-file `wait` on large transfers, a deferred FUSE reply) occupies only that
// user's threads and never a FUSE loop thread or another user's lane (docs/security.md, "Nobody
// waits for another user").
//
// Each uid (the key) has a lane: at most `threads_per_key` of its jobs run at once, up to
// `max_queued` more wait in submission order, and a job beyond that is refused with EAGAIN (the
// caller answers its client with it). Threads are made on demand, when a job finds no idle thread
// of its lane, and end after `idle` without work, so a machine with many users holds threads only
// for those that are busy. A lane without threads or jobs is forgotten.
//
// Used by the control file (each ctl request runs on its writer's lane and replies from there)
// and meant for any job keyed by a uid: jobs are plain callables, and what they answer is theirs.
//
// Thread contract: Submit, the counters and Shutdown are thread-safe. A job runs on a lane thread
// with no lock of UidLanes held; it may Submit further jobs. Shutdown must not be called from a
// lane thread (it waits for them). After Shutdown nothing is accepted; the destructor shuts down.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "dnvme/status.h"

namespace dnvme::fs {

class UidLanes {
 public:
  struct Options {
    int threads_per_key = 4;               // jobs of one uid running at once
    size_t max_queued = 256;               // jobs of one uid waiting beyond those
    std::chrono::milliseconds idle{2000};  // a thread with nothing to do ends after this
    // Named in refusals: the option that sets threads_per_key (e.g. "ctl_threads_per_uid").
    std::string option = "threads_per_uid";
  };
  // What Submit does when the uid's queue is full.
  enum class IfFull {
    kRefuse,  // EAGAIN: the client is told to retry
    kQueue,   // queue anyway: for work that must run once started (disposing of a session)
  };
  using Job = std::function<void()>;

  explicit UidLanes(Options o);
  ~UidLanes();  // Shutdown()
  UidLanes(const UidLanes&) = delete;
  UidLanes& operator=(const UidLanes&) = delete;

  // Queues `job` on `uid`'s lane. Refused (the job is destroyed unrun, on this thread) with
  // ResourceExhausted(EAGAIN) when `max_queued` jobs of the uid wait already (kRefuse) or no
  // thread could be made, and with Unsupported(ESHUTDOWN) after Shutdown.
  Status Submit(uid_t uid, Job job, IfFull if_full = IfFull::kRefuse);

  // Stops accepting jobs, lets every queued job run, and joins every thread. Idempotent.
  void Shutdown();

  // Counters (for stats and tests).
  size_t Running(uid_t uid) const;
  size_t Queued(uid_t uid) const;
  size_t Threads() const;  // lane threads alive, all uids together

 private:
  struct Lane {
    std::deque<Job> queue;
    int threads = 0;  // started and not yet ended
    int idle = 0;     // of those, waiting for a job
    int running = 0;  // of those, running a job
    std::condition_variable cv;
  };
  void Worker(uid_t uid, Lane* lane, uint64_t id);
  // Joins threads that ended; the caller holds no lock.
  void ReapEnded();

  const Options opts_;
  mutable std::mutex mu_;
  std::unordered_map<uid_t, std::unique_ptr<Lane>> lanes_;  // guarded by mu_
  std::map<uint64_t, std::thread> threads_;                 // guarded by mu_
  std::vector<uint64_t> ended_;  // threads that returned, to be joined; guarded by mu_
  uint64_t next_id_ = 1;         // guarded by mu_
  size_t alive_ = 0;             // threads not yet ended; guarded by mu_
  bool stopping_ = false;        // guarded by mu_
  std::condition_variable ended_cv_;
};

}  // namespace dnvme::fs
