// The registry of open handles (fi->fh of every open the kernel has not released), so the daemon
// frees, when it ends, the handles of files still open: the kernel sends no RELEASE for them.
//
// Thread contract: Track and Dispose from any FUSE thread (one mutex, held only for the set);
// DeleteAll once, after the session loop ended, when no request can use a handle any more.
#pragma once

#include <mutex>
#include <unordered_set>

#include "fs/core/inode.h"

namespace dnvme::fs {

class OpenHandles {
 public:
  OpenHandles() = default;
  OpenHandles(const OpenHandles&) = delete;
  OpenHandles& operator=(const OpenHandles&) = delete;
  ~OpenHandles() { DeleteAll(); }

  // Takes ownership of `h` (created by an open) until Dispose.
  void Track(OpenHandle* h) {
    std::lock_guard lock(mu_);
    handles_.insert(h);
  }
  // At release: forgets and deletes `h`.
  void Dispose(OpenHandle* h) {
    {
      std::lock_guard lock(mu_);
      handles_.erase(h);
    }
    delete h;
  }
  // Deletes the handles of files still open when the session ended.
  void DeleteAll() {
    std::lock_guard lock(mu_);
    for (OpenHandle* h : handles_) delete h;
    handles_.clear();
  }

 private:
  std::mutex mu_;
  std::unordered_set<OpenHandle*> handles_;  // guarded by mu_
};

}  // namespace dnvme::fs
