// The mount's data-path counters, shared by every inode's WriteBehind and ReadAhead: reported by
// the control file's stats and logged at unmount.
//
// Thread safety: relaxed atomics, updated from FUSE threads and engine completion threads.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

namespace dnvme::fs {

struct MountCounters {
  std::atomic<uint64_t> write_ops{0}, read_ops{0};
  std::atomic<uint64_t> bytes_written_behind{0};  // gathered into pinned chunks, flushed async
  std::atomic<uint64_t> bytes_written_sync{0};    // written through the engine before replying
  std::atomic<uint64_t> bytes_read_ahead_hit{0};  // served from the read-ahead window
  std::atomic<uint64_t> bytes_read_engine{0};     // read through the engine on demand
  std::atomic<uint64_t> write_behind_flushes{0};
  std::atomic<uint64_t> read_ahead_fetches{0};
  std::atomic<uint64_t> errors{0};
  // Spliced write-behind (fs/data/splice_io.h): bytes that went to the disk from the kernel's
  // pages, and spliced extents the kernel refused and the engine wrote instead.
  std::atomic<uint64_t> bytes_written_spliced{0};
  std::atomic<uint64_t> bytes_splice_fallback{0};
  // Part of bytes_written_behind written by the engine straight from the request buffer it was
  // received in (fs/transport/request_buffer.h), without a copy into a chunk.
  std::atomic<uint64_t> bytes_written_adopted{0};
  // The largest WRITE and READ the kernel sent (bounded by max_request and the kernel's
  // fs.fuse.max_pages_limit): shows whether larger requests are in effect.
  std::atomic<uint64_t> largest_write{0}, largest_read{0};
  // FUSE passthrough (fs/fuse/passthrough.h): opens the kernel served from the backing file,
  // backing files registered now, and registrations the kernel refused (those opens went
  // through the daemon).
  std::atomic<uint64_t> passthrough_opens{0}, passthrough_refused{0};
  std::atomic<int64_t> backing_files{0};
  // Replies sent by splice (-o splice_reply) and their bytes; large replies that found no free
  // reply pipe (or did not fit one) were written instead.
  std::atomic<uint64_t> replies_spliced{0}, bytes_replied_spliced{0}, replies_unspliced{0};
  // Raises `at_most` to `n` if it is smaller.
  static void NoteMax(std::atomic<uint64_t>& at_most, uint64_t n) {
    uint64_t cur = at_most.load(std::memory_order_relaxed);
    while (cur < n && !at_most.compare_exchange_weak(cur, n, std::memory_order_relaxed)) {
    }
  }
  std::string ToJson() const;
};

}  // namespace dnvme::fs
