// Fs::StatsJson: the mount's counters as one JSON document -- what `.dnvme/stats` shows, what a
// ctl `stats` request answers and what the daemon logs when it unmounts
// (docs/control-protocol.md, "stats"). Every room of fs/ contributes its part.
#include <time.h>

#include <nlohmann/json.hpp>
#include <string>

#include "fs/fs.h"

namespace dnvme::fs {

using nlohmann::json;

std::string Fs::StatsJson() {
  HandleStats engine_total;
  {
    std::lock_guard rl(reconfig_mu_);
    ReapRetiredLocked();
    engine_total = retired_stats_;
    for (auto& r : retired_) engine_total += r->stats();
  }
  if (auto e = Engine()) engine_total += e->stats();
  HandleStats ctl_total;
  {
    std::lock_guard lock(ctl_engines_mu_);
    ctl_total = ctl_closed_stats_;
    for (AioHandle* h : ctl_engines_) ctl_total += h->stats();
  }
  auto r = [](const std::atomic<uint64_t>& a) { return a.load(std::memory_order_relaxed); };
  const CtlCounters& c = ctl_counters_;
  struct timespec now {};
  clock_gettime(CLOCK_REALTIME, &now);
  json j = {
      {"mount",
       {{"backing", opts_.backing},
        {"mountpoint", opts_.mountpoint},
        {"uptime_s", static_cast<double>(now.tv_sec - started_.tv_sec) +
                         (now.tv_nsec - started_.tv_nsec) / 1e9},
        {"write_behind", opts_.write_behind},
        {"write_chunk", opts_.write_chunk},
        {"read_ahead", opts_.read_ahead},
        {"async_reply", opts_.async_reply},
        {"splice_read", opts_.SpliceRequests()},
        {"direct_io", DirectIoName(opts_.direct_io)},
        {"splice_reply", opts_.splice_reply},
        {"clone_fd", opts_.clone_fd},
        {"io_uring", opts_.io_uring},
        {"max_request", opts_.max_request},
        {"passthrough", PassthroughName(opts_.passthrough)},
        {"preload", opts_.preload}}},
      {"config", json::parse(EngineConfig().ToJson())},
      {"fuse", json::parse(counters_.ToJson())},
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
  j["mount"]["splice_pipes"] = wb_pipes_ ? wb_pipes_->count() : 0;
  // Pipes for spliced replies (-o splice_reply); 0 when replies are written.
  j["mount"]["reply_pipes"] = reply_pipes_ ? reply_pipes_->count() : 0;
  // How requests arrive (fs/transport/transport.h); null before the session runs.
  j["transport"] = transport_ ? json::parse(transport_->StatsJson()) : json(nullptr);
  // What was negotiated with the kernel beyond libfuse's 7.38 (fs/transport/protocol_ext.h).
  j["kernel"] = json::parse(protocol_.StatsJson());
  // The preload broker (fs/broker/broker.h); null with -o preload=0.
  j["broker"] = broker_ ? json::parse(broker_->StatsJson()) : json(nullptr);
  return j.dump();
}

}  // namespace dnvme::fs
