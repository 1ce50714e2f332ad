#include "fs/core/counters.h"

#include <nlohmann/json.hpp>

namespace dnvme::fs {

std::string MountCounters::ToJson() const {
  auto r = [](const std::atomic<uint64_t>& a) { return a.load(std::memory_order_relaxed); };
  nlohmann::json j = {
      {"write_ops", r(write_ops)},
      {"read_ops", r(read_ops)},
      {"bytes_written_behind", r(bytes_written_behind)},
      {"bytes_written_sync", r(bytes_written_sync)},
      {"bytes_read_ahead_hit", r(bytes_read_ahead_hit)},
      {"bytes_read_engine", r(bytes_read_engine)},
      {"bytes_read_cached", r(bytes_read_cached)},
      {"bytes_written_cached", r(bytes_written_cached)},
      {"engine_opens", r(engine_opens)},
      {"write_behind_flushes", r(write_behind_flushes)},
      {"read_ahead_fetches", r(read_ahead_fetches)},
      {"errors", r(errors)},
      {"bytes_written_spliced", r(bytes_written_spliced)},
      {"bytes_splice_fallback", r(bytes_splice_fallback)},
      {"bytes_written_adopted", r(bytes_written_adopted)},
      {"space_refusals", r(space_refusals)},
      {"space_short_writes", r(space_short_writes)},
      {"space_write_through", r(space_write_through)},
      {"largest_write", r(largest_write)},
      {"largest_read", r(largest_read)},
      {"passthrough_opens", r(passthrough_opens)},
      {"passthrough_refused", r(passthrough_refused)},
      {"backing_files", backing_files.load(std::memory_order_relaxed)},
      {"replies_spliced", r(replies_spliced)},
      {"bytes_replied_spliced", r(bytes_replied_spliced)},
      {"replies_unspliced", r(replies_unspliced)},
  };
  return j.dump();
}

}  // namespace dnvme::fs
