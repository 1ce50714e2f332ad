// FUSE ops on names and attributes: lookup, forget, getattr/setattr, the creates (mknod, mkdir,
// symlink, link), unlink, rmdir, rename, statfs and the xattrs. Each acts on the O_PATH fds the
// inodes hold and answers exactly once; Status/errno become the reply here.
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

#include "engine/common/log.h"
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
  fuse_reply_none(req);
}

void OpForgetMulti(fuse_req_t req, size_t count, fuse_forget_data* forgets) {
  for (size_t i = 0; i < count; ++i) FsOf(req).inodes().Forget(forgets[i].ino, forgets[i].nlookup);
  fuse_reply_none(req);
}

void OpGetattr(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  (void)fi;
  if (auto v = VirtualGetattr(ino)) return ReplyAttr(req, *v, kVirtualTimeout);
  Fs& fs = FsOf(req);
  struct stat st {};
  int err = StatInode(fs.inodes().Get(ino), &st);
  if (err) {
    fuse_reply_err(req, err);
  } else {
    // Uncached while a `dnvme run` client may change the size around the mount.
    fuse_reply_attr(req, &st, fs.inodes().Get(ino).leases.count() > 0 ? 0.0 : kTimeout);
  }
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
int TruncateNoWait(Inode& in, off_t size) {
  UniqueFd fd(ReopenNoWait(in.fd, O_WRONLY | O_CLOEXEC | O_NOCTTY));
  if (!fd.valid()) return errno;
  return ftruncate(fd.get(), size) == 0 ? 0 : errno;
}

void SetattrNow(fuse_req_t req, fuse_ino_t ino, struct stat* attr, int valid, fuse_file_info* fi) {
  Fs& fs = FsOf(req);
  Inode& in = fs.inodes().Get(ino);
  const std::string proc = ProcPath(in.fd);
  int err = 0;
  if (valid & FUSE_SET_ATTR_MODE) {
    int rc = fi ? fchmod(Fh(fi).fd.get(), attr->st_mode) : chmod(proc.c_str(), attr->st_mode);
    if (rc != 0) err = errno;
  }
  if (!err && (valid & (FUSE_SET_ATTR_UID | FUSE_SET_ATTR_GID))) {
    uid_t uid = (valid & FUSE_SET_ATTR_UID) ? attr->st_uid : static_cast<uid_t>(-1);
    gid_t gid = (valid & FUSE_SET_ATTR_GID) ? attr->st_gid : static_cast<gid_t>(-1);
    if (fchownat(in.fd, "", uid, gid, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW) != 0) err = errno;
  }
  if (!err && (valid & FUSE_SET_ATTR_SIZE)) {
    // A truncate by a user clears set-user-ID/set-group-ID as a write does. The kernel sent the
    // mode it cleared already (applied above) but not the rest of ext4's rule (KillPrivs).
    if (fuse_req_ctx(req)->uid != 0) err = KillPrivs(req, in);
    // Pending write-behind data -- the mount's, and a `dnvme run` client's (OpSetattr waited
    // for those) -- must not land after (and undo) the truncation.
    if (!err) err = in.wb.Drain(nullptr).ErrnoOr();
    in.ra.Invalidate();
    if (!err)
      err = fi ? (ftruncate(Fh(fi).fd.get(), attr->st_size) == 0 ? 0 : errno)
               : TruncateNoWait(in, attr->st_size);
    in.ra.Invalidate();  // after the change too (datapath/read_ahead.h, Generation)
  }
  if (!err && (valid & (FUSE_SET_ATTR_ATIME | FUSE_SET_ATTR_MTIME))) {
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
    if (S_ISREG(in.type)) err = in.wb.Drain(nullptr).ErrnoOr();
    if (!err) {
      int rc = fi ? futimens(Fh(fi).fd.get(), tv) : utimensat(AT_FDCWD, proc.c_str(), tv, 0);
      if (rc != 0) err = errno;
    }
  }
  if (err) {
    fuse_reply_err(req, err);
    return;
  }
  OpGetattr(req, ino, fi);
}

}  // namespace

