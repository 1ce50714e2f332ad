// The library's settings: the DNVME_PRELOAD_* environment `dnvme run` sets (docs/preload.md).
//
// Thread contract: PreloadSettings() is thread-safe; the environment is read once (at load, by
// the constructor in interposers.cc, or at the first call) and the settings never change after.
#ifndef DNVME_PRELOAD_SETTINGS_H_
#define DNVME_PRELOAD_SETTINGS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "datapath/read_policy.h"

namespace dnvme::preload {

struct Settings {
  bool enabled = true;              // DNVME_PRELOAD_DISABLE=1 turns everything off
  int64_t min_bytes = 128 << 10;    // DNVME_PRELOAD_MIN_BYTES: smaller transfers stay libc's
  std::vector<std::string> mounts;  // DNVME_PRELOAD_MOUNTS (':'-separated); empty: every mount
  std::string stats_file;           // DNVME_PRELOAD_STATS: a JSON line per process at exit
  std::string config_file;          // DNVME_PRELOAD_CONFIG: the engine's HandleConfig
  int64_t readahead = 32 << 20;     // DNVME_PRELOAD_READAHEAD: bytes of read-ahead buffers; 0 off
  // DNVME_PRELOAD_READ_CACHE (auto, resident, off): which reads the page cache serves
  // (datapath/read_policy.h); a value that is none of them is warned about and auto used.
  datapath::ReadCache read_cache = datapath::ReadCache::kAuto;
  // DNVME_PRELOAD_CACHE_WRITES=1: writes of a file that fits go through the page cache
  // (datapath/read_policy.h, cache_writes); off by default.
  bool cache_writes = false;
  // DNVME_PRELOAD_MAP_FILL: read-only mappings of at least this many bytes are filled at mmap
  // (map_fill.h); 0, the default, off: measured slower than the kernel's own faults on both
  // devices here (docs/performance-journal.md, "Issue 36").
  int64_t map_fill = 0;
  // CPUs this process may run on (sched_getaffinity at load, at least 1): how many threads the
  // engine and the map fill use.
  int cpus = 1;
};

// The settings, read from the environment at the first call (which also sets the log level,
// DNVME_PRELOAD_LOG, default warn).
const Settings& PreloadSettings();

}  // namespace dnvme::preload

#endif  // DNVME_PRELOAD_SETTINGS_H_
