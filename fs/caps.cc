#include "fs/caps.h"

#include <sys/prctl.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>

#include "dnvme/log.h"

// Why there is no prctl(PR_SET_NO_NEW_PRIVS) here:
// When dnvmefs runs as an ordinary user, libfuse mounts and unmounts through the setuid-root
// helper fusermount3 (fuse_session_unmount() execs `fusermount3 -u`). With no_new_privs the
// kernel ignores the setuid bit on exec, fusermount3 runs unprivileged and the unmount fails,
// leaving a dead mount ("Transport endpoint is not connected"). For root it would add little:
// once the bounding set holds only the keep set, no exec -- setuid or not -- can get anything
// else back (a uid-0 exec gets at most the bounding set).
//
// The flip side for root: with CAP_SYS_ADMIN gone from the bounding set, neither the daemon nor
// any fusermount3 it execs can unmount (libfuse calls umount2() itself when geteuid() == 0 and
// gets EPERM). Unmounting is then done from outside -- `fusermount3 -u` / `umount` by the admin
// or the systemd unit's ExecStop -- or by auto_unmount (main.cc always asks for it), where
// libfuse mounts through a fusermount3 process started before the drop that keeps its
// capabilities and unmounts as soon as the daemon's /dev/fuse descriptor closes (also after a
// crash).

namespace dnvme::fs {
namespace {

struct CapFree {
  void operator()(void* p) const { cap_free(p); }
};
using CapPtr = std::unique_ptr<std::remove_pointer_t<cap_t>, CapFree>;
using CapName = std::unique_ptr<char, CapFree>;

std::string Name(cap_value_t cap) {
  CapName name(cap_to_name(cap));
  return name ? std::string(name.get()) : "cap_" + std::to_string(cap);
}

bool Contains(const std::vector<cap_value_t>& set, cap_value_t cap) {
  return std::find(set.begin(), set.end(), cap) != set.end();
}

// One bit per capability and set, read from the kernel for the calling thread.
struct Snapshot {
  std::vector<bool> effective, permitted, inheritable, bounding, ambient;
};

Result<Snapshot> TakeSnapshot(cap_value_t count) {
  CapPtr caps(cap_get_proc());
  if (!caps) return Status::FromErrno(errno, "cap_get_proc");
  Snapshot s;
  for (auto* v : {&s.effective, &s.permitted, &s.inheritable, &s.bounding, &s.ambient}) {
    v->assign(static_cast<size_t>(count), false);
  }
  for (cap_value_t cap = 0; cap < count; ++cap) {
    const auto i = static_cast<size_t>(cap);
    cap_flag_value_t on = CAP_CLEAR;
    if (cap_get_flag(caps.get(), cap, CAP_EFFECTIVE, &on) == 0) s.effective[i] = on == CAP_SET;
    if (cap_get_flag(caps.get(), cap, CAP_PERMITTED, &on) == 0) s.permitted[i] = on == CAP_SET;
    if (cap_get_flag(caps.get(), cap, CAP_INHERITABLE, &on) == 0) {
      s.inheritable[i] = on == CAP_SET;
    }
    s.bounding[i] = cap_get_bound(cap) == 1;
    s.ambient[i] = cap_get_ambient(cap) == 1;  // -1 (not supported) reads as "not set"
  }
  return s;
}

bool HeldAnywhere(const Snapshot& s, size_t i) {
  return s.effective[i] || s.permitted[i] || s.inheritable[i] || s.bounding[i] || s.ambient[i];
}

// The number of threads of this process, from /proc/self/status; 0 when it cannot be read.
int ThreadCount() {
  std::ifstream status("/proc/self/status");
  std::string line;
  constexpr std::string_view kKey = "Threads:";
  while (std::getline(status, line)) {
    if (line.compare(0, kKey.size(), kKey) == 0) return std::atoi(line.c_str() + kKey.size());
  }
  return 0;
}

std::string Join(const std::vector<std::string>& names) {
  std::string out = "[";
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) out += ", ";
    out += names[i];
  }
  return out + "]";
}

}  // namespace

std::string CapReport::ToString() const {
  std::string out =
      "kept " + Join(kept) + " dropped " + std::to_string(dropped.size()) + " " + Join(dropped);
  for (const auto& note : notes) out += "; " + note;
  return out;
}