void OpReadlink(fuse_req_t req, fuse_ino_t ino) {
  if (RefuseVirtual(req, ino, EINVAL)) return;
  Inode& in = FsOf(req).inodes().Get(ino);
  char buf[PATH_MAX + 1];
  ssize_t n = readlinkat(in.fd, "", buf, sizeof(buf));
  if (n < 0) {
    fuse_reply_err(req, errno);
  } else if (n >= static_cast<ssize_t>(sizeof(buf))) {
    fuse_reply_err(req, ENAMETOOLONG);
  } else {
    buf[n] = '\0';
    fuse_reply_readlink(req, buf);
  }
}

void OpMknod(fuse_req_t req, fuse_ino_t parent, const char* name, mode_t mode, dev_t rdev) {
  if (RefuseVirtualName(req, parent, name, IsHiddenName(parent, name) ? EEXIST : EPERM)) return;
  Inode& dir = FsOf(req).inodes().Get(parent);
  ActAsCaller as(req);
  if (as.error()) return (void)fuse_reply_err(req, as.error());
  // A device node reaches us only from a caller that holds CAP_MKNOD (the kernel checks it in
  // vfs_mknod first), so the daemon may use its own, raised for this call alone (fs/caps.cc);
  // leaving the caller's identity puts the thread's effective set back without it.
  std::optional<Result<ScopedCapability>> mknod_cap;
  if (S_ISBLK(mode) || S_ISCHR(mode)) {
    mknod_cap.emplace(ScopedCapability::Raise(CAP_MKNOD));
    if (!mknod_cap->ok()) {
      Logger().info("device mknod of '{}' refused: {}", LogEscape(name),
                    mknod_cap->status().ToString());
      fuse_reply_err(req, EPERM);
      return;
    }
  }
  if (mknodat(dir.fd, name, mode, rdev) != 0) return (void)fuse_reply_err(req, errno);
  mknod_cap.reset();
  ReplyEntry(req, parent, name);
}

void OpMkdir(fuse_req_t req, fuse_ino_t parent, const char* name, mode_t mode) {
  if (RefuseVirtualName(req, parent, name, IsHiddenName(parent, name) ? EEXIST : EPERM)) return;
  Inode& dir = FsOf(req).inodes().Get(parent);
  ActAsCaller as(req);
  if (as.error()) return (void)fuse_reply_err(req, as.error());
  if (mkdirat(dir.fd, name, mode) != 0) return (void)fuse_reply_err(req, errno);
  ReplyEntry(req, parent, name);
}

void OpSymlink(fuse_req_t req, const char* link, fuse_ino_t parent, const char* name) {
  if (RefuseVirtualName(req, parent, name, IsHiddenName(parent, name) ? EEXIST : EPERM)) return;
  Inode& dir = FsOf(req).inodes().Get(parent);
  ActAsCaller as(req);
  if (as.error()) return (void)fuse_reply_err(req, as.error());
  if (symlinkat(link, dir.fd, name) != 0) return (void)fuse_reply_err(req, errno);
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
  int rc;
  {
    // As the caller: the kernel's protected_hardlinks rule and the directory's permissions are
    // decided for it.
    ActAsCaller as(req);
    if (as.error()) return (void)fuse_reply_err(req, as.error());
    rc = linkat(AT_FDCWD, ProcPath(in.fd).c_str(), dir.fd, newname, AT_SYMLINK_FOLLOW);
  }
  // A symlink cannot be reached through /proc with AT_SYMLINK_FOLLOW; its own fd with
  // AT_EMPTY_PATH needs CAP_DAC_READ_SEARCH, which only the daemon's identity has. It is the
  // inode itself, never a name, so nothing can be swapped in.
  if (rc != 0 && errno == ENOENT && S_ISLNK(in.type))
    rc = linkat(in.fd, "", dir.fd, newname, AT_EMPTY_PATH);
  if (rc != 0) return (void)fuse_reply_err(req, errno);
  ReplyEntry(req, newparent, newname);
}

void OpUnlink(fuse_req_t req, fuse_ino_t parent, const char* name) {
  if (RefuseVirtualName(req, parent, name, EPERM)) return;
  Inode& dir = FsOf(req).inodes().Get(parent);
  ActAsCaller as(req);
  if (as.error()) return (void)fuse_reply_err(req, as.error());
  fuse_reply_err(req, unlinkat(dir.fd, name, 0) == 0 ? 0 : errno);
}

