// The lease-write gate and the notifier thread (fs/core/off_loop.h).
#include "fs/core/off_loop.h"

#include <algorithm>
#include <utility>

#include "dnvme/log.h"

namespace dnvme::fs {

void OffLoop::StartLocked() {
  if (started_) return;
  started_ = true;
  gate_ = std::thread([this] { Gate(); });
  notifier_ = std::thread([this] { Notifier(); });
}

void OffLoop::AfterLeaseWrites(PreloadLeases* leases, bool share_if_busy, Work work,
                               std::chrono::milliseconds limit) {
  {
    std::lock_guard lock(mu_);
    if (!stopping_) {
      StartLocked();
      waits_.push_back(
          {leases, share_if_busy, std::chrono::steady_clock::now() + limit, std::move(work)});
      gate_cv_.notify_one();
      return;
    }
  }
  work(leases->PollWrites(share_if_busy, /*late=*/true) == PreloadLeases::Poll::kLanded);
}

void OffLoop::Gate() {
  std::list<Wait> mine;  // the waits this thread polls; new ones join from waits_
  auto nap = std::chrono::microseconds(20);
  std::unique_lock lock(mu_);
  for (;;) {
    mine.splice(mine.end(), waits_);
    if (mine.empty()) {
      if (stopping_) {
        gate_done_ = true;  // everything it polled is in ready_ now
        notify_cv_.notify_all();
        return;
      }
      gate_cv_.wait(lock, [this] { return stopping_ || !waits_.empty(); });
      nap = std::chrono::microseconds(20);
      continue;
    }
    const bool stopping = stopping_;
    lock.unlock();
    // Polled without mu_: PreloadLeases' mutex is a leaf (fs/core/fs.h), taken under nothing.
    const auto now = std::chrono::steady_clock::now();
    std::vector<Ready> done;
    for (auto it = mine.begin(); it != mine.end();) {
      const bool late = stopping || now >= it->deadline;
      const PreloadLeases::Poll p = it->leases->PollWrites(it->share_if_busy, late);
      if (p == PreloadLeases::Poll::kBusy) {
        ++it;
        continue;
      }
      done.push_back({std::move(it->work), p == PreloadLeases::Poll::kLanded});
      it = mine.erase(it);
    }
    lock.lock();
    for (Ready& r : done) {
      if (!r.landed) ++gave_up_;
      ready_.push_back(std::move(r));
    }
    if (!done.empty()) notify_cv_.notify_one();
    if (mine.empty()) continue;
    // Someone's writes are in flight: look again soon, less often the longer they take (a write
    // that returned to its program is in the kernel within microseconds; docs/preload.md).
    gate_cv_.wait_for(lock, nap, [this] { return stopping_ || !waits_.empty(); });
    nap = std::min<std::chrono::microseconds>(nap * 2, std::chrono::milliseconds(2));
  }
}

void OffLoop::Notifier() {
  std::unique_lock lock(mu_);
  for (;;) {
    notify_cv_.wait(lock, [this] { return !ready_.empty() || gate_done_; });
    if (ready_.empty()) return;  // stopping: the gate handed over everything, all of it ran
    Ready r = std::move(ready_.front());
    ready_.pop_front();
    lock.unlock();
    r.work(r.landed);
    lock.lock();
  }
}

void OffLoop::Shutdown() {
  {
    std::lock_guard lock(mu_);
    if (stopping_) return;
    stopping_ = true;
    gate_cv_.notify_all();
    notify_cv_.notify_all();
  }
  // The gate hands its waits over as given up, then ends; the notifier runs them and ends.
  if (gate_.joinable()) gate_.join();
  if (notifier_.joinable()) notifier_.join();
}

}  // namespace dnvme::fs
