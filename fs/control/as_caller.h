// A control request acts as the process that sent it: AsCaller switches the serving thread's
// filesystem identity to the caller's for a scope, and OpenBeneath resolves a path strictly
// inside BACKING_DIR, so the kernel makes the permission decision open(2) would have made.
//
// Thread contract: AsCaller changes only the calling thread's identity (fsuid, fsgid, groups)
// and must be destroyed on that thread; the functions are thread-safe.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "dnvme/fd.h"
#include "dnvme/identity.h"
#include "dnvme/status.h"
#include "fs/control/control.h"

namespace dnvme::fs {

// Runs the calling thread with the caller's filesystem identity (fsuid, fsgid, supplementary
// groups) until destroyed: a thin wrapper of ScopedFsIdentity (dnvme/identity.h, which
// also keeps dormant capabilities dormant afterwards). A daemon not running as root cannot
// switch: it serves only its own uid (which is all FUSE lets through without allow_other anyway).
class AsCaller {
 public:
  static Result<std::unique_ptr<AsCaller>> Enter(const Caller& c);
  AsCaller(const AsCaller&) = delete;
  AsCaller& operator=(const AsCaller&) = delete;

 private:
  explicit AsCaller(ScopedFsIdentity s) : scope_(std::move(s)) {}
  ScopedFsIdentity scope_;
};

// The identity a caller's work runs under (engine writes, opens on its behalf).
FsIdentity IdentityOf(const Caller& c);

// openat2 below `dirfd`: the path cannot leave it (..), and no symlink or /proc magic link in it
// is followed (ELOOP). Always O_NONBLOCK, so opening a FIFO or a device never blocks: a caller
// that keeps the descriptor checks its type (fstat) and clears O_NONBLOCK where it matters.
Result<UniqueFd> OpenBeneath(int dirfd, const std::string& rel, int flags, mode_t mode);

// What OpenKindBeneath accepts at the name.
enum class FileKind { kRegular, kRegularOrDirectory };

// OpenBeneath for a file the daemon reads or writes: the name is first opened O_PATH (no open
// of the object itself) and its type checked, and only a `kind` is then opened with `flags`,
// through /proc/self/fd (the same inode, the permission check made again as the current
// identity). A device node's open has effects of its own -- a tape rewinds, a terminal becomes
// a controlling one -- and the mount is nodev: the daemon never opens one for a user. EINVAL
// "not a regular file" otherwise. It never creates: a create is OpenBeneath's O_CREAT | O_EXCL,
// whose result is the regular file it made.
Result<UniqueFd> OpenKindBeneath(int dirfd, const std::string& rel, int flags,
                                 FileKind kind = FileKind::kRegular);

// The directory part of a relative path ("" for none) and its last component.
std::string Dirname(const std::string& rel);
std::string Basename(const std::string& rel);

}  // namespace dnvme::fs