void OpRmdir(fuse_req_t req, fuse_ino_t parent, const char* name) {
  if (RefuseVirtualName(req, parent, name, EPERM)) return;
  Inode& dir = FsOf(req).inodes().Get(parent);
  ActAsCaller as(req);
  if (as.error()) return (void)fuse_reply_err(req, as.error());
  fuse_reply_err(req, unlinkat(dir.fd, name, AT_REMOVEDIR) == 0 ? 0 : errno);
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
  if (as.error()) return (void)fuse_reply_err(req, as.error());
  // RENAME_WHITEOUT makes a whiteout device node: the kernel let it through only for a caller
  // with CAP_MKNOD, so the daemon raises its own for this call, as for a device mknod.
  std::optional<Result<ScopedCapability>> mknod_cap;
  if (flags & RENAME_WHITEOUT) {
    mknod_cap.emplace(ScopedCapability::Raise(CAP_MKNOD));
    if (!mknod_cap->ok()) return (void)fuse_reply_err(req, EPERM);
  }
  int rc = renameat2(a.fd, name, b.fd, newname, flags);
  fuse_reply_err(req, rc == 0 ? 0 : errno);
}

void OpStatfs(fuse_req_t req, fuse_ino_t ino) {
  struct statvfs sv {};
  if (IsVirtual(ino)) ino = FUSE_ROOT_ID;
  if (fstatvfs(FsOf(req).inodes().Get(ino).fd, &sv) != 0) {
    fuse_reply_err(req, errno);
  } else {
    fuse_reply_statfs(req, &sv);
  }
}

// xattrs go through /proc/self/fd paths: the *xattr calls do not take O_PATH fds. Symlinks
// cannot carry user xattrs on Linux anyway.
bool XattrCapable(Inode& in) { return !S_ISLNK(in.type); }

void OpSetxattr(fuse_req_t req, fuse_ino_t ino, const char* name, const char* value, size_t size,
                int flags) {
  if (RefuseVirtual(req, ino, ENOTSUP)) return;
  Inode& in = FsOf(req).inodes().Get(ino);
  if (!XattrCapable(in)) {
    fuse_reply_err(req, ENOTSUP);
    return;
  }
  int rc = setxattr(ProcPath(in.fd).c_str(), name, value, size, flags);
  fuse_reply_err(req, rc == 0 ? 0 : errno);
}

// getxattr and listxattr answer alike: size 0 asks for the length, otherwise for the bytes.
// `call(buf, size)` is the syscall, returning a length or -1 with errno.
template <typename Call>
void ReplyXattr(fuse_req_t req, size_t size, Call call) {
  std::string buf(size, '\0');
  ssize_t n = call(size ? buf.data() : nullptr, size);
  if (n < 0) {
    fuse_reply_err(req, errno);
  } else if (size == 0) {
    fuse_reply_xattr(req, static_cast<size_t>(n));
  } else {
    fuse_reply_buf(req, buf.data(), static_cast<size_t>(n));
  }
}

void OpGetxattr(fuse_req_t req, fuse_ino_t ino, const char* name, size_t size) {
  if (RefuseVirtual(req, ino, ENODATA)) return;
  Inode& in = FsOf(req).inodes().Get(ino);
  if (!XattrCapable(in)) {
    fuse_reply_err(req, ENODATA);
    return;
  }
  const std::string p = ProcPath(in.fd);
  ReplyXattr(req, size, [&](char* b, size_t n) { return getxattr(p.c_str(), name, b, n); });
}

void OpListxattr(fuse_req_t req, fuse_ino_t ino, size_t size) {
  Inode& in = FsOf(req).inodes().Get(ino);
  if (!XattrCapable(in) || IsVirtual(ino)) {  // no names; answered the same way
    ReplyXattr(req, size, [](char*, size_t) { return ssize_t{0}; });
    return;
  }
  const std::string p = ProcPath(in.fd);
  ReplyXattr(req, size, [&](char* b, size_t n) { return listxattr(p.c_str(), b, n); });
}

void OpRemovexattr(fuse_req_t req, fuse_ino_t ino, const char* name) {
  if (RefuseVirtual(req, ino, ENOTSUP)) return;
  Inode& in = FsOf(req).inodes().Get(ino);
  if (!XattrCapable(in)) {
    fuse_reply_err(req, ENOTSUP);
    return;
  }
  int rc = removexattr(ProcPath(in.fd).c_str(), name);
  fuse_reply_err(req, rc == 0 ? 0 : errno);
}

}  // namespace dnvme::fs::ops
