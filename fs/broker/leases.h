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
#include <cstdint>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "dnvme/broker.h"

namespace dnvme::fs {

class PreloadLeases {
 public:
  // Leases held now; the ops test this before anything else.
  int count() const { return count_.load(std::memory_order_acquire); }

  // Adds a lease of connection `conn` of user `uid` whose word is `w` (`writable`: its
  // descriptors may write); returns true when another connection holds a lease on the same inode
  // (the file is then shared).
  bool Add(uint64_t conn, uid_t uid, broker::LeaseWord* w, bool writable) {
    std::lock_guard lock(mu_);
    bool other = std::any_of(entries_.begin(), entries_.end(),
                             [conn](const Entry& e) { return e.conn != conn; });
    entries_.push_back({conn, uid, w, writable, false});
    count_.fetch_add(1, std::memory_order_release);
    if (other) MarkSharedLocked();
    return other;
  }
  void Remove(broker::LeaseWord* w) {
    std::lock_guard lock(mu_);
    auto it =
        std::find_if(entries_.begin(), entries_.end(), [w](const Entry& e) { return e.word == w; });
    if (it == entries_.end()) return;
    entries_.erase(it);
    count_.fetch_sub(1, std::memory_order_release);
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
  // so an honest one never needs that long. Polls: the wait is rare (an open, truncate or utimes
  // of a file whose holder's write(2) returned a moment ago) and short (the writes in flight).
  // Callers keep it off the FUSE loop threads where they can (fs/fuse/ops_common.h,
  // DeferForLeases): it then delays only the request that must see the holder's writes.
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
      const bool late = std::chrono::steady_clock::now() >= deadline;
      {
        std::lock_guard lock(mu_);
        bool busy = false;
        for (Entry& e : entries_) {
          if (!Flying(e)) continue;
          busy = true;
          if (late) e.untrusted = true;
        }
        if (!busy) return true;
        if (late) return false;
        if (share_if_busy) MarkSharedLocked();
      }
      std::this_thread::sleep_for(nap);
      nap = std::min<std::chrono::microseconds>(nap * 2, std::chrono::milliseconds(2));
    }
  }
  // Whether WaitForWrites would wait now, and for whose writes: the uid of a holder with writes
  // in flight (the one whose lane the wait is charged to), or nullopt.
  std::optional<uid_t> BusyHolder() {
    std::lock_guard lock(mu_);
    for (const Entry& e : entries_) {
      if (Flying(e)) return e.uid;
    }
    return std::nullopt;
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
  std::vector<Entry> entries_;  // guarded by mu_
};

}  // namespace dnvme::fs
