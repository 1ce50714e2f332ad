// What the daemon knows of the preload clients' leases on one inode (fs/broker/broker.h).
//
// A lease is one client descriptor pair handed out by the broker for this file. The FUSE ops read
// `count` on their hot paths (an atomic load); only when it is non-zero do they take the mutex to
// tell the lease holders, through their lease words, that the mount was used: an open by someone
// else (shared) or a WRITE whose data sits in write-behind (mount_dirty).
//
// Thread contract: every method is thread-safe; `mu` is a leaf lock (taken after everything in
// the daemon's lock order (fs/core/fs.h), nothing taken under it, never held while WaitForWrites
// sleeps).
#pragma once

#include <sys/types.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "dnvme/broker.h"
#include "dnvme/fd.h"
#include "dnvme/status.h"
#include "fs/limits/uid_limits.h"

namespace dnvme::fs {

// Holders that kept a wait for their writes to its limit (PreloadLeases::WaitForWrites), by uid,
// for the whole daemon: such a user is not waited for again, on any file and through any new
// lease, for kDistrust. A lease's counter is the client's to write, so trusting each new lease
// afresh would let one user add leases and stall every open and truncate of a file another user
// makes (2 s each), file after file. At most kMaxUids are remembered (the oldest go first); a
// forgotten uid can cost one more stall of kWriteWait.
//
// Thread contract: thread-safe; `mu_` is a leaf lock (taken under PreloadLeases::mu_).
class HolderTrust {
 public:
  static constexpr std::chrono::seconds kDistrust{60};
  static constexpr size_t kMaxUids = 4096;
  static HolderTrust& Daemon() {
    static HolderTrust trust;
    return trust;
  }
  bool Distrusted(uid_t uid, std::chrono::steady_clock::time_point now) {
    std::lock_guard lock(mu_);
    for (const auto& [u, until] : until_) {
      if (u == uid) return now < until;
    }
    return false;
  }
  void Distrust(uid_t uid, std::chrono::steady_clock::time_point now) {
    std::lock_guard lock(mu_);
    for (auto& [u, until] : until_) {
      if (u == uid) {
        until = now + kDistrust;
        return;
      }
    }
    std::erase_if(until_, [now](const auto& e) { return e.second <= now; });
    if (until_.size() >= kMaxUids) until_.erase(until_.begin());
    until_.emplace_back(uid, now + kDistrust);
  }

 private:
  std::mutex mu_;
  // guarded by mu_; in the order distrusted (short: only uids whose counters lied or stopped)
  std::vector<std::pair<uid_t, std::chrono::steady_clock::time_point>> until_;
};

class PreloadLeases {
 public:
  // Leases held now; the ops test this before anything else.
  int count() const { return count_.load(std::memory_order_acquire); }

  // Leases of one inode: every WRITE through the mount and every wait walks them (under mu_), so
  // a user cannot make them many (its connections x kMaxLeases each would be 500,000 on one file
  // another user writes). Root's are not counted.
  static constexpr size_t kMaxPerUid = 64;
  static constexpr size_t kMaxUsers = 1024;

