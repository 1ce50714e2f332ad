// What this process did, for the stats line DNVME_PRELOAD_STATS asks for (docs/preload.md).
//
// Thread contract: the counters are relaxed atomics, bumped from any thread without a lock;
// Reset() is for a forked child (one thread) only.
#ifndef DNVME_PRELOAD_COUNTERS_H_
#define DNVME_PRELOAD_COUNTERS_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "datapath/counters.h"
#include "dnvme/handle.h"

namespace dnvme::preload {

struct Counters {
  std::atomic<uint64_t> adopted{0}, refused{0}, reads{0}, writes{0};
  std::atomic<uint64_t> bytes_read{0}, bytes_written{0}, drains{0}, invalidations{0};
  std::atomic<uint64_t> errors{0}, stale{0};
  std::atomic<uint64_t> map_fills{0}, map_filled{0};  // mappings filled at mmap, their bytes
  // Large reads the mount served because the engine had no bounce buffers (RLIMIT_MEMLOCK).
  std::atomic<uint64_t> mount_fallbacks{0};
  // The write-behind's and read-ahead's (datapath/): its errors and read-ahead hits are in the
  // stats line.
  datapath::Counters data;

  // Zeroes every counter: a forked child's stats line says what the child did.
  void Reset();
  // The stats line of process `pid`: one JSON object and a newline, with what `engine` (null:
  // this process made none) says of its workers and of how its bytes moved: straight between
  // the device and the program's memory, through bounce buffers, or the page cache (edges).
  std::string JsonLine(pid_t pid, const AioHandle* engine) const;
};

// This process's counters.
Counters& ProcessCounters();

}  // namespace dnvme::preload

#endif  // DNVME_PRELOAD_COUNTERS_H_
