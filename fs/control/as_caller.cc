#include "fs/control/as_caller.h"

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/fsuid.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <string>

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
  // O_PATH takes no other flags from openat2 (EINVAL): it opens nothing that could block.
  how.flags = static_cast<uint64_t>(
      (flags & O_PATH) != 0 ? flags | O_CLOEXEC : flags | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
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

Result<UniqueFd> OpenKindBeneath(int dirfd, const std::string& rel, int flags, FileKind kind) {
  if ((flags & O_CREAT) != 0) return CtlError(EINVAL, "OpenKindBeneath does not create");
  DNVME_ASSIGN_OR_RETURN(UniqueFd path, OpenBeneath(dirfd, rel, O_PATH, 0));
  struct stat st {};
  if (fstat(path.get(), &st) != 0) return Status::FromErrno(errno, "fstat '" + rel + "'");
  const bool fits =
      S_ISREG(st.st_mode) || (kind == FileKind::kRegularOrDirectory && S_ISDIR(st.st_mode));
  if (!fits) {
    // open(2) answers a directory opened for writing so; anything else is refused as one.
    if (S_ISDIR(st.st_mode) && (flags & O_ACCMODE) != O_RDONLY) {
      return Status::FromErrno(EISDIR, "open '" + rel + "'");
    }
    return CtlError(EINVAL, "'" + rel + "' is not a regular file");
  }
  const std::string proc = "/proc/self/fd/" + std::to_string(path.get());
  int fd;
  do {
    fd = open(proc.c_str(), (flags & ~O_NOFOLLOW) | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return Status::FromErrno(errno, "open '" + rel + "'");
  return UniqueFd(fd);
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
