// The library's settings (settings.h).
#include "preload/settings.h"

#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "dnvme/log.h"
#include "preload/internal.h"

namespace dnvme::preload {

const Settings& PreloadSettings() {
  static Settings s = [] {
    Settings v;
    if (const char* e = getenv("DNVME_PRELOAD_DISABLE"); e && *e && std::strcmp(e, "0") != 0) {
      v.enabled = false;
    }
    if (const char* e = getenv("DNVME_PRELOAD_MIN_BYTES"); e && *e) {
      char* end = nullptr;
      long long n = std::strtoll(e, &end, 10);
      if (end && *end == '\0' && n > 0) v.min_bytes = n;
    }
    if (const char* e = getenv("DNVME_PRELOAD_MOUNTS"); e && *e) {
      std::string all(e);
      size_t start = 0;
      while (start <= all.size()) {
        size_t colon = all.find(':', start);
        if (colon == std::string::npos) colon = all.size();
        std::string m = all.substr(start, colon - start);
        while (m.size() > 1 && m.back() == '/') m.pop_back();
        if (!m.empty()) v.mounts.push_back(m);
        start = colon + 1;
      }
    }
    if (const char* e = getenv("DNVME_PRELOAD_READAHEAD"); e && *e) {
      char* end = nullptr;
      long long n = std::strtoll(e, &end, 10);
      if (end && *end == '\0' && n >= 0) v.readahead = n;
    }
    if (const char* e = getenv("DNVME_PRELOAD_MAP_FILL"); e && *e) {
      char* end = nullptr;
      long long n = std::strtoll(e, &end, 10);
      if (end && *end == '\0' && n >= 0) v.map_fill = n;
    }
    if (const char* e = getenv("DNVME_PRELOAD_STATS"); e && *e) v.stats_file = e;
    if (const char* e = getenv("DNVME_PRELOAD_CACHE_WRITES"); e && *e && std::strcmp(e, "0") != 0) {
      v.cache_writes = true;
    }
    std::string bad_read_cache;
    if (const char* e = getenv("DNVME_PRELOAD_READ_CACHE"); e && *e) {
      auto c = datapath::ParseReadCache(e);
      if (c.ok()) {
        v.read_cache = c.value();
      } else {
        bad_read_cache = c.status().message();
      }
    }
    if (const char* e = getenv("DNVME_PRELOAD_CONFIG"); e && *e) v.config_file = e;
    // The affinity mask, not the machine's CPUs: a program pinned with taskset or a cpuset gets
    // as many engine threads as it can run.
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) == 0) {
      v.cpus = std::max(1, CPU_COUNT(&set));
    } else {  // EINVAL: more CPUs than a cpu_set_t holds; they are not few
      v.cpus = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    }
    if (const char* e = getenv("DNVME_PRELOAD_LOG"); !(e && *e && dnvme::SetLogLevel(e).ok())) {
      (void)dnvme::SetLogLevel("warn");  // unset or not a level: the default, not spdlog's info
    }
    if (!bad_read_cache.empty()) {  // after the level is set: warn is the default
      dnvme::Logger().warn("dnvme run: DNVME_PRELOAD_READ_CACHE: {}; using auto",
                           LogEscape(bad_read_cache));
    }
    return v;
  }();
  return s;
}

bool IsLarge(size_t n) { return static_cast<int64_t>(n) >= PreloadSettings().min_bytes; }

}  // namespace dnvme::preload
