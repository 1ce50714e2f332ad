// The mount's counters: the data path's, shared by every inode's WriteBehind and ReadAhead, and
// the transport's. Reported by the control file's stats and logged at unmount.
//
// Thread safety: relaxed atomics, updated from FUSE threads and engine completion threads.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "datapath/counters.h"
#include "fs/transport/session_io.h"

namespace dnvme::fs {

// The data path's counters (datapath/counters.h) and the transport's (its replies: ReplyCounters,
// fs/transport/session_io.h).
struct MountCounters : datapath::Counters, ReplyCounters {
  // The largest WRITE and READ the kernel sent (bounded by max_request and the kernel's
  // fs.fuse.max_pages_limit): shows whether larger requests are in effect.
  std::atomic<uint64_t> largest_write{0}, largest_read{0};
  // FUSE passthrough (fs/fuse/passthrough.h): opens the kernel served from the backing file,
  // backing files registered now, and registrations the kernel refused (those opens went
  // through the daemon).
  std::atomic<uint64_t> passthrough_opens{0}, passthrough_refused{0};
  std::atomic<int64_t> backing_files{0};
  // Read-only opens whose reads the daemon serves from the engine instead of passthrough
  // (datapath/read_policy.h, ColdReadsToEngine: a cold file larger than its reader's memory).
  std::atomic<uint64_t> engine_opens{0};
  // Raises `at_most` to `n` if it is smaller.
  static void NoteMax(std::atomic<uint64_t>& at_most, uint64_t n) {
    uint64_t cur = at_most.load(std::memory_order_relaxed);
    while (cur < n && !at_most.compare_exchange_weak(cur, n, std::memory_order_relaxed)) {
    }
  }
  std::string ToJson() const;
};

}  // namespace dnvme::fs
