#include "fs/limits/uid_lanes.h"

#include <cerrno>
#include <system_error>
#include <utility>

namespace dnvme::fs {

UidLanes::UidLanes(Options o) : opts_(std::move(o)) {}

UidLanes::~UidLanes() { Shutdown(); }

Status UidLanes::Submit(uid_t uid, Job job, IfFull if_full) {
  ReapEnded();
  std::unique_lock lock(mu_);
  if (stopping_) return Status::Unsupported(ESHUTDOWN, "the daemon is shutting down");
  std::unique_ptr<Lane>& slot = lanes_[uid];
  if (slot == nullptr) slot = std::make_unique<Lane>();
  Lane* lane = slot.get();
  // Jobs a thread of the lane has not taken yet count as queued only beyond the free running
  // places (a thread just made has not taken its job yet).
  const size_t places = static_cast<size_t>(opts_.threads_per_key - lane->running);
  if (if_full == IfFull::kRefuse && lane->queue.size() >= places + opts_.max_queued) {
    const size_t running = static_cast<size_t>(lane->running);
    lock.unlock();
    return Status::ResourceExhausted(
        EAGAIN, "uid " + std::to_string(uid) + " has " + std::to_string(running) +
                    " requests running (" + opts_.option + "=" +
                    std::to_string(opts_.threads_per_key) + ") and " +
                    std::to_string(opts_.max_queued) + " queued, the most it may; retry later");
  }
  lane->queue.push_back(std::move(job));
  // Idle threads are already woken for the jobs ahead of this one; a new thread only when the
  // queue is longer than the idle threads that will take from it.
  if (lane->queue.size() <= static_cast<size_t>(lane->idle)) {
    lane->cv.notify_one();
    return Status::Ok();
  }
  if (lane->threads >= opts_.threads_per_key) return Status::Ok();  // waits for a running one
  const uint64_t id = next_id_++;
  try {
    threads_.emplace(id, std::thread([this, uid, lane, id] { Worker(uid, lane, id); }));
  } catch (const std::system_error& e) {
    // No thread: the job is not run. When the lane has threads of its own they take it later.
    if (lane->threads > 0) return Status::Ok();
    Job refused = std::move(lane->queue.back());
    lane->queue.pop_back();
    if (lane->queue.empty() && lane->threads == 0) lanes_.erase(uid);
    lock.unlock();
    return Status::ResourceExhausted(EAGAIN, std::string("no thread for the request: ") + e.what());
  }
  ++lane->threads;
  ++alive_;
  return Status::Ok();
}

void UidLanes::Worker(uid_t uid, Lane* lane, uint64_t id) {
  std::unique_lock lock(mu_);
  for (;;) {
    if (lane->queue.empty()) {
      if (stopping_) break;
      ++lane->idle;
      const bool woken =
          lane->cv.wait_for(lock, opts_.idle, [&] { return !lane->queue.empty() || stopping_; });
      --lane->idle;
      // Idle for the whole period: end (held the lock since the check, so no Submit counted on
      // this thread meanwhile).
      if (!woken) break;
      continue;
    }
    Job job = std::move(lane->queue.front());
    lane->queue.pop_front();
    ++lane->running;
    lock.unlock();
    job();
    job = nullptr;  // whatever it captured goes before the lock is taken again
    lock.lock();
    --lane->running;
  }
  if (--lane->threads == 0 && lane->queue.empty()) lanes_.erase(uid);
  --alive_;
  ended_.push_back(id);
  ended_cv_.notify_all();
}

void UidLanes::ReapEnded() {
  std::vector<std::thread> done;
  {
    std::lock_guard lock(mu_);
    for (uint64_t id : ended_) {
      auto it = threads_.find(id);
      if (it == threads_.end()) continue;
      done.push_back(std::move(it->second));
      threads_.erase(it);
    }
    ended_.clear();
  }
  // Each has returned from Worker (or is about to): joining is short.
  for (std::thread& t : done) t.join();
}

void UidLanes::Shutdown() {
  {
    std::unique_lock lock(mu_);
    stopping_ = true;
    for (auto& [uid, lane] : lanes_) lane->cv.notify_all();
    ended_cv_.wait(lock, [&] { return alive_ == 0; });
  }
  ReapEnded();
}

size_t UidLanes::Running(uid_t uid) const {
  std::lock_guard lock(mu_);
  auto it = lanes_.find(uid);
  return it == lanes_.end() ? 0 : static_cast<size_t>(it->second->running);
}

size_t UidLanes::Queued(uid_t uid) const {
  std::lock_guard lock(mu_);
  auto it = lanes_.find(uid);
  return it == lanes_.end() ? 0 : it->second->queue.size();
}

size_t UidLanes::Threads() const {
  std::lock_guard lock(mu_);
  return alive_;
}

}  // namespace dnvme::fs
