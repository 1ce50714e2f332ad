// Fs::StatsJson: the mount's counters as one JSON document -- what `.dnvme/stats` shows, what a
// ctl `stats` request answers and what the daemon logs when it unmounts
// (docs/control-protocol.md, "stats"). Every piece of the core contributes its part.
#include <time.h>

#include <nlohmann/json.hpp>
#include <string>

#include "fs/core/fs.h"

namespace dnvme::fs {

using nlohmann::json;

std::string Fs::StatsJson() {
  Engines& engines = mount_.engines();
  const HandleStats engine_total = engines.MountStats();
  const HandleStats ctl_total = engines.SessionStats();
  const MountOptions& opts = mount_.opts();
  auto r = [](const std::atomic<uint64_t>& a) { return a.load(std::memory_order_relaxed); };
  const CtlCounters& c = ctl_counters_;
  struct timespec now {};
  clock_gettime(CLOCK_REALTIME, &now);
  json j = {
      {"mount",
       {{"backing", opts.backing},
        {"mountpoint", opts.mountpoint},
        {"uptime_s", static_cast<double>(now.tv_sec - mount_.started().tv_sec) +
                         (now.tv_nsec - mount_.started().tv_nsec) / 1e9},
        {"write_behind", opts.write_behind},
        {"write_chunk", opts.write_chunk},
        {"read_ahead", opts.read_ahead},
        {"async_reply", opts.async_reply},
        {"splice_read", opts.SpliceRequests()},
        {"direct_io", DirectIoName(opts.direct_io)},
        {"splice_reply", opts.splice_reply},
        {"clone_fd", opts.clone_fd},
        {"io_uring", opts.io_uring},
        {"max_request", opts.max_request},
        {"passthrough", PassthroughName(opts.passthrough)},
        {"preload", opts.preload}}},
      {"config", json::parse(engines.config().ToJson())},
      {"fuse", json::parse(mount_.counters().ToJson())},
      {"engine", json::parse(engine_total.ToJson())},
      {"ctl",
       {{"requests", r(c.requests)},
        {"request_errors", r(c.request_errors)},
        {"ops_read", r(c.ops_read)},
        {"ops_written", r(c.ops_written)},
        {"ops_failed", r(c.ops_failed)},
        {"bytes_read", r(c.bytes_read)},
        {"bytes_written", r(c.bytes_written)},
        {"sessions_open", r(c.sessions_open)},
        {"handles_open", r(c.handles_open)},
        {"buffers_registered", r(c.buffers_registered)},
        {"bytes_registered", r(c.bytes_registered)},
        {"config_changes", r(c.config_changes)},
        {"engine", json::parse(ctl_total.ToJson())}}},
  };
  // Pipes for spliced write-behind (datapath/splice_io.h); 0 when requests are read, not spliced.
  j["mount"]["splice_pipes"] =
      mount_.write_behind_pipes() ? mount_.write_behind_pipes()->count() : 0;
  // Pipes for spliced replies (-o splice_reply); 0 when replies are written.
  j["mount"]["reply_pipes"] = mount_.reply_pipes() ? mount_.reply_pipes()->count() : 0;
  // How requests arrive (fs/transport/transport.h); null before the session runs.
  j["transport"] =
      mount_.transport() ? json::parse(mount_.transport()->StatsJson()) : json(nullptr);
  // What was negotiated with the kernel beyond libfuse's 7.38 (fs/transport/protocol_ext.h).
  j["kernel"] = json::parse(mount_.protocol().StatsJson());
  // The preload broker (fs/broker/broker.h); null with -o preload=0.
  j["broker"] = broker_ ? json::parse(broker_->StatsJson()) : json(nullptr);
  // The daemon's descriptor budget (fs/limits/uid_limits.h, FdShape) and the inode pruner.
  const FdShape& shape = uid_limits_.fd_shape();
  const UidLimits::FdHeld held = uid_limits_.FdsHeld();
  const InodeTable::PruneCounters pruned = inodes_.prune_counters();
  j["descriptors"] = {
      {"limit", shape.limit},          {"reserve", shape.reserve},
      {"capacity", shape.capacity},    {"held", held.all},
      {"users_share", shape.users},    {"users_held", held.users},
      {"inode_cap", shape.inodes},     {"inodes_held", held.inodes},
      {"prune_at", shape.prune_at},    {"prune_to", shape.prune_to},
      {"pruner", pruned.running},      {"prune_supported", mount_.protocol().prune_supported()},
      {"prune_rounds", pruned.rounds}, {"prune_asked", pruned.asked}};
  return j.dump();
}

namespace {

// Counters of the read path's per-file decisions, shown only to root and the mount's owner: each
// moves by what the policy decided for one file from its residency (engine_opens: a cold large
// file's open; bytes_read_cached against bytes_read_engine; the read-ahead's), so a user watching
// them while opening or reading another user's file, or while that user does, would learn what
// the kernel keeps from them (cachestat is refused to a reader who could not write the file).
// (The decisions for a reader's own opens use only what it may know: fs/fuse/passthrough.h.)
constexpr const char* kReadDecisions[] = {
    "engine_opens",      "passthrough_opens",    "passthrough_refused", "bytes_read_engine",
    "bytes_read_cached", "bytes_read_ahead_hit", "read_ahead_fetches",
};

}  // namespace

std::string Fs::StatsJsonFor(uid_t reader) {
  if (MayReconfigure(reader)) return StatsJson();
  json j = json::parse(StatsJson());
  for (const char* key : kReadDecisions) j["fuse"].erase(key);
  j["fuse"]["read_decisions"] = "shown to root and the mount's owner only";
  // The mount engine's own counters add up the same reads (those that went to the device).
  j["engine"] = "shown to root and the mount's owner only";
  return j.dump();
}

}  // namespace dnvme::fs
