#include "fs/control/as_caller.h"

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/fsuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>

#include "dnvme/log.h"
#include "fs/control/ctl_protocol.h"

namespace dnvme::fs {
FsIdentity IdentityOf(const Caller& c) { return FsIdentity{c.uid, c.gid, c.groups}; }

Result<std::unique_ptr<AsCaller>> AsCaller::Enter(const Caller& c) {
  auto scope = ScopedFsIdentity::Enter(IdentityOf(c));
  if (!scope.ok()) {
    const Status& st = scope.status();
    return CtlError(st.ErrnoOr(EPERM), st.message());
  }
  return std::unique_ptr<AsCaller>(new AsCaller(std::move(scope).value()));
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
