// What the data path did, counted for stats: shared by every file's WriteBehind and ReadAhead of
// one user of the library (the mount, or one `dnvme run` process). The mount adds its
// transport's counters (fs/core/counters.h) and reports both in the control file's stats.
//
// Thread safety: relaxed atomics, updated from request threads and engine completion threads.
#pragma once

#include <atomic>
#include <cstdint>

namespace dnvme::datapath {

struct Counters {
  std::atomic<uint64_t> write_ops{0}, read_ops{0};
  std::atomic<uint64_t> bytes_written_behind{0};  // gathered into pinned chunks, flushed async
  std::atomic<uint64_t> bytes_written_sync{0};    // written through the engine before returning
  std::atomic<uint64_t> bytes_read_ahead_hit{0};  // served from the read-ahead window
  std::atomic<uint64_t> bytes_read_engine{0};     // read through the engine on demand
  std::atomic<uint64_t> bytes_read_cached{0};     // read through the page cache (ReadPolicy)
  // Part of bytes_written_behind flushed through the page cache (ReadPolicy::CachesWrites).
  std::atomic<uint64_t> bytes_written_cached{0};
  std::atomic<uint64_t> write_behind_flushes{0};
  std::atomic<uint64_t> read_ahead_fetches{0};
  std::atomic<uint64_t> errors{0};
  // Spliced write-behind (datapath/splice_io.h): bytes that went to the disk from the kernel's
  // pages, and spliced extents the kernel refused and the engine wrote instead.
  std::atomic<uint64_t> bytes_written_spliced{0};
  std::atomic<uint64_t> bytes_splice_fallback{0};
  // Part of bytes_written_behind written by the engine straight from the buffer the source
  // handed over (ExtentSource::Adopt), without a copy into a chunk.
  std::atomic<uint64_t> bytes_written_adopted{0};
  // Space before acknowledgement (datapath/space.h): writes refused for space (ENOSPC/EDQUOT at
  // the write), granted in part only (short writes), and written through for want of a
  // reservation (no fallocate, copy-on-write overwrites with the budget short).
  std::atomic<uint64_t> space_refusals{0};
  std::atomic<uint64_t> space_short_writes{0};
  std::atomic<uint64_t> space_write_through{0};

  // Zeroes every counter (a forked `dnvme run` child counts what it does itself).
  void Reset() {
    for (auto* c :
         {&write_ops, &read_ops, &bytes_written_behind, &bytes_written_sync, &bytes_read_ahead_hit,
          &bytes_read_engine, &bytes_read_cached, &bytes_written_cached, &write_behind_flushes,
          &read_ahead_fetches, &errors, &bytes_written_spliced, &bytes_splice_fallback,
          &bytes_written_adopted, &space_refusals, &space_short_writes, &space_write_through}) {
      c->store(0, std::memory_order_relaxed);
    }
  }
};

}  // namespace dnvme::datapath