  // Adds a lease of connection `conn` of user `uid` whose word is `w` (`writable`: its
  // descriptors may write); `*other` says whether another connection holds a lease on the same
  // inode (the file is then shared). EMFILE when the uid holds kMaxPerUid leases of this inode
  // already, or users other than root kMaxUsers.
  Status Add(uint64_t conn, uid_t uid, broker::LeaseWord* w, bool writable, bool* other) {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [this] { return !excluding_; });
    if (uid != 0) {
      size_t mine = 0, users = 0;
      for (const Entry& e : entries_) {
        if (e.uid == uid) ++mine;
        if (e.uid != 0) ++users;
      }
      if (mine >= kMaxPerUid || users >= kMaxUsers) {
        return Status::ResourceExhausted(
            EMFILE, mine >= kMaxPerUid
                        ? "this user holds " + std::to_string(kMaxPerUid) +
                              " leases of the file already (close some)"
                        : "users hold " + std::to_string(kMaxUsers) + " leases of the file");
      }
    }
    *other = std::any_of(entries_.begin(), entries_.end(),
                         [conn](const Entry& e) { return e.conn != conn; });
    entries_.push_back({conn, uid, w, writable, false});
    count_.fetch_add(1, std::memory_order_release);
    if (*other) MarkSharedLocked();
    return Status::Ok();
  }
  void Remove(broker::LeaseWord* w) {
    std::lock_guard lock(mu_);
    auto it =
        std::find_if(entries_.begin(), entries_.end(), [w](const Entry& e) { return e.word == w; });
    if (it == entries_.end()) return;
    entries_.erase(it);
    count_.fetch_sub(1, std::memory_order_release);
    if (entries_.empty()) {
      guard_ = Guard{};
      guard_skipped_ = false;
    }
  }
  // Runs `fn` only while the file has no writable lease, and keeps new leases out until it
  // returns (Add waits): freeing the space reserved past the end (datapath/space.h) truncates the
  // file to the size it has, which a client extending it meanwhile would lose bytes to. A
  // read-only lease cannot extend it, and must not keep another user's space allocated (a
  // reader's lease held across the writer's close did). False, without running it, when a
  // writable lease lives. `fn` must not wait for anything a user controls (it holds back the
  // broker's opens of this file).
  bool WithoutLeases(const std::function<void()>& fn) {
    {
      std::lock_guard lock(mu_);
      if (excluding_ || std::any_of(entries_.begin(), entries_.end(),
                                    [](const Entry& e) { return e.writable; })) {
        return false;
      }
      excluding_ = true;
    }
    fn();
    {
      std::lock_guard lock(mu_);
      excluding_ = false;
    }
    cv_.notify_all();
    return true;
  }
  // The kernel grants a file lease (fcntl F_SETLEASE) to its owner on any descriptor of the file,
  // and every open that conflicts with it -- the daemon's, on a loop thread -- then waits for the
  // holder (lease-break-time, 45 s). The descriptors the broker hands out must not carry one, so
  // while a lease of ours lives the daemon holds the file open for writing: a read lease is
  // refused while anyone has the file open for writing, a write lease while anyone else has it
  // open at all (both EAGAIN). `open_guard` (called once, under the mutex: it must not block)
  // opens it; an error from it refuses the broker's open. The daemon's own opens are
  // non-blocking as well (docs/security.md): this keeps a client from making them fail.
  // The guard's descriptor and its charge (one of the daemon's descriptors, UidLimits::ChargeFds).
  struct Guard {
    UniqueFd fd;
    UidCharge charge;
  };
  Status EnsureGuard(const std::function<Result<Guard>()>& open_guard) {
    std::lock_guard lock(mu_);
    if (guard_.fd.valid() || guard_skipped_) return Status::Ok();
    auto g = open_guard();
    if (!g.ok()) return g.status();
    guard_ = std::move(g).value();
    guard_skipped_ = !guard_.fd.valid();  // nothing to guard (a read-only file system)
    return Status::Ok();
  }
  bool guarded() {
    std::lock_guard lock(mu_);
    return guard_.fd.valid();
  }
  // Someone else opened the file through the mount: every holder invalidates after each write.
  void MarkShared() {
    std::lock_guard lock(mu_);
    MarkSharedLocked();
  }
  // Waits until no writable holder has a direct write in flight (LeaseWord::writes_inflight), or
  // `limit` passed; returns false then. A lease that ends stops counting: a client that died had
  // its requests completed by the kernel before its socket closed (exit_aio runs before
  // exit_files), though its counter never came down. The counter is the client's to write, so it
  // is trusted for this wait alone and only so far (docs/security.md): read-only leases are not
  // waited for, and a holder whose counter keeps one wait to its limit (a stopped client, or one
  // that lies) is never waited for again while that lease lives -- one stall per lease, at most
  // `limit`, and a client's writes are in the kernel when its write() returns (docs/preload.md),
  // so an honest one never needs that long. The stall is bounded per holder and per file too, not
  // per lease (a user adds leases at will): the holder's uid is distrusted daemon-wide
  // (HolderTrust), and after a wait on this file ran to its limit the next kDistrust of waits on
  // it ask nothing of any holder. Polls: the wait is rare (an open, truncate or utimes
  // of a file whose holder's write(2) returned a moment ago) and short (the writes in flight).
  // The FUSE ops never wait here on a loop thread: they poll through OffLoop (fs/core/off_loop.h),
  // which delays only the request that must see the holder's writes, never behind anything the
  // holder queued (docs/security.md).
  //
  // `share_if_busy` (a truncate or utimes, which open nothing and so did not mark the leases
  // shared): when a holder has writes in flight, the leases are marked shared before the wait.
  // A holder streaming writes with write-behind keeps its counter above 0 without a break, so
  // the wait would run to its limit and the truncate would then go on before writes that had
  // returned; once shared, each write lands before it returns, and the wait ends at the first
  // gap between two writes. A holder with nothing in flight (its own ftruncate landed its
  // writes first) is not marked, so it keeps its write-behind.
  static constexpr std::chrono::milliseconds kWriteWait{2000};
  bool WaitForWrites(bool share_if_busy, std::chrono::milliseconds limit = kWriteWait) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    auto nap = std::chrono::microseconds(20);
    for (;;) {
      const Poll p = PollWrites(share_if_busy, std::chrono::steady_clock::now() >= deadline);
      if (p != Poll::kBusy) return p == Poll::kLanded;
      std::this_thread::sleep_for(nap);
      nap = std::min<std::chrono::microseconds>(nap * 2, std::chrono::milliseconds(2));
    }
  }
  // One look of WaitForWrites, for a waiter that polls many inodes without sleeping on any
  // (fs/core/off_loop.h): kLanded when no trusted writable holder has writes in flight; kBusy
  // while one has (marking the leases shared first when `share_if_busy`); `late` (the waiter's
  // limit passed) turns kBusy into kGaveUp and marks the busy holders untrusted.
  enum class Poll { kLanded, kBusy, kGaveUp };
  Poll PollWrites(bool share_if_busy, bool late) {
    const auto now = std::chrono::steady_clock::now();
    std::lock_guard lock(mu_);
    // A wait on this file ran to its limit a moment ago: nobody is waited for (as for an
    // untrusted holder, nothing to wait for).
    if (now < stalled_until_) return Poll::kLanded;
    bool busy = false;
    for (Entry& e : entries_) {
      if (!Flying(e)) continue;
      if (!e.untrusted && HolderTrust::Daemon().Distrusted(e.uid, now)) {
        e.untrusted = true;  // its user stalled a wait elsewhere, or through another lease
        continue;
      }
      busy = true;
      if (late) {
        e.untrusted = true;
        HolderTrust::Daemon().Distrust(e.uid, now);
      }
    }
    if (!busy) return Poll::kLanded;
    if (late) {
      stalled_until_ = now + HolderTrust::kDistrust;
      return Poll::kGaveUp;
    }
    if (share_if_busy) MarkSharedLocked();
    return Poll::kBusy;
  }
  // A WRITE reached write-behind: holders drain before their next direct transfer.
  void MarkMountDirty() {
    std::lock_guard lock(mu_);
    for (Entry& e : entries_) e.word->mount_dirty.store(1, std::memory_order_seq_cst);
  }

 private:
  struct Entry {
    uint64_t conn;
    uid_t uid;  // the client's (SO_PEERCRED)
    broker::LeaseWord* word;
    bool writable;
    bool untrusted;  // its counter kept a wait to the limit: never waited for again
  };
  // A holder whose writes in flight a waiter must wait for.
  static bool Flying(const Entry& e) {
    return e.writable && !e.untrusted &&
           e.word->writes_inflight.load(std::memory_order_seq_cst) != 0;
  }
  void MarkSharedLocked() {
    for (Entry& e : entries_) e.word->shared.store(1, std::memory_order_seq_cst);
  }
  std::atomic<int> count_{0};
  std::mutex mu_;
  std::condition_variable cv_;  // excluding_ ended
  bool excluding_ = false;      // guarded by mu_: WithoutLeases runs
  // guarded by mu_: a wait on this file ran to its limit; none asks any holder until then
  std::chrono::steady_clock::time_point stalled_until_{};
  std::vector<Entry> entries_;  // guarded by mu_
  Guard guard_;                 // guarded by mu_: held while entries_ is not empty (EnsureGuard)
  bool guard_skipped_ = false;  // guarded by mu_
};

}  // namespace dnvme::fs
