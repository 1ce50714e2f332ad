// FsIdentity: a file-system identity (fsuid, fsgid, supplementary groups) that work done on
// someone's behalf runs under, so the kernel decides for that work exactly as for its owner; and
// switching a thread to one and back (implemented in dnvme_engine, engine/posix/identity.cc).
//
// Used by a daemon serving many users (dnvmefs): an engine file adopted for a writer carries the
// writer's identity (AioHandle::adopt_fd), and the engine's threads switch to it before they
// submit the file's writes, so block allocation sees the writer's fsuid (ext4 keeps its reserved
// blocks for root) and the kernel applies its own set-user-ID rules to the write.
//
// The switch is the one place in the project that does it (the daemon's control file and broker
// act as the caller with ScopedFsIdentity; engine and splice threads write as the writer with
// SwitchThreadFsIdentity).
//
// Why per thread: Linux keeps fsuid, fsgid, groups and capabilities per thread. glibc's
// setgroups() changes every thread of the process, so the raw syscall is used.
//
// Why the effective capability set is saved and put back: when a thread's fsuid leaves 0 the
// kernel drops the file-system capabilities (CAP_CHOWN, CAP_DAC_*, CAP_FOWNER, CAP_FSETID,
// CAP_MKNOD, ...) from its effective set, and when fsuid returns to 0 it raises *every permitted*
// one of them again -- also those a daemon keeps dormant (CAP_MKNOD, raised only around a device
// mknod). Restoring the exact effective set keeps them dormant.
//
// A process that is not root (geteuid() != 0) cannot switch: acting as its own uid is a no-op,
// anything else is refused (EPERM).
//
// Thread contract: an FsIdentity is a plain value, immutable once shared. The switching functions
// act on the calling thread only. A ScopedFsIdentity must be destroyed on the thread that made
// it; failing to restore the thread's identity aborts the process (a thread left with a client's
// identity would serve other users wrongly).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <vector>

#include "dnvme/status.h"

namespace dnvme {

struct FsIdentity {
  uid_t uid = 0;
  gid_t gid = 0;
  std::vector<gid_t> groups;  // supplementary groups

  bool operator==(const FsIdentity& o) const {
    return uid == o.uid && gid == o.gid && groups == o.groups;
  }
};

// Runs the calling thread as `who` until destroyed.
class ScopedFsIdentity {
 public:
  static Result<ScopedFsIdentity> Enter(const FsIdentity& who);
  // Enter(*who), or a scope that changes nothing when `who` is null (a file written as the
  // daemon itself: FileRef::write_identity).
  static Result<ScopedFsIdentity> EnterIf(const FsIdentity* who);
  ScopedFsIdentity(ScopedFsIdentity&& o) noexcept;
  ScopedFsIdentity& operator=(ScopedFsIdentity&&) = delete;
  ScopedFsIdentity(const ScopedFsIdentity&) = delete;
  ScopedFsIdentity& operator=(const ScopedFsIdentity&) = delete;
  ~ScopedFsIdentity();

  // The thread's identity before Enter (what the destructor restores).
  struct Saved {
    bool switched = false;
    uid_t fsuid = 0;
    gid_t fsgid = 0;
    std::vector<gid_t> groups;
    uint32_t effective[2] = {0, 0};  // the effective capability set (capget v3, two words)
  };

 private:
  ScopedFsIdentity() = default;
  Saved saved_;
};

// For long-lived I/O threads: makes the calling thread run as `*want`, or as its own identity when
// `want` is null, switching only when that differs from what the thread runs as now (a worker
// serving one user switches once). The thread's own identity is remembered at its first switch.
Status SwitchThreadFsIdentity(const FsIdentity* want);

// The calling thread's effective capability set, as capget returns it (for tests and logs).
Result<uint64_t> ThreadEffectiveCapabilities();

}  // namespace dnvme