Result<CapReport> DropCapabilities(const std::vector<cap_value_t>& keep,
                                   const std::vector<cap_value_t>& dormant) {
  // cap_max_bits() is what the running kernel supports (cap_last_cap + 1), which may be more or
  // fewer than the CAP_LAST_CAP libcap was built with.
  const cap_value_t count = cap_max_bits();
  for (cap_value_t cap : keep) {
    if (cap < 0 || cap >= count || !CAP_IS_SUPPORTED(cap)) {
      return Status::InvalidArgument("DropCapabilities: " + std::to_string(cap) +
                                     " is not a capability this kernel supports (0.." +
                                     std::to_string(count - 1) + ")");
    }
  }
  for (cap_value_t cap : dormant) {
    if (!Contains(keep, cap)) {
      return Status::InvalidArgument("DropCapabilities: dormant " + Name(cap) + " is not kept");
    }
  }
  // ThreadSanitizer's runtime starts a thread of its own before main (scripts/tsan.sh); it never
  // acts for a user.
#if defined(__SANITIZE_THREAD__)
  constexpr int kOwnThreads = 2;
#else
  constexpr int kOwnThreads = 1;
#endif
  if (int threads = ThreadCount(); threads > kOwnThreads) {
    return Status::Internal(
        "DropCapabilities must run before any thread starts: capabilities "
        "are per thread and this process has " +
        std::to_string(threads) + " threads");
  }

  DNVME_ASSIGN_OR_RETURN(Snapshot before, TakeSnapshot(count));
  CapReport report;

  // 1. The bounding set, while CAP_SETPCAP is still effective.
  const bool can_setpcap = before.effective[CAP_SETPCAP];
  bool bounding_left = false;
  for (cap_value_t cap = 0; cap < count; ++cap) {
    if (Contains(keep, cap) || !before.bounding[static_cast<size_t>(cap)]) continue;
    if (!can_setpcap) {
      bounding_left = true;
      continue;
    }
    if (cap_drop_bound(cap) != 0) {
      return Status::FromErrno(errno, "PR_CAPBSET_DROP " + Name(cap));
    }
  }
  if (bounding_left) {
    report.notes.push_back("bounding set left unchanged (no cap_setpcap)");
  }

  // 2. The ambient set (kernels before 4.3 have none; then there is nothing to clear).
  if (CAP_AMBIENT_SUPPORTED()) {
    if (cap_reset_ambient() != 0) return Status::FromErrno(errno, "PR_CAP_AMBIENT_CLEAR_ALL");
  } else {
    report.notes.push_back("no ambient capability set on this kernel");
  }

  // 3. Effective + permitted = keep (as far as held), inheritable = nothing. This also drops
  //    CAP_SETPCAP unless it was kept, so it must come after the bounding set.
  CapPtr next(cap_init());
  if (!next) return Status::FromErrno(errno, "cap_init");
  std::vector<cap_value_t> held;
  std::vector<std::string> not_held;
  for (cap_value_t cap : keep) {
    if (before.permitted[static_cast<size_t>(cap)]) {
      if (!Contains(held, cap)) held.push_back(cap);
    } else {
      not_held.push_back(Name(cap));  // an ordinary user, or a unit that withheld it
    }
  }
  if (!not_held.empty()) report.notes.push_back("not held, so not kept: " + Join(not_held));
  std::vector<cap_value_t> effective;
  for (cap_value_t cap : held) {
    if (!Contains(dormant, cap)) effective.push_back(cap);
  }
  if (!held.empty() && cap_set_flag(next.get(), CAP_PERMITTED, static_cast<int>(held.size()),
                                    held.data(), CAP_SET) != 0) {
    return Status::FromErrno(errno, "cap_set_flag");
  }
  if (!effective.empty() &&
      cap_set_flag(next.get(), CAP_EFFECTIVE, static_cast<int>(effective.size()), effective.data(),
                   CAP_SET) != 0) {
    return Status::FromErrno(errno, "cap_set_flag");
  }
  if (cap_set_proc(next.get()) != 0) return Status::FromErrno(errno, "cap_set_proc");

  DNVME_ASSIGN_OR_RETURN(Snapshot after, TakeSnapshot(count));
  for (cap_value_t cap = 0; cap < count; ++cap) {
    const auto i = static_cast<size_t>(cap);
    if (after.permitted[i] && Contains(keep, cap)) report.kept.push_back(Name(cap));
    if (HeldAnywhere(before, i) && !HeldAnywhere(after, i)) report.dropped.push_back(Name(cap));
  }
  return report;
}

