#include "fs/control/as_caller.h"

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/fsuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>

#include "engine/common/log.h"
#include "fs/control/ctl_protocol.h"

namespace dnvme::fs {
Result<std::unique_ptr<AsCaller>> AsCaller::Enter(const Caller& c) {
  auto a = std::unique_ptr<AsCaller>(new AsCaller());
  if (geteuid() != 0) {
    if (c.uid != geteuid()) {
      return CtlError(EACCES, "the daemon runs as uid " + std::to_string(geteuid()) +
                                  " and cannot act for uid " + std::to_string(c.uid));
    }
    return a;
  }
  int n = getgroups(0, nullptr);
  if (n < 0) return Status::FromErrno(errno, "getgroups");
  a->saved_groups_.resize(static_cast<size_t>(n));
  if (n > 0 && getgroups(n, a->saved_groups_.data()) < 0) {
    return Status::FromErrno(errno, "getgroups");
  }
  a->saved_uid_ = static_cast<uid_t>(setfsuid(static_cast<uid_t>(-1)));
  a->saved_gid_ = static_cast<gid_t>(setfsgid(static_cast<gid_t>(-1)));
  a->switched_ = true;  // from here the destructor restores
  if (syscall(SYS_setgroups, c.groups.size(), c.groups.data()) != 0) {
    return Status::FromErrno(errno, "setgroups for the caller");
  }
  setfsgid(c.gid);
  if (static_cast<gid_t>(setfsgid(static_cast<gid_t>(-1))) != c.gid) {
    return CtlError(EPERM, "cannot take the caller's gid " + std::to_string(c.gid));
  }
  setfsuid(c.uid);
  if (static_cast<uid_t>(setfsuid(static_cast<uid_t>(-1))) != c.uid) {
    return CtlError(EPERM, "cannot take the caller's uid " + std::to_string(c.uid));
  }
  return a;
}

AsCaller::~AsCaller() {
  if (!switched_) return;
  setfsuid(saved_uid_);
  setfsgid(saved_gid_);
  const bool groups_ok = syscall(SYS_setgroups, saved_groups_.size(), saved_groups_.data()) == 0;
  if (!groups_ok || static_cast<uid_t>(setfsuid(static_cast<uid_t>(-1))) != saved_uid_ ||
      static_cast<gid_t>(setfsgid(static_cast<gid_t>(-1))) != saved_gid_) {
    // A FUSE thread left with a client's identity would serve other users wrongly: stop.
    Logger().critical("could not restore the daemon's identity after a control request");
    std::abort();
  }
}

Result<UniqueFd> OpenBeneath(int dirfd, const std::string& rel, int flags, mode_t mode) {
  struct open_how how {};
  // O_NONBLOCK: a FIFO (or a device) planted under the name must not hold the thread that opens
  // it (a broker thread blocked on a FIFO kept the daemon from unmounting). Callers that keep
  // the descriptor check it is a regular file and clear the flag when it matters.
  how.flags = static_cast<uint64_t>(flags | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  how.mode = (flags & O_CREAT) ? mode : 0;
  // No symlink at all, not even one that stays inside: a user can swap a component for a link
  // between a check and the open, and the daemon never follows a name for anyone.
  how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
  long fd;
  do {
    fd = syscall(SYS_openat2, dirfd, rel.c_str(), &how, sizeof(how));
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) {
    const int err = errno;
    if (err == EXDEV) return CtlError(EXDEV, "'" + rel + "' resolves outside the mount");
    if (err == ELOOP) {
      return CtlError(ELOOP, "'" + rel + "' goes through a symbolic link (never followed)");
    }
    return Status::FromErrno(err, "open '" + rel + "'");
  }
  return UniqueFd(static_cast<int>(fd));
}

std::string Dirname(const std::string& rel) {
  const size_t slash = rel.rfind('/');
  return slash == std::string::npos ? std::string() : rel.substr(0, slash);
}

std::string Basename(const std::string& rel) {
  const size_t slash = rel.rfind('/');
  return slash == std::string::npos ? rel : rel.substr(slash + 1);
}

}  // namespace dnvme::fs
