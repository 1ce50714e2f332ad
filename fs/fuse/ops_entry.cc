// FUSE ops on names and attributes: lookup, forget, getattr/setattr, the creates (mknod, mkdir,
// symlink, link), unlink, rmdir, rename, statfs and the xattrs. Each acts on the O_PATH fds the
// inodes hold and answers exactly once, through the Reply* helpers (ops_common.h): errno becomes
// a Status at the syscall.
#include <dirent.h>
#include <fcntl.h>
#include <sched.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "dnvme/log.h"
#include "fs/caps.h"
#include "fs/core/fs.h"
#include "fs/fuse/control_dir.h"
#include "fs/fuse/ops.h"
#include "fs/fuse/ops_common.h"

namespace dnvme::fs::ops {

void OpLookup(fuse_req_t req, fuse_ino_t parent, const char* name) {
  if (auto v = VirtualLookup(FsOf(req), parent, name)) return ReplyEntry(req, *v);
  ReplyEntry(req, parent, name);
}

void OpForget(fuse_req_t req, fuse_ino_t ino, uint64_t nlookup) {
  FsOf(req).inodes().Forget(ino, nlookup);
  ReplyNone(req);
}

void OpForgetMulti(fuse_req_t req, size_t count, fuse_forget_data* forgets) {
  for (size_t i = 0; i < count; ++i) FsOf(req).inodes().Forget(forgets[i].ino, forgets[i].nlookup);
  ReplyNone(req);
}

void OpGetattr(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  (void)fi;
  if (auto v = VirtualGetattr(ino)) return ReplyAttr(req, *v, kVirtualTimeout);
  Inode& in = FsOf(req).inodes().Get(ino);
  // Uncached while a `dnvme run` client may change the size around the mount.
  ReplyAttr(req, StatInode(in), in.leases.count() > 0 ? 0.0 : kTimeout);
}

namespace {

void SetattrNow(fuse_req_t req, fuse_ino_t ino, struct stat* attr, int valid, fuse_file_info* fi);

}  // namespace

void OpSetattr(fuse_req_t req, fuse_ino_t ino, struct stat* attr, int valid, fuse_file_info* fi) {
  if (auto v = VirtualSetattr(ino, valid)) return ReplyAttr(req, *v, kVirtualTimeout);
  Fs& fs = FsOf(req);
  Inode& in = fs.inodes().Get(ino);
  const int waits = FUSE_SET_ATTR_SIZE | FUSE_SET_ATTR_ATIME | FUSE_SET_ATTR_MTIME |
                    FUSE_SET_ATTR_ATIME_NOW | FUSE_SET_ATTR_MTIME_NOW;
  if (!(valid & waits) || in.leases.count() == 0) return SetattrNow(req, ino, attr, valid, fi);
  // A truncate or a time change waits for a `dnvme run` client's writes in flight: off the loop
  // thread (AfterLeaseWrites), with copies of what the request handed in.
  struct Args {
    struct stat attr;
    std::optional<fuse_file_info> fi;
  };
  auto args = std::make_shared<Args>(Args{*attr, fi ? std::optional(*fi) : std::nullopt});
  const char* what = (valid & FUSE_SET_ATTR_SIZE) ? "the truncate" : "setting the times";
  AfterLeaseWrites(fs, in, /*share_if_busy=*/true, what, [req, ino, valid, args] {
    SetattrNow(req, ino, &args->attr, valid, args->fi ? &*args->fi : nullptr);
  });
}

namespace {

// truncate(2) of the backing file without a name and without waiting: truncate(2) of a path
// breaks a lease on the file and sleeps until its holder lets go (lease-break-time, 45 s, on a
// loop thread); ReopenNoWait answers EWOULDBLOCK instead (docs/security.md). The kernel
// checked the caller's right to truncate (default_permissions) before the SETATTR was sent.
Status TruncateNoWait(Inode& in, off_t size) {
  UniqueFd fd(ReopenNoWait(in.fd, O_WRONLY | O_CLOEXEC | O_NOCTTY));
  if (!fd.valid()) return Status::FromErrno(errno, "reopening for truncate");
  if (ftruncate(fd.get(), size) != 0) return Status::FromErrno(errno, "truncate");
  return Status::Ok();
}

// The truncate of a SETATTR: through the open file when the request names one.
Status Truncate(Inode& in, fuse_file_info* fi, off_t size) {
  if (fi == nullptr) return TruncateNoWait(in, size);
  if (ftruncate(Fh(fi).fd.get(), size) != 0) return Status::FromErrno(errno, "truncate");
  return Status::Ok();
}

// The changes a SETATTR asks for, in order; stops at the first that fails.
Status ApplySetattr(fuse_req_t req, Inode& in, struct stat* attr, int valid, fuse_file_info* fi) {
  const std::string proc = ProcPath(in.fd);
  if (valid & FUSE_SET_ATTR_MODE) {
    int rc = fi ? fchmod(Fh(fi).fd.get(), attr->st_mode) : chmod(proc.c_str(), attr->st_mode);
    if (rc != 0) return Status::FromErrno(errno, "chmod");
  }
  if (valid & (FUSE_SET_ATTR_UID | FUSE_SET_ATTR_GID)) {
    uid_t uid = (valid & FUSE_SET_ATTR_UID) ? attr->st_uid : static_cast<uid_t>(-1);
    gid_t gid = (valid & FUSE_SET_ATTR_GID) ? attr->st_gid : static_cast<gid_t>(-1);
    if (fchownat(in.fd, "", uid, gid, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW) != 0) {
      return Status::FromErrno(errno, "chown");
    }
  }
  if (valid & FUSE_SET_ATTR_SIZE) {
    // A truncate by a user clears set-user-ID/set-group-ID as a write does. The kernel sent the
    // mode it cleared already (applied above) but not the rest of ext4's rule (KillPrivs).
    if (fuse_req_ctx(req)->uid != 0) DNVME_RETURN_IF_ERROR(KillPrivs(req, in));
    // Pending write-behind data -- the mount's, and a `dnvme run` client's (OpSetattr waited
    // for those) -- must not land after (and undo) the truncation.
    DNVME_RETURN_IF_ERROR(in.data.Change([&] { return Truncate(in, fi, attr->st_size); }));
  }
  if (valid & (FUSE_SET_ATTR_ATIME | FUSE_SET_ATTR_MTIME)) {
    struct timespec tv[2];
    tv[0].tv_sec = 0;
    tv[1].tv_sec = 0;
    tv[0].tv_nsec = UTIME_OMIT;
    tv[1].tv_nsec = UTIME_OMIT;
    if (valid & FUSE_SET_ATTR_ATIME_NOW) {
      tv[0].tv_nsec = UTIME_NOW;
    } else if (valid & FUSE_SET_ATTR_ATIME) {
      tv[0] = attr->st_atim;
    }
    if (valid & FUSE_SET_ATTR_MTIME_NOW) {
      tv[1].tv_nsec = UTIME_NOW;
    } else if (valid & FUSE_SET_ATTR_MTIME) {
      tv[1] = attr->st_mtim;
    }
    // Write-behind flushes would move mtime after we set it: land them first (and a `dnvme run`
    // client's: OpSetattr waited for those).
    if (S_ISREG(in.type)) DNVME_RETURN_IF_ERROR(in.data.Drain());
    int rc = fi ? futimens(Fh(fi).fd.get(), tv) : utimensat(AT_FDCWD, proc.c_str(), tv, 0);
    if (rc != 0) return Status::FromErrno(errno, "setting the times");
  }
  return Status::Ok();
}

void SetattrNow(fuse_req_t req, fuse_ino_t ino, struct stat* attr, int valid, fuse_file_info* fi) {
  Status st = ApplySetattr(req, FsOf(req).inodes().Get(ino), attr, valid, fi);
  if (!st.ok()) return ReplyStatus(req, st);
  OpGetattr(req, ino, fi);
}

Result<std::string> ReadLink(Inode& in) {
  char buf[PATH_MAX + 1];
  ssize_t n = readlinkat(in.fd, "", buf, sizeof(buf));
  if (n < 0) return Status::FromErrno(errno, "readlink");
  if (n >= static_cast<ssize_t>(sizeof(buf))) return Status::FromErrno(ENAMETOOLONG, "readlink");
  return std::string(buf, static_cast<size_t>(n));
}

}  // namespace

void OpReadlink(fuse_req_t req, fuse_ino_t ino) {
  if (RefuseVirtual(req, ino, EINVAL)) return;
  ReplyReadlink(req, ReadLink(FsOf(req).inodes().Get(ino)));
}

void OpMknod(fuse_req_t req, fuse_ino_t parent, const char* name, mode_t mode, dev_t rdev) {
  if (RefuseVirtualName(req, parent, name, IsHiddenName(parent, name) ? EEXIST : EPERM)) return;
  Inode& dir = FsOf(req).inodes().Get(parent);
  ActAsCaller as(req);
  if (Status st = as.status(); !st.ok()) return ReplyStatus(req, st);
  // A device node reaches us only from a caller that holds CAP_MKNOD (the kernel checks it in
  // vfs_mknod first), so the daemon may use its own, raised for this call alone (fs/caps.cc);
  // leaving the caller's identity puts the thread's effective set back without it.
  std::optional<Result<ScopedCapability>> mknod_cap;
  if (S_ISBLK(mode) || S_ISCHR(mode)) {
    mknod_cap.emplace(ScopedCapability::Raise(CAP_MKNOD));
    if (!mknod_cap->ok()) {
      DNVME_LOG_THROTTLED(info, "device mknod of '{}' refused: {}", LogEscape(name),
                          mknod_cap->status().ToString());
      return ReplyStatus(req, Status::FromErrno(EPERM, "device mknod"));
    }
  }
  if (Status st = SyscallStatus(mknodat(dir.fd, name, mode, rdev), "mknod"); !st.ok()) {
    return ReplyStatus(req, st);
  }
  mknod_cap.reset();
  ReplyEntry(req, parent, name);
}

void OpMkdir(fuse_req_t req, fuse_ino_t parent, const char* name, mode_t mode) {
  if (RefuseVirtualName(req, parent, name, IsHiddenName(parent, name) ? EEXIST : EPERM)) return;
  Inode& dir = FsOf(req).inodes().Get(parent);
  ActAsCaller as(req);
  if (Status st = as.status(); !st.ok()) return ReplyStatus(req, st);
  if (Status st = SyscallStatus(mkdirat(dir.fd, name, mode), "mkdir"); !st.ok()) {
    return ReplyStatus(req, st);
  }
  ReplyEntry(req, parent, name);
}

void OpSymlink(fuse_req_t req, const char* link, fuse_ino_t parent, const char* name) {
  if (RefuseVirtualName(req, parent, name, IsHiddenName(parent, name) ? EEXIST : EPERM)) return;
  Inode& dir = FsOf(req).inodes().Get(parent);
  ActAsCaller as(req);
  if (Status st = as.status(); !st.ok()) return ReplyStatus(req, st);
  if (Status st = SyscallStatus(symlinkat(link, dir.fd, name), "symlink"); !st.ok()) {
    return ReplyStatus(req, st);
  }
  ReplyEntry(req, parent, name);
}

void OpLink(fuse_req_t req, fuse_ino_t ino, fuse_ino_t newparent, const char* newname) {
  if (RefuseVirtual(req, ino, EPERM)) return;
  if (RefuseVirtualName(req, newparent, newname,
                        IsHiddenName(newparent, newname) ? EEXIST : EPERM)) {
    return;
  }
  Fs& fs = FsOf(req);
  Inode& in = fs.inodes().Get(ino);
  Inode& dir = fs.inodes().Get(newparent);
  Status linked;
  {
    // As the caller: the kernel's protected_hardlinks rule and the directory's permissions are
    // decided for it.
    ActAsCaller as(req);
    if (Status st = as.status(); !st.ok()) return ReplyStatus(req, st);
    linked = SyscallStatus(
        linkat(AT_FDCWD, ProcPath(in.fd).c_str(), dir.fd, newname, AT_SYMLINK_FOLLOW), "link");
  }
  // A symlink cannot be reached through /proc with AT_SYMLINK_FOLLOW; its own fd with
  // AT_EMPTY_PATH needs CAP_DAC_READ_SEARCH, which only the daemon's identity has. It is the
  // inode itself, never a name, so nothing can be swapped in.
  if (linked.error_number() == ENOENT && S_ISLNK(in.type)) {
    linked = SyscallStatus(linkat(in.fd, "", dir.fd, newname, AT_EMPTY_PATH), "link");
  }
  if (!linked.ok()) return ReplyStatus(req, linked);
  ReplyEntry(req, newparent, newname);
}

void OpUnlink(fuse_req_t req, fuse_ino_t parent, const char* name) {
  if (RefuseVirtualName(req, parent, name, EPERM)) return;
  Inode& dir = FsOf(req).inodes().Get(parent);
  ActAsCaller as(req);
  if (Status st = as.status(); !st.ok()) return ReplyStatus(req, st);
  ReplyStatus(req, SyscallStatus(unlinkat(dir.fd, name, 0), "unlink"));
}

void OpRmdir(fuse_req_t req, fuse_ino_t parent, const char* name) {
  if (RefuseVirtualName(req, parent, name, EPERM)) return;
  Inode& dir = FsOf(req).inodes().Get(parent);
  ActAsCaller as(req);
  if (Status st = as.status(); !st.ok()) return ReplyStatus(req, st);
  ReplyStatus(req, SyscallStatus(unlinkat(dir.fd, name, AT_REMOVEDIR), "rmdir"));
}

void OpRename(fuse_req_t req, fuse_ino_t parent, const char* name, fuse_ino_t newparent,
              const char* newname, unsigned int flags) {
  if (RefuseVirtualName(req, parent, name, EPERM) ||
      RefuseVirtualName(req, newparent, newname, EPERM)) {
    return;
  }
  Fs& fs = FsOf(req);
  Inode& a = fs.inodes().Get(parent);
  Inode& b = fs.inodes().Get(newparent);
  ActAsCaller as(req);
  if (Status st = as.status(); !st.ok()) return ReplyStatus(req, st);
  // RENAME_WHITEOUT makes a whiteout device node: the kernel let it through only for a caller
  // with CAP_MKNOD, so the daemon raises its own for this call, as for a device mknod.
  std::optional<Result<ScopedCapability>> mknod_cap;
  if (flags & RENAME_WHITEOUT) {
    mknod_cap.emplace(ScopedCapability::Raise(CAP_MKNOD));
    if (!mknod_cap->ok()) return ReplyStatus(req, Status::FromErrno(EPERM, "rename whiteout"));
  }
  ReplyStatus(req, SyscallStatus(renameat2(a.fd, name, b.fd, newname, flags), "rename"));
}

namespace {

Result<struct statvfs> StatFs(Inode& in) {
  struct statvfs sv {};
  if (fstatvfs(in.fd, &sv) != 0) return Status::FromErrno(errno, "statfs");
  return sv;
}

}  // namespace

void OpStatfs(fuse_req_t req, fuse_ino_t ino) {
  if (IsVirtual(ino)) ino = FUSE_ROOT_ID;
  ReplyStatfs(req, StatFs(FsOf(req).inodes().Get(ino)));
}

// xattrs go through /proc/self/fd paths: the *xattr calls do not take O_PATH fds. Symlinks
// cannot carry user xattrs on Linux anyway.
bool XattrCapable(Inode& in) { return !S_ISLNK(in.type); }

void OpSetxattr(fuse_req_t req, fuse_ino_t ino, const char* name, const char* value, size_t size,
                int flags) {
  if (RefuseVirtual(req, ino, ENOTSUP)) return;
  Inode& in = FsOf(req).inodes().Get(ino);
  if (!XattrCapable(in)) return ReplyStatus(req, Status::FromErrno(ENOTSUP, "setxattr"));
  // An access ACL is set as its caller: the backing filesystem then clears the set-group-ID bit
  // as ext4 does for a caller outside the file's group without CAP_FSETID (the kernel would ask
  // us to through FUSE_SETXATTR_ACL_KILL_SGID only with FUSE_CAP_SETXATTR_EXT, which libfuse
  // 3.14 cannot ask for). The kernel has checked already that the caller may set it (the owner,
  // or CAP_FOWNER).
  std::optional<ActAsCaller> as;
  if (std::strcmp(name, "system.posix_acl_access") == 0) {
    as.emplace(req);
    if (Status st = as->status(); !st.ok()) return ReplyStatus(req, st);
  }
  ReplyStatus(
      req, SyscallStatus(setxattr(ProcPath(in.fd).c_str(), name, value, size, flags), "setxattr"));
}

namespace {

// getxattr and listxattr answer alike: size 0 asks for the length, otherwise for the bytes.
// `call(buf, size)` is the syscall, returning a length or -1 with errno.
template <typename Call>
void AnswerXattr(fuse_req_t req, size_t size, const char* what, Call call) {
  std::string buf(size, '\0');
  const ssize_t n = call(size ? buf.data() : nullptr, size);
  ReplyXattr(req, size,
             n < 0 ? Result<size_t>(Status::FromErrno(errno, what))
                   : Result<size_t>(static_cast<size_t>(n)),
             buf.data());
}

}  // namespace

void OpGetxattr(fuse_req_t req, fuse_ino_t ino, const char* name, size_t size) {
  if (RefuseVirtual(req, ino, ENODATA)) return;
  Inode& in = FsOf(req).inodes().Get(ino);
  if (!XattrCapable(in)) return ReplyStatus(req, Status::FromErrno(ENODATA, "getxattr"));
  const std::string p = ProcPath(in.fd);
  AnswerXattr(req, size, "getxattr",
              [&](char* b, size_t n) { return getxattr(p.c_str(), name, b, n); });
}

void OpListxattr(fuse_req_t req, fuse_ino_t ino, size_t size) {
  Inode& in = FsOf(req).inodes().Get(ino);
  if (!XattrCapable(in) || IsVirtual(ino)) {  // no names; answered the same way
    AnswerXattr(req, size, "listxattr", [](char*, size_t) { return ssize_t{0}; });
    return;
  }
  const std::string p = ProcPath(in.fd);
  AnswerXattr(req, size, "listxattr",
              [&](char* b, size_t n) { return listxattr(p.c_str(), b, n); });
}

void OpRemovexattr(fuse_req_t req, fuse_ino_t ino, const char* name) {
  if (RefuseVirtual(req, ino, ENOTSUP)) return;
  Inode& in = FsOf(req).inodes().Get(ino);
  if (!XattrCapable(in)) return ReplyStatus(req, Status::FromErrno(ENOTSUP, "removexattr"));
  ReplyStatus(req, SyscallStatus(removexattr(ProcPath(in.fd).c_str(), name), "removexattr"));
}

}  // namespace dnvme::fs::ops
