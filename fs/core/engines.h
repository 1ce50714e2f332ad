// Every engine of the mount: the live one, which config.set swaps for a new one (no remount), the
// engines it replaced until their last submission ends, and the control sessions' engines, which
// count in the stats while they live.
//
// Thread contract: Current() from any thread, once per submission on the read and write paths:
// a leaf mutex of its own, held to copy the pointer (none shared with config.set or the stats).
// Reconfigure runs one at a time (serialised here) and may run while submissions go on: a caller
// keeps the engine it got for the duration of one submission only, and a retired engine is
// destroyed once nobody holds it (by the next Reconfigure, MountStats or Stop, on a thread that
// holds no inode lock), which also waits for its in-flight operations. Start, Reset and Stop from
// the thread that starts and ends the mount.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>
#include <vector>

#include "dnvme/config.h"
#include "dnvme/handle.h"
#include "dnvme/status.h"

namespace dnvme::fs {

class Engines {
 public:
  Engines() = default;
  Engines(const Engines&) = delete;
  Engines& operator=(const Engines&) = delete;

  // The live engine; null before Start and after Reset or Stop.
  std::shared_ptr<AioHandle> Current() const {
    std::lock_guard lock(current_mu_);
    return current_;
  }
  // Its configuration (config.get, the stats).
  HandleConfig config() const;

  // Creates the first engine with `c`.
  Status Start(const HandleConfig& c);
  // Applies a JSON object of HandleConfig keys on top of the live configuration: a new engine
  // with the result takes the new I/O at once. `*changed` says whether anything changed (an
  // equal configuration keeps the engine). On failure the old engine stays.
  Result<HandleConfig> Reconfigure(const std::string& json_patch, bool* changed);
  // Drops the live engine (a preflight's engine, before the mount).
  void Reset();
  // Destroys the live engine and the retired ones, waiting for every operation and its callback.
  // Call once nothing can submit any more (the session loop has ended).
  void Stop();

  // The live and retired engines' stats together (destroyed ones included).
  HandleStats MountStats();
  // Replaced engines not yet destroyed (someone held them at the last reap).
  size_t retired();
  // Control-file engines: registered at handle.open, unregistered at close.
  void AddSessionEngine(AioHandle* h);
  void RemoveSessionEngine(AioHandle* h);
  HandleStats SessionStats();

 private:
  // Set by the last reference to an engine the mount handed out (Current), under its own mutex:
  // the reaper reads it under that mutex, so everything the last holder did with the engine
  // happens before the engine is retired and destroyed (shared_ptr::use_count() is a relaxed
  // load and orders nothing; ThreadSanitizer reported the destruction racing the last
  // submission).
  struct Released {
    std::mutex mu;
    bool done = false;  // guarded by mu
  };
  // An engine the mount made, owned here; its handed-out references only mark `released`.
  struct Slot {
    std::unique_ptr<AioHandle> engine;
    std::shared_ptr<Released> released;
  };

  void ReapRetiredLocked();
  // Under reconfig_mu_: `ref` (null: none) becomes the live engine, `fresh` its slot, `*c` (when
  // given) the configuration; the engine it replaces is retired, and whatever nobody holds is
  // destroyed.
  void InstallLocked(Slot fresh, std::shared_ptr<AioHandle> ref, const HandleConfig* c);
  // Wraps a new engine: the slot owns it, the returned pointer is what Current() hands out.
  std::shared_ptr<AioHandle> Adopt(std::unique_ptr<AioHandle> engine, Slot* slot);

  // Replaces the live engine with `h`; returns the one it replaced (dropped by the caller, out
  // of the lock). Called under config_mu_, so the engine and config_ change together.
  std::shared_ptr<AioHandle> SwapCurrent(std::shared_ptr<AioHandle> h);

  // The live engine, behind a mutex of its own held only to copy or replace the pointer. Not
  // std::atomic<std::shared_ptr>: libstdc++ 12's load unlocks with a relaxed store, so a load and
  // the exchange after it have no happens-before (ThreadSanitizer reports it, scripts/tsan.sh).
  mutable std::mutex current_mu_;
  std::shared_ptr<AioHandle> current_;  // guarded by current_mu_
  mutable std::mutex config_mu_;
  HandleConfig config_;        // guarded by config_mu_
  std::mutex reconfig_mu_;     // one Start/Reconfigure/Reset/Stop at a time; guards the three below
  Slot live_;                  // the engine behind current_ (a null engine before Start)
  std::vector<Slot> retired_;  // replaced engines, destroyed once released
  HandleStats retired_stats_;  // of destroyed engines
  std::mutex sessions_mu_;
  std::unordered_set<AioHandle*> sessions_;  // guarded by sessions_mu_
  HandleStats sessions_closed_;              // guarded by sessions_mu_
};

}  // namespace dnvme::fs
