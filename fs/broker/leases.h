// What the daemon knows of the preload clients' leases on one inode (fs/broker/broker.h).
//
// A lease is one client descriptor pair handed out by the broker for this file. The FUSE ops read
// `count` on their hot paths (an atomic load); only when it is non-zero do they take the mutex to
// tell the lease holders, through their lease words, that the mount was used: an open by someone
// else (shared) or a WRITE whose data sits in write-behind (mount_dirty).
//
// Thread contract: every method is thread-safe; `mu` is a leaf lock (taken after everything in
// Fs's lock order, nothing taken under it).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <vector>

#include "dnvme/broker.h"

namespace dnvme::fs {

class PreloadLeases {
 public:
  // Leases held now; the ops test this before anything else.
  int count() const { return count_.load(std::memory_order_acquire); }

  // Adds a lease of connection `conn` whose word is `w`; returns true when another connection
  // holds a lease on the same inode (the file is then shared).
  bool Add(uint64_t conn, broker::LeaseWord* w) {
    std::lock_guard lock(mu_);
    bool other = std::any_of(entries_.begin(), entries_.end(),
                             [conn](const Entry& e) { return e.conn != conn; });
    entries_.push_back({conn, w});
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
  // A WRITE reached write-behind: holders drain before their next direct transfer.
  void MarkMountDirty() {
    std::lock_guard lock(mu_);
    for (Entry& e : entries_) e.word->mount_dirty.store(1, std::memory_order_seq_cst);
  }

 private:
  struct Entry {
    uint64_t conn;
    broker::LeaseWord* word;
  };
  void MarkSharedLocked() {
    for (Entry& e : entries_) e.word->shared.store(1, std::memory_order_seq_cst);
  }
  std::atomic<int> count_{0};
  std::mutex mu_;
  std::vector<Entry> entries_;  // guarded by mu_
};

}  // namespace dnvme::fs
