// Least privilege for the dnvmefs daemon: drop every Linux capability it does not need (libcap).
//
// What DropCapabilities(keep, dormant) does, in this order:
//   1. bounding set: drops every capability not in `keep` (PR_CAPBSET_DROP). This needs
//      CAP_SETPCAP in the effective set, so it happens first, while we still have it. Without
//      CAP_SETPCAP (not root, or a container that took it away) the bounding set is left as it is
//      and a note says so; that is not an error.
//   2. ambient set: cleared (PR_CAP_AMBIENT_CLEAR_ALL), so nothing is passed to programs we exec.
//   3. permitted: exactly `keep` intersected with what the process holds now (a capability can
//      never be gained, only kept); effective: the same less `dormant`, whose capabilities stay
//      permitted but are off until a ScopedCapability raises them for one call on one thread;
//      inheritable: cleared. CAP_SETPCAP goes here too unless it is in `keep`.
// A process without capabilities (an ordinary user) gets a report with nothing dropped.
//
// No PR_SET_NO_NEW_PRIVS: see caps.cc (fusermount3, the setuid helper, must stay usable).
//
// Thread contract: capabilities, the bounding set and the ambient set are per *thread* in Linux,
// and plain libcap (no libpsx) changes only the calling thread. DropCapabilities must therefore
// run while the process has exactly one thread -- after fuse_session_mount() and daemonizing,
// before the FUSE loop, the engine's workers or any logger thread start. It checks
// /proc/self/task and returns kInternal when other threads exist, rather than leaving them
// privileged. DaemonKeepSet(), DaemonDormantSet() and CapReport are plain values, safe from any
// thread. A ScopedCapability changes only the thread that made it, for as long as it lives.
#pragma once

#include <sys/capability.h>

#include <string>
#include <vector>

#include "dnvme/status.h"

namespace dnvme::fs {

// What DropCapabilities did, for the daemon to log. Names are libcap's ("cap_ipc_lock").
struct CapReport {
  // Capabilities of `keep` that the process still holds (permitted) afterwards.
  std::vector<std::string> kept;
  // Capabilities that were in the effective, permitted, inheritable or bounding set before and
  // are in none of them afterwards.
  std::vector<std::string> dropped;
  // Anything worth a log line: the bounding set could not be changed (no CAP_SETPCAP), a
  // capability of `keep` was not held to begin with, the ambient set is not supported.
  std::vector<std::string> notes;

  // One line: "kept [a, b] dropped N [x, y, ...]" plus "; note" for each note.
  std::string ToString() const;
};

// Drops every capability not in `keep` from the effective, permitted, inheritable, ambient and
// (when CAP_SETPCAP allows) bounding sets of the calling thread, and those of `dormant` (a subset
// of `keep`) from the effective set only. Errors: kInvalidArgument for a value that is not a
// capability this kernel knows, or a dormant one that is not kept; kInternal when the process
// has more than one thread; kIoError (with errno) when the kernel refuses a change. On error the
// sets may be partly reduced (never widened); the daemon should exit.
Result<CapReport> DropCapabilities(const std::vector<cap_value_t>& keep,
                                   const std::vector<cap_value_t>& dormant = {});

// The capabilities the dnvmefs daemon keeps after mounting; caps.cc says why for each one.
// `passthrough`: FUSE passthrough is asked for (fs/fuse/passthrough.h), which adds CAP_SYS_ADMIN.
std::vector<cap_value_t> DaemonKeepSet(bool passthrough = false);
// Of those, the ones kept permitted but not effective: raised only around the one request that
// needs each (ScopedCapability). caps.cc says why.
std::vector<cap_value_t> DaemonDormantSet(bool passthrough = false);

// Raises one permitted capability into the calling thread's effective set and lowers it again
// when destroyed (unless it was effective already). Raise returns kIoError with EPERM when the
// thread does not hold it in its permitted set (an unprivileged daemon), kIoError with the
// kernel's errno when it refuses the change.
class ScopedCapability {
 public:
  static Result<ScopedCapability> Raise(cap_value_t cap);
  ScopedCapability(ScopedCapability&& o) noexcept : cap_(o.cap_), lower_(o.lower_) {
    o.lower_ = false;
  }
  ScopedCapability& operator=(ScopedCapability&&) = delete;
  ScopedCapability(const ScopedCapability&) = delete;
  ScopedCapability& operator=(const ScopedCapability&) = delete;
  ~ScopedCapability();

 private:
  ScopedCapability(cap_value_t cap, bool lower) : cap_(cap), lower_(lower) {}
  cap_value_t cap_;
  bool lower_;
};

}  // namespace dnvme::fs