std::vector<cap_value_t> DaemonKeepSet(bool passthrough) {
  std::vector<cap_value_t> keep = {
      // Pinned (mlock'ed) I/O and bounce buffers beyond RLIMIT_MEMLOCK. A daemon serving several
      // clients pins far more than the 8 MiB default limit; without this the engine falls back
      // to smaller pools or fails with kResourceExhausted.
      CAP_IPC_LOCK,
      // A root passthrough daemon serving many users opens, lists and modifies files it does not
      // own. With default_permissions the kernel has already checked the caller's rights against
      // the mode bits before the request reaches us; these let the daemon act on that decision.
      CAP_DAC_OVERRIDE,     // open/create/unlink regardless of mode bits
      CAP_DAC_READ_SEARCH,  // read/search any directory (also allows open_by_handle_at)
      CAP_FOWNER,           // chmod, utimens, setxattr on files whose owner is not us
      // chown requests, and handing a newly created file to the caller: create as root, then
      // fchown to the caller's uid/gid (with gid -1 under a setgid directory so the directory's
      // group is inherited as on a local filesystem).
      CAP_CHOWN,
      // Without it the kernel clears S_ISGID when we chmod a file whose group is not ours (root's
      // groups), and clears S_ISUID/S_ISGID when we write or chown. The FUSE kernel already
      // applied those rules for the real caller; the daemon must not apply them a second time as
      // root.
      CAP_FSETID,
      // The control file (`.dnvme/ctl`) acts as the process that sent each request: it opens
      // the request's path and shared-memory object under the caller's fsuid/fsgid/groups
      // (setfsuid, setfsgid, setgroups on that thread only, restored right after), so the kernel
      // makes exactly the permission decision open(2) would, ACLs included. Those three calls
      // need these two capabilities. Ordinary FUSE requests do not use them: new files get
      // their owner through fchown (CAP_CHOWN).
      CAP_SETUID,
      CAP_SETGID,
      // Device nodes (mknod of a block or character device) for callers that may make them.
      // The kernel checks CAP_MKNOD of the *caller* in vfs_mknod before a device MKNOD reaches
      // FUSE, so every such request comes from a process that could make the node on ext4
      // itself; without the capability the daemon answered EPERM where ext4 succeeds. Dormant
      // (DaemonDormantSet): raised on one loop thread only around that mknodat. The mount stays
      // nodev, so the nodes cannot be opened as devices through it.
      CAP_MKNOD,
  };
  // FUSE passthrough: registering a backing file with the kernel (FUSE_DEV_IOC_BACKING_OPEN and
  // _CLOSE) needs CAP_SYS_ADMIN. Kept dormant (DaemonDormantSet), raised on one thread around
  // each ioctl, and only when passthrough is asked for.
  if (passthrough) keep.push_back(CAP_SYS_ADMIN);
  return keep;
  // Deliberately dropped:
  // - CAP_SYS_ADMIN (unless passthrough is asked for): only the mount needs it, and that has
  //   happened before the drop. Unmount is done from outside or by auto_unmount (see the top of
  //   this file).
  // - CAP_SYS_RESOURCE: without it writes on behalf of users stop at the filesystem's
  //   root-reserved blocks (ext4's 5%) like the users' own writes would.
  // - CAP_LINUX_IMMUTABLE, CAP_SETPCAP and the rest: no request needs them.
}

std::vector<cap_value_t> DaemonDormantSet(bool passthrough) {
  if (passthrough) return {CAP_MKNOD, CAP_SYS_ADMIN};
  return {CAP_MKNOD};
}

Result<ScopedCapability> ScopedCapability::Raise(cap_value_t cap) {
  CapPtr caps(cap_get_proc());
  if (!caps) return Status::FromErrno(errno, "cap_get_proc");
  cap_flag_value_t permitted = CAP_CLEAR, effective = CAP_CLEAR;
  if (cap_get_flag(caps.get(), cap, CAP_PERMITTED, &permitted) != 0 ||
      cap_get_flag(caps.get(), cap, CAP_EFFECTIVE, &effective) != 0) {
    return Status::FromErrno(errno, "cap_get_flag " + Name(cap));
  }
  if (effective == CAP_SET) return ScopedCapability(cap, /*lower=*/false);
  if (permitted != CAP_SET) return Status::FromErrno(EPERM, Name(cap) + " is not permitted");
  if (cap_set_flag(caps.get(), CAP_EFFECTIVE, 1, &cap, CAP_SET) != 0 ||
      cap_set_proc(caps.get()) != 0) {
    return Status::FromErrno(errno, "raise " + Name(cap));
  }
  return ScopedCapability(cap, /*lower=*/true);
}

ScopedCapability::~ScopedCapability() {
  if (!lower_) return;
  // Lowering a capability one holds cannot fail for lack of privilege; a failure (ENOMEM in
  // libcap) would leave it raised on this thread, so it is logged where the daemon can see it.
  CapPtr caps(cap_get_proc());
  if (!caps || cap_set_flag(caps.get(), CAP_EFFECTIVE, 1, &cap_, CAP_CLEAR) != 0 ||
      cap_set_proc(caps.get()) != 0) {
    Logger().error("could not lower {} again: {}", Name(cap_), std::strerror(errno));
  }
}

}  // namespace dnvme::fs
