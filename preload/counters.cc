// What this process did (counters.h).
#include "preload/counters.h"

namespace dnvme::preload {
namespace {

// A namespace-scope object (constant-initialised atomics): counted from the first interposed
// call on, whatever the order of static initialisation.
Counters g_counters;

std::string EngineFields(const AioHandle* engine) {
  const HandleStats st = engine ? engine->stats() : HandleStats{};
  const int workers = engine ? engine->get_intra_op_parallelism() : 0;
  return ", \"engine_workers\": " + std::to_string(workers) +
         ", \"engine_bytes_direct\": " + std::to_string(st.bytes_direct) +
         ", \"engine_bytes_bounce\": " + std::to_string(st.bytes_bounce) +
         ", \"engine_bytes_buffered\": " + std::to_string(st.bytes_buffered);
}

}  // namespace

Counters& ProcessCounters() { return g_counters; }

void Counters::Reset() {
  for (auto* c : {&adopted, &refused, &reads, &writes, &bytes_read, &bytes_written, &drains,
                  &invalidations, &errors, &stale, &map_fills, &map_filled, &mount_fallbacks}) {
    c->store(0);
  }
  data.Reset();
}

std::string Counters::JsonLine(pid_t pid, const AioHandle* engine) const {
  auto v = [](const std::atomic<uint64_t>& a) { return std::to_string(a.load()); };
  return "{\"pid\": " + std::to_string(pid) + ", \"adopted\": " + v(adopted) +
         ", \"refused\": " + v(refused) + ", \"reads\": " + v(reads) +
         ", \"writes\": " + v(writes) + ", \"bytes_read\": " + v(bytes_read) +
         ", \"bytes_written\": " + v(bytes_written) + ", \"drains\": " + v(drains) +
         ", \"invalidations\": " + v(invalidations) +
         ", \"errors\": " + std::to_string(errors.load() + data.errors.load()) +
         ", \"stale\": " + v(stale) + ", \"readahead_bytes\": " + v(data.bytes_read_ahead_hit) +
         ", \"cached_bytes\": " + v(data.bytes_read_cached) +
         ", \"cached_write_bytes\": " + v(data.bytes_written_cached) +
         ", \"engine_read_bytes\": " + v(data.bytes_read_engine) +
         ", \"map_fills\": " + v(map_fills) + ", \"map_filled\": " + v(map_filled) +
         ", \"mount_fallbacks\": " + v(mount_fallbacks) + EngineFields(engine) + "}\n";
}

}  // namespace dnvme::preload
