// The FUSE low-level operations of dnvmefs: a passthrough of BACKING_DIR in which file data goes
// through the engine (fs/data_path.cc). Metadata calls act on O_PATH fds held by the inodes.
//
// Error boundary: inside, failures are errnos from syscalls or Status from the engine; they leave
// through Reply*/fuse_reply_err only here. Every request gets exactly one reply.
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
#include "fs/fs.h"
#include "fs/fuse_status.h"
#include "fs/virtual.h"

namespace dnvme::fs {
namespace {

constexpr double kTimeout = 1.0;  // attr/entry cache: the backing dir changes only through us

Fs& FsOf(fuse_req_t req) { return *static_cast<Fs*>(fuse_req_userdata(req)); }

std::string ProcPath(int fd) { return "/proc/self/fd/" + std::to_string(fd); }

FileHandle& Fh(fuse_file_info* fi) { return *reinterpret_cast<FileHandle*>(fi->fh); }

// FUSE_CAP_DONT_MASK (asked for in init) makes the kernel send create/mkdir/mknod modes without
// the caller's umask and the umask beside them (fuse_ctx::umask). The backing create then runs
// under the caller's umask, so ext4 applies it exactly as for the caller -- or, where the parent
// has a default ACL, ignores it and applies the ACL, as it does for a local process. The umask is
// set on this thread alone: each FUSE thread gets its own fs_struct (unshare(CLONE_FS)) the first
// time it creates something. Restored when the scope ends.
class CallerUmask {
 public:
  explicit CallerUmask(fuse_req_t req) {
    thread_local const int unshared = unshare(CLONE_FS) == 0 ? 0 : errno;
    err_ = unshared;
    if (err_ == 0) saved_ = umask(fuse_req_ctx(req)->umask);
  }
  ~CallerUmask() {
    if (err_ == 0) umask(saved_);
  }
  CallerUmask(const CallerUmask&) = delete;
  CallerUmask& operator=(const CallerUmask&) = delete;
  // 0, or why this thread could not get a umask of its own: the create must then fail rather
  // than run under the daemon's umask, which is not the caller's.
  int error() const { return err_; }

 private:
  int err_ = 0;
  mode_t saved_ = 0;
};

// Gives the object just created (and looked up into `e`) to the caller: the daemon runs as root
// for many users and creates everything as root. Acts on the inode's own fd, not the name, which
// another request may already have renamed. Under a set-group-ID directory the group stays the
// directory's, as the backing fs chose it. chown(2) clears set-user-ID (and set-group-ID with
// group execute) even for root, but on ext4 the creator's own file keeps the mode it was created
// with, so that mode is put back. Refreshes e->attr. Returns an errno.
int GiveToCaller(fuse_req_t req, Fs& fs, Inode& parent, fuse_entry_param* e) {
  if (geteuid() != 0) return 0;  // an unprivileged daemon: everything belongs to its user anyway
  const fuse_ctx* ctx = fuse_req_ctx(req);
  struct stat dir {};
  if (fstatat(parent.fd, "", &dir, AT_EMPTY_PATH) != 0) return errno;
  const uid_t uid = ctx->uid == e->attr.st_uid ? static_cast<uid_t>(-1) : ctx->uid;
  const gid_t gid = (dir.st_mode & S_ISGID) || ctx->gid == e->attr.st_gid
                        ? static_cast<gid_t>(-1)  // setgid directory: the group it chose stays
                        : ctx->gid;
  if (uid == static_cast<uid_t>(-1) && gid == static_cast<gid_t>(-1)) return 0;
  Inode& in = fs.GetInode(e->ino);
  if (fchownat(in.fd, "", uid, gid, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW) != 0) return errno;
  const mode_t created = e->attr.st_mode;
  if (fstatat(in.fd, "", &e->attr, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW) != 0) return errno;
  if (e->attr.st_mode != created && !S_ISLNK(created)) {
    if (chmod(ProcPath(in.fd).c_str(), created & 07777) != 0) return errno;
    e->attr.st_mode = created;
  }
  return 0;
}

// Replies to a create-like request (mknod, mkdir, symlink) whose object `name` was just made in
// `parent`: looks it up, hands it to the caller and answers with its entry. When the hand-over
// fails the object is removed again (`rmflags` for unlinkat): ext4 would not have made it.
void ReplyCreated(fuse_req_t req, fuse_ino_t parent, const char* name, int rmflags) {
  Fs& fs = FsOf(req);
  fuse_entry_param e{};
  int err = fs.DoLookup(parent, name, &e);
  if (err) {  // gone or replaced already: nothing of ours to clean up
    fuse_reply_err(req, err);
    return;
  }
  const dev_t dev = e.attr.st_dev;
  const ino_t ino = e.attr.st_ino;
  err = GiveToCaller(req, fs, fs.GetInode(parent), &e);
  if (err) {
    fs.Forget(e.ino, 1);
    // Remove it only while the name still means the object we made.
    struct stat now {};
    Inode& dir = fs.GetInode(parent);
    if (fstatat(dir.fd, name, &now, AT_SYMLINK_NOFOLLOW) == 0 && now.st_dev == dev &&
        now.st_ino == ino && unlinkat(dir.fd, name, rmflags) != 0) {
      Logger().warn("removing '{}' after a failed create: {}", name, std::strerror(errno));
    }
    fuse_reply_err(req, err);
    return;
  }
  fuse_reply_entry(req, &e);
}

void ReplyEntry(fuse_req_t req, fuse_ino_t parent, const char* name) {
  fuse_entry_param e{};
  int err = FsOf(req).DoLookup(parent, name, &e);
  if (err) {
    fuse_reply_err(req, err);
  } else {
    fuse_reply_entry(req, &e);
  }
}

int StatInode(Inode& in, struct stat* st) {
  if (fstatat(in.fd, "", st, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW) != 0) return errno;
  // Data accepted by write-behind counts, though the backing file has not seen it yet.
  if (S_ISREG(st->st_mode)) in.wb.ApplyPending(st);
  return 0;
}

// True when `gid` is the caller's group or one of its supplementary groups. A caller whose groups
// cannot be read counts as outside the group: the bit it decides then goes, which is the safe side.
bool CallerInGroup(fuse_req_t req, gid_t gid) {
  if (fuse_req_ctx(req)->gid == gid) return true;
  std::vector<gid_t> groups(64);
  int n = fuse_req_getgroups(req, static_cast<int>(groups.size()), groups.data());
  if (n > static_cast<int>(groups.size())) {
    groups.resize(static_cast<size_t>(n));
    n = fuse_req_getgroups(req, n, groups.data());
  }
  if (n < 0) return false;
  groups.resize(std::min(groups.size(), static_cast<size_t>(n)));
  return std::find(groups.begin(), groups.end(), gid) != groups.end();
}

// What a write or truncate by a process without CAP_FSETID clears on ext4
// (setattr_should_drop_suidgid): set-user-ID always; set-group-ID when group execute is set, or
// when the writer is not in the file's group. Applies it to the inode. Returns an errno.
//
// The FUSE kernel does part of this itself -- set-user-ID, and set-group-ID with group execute,
// as a SETATTR before a page-cache write or with a truncate -- but never the third case, and
// leaves all of it to us for a direct write (which only carries FUSE_WRITE_KILL_SUIDGID).
int KillPrivs(fuse_req_t req, Inode& in) {
  struct stat st {};
  if (fstatat(in.fd, "", &st, AT_EMPTY_PATH) != 0) return errno;
  if ((st.st_mode & (S_ISUID | S_ISGID)) == 0) return 0;
  mode_t kill = st.st_mode & S_ISUID;
  if ((st.st_mode & S_ISGID) && ((st.st_mode & S_IXGRP) || !CallerInGroup(req, st.st_gid))) {
    kill |= S_ISGID;
  }
  if (kill == 0) return 0;
  return chmod(ProcPath(in.fd).c_str(), st.st_mode & 07777 & ~kill) == 0 ? 0 : errno;
}

// Whether a WRITE comes from a process without CAP_FSETID. A direct write (an O_DIRECT client, a
// direct_io open) says so exactly with FUSE_WRITE_KILL_SUIDGID. A page-cache write never carries
// it (the kernel sets it only with FUSE_HANDLE_KILLPRIV_V2, which libfuse 3.14 cannot ask for),
// and neither does any write under libfuse's own loop (clone_fd=1, which does not pass the flags
// on): there the caller counts as privileged exactly when it is root.
bool WriterUnprivileged(fuse_req_t req, const FileHandle& fh) {
  const std::optional<uint32_t> flags = CurrentWriteFlags();
  if (flags && !fh.page_cache_writes) return (*flags & FUSE_WRITE_KILL_SUIDGID) != 0;
  return fuse_req_ctx(req)->uid != 0;
}

// The kernel reads ahead at most the FUSE bdi's read_ahead_kb (128 KiB by default, whatever
// max_readahead says), in requests of at most 1 MiB. Raising it lets a sequential reader's
// requests reach us many at a time. Found through /proc/self/mountinfo, not stat(): a stat of
// our own mountpoint from inside init would wait for ourselves.
void RaiseKernelReadAhead(const std::string& mountpoint, int64_t bytes) {
  FILE* f = std::fopen("/proc/self/mountinfo", "r");
  if (f == nullptr) return;
  char line[4096];
  std::string dev;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    char majmin[64], mnt[2048];
    if (std::sscanf(line, "%*s %*s %63s %*s %2047s", majmin, mnt) == 2 && mountpoint == mnt) {
      dev = majmin;  // the last match is the newest mount
    }
  }
  std::fclose(f);
  if (dev.empty()) return;
  const std::string path = "/sys/class/bdi/" + dev + "/read_ahead_kb";
  FILE* ra = std::fopen(path.c_str(), "w");
  if (ra == nullptr) {
    Logger().info("kernel read-ahead left as is ({}: {})", path, std::strerror(errno));
    return;
  }
  std::fprintf(ra, "%lld\n", static_cast<long long>(bytes / 1024));
  if (std::fclose(ra) != 0) {
    Logger().info("kernel read-ahead left as is ({}: {})", path, std::strerror(errno));
  } else {
    Logger().info("kernel read-ahead for the mount set to {} KiB", bytes / 1024);
  }
}

void OpInit(void* userdata, fuse_conn_info* conn) {
  Fs& fs = *static_cast<Fs*>(userdata);
  // Measured on the reference VM (docs/performance-journal.md): 512 KiB-1 MiB is best, 4 MiB and
  // more lose to the daemon's own read-ahead (the kernel then floods us with parallel requests).
  if (fs.opts().read_ahead > 0) RaiseKernelReadAhead(fs.opts().mountpoint, 1 << 20);
  // 1 MiB requests (libfuse 3.14's buffer limit), parallel reads, async direct I/O so a libaio
  // client's requests reach us concurrently, splice where the kernel offers it.
  conn->max_write = kMaxFuseRequestBytes;
  conn->max_readahead = 1 << 20;
  if (conn->capable & FUSE_CAP_ASYNC_READ) conn->want |= FUSE_CAP_ASYNC_READ;
  if (conn->capable & FUSE_CAP_ASYNC_DIO) conn->want |= FUSE_CAP_ASYNC_DIO;
  if (conn->capable & FUSE_CAP_PARALLEL_DIROPS) conn->want |= FUSE_CAP_PARALLEL_DIROPS;
  // open(O_TRUNC) as a separate SETATTR: only then does the kernel clear set-user-ID/set-group-ID
  // for an opener without CAP_FSETID, as ext4 does (with atomic O_TRUNC it leaves that to a
  // daemon that is told who may keep them only under FUSE_HANDLE_KILLPRIV_V2). One extra round
  // trip per truncating open.
  conn->want &= ~static_cast<unsigned>(FUSE_CAP_ATOMIC_O_TRUNC);
  if (conn->capable & FUSE_CAP_SPLICE_WRITE) conn->want |= FUSE_CAP_SPLICE_WRITE;
  if (conn->capable & FUSE_CAP_SPLICE_MOVE) conn->want |= FUSE_CAP_SPLICE_MOVE;
  // FUSE_CAP_SPLICE_READ stays off: it only steers libfuse's own receive, which our session
  // loop replaces (fs/session_loop.h); with clone_fd's libfuse loop it would fall back to read(2)
  // anyway once CAP_SYS_RESOURCE is gone.
  if (conn->capable & FUSE_CAP_AUTO_INVAL_DATA) conn->want |= FUSE_CAP_AUTO_INVAL_DATA;
  // The caller's umask comes with each create and is applied by the backing fs (CallerUmask),
  // which also lets a parent's default ACL take its place as on ext4.
  if (conn->capable & FUSE_CAP_DONT_MASK) conn->want |= FUSE_CAP_DONT_MASK;
  // POSIX ACLs enforced as on ext4: the kernel reads them (system.posix_acl_* through getxattr),
  // caches them and checks them with default_permissions. The backing ext4 does the rest: it keeps
  // mode and ACL in step on chmod and setxattr, and inherits default ACLs on create.
  if (conn->capable & FUSE_CAP_POSIX_ACL) conn->want |= FUSE_CAP_POSIX_ACL;
  // Locks stay in the kernel (flock and POSIX locks are local to this mount: correct for every
  // process on this machine). Writeback caching stays off: write-behind happens in the daemon,
  // into pinned buffers, where errors can be tracked per inode.
  conn->want &= ~static_cast<unsigned>(FUSE_CAP_WRITEBACK_CACHE);
  if (conn->max_background < 64) conn->max_background = 64;
  if (conn->congestion_threshold < 48) conn->congestion_threshold = 48;
  // Connection options given with -o (max_background=, max_read=, ...) win over our defaults.
  if (fs.conn_opts() != nullptr) fuse_apply_conn_info_opts(fs.conn_opts(), conn);
}

void OpDestroy(void* userdata) { static_cast<Fs*>(userdata)->DrainAll(); }

void OpLookup(fuse_req_t req, fuse_ino_t parent, const char* name) {
  if (VirtualLookup(req, parent, name)) return;
  ReplyEntry(req, parent, name);
}

void OpForget(fuse_req_t req, fuse_ino_t ino, uint64_t nlookup) {
  FsOf(req).Forget(ino, nlookup);
  fuse_reply_none(req);
}

void OpForgetMulti(fuse_req_t req, size_t count, fuse_forget_data* forgets) {
  for (size_t i = 0; i < count; ++i) FsOf(req).Forget(forgets[i].ino, forgets[i].nlookup);
  fuse_reply_none(req);
}

void OpGetattr(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  (void)fi;
  if (VirtualGetattr(req, ino)) return;
  Fs& fs = FsOf(req);
  struct stat st {};
  int err = StatInode(fs.GetInode(ino), &st);
  if (err) {
    fuse_reply_err(req, err);
  } else {
    fuse_reply_attr(req, &st, kTimeout);
  }
}

void OpSetattr(fuse_req_t req, fuse_ino_t ino, struct stat* attr, int valid, fuse_file_info* fi) {
  if (VirtualSetattr(req, ino, attr, valid)) return;
  Fs& fs = FsOf(req);
  Inode& in = fs.GetInode(ino);
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
    // Pending write-behind data must not land after (and undo) the truncation.
    if (!err) err = ErrnoOf(in.wb.Drain(/*take_error=*/false));
    in.ra.Invalidate();
    if (!err) {
      int rc =
          fi ? ftruncate(Fh(fi).fd.get(), attr->st_size) : truncate(proc.c_str(), attr->st_size);
      if (rc != 0) err = errno;
    }
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
    // Write-behind flushes would move mtime after we set it: land them first.
    if (S_ISREG(in.type)) err = ErrnoOf(in.wb.Drain(/*take_error=*/false));
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

void OpReadlink(fuse_req_t req, fuse_ino_t ino) {
  if (RefuseVirtual(req, ino, EINVAL)) return;
  Inode& in = FsOf(req).GetInode(ino);
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
  Inode& dir = FsOf(req).GetInode(parent);
  // A device node reaches us only from a caller that holds CAP_MKNOD (the kernel checks it in
  // vfs_mknod first), so the daemon may use its own, raised for this call alone (fs/caps.cc).
  std::optional<Result<ScopedCapability>> mknod_cap;
  if (S_ISBLK(mode) || S_ISCHR(mode)) {
    mknod_cap.emplace(ScopedCapability::Raise(CAP_MKNOD));
    if (!mknod_cap->ok()) {
      Logger().info("device mknod of '{}' refused: {}", name, mknod_cap->status().ToString());
      fuse_reply_err(req, EPERM);
      return;
    }
  }
  CallerUmask mask(req);
  if (mask.error() || mknodat(dir.fd, name, mode, rdev) != 0) {
    fuse_reply_err(req, mask.error() ? mask.error() : errno);
    return;
  }
  mknod_cap.reset();
  ReplyCreated(req, parent, name, 0);
}

void OpMkdir(fuse_req_t req, fuse_ino_t parent, const char* name, mode_t mode) {
  if (RefuseVirtualName(req, parent, name, IsHiddenName(parent, name) ? EEXIST : EPERM)) return;
  Inode& dir = FsOf(req).GetInode(parent);
  CallerUmask mask(req);
  if (mask.error() || mkdirat(dir.fd, name, mode) != 0) {
    fuse_reply_err(req, mask.error() ? mask.error() : errno);
    return;
  }
  ReplyCreated(req, parent, name, AT_REMOVEDIR);
}

void OpSymlink(fuse_req_t req, const char* link, fuse_ino_t parent, const char* name) {
  if (RefuseVirtualName(req, parent, name, IsHiddenName(parent, name) ? EEXIST : EPERM)) return;
  Inode& dir = FsOf(req).GetInode(parent);
  if (symlinkat(link, dir.fd, name) != 0) {
    fuse_reply_err(req, errno);
    return;
  }
  ReplyCreated(req, parent, name, 0);
}

void OpLink(fuse_req_t req, fuse_ino_t ino, fuse_ino_t newparent, const char* newname) {
  if (RefuseVirtual(req, ino, EPERM)) return;
  if (RefuseVirtualName(req, newparent, newname,
                        IsHiddenName(newparent, newname) ? EEXIST : EPERM)) {
    return;
  }
  Fs& fs = FsOf(req);
  Inode& in = fs.GetInode(ino);
  Inode& dir = fs.GetInode(newparent);
  if (linkat(AT_FDCWD, ProcPath(in.fd).c_str(), dir.fd, newname, AT_SYMLINK_FOLLOW) != 0) {
    // Symlinks cannot be reached through /proc with AT_SYMLINK_FOLLOW; use the empty path form.
    if (errno != ENOENT || linkat(in.fd, "", dir.fd, newname, AT_EMPTY_PATH) != 0) {
      fuse_reply_err(req, errno);
      return;
    }
  }
  ReplyEntry(req, newparent, newname);
}

void OpUnlink(fuse_req_t req, fuse_ino_t parent, const char* name) {
  if (RefuseVirtualName(req, parent, name, EPERM)) return;
  Inode& dir = FsOf(req).GetInode(parent);
  fuse_reply_err(req, unlinkat(dir.fd, name, 0) == 0 ? 0 : errno);
}

void OpRmdir(fuse_req_t req, fuse_ino_t parent, const char* name) {
  if (RefuseVirtualName(req, parent, name, EPERM)) return;
  Inode& dir = FsOf(req).GetInode(parent);
  fuse_reply_err(req, unlinkat(dir.fd, name, AT_REMOVEDIR) == 0 ? 0 : errno);
}

void OpRename(fuse_req_t req, fuse_ino_t parent, const char* name, fuse_ino_t newparent,
              const char* newname, unsigned int flags) {
  if (RefuseVirtualName(req, parent, name, EPERM) ||
      RefuseVirtualName(req, newparent, newname, EPERM)) {
    return;
  }
  Fs& fs = FsOf(req);
  Inode& a = fs.GetInode(parent);
  Inode& b = fs.GetInode(newparent);
  int rc = renameat2(a.fd, name, b.fd, newname, flags);
  fuse_reply_err(req, rc == 0 ? 0 : errno);
}

// Opens the backing object of `in` with the client's flags, minus those the engine handles
// itself (O_DIRECT: the engine decides per request; O_APPEND: the kernel already turned it into
// offsets) and those that only make sense at create time.
int OpenBacking(Inode& in, int flags, UniqueFd* out) {
  const int strip = O_DIRECT | O_APPEND | O_CREAT | O_EXCL | O_NOCTTY;
  int fd = open(ProcPath(in.fd).c_str(), (flags & ~strip) | O_CLOEXEC);
  if (fd < 0) return errno;
  out->Reset(fd);
  return 0;
}

int MakeHandle(Fs& fs, Inode& in, int flags, UniqueFd fd, FileHandle** out) {
  auto fh = std::make_unique<FileHandle>();
  fh->inode = &in;
  fh->client_direct = (flags & O_DIRECT) != 0;
  const int acc = flags & O_ACCMODE;
  fh->writable = acc != O_RDONLY;
  if (S_ISREG(in.type)) {
    FileAccess access = acc == O_RDONLY   ? FileAccess::kRead
                        : acc == O_WRONLY ? FileAccess::kWrite
                                          : FileAccess::kReadWrite;
    auto ref = fs.Engine()->adopt_fd(fd.get(), access);
    if (!ref.ok()) {
      Logger().warn("engine open of inode {} failed: {}", in.ino, ref.status().ToString());
      return ref.status().error_number() ? ref.status().error_number() : EIO;
    }
    fh->file = std::move(ref).value();
  }
  fh->fd = std::move(fd);
  *out = fh.release();
  fs.Track(*out);
  return 0;
}

void FillOpenFlags(const Fs& fs, fuse_file_info* fi, FileHandle* fh) {
  fi->keep_cache = 0;  // the page cache of this file may be stale after a truncate elsewhere
  // A write-only open (a checkpoint writer) reads nothing back. When requests are spliced, its
  // writes through the page cache cost the daemon no copy at all (fs/splice_io.h): keep
  // the page cache. Otherwise every byte would be copied into the page cache, out of it into
  // the daemon, and into a chunk: direct_io saves the first of those. Measured with dd bs=1M
  // (docs/performance-journal.md): same GiB/s either way when spliced, a quarter of the daemon CPU.
  fi->direct_io = (fi->flags & O_ACCMODE) == O_WRONLY && !fs.SplicesWrites() ? 1 : 0;
  fi->noflush = 0;
  // Otherwise the kernel copies a write's data into its page cache first and, when the session
  // loop splices, hands us references to those pages (fs/pipe.h). With direct_io or O_DIRECT it
  // sends the caller's own pages, which splice can only copy.
  fh->page_cache_writes = !fi->direct_io && !fh->client_direct;
}

void OpOpen(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  if (VirtualOpen(req, ino, fi)) return;
  Fs& fs = FsOf(req);
  Inode& in = fs.GetInode(ino);
  // No O_TRUNC here: without atomic O_TRUNC (OpInit) the kernel truncates with a SETATTR.
  UniqueFd fd;
  int err = OpenBacking(in, fi->flags, &fd);
  FileHandle* fh = nullptr;
  if (!err) err = MakeHandle(fs, in, fi->flags, std::move(fd), &fh);
  if (err) {
    fuse_reply_err(req, err);
    return;
  }
  fi->fh = reinterpret_cast<uint64_t>(fh);
  FillOpenFlags(fs, fi, fh);
  if (fuse_reply_open(req, fi) == -ENOENT) fs.Dispose(fh);  // the opener was interrupted
}

void OpCreate(fuse_req_t req, fuse_ino_t parent, const char* name, mode_t mode,
              fuse_file_info* fi) {
  if (RefuseVirtualName(req, parent, name, IsHiddenName(parent, name) ? EEXIST : EPERM)) return;
  Fs& fs = FsOf(req);
  Inode& dir = fs.GetInode(parent);
  const int flags = (fi->flags & ~(O_DIRECT | O_APPEND | O_NOCTTY | O_CREAT | O_EXCL)) | O_CLOEXEC;
  // O_EXCL always, so that we know whether this request made the file: only then does it go to
  // the caller (and away again if the reply fails). The kernel sends CREATE for a name it found
  // missing; one that appeared since (another client, BACKING_DIR) is opened as open(2) would.
  int fd;
  bool created = true;
  {
    CallerUmask mask(req);
    if (mask.error()) {
      fuse_reply_err(req, mask.error());
      return;
    }
    fd = openat(dir.fd, name, flags | O_CREAT | O_EXCL, mode);
    if (fd < 0 && errno == EEXIST && !(fi->flags & O_EXCL)) {
      created = false;
      fd = openat(dir.fd, name, flags);
    }
    if (fd < 0) {
      fuse_reply_err(req, errno);
      return;
    }
  }
  UniqueFd owned(fd);
  fuse_entry_param e{};
  int err = fs.DoLookup(parent, name, &e);
  FileHandle* fh = nullptr;
  if (!err) {
    if (created) err = GiveToCaller(req, fs, dir, &e);
    if (!err) err = MakeHandle(fs, fs.GetInode(e.ino), fi->flags, std::move(owned), &fh);
    if (err) fs.Forget(e.ino, 1);
  }
  if (err) {
    if (created && unlinkat(dir.fd, name, 0) != 0) {
      Logger().warn("removing '{}' after a failed create: {}", name, std::strerror(errno));
    }
    fuse_reply_err(req, err);
    return;
  }
  fi->fh = reinterpret_cast<uint64_t>(fh);
  FillOpenFlags(fs, fi, fh);
  if (fuse_reply_create(req, &e, fi) == -ENOENT) fs.Dispose(fh);
}

// One pinned, aligned buffer per FUSE thread (grown on demand): reads into it and writes from it
// are plain O_DIRECT requests, no bounce copy. Null when it cannot be pinned.
char* ThreadScratch(size_t size) {
  thread_local PinnedBuffer buf;
  if (buf.size() < size) {
    auto b = PinnedBuffer::Allocate(std::max<size_t>(size, kMaxFuseRequestBytes));
    if (!b.ok()) {
      Logger().error("request buffer: {}", b.status().ToString());
      return nullptr;
    }
    buf = std::move(b).value();
  }
  return buf.bytes();
}

void OpRead(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, fuse_file_info* fi) {
  if (VirtualRead(req, ino, size, off, fi)) return;
  Fs& fs = FsOf(req);
  FileHandle& fh = Fh(fi);
  // An O_DIRECT client (libaio at queue depth N) sends N reads at once: with async_reply they are
  // answered from the engine's completion, freeing this thread for the next one (measured slower
  // on 2 cores, see options.h, hence off by default).
  if (fh.client_direct && fs.opts().async_reply && fs.ReadAndReplyAsync(req, fh, size, off)) {
    return;
  }
  char* scratch = ThreadScratch(size);
  if (scratch == nullptr) {
    fuse_reply_err(req, ENOMEM);
    return;
  }
  ReadReply reply;
  Result<int64_t> n = fs.Read(fh, scratch, size, off, &reply);
  if (!n.ok()) {
    fuse_reply_err(req, ErrnoOf(n.status()));
  } else {
    fuse_reply_iov(req, reply.iov.data(), static_cast<int>(reply.iov.size()));
  }
}

void OpWriteBuf(fuse_req_t req, fuse_ino_t ino, fuse_bufvec* bufv, off_t off, fuse_file_info* fi) {
  if (VirtualWrite(req, ino, bufv, fi)) return;
  if (WriterUnprivileged(req, Fh(fi))) {
    if (int err = KillPrivs(req, *Fh(fi).inode); err != 0) {
      fuse_reply_err(req, err);
      return;
    }
  }
  const size_t size = fuse_buf_size(bufv);
  char* scratch = ThreadScratch(size);
  if (scratch == nullptr) {
    fuse_reply_err(req, ENOMEM);
    return;
  }
  WriteSource src(bufv);
  int err = ErrnoOf(FsOf(req).Write(Fh(fi), src, size, off, scratch));
  if (err) {
    fuse_reply_err(req, err);
  } else {
    fuse_reply_write(req, size);
  }
}

void OpFlush(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  if (VirtualNoop(req, ino)) return;
  // close(2): hand the writer any write-behind error; the data need not be durable yet.
  FileHandle& fh = Fh(fi);
  int err = S_ISREG(fh.inode->type) ? ErrnoOf(fh.inode->wb.Drain(/*take_error=*/true)) : 0;
  fuse_reply_err(req, err);
}

void OpRelease(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  if (VirtualRelease(req, ino, fi)) return;
  FileHandle* fh = &Fh(fi);
  if (S_ISREG(fh->inode->type)) {
    Status st = fh->inode->wb.Drain(/*take_error=*/false);
    if (!st.ok()) {
      Logger().warn("release of inode {}: write-behind error {}", fh->inode->ino, st.ToString());
    }
    // Read-ahead in flight uses the inode, which may be forgotten once no file is open.
    fh->inode->ra.Quiesce();
  }
  FsOf(req).Dispose(fh);
  fuse_reply_err(req, 0);
}

void OpFsync(fuse_req_t req, fuse_ino_t ino, int datasync, fuse_file_info* fi) {
  if (VirtualNoop(req, ino)) return;
  FileHandle& fh = Fh(fi);
  int err = S_ISREG(fh.inode->type) ? ErrnoOf(fh.inode->wb.Drain(/*take_error=*/true)) : 0;
  if (!err) {
    int rc = datasync ? fdatasync(fh.fd.get()) : fsync(fh.fd.get());
    if (rc != 0) err = errno;
  }
  fuse_reply_err(req, err);
}

struct DirHandle : OpenHandle {
  DIR* dp = nullptr;
  off_t offset = 0;
  ~DirHandle() override {
    if (dp) closedir(dp);
  }
};

void OpOpendir(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  if (VirtualOpendir(req, ino, fi)) return;
  Inode& in = FsOf(req).GetInode(ino);
  int fd = openat(in.fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    fuse_reply_err(req, errno);
    return;
  }
  auto dh = std::make_unique<DirHandle>();
  dh->dp = fdopendir(fd);
  if (dh->dp == nullptr) {
    int err = errno;
    close(fd);
    fuse_reply_err(req, err);
    return;
  }
  fi->fh = reinterpret_cast<uint64_t>(dh.get());
  fi->cache_readdir = 0;
  Fs& fs = FsOf(req);
  DirHandle* raw = dh.release();
  fs.Track(raw);
  if (fuse_reply_open(req, fi) == -ENOENT) fs.Dispose(raw);
}

void DoReaddir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, fuse_file_info* fi,
               bool plus) {
  if (VirtualReaddir(req, ino, size, off, plus)) return;
  Fs& fs = FsOf(req);
  auto* dh = reinterpret_cast<DirHandle*>(fi->fh);
  std::string buf(size, '\0');
  size_t used = 0;
  if (off != dh->offset) {
    seekdir(dh->dp, off);
    dh->offset = off;
  }
  int err = 0;
  while (true) {
    errno = 0;
    struct dirent* d = readdir(dh->dp);
    if (d == nullptr) {
      err = errno;
      break;
    }
    const bool dots = std::strcmp(d->d_name, ".") == 0 || std::strcmp(d->d_name, "..") == 0;
    if (IsHiddenName(ino, d->d_name)) {  // a backing entry hidden by the control directory
      dh->offset = d->d_off;
      continue;
    }
    size_t need;
    if (plus) {
      fuse_entry_param e{};
      if (dots) {
        e.attr.st_ino = d->d_ino;
        e.attr.st_mode = static_cast<mode_t>(d->d_type) << 12;
      } else {
        int lerr = fs.DoLookup(ino, d->d_name, &e);
        if (lerr) {
          if (lerr == ENOENT) continue;  // removed while listing
          err = lerr;
          break;
        }
      }
      need = fuse_add_direntry_plus(req, &buf[used], size - used, d->d_name, &e, d->d_off);
      if (need > size - used) {
        if (!dots) fs.Forget(e.ino, 1);  // not handed to the kernel after all
        dh->offset = -1;  // the stream is past this entry: seek back on the next call
        break;
      }
    } else {
      struct stat st {};
      st.st_ino = d->d_ino;
      st.st_mode = static_cast<mode_t>(d->d_type) << 12;
      need = fuse_add_direntry(req, &buf[used], size - used, d->d_name, &st, d->d_off);
      if (need > size - used) {
        dh->offset = -1;  // the stream is past this entry: seek back on the next call
        break;
      }
    }
    used += need;
    dh->offset = d->d_off;
  }
  if (err && used == 0) {
    fuse_reply_err(req, err);
  } else {
    fuse_reply_buf(req, buf.data(), used);
  }
}

void OpReaddir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, fuse_file_info* fi) {
  DoReaddir(req, ino, size, off, fi, false);
}

void OpReaddirplus(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, fuse_file_info* fi) {
  DoReaddir(req, ino, size, off, fi, true);
}

void OpReleasedir(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  if (VirtualReleasedir(req, ino)) return;
  FsOf(req).Dispose(reinterpret_cast<DirHandle*>(fi->fh));
  fuse_reply_err(req, 0);
}

void OpFsyncdir(fuse_req_t req, fuse_ino_t ino, int datasync, fuse_file_info* fi) {
  if (VirtualNoop(req, ino)) return;
  int fd = dirfd(reinterpret_cast<DirHandle*>(fi->fh)->dp);
  int rc = datasync ? fdatasync(fd) : fsync(fd);
  fuse_reply_err(req, rc == 0 ? 0 : errno);
}

void OpStatfs(fuse_req_t req, fuse_ino_t ino) {
  struct statvfs sv {};
  if (IsVirtual(ino)) ino = FUSE_ROOT_ID;
  if (fstatvfs(FsOf(req).GetInode(ino).fd, &sv) != 0) {
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
  Inode& in = FsOf(req).GetInode(ino);
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
  Inode& in = FsOf(req).GetInode(ino);
  if (!XattrCapable(in)) {
    fuse_reply_err(req, ENODATA);
    return;
  }
  const std::string p = ProcPath(in.fd);
  ReplyXattr(req, size, [&](char* b, size_t n) { return getxattr(p.c_str(), name, b, n); });
}

void OpListxattr(fuse_req_t req, fuse_ino_t ino, size_t size) {
  Inode& in = FsOf(req).GetInode(ino);
  if (!XattrCapable(in) || IsVirtual(ino)) {  // no names; answered the same way
    ReplyXattr(req, size, [](char*, size_t) { return ssize_t{0}; });
    return;
  }
  const std::string p = ProcPath(in.fd);
  ReplyXattr(req, size, [&](char* b, size_t n) { return listxattr(p.c_str(), b, n); });
}

void OpRemovexattr(fuse_req_t req, fuse_ino_t ino, const char* name) {
  if (RefuseVirtual(req, ino, ENOTSUP)) return;
  Inode& in = FsOf(req).GetInode(ino);
  if (!XattrCapable(in)) {
    fuse_reply_err(req, ENOTSUP);
    return;
  }
  int rc = removexattr(ProcPath(in.fd).c_str(), name);
  fuse_reply_err(req, rc == 0 ? 0 : errno);
}

void OpFallocate(fuse_req_t req, fuse_ino_t ino, int mode, off_t offset, off_t length,
                 fuse_file_info* fi) {
  if (RefuseVirtual(req, ino, EOPNOTSUPP)) return;
  Fs& fs = FsOf(req);
  Inode& in = fs.GetInode(ino);
  int err = ErrnoOf(in.wb.Drain(/*take_error=*/false));
  in.ra.Invalidate();
  if (!err && fallocate(Fh(fi).fd.get(), mode, offset, length) != 0) err = errno;
  fuse_reply_err(req, err);
}

void OpLseek(fuse_req_t req, fuse_ino_t ino, off_t off, int whence, fuse_file_info* fi) {
  if (RefuseVirtual(req, ino, EINVAL)) return;
  Fs& fs = FsOf(req);
  int err = ErrnoOf(fs.GetInode(ino).wb.Drain(/*take_error=*/false));
  if (err) {
    fuse_reply_err(req, err);
    return;
  }
  off_t r = lseek(Fh(fi).fd.get(), off, whence);
  if (r < 0) {
    fuse_reply_err(req, errno);
  } else {
    fuse_reply_lseek(req, r);
  }
}

fuse_lowlevel_ops MakeOps() {
  fuse_lowlevel_ops ops{};
  ops.init = OpInit;
  ops.destroy = OpDestroy;
  ops.lookup = OpLookup;
  ops.forget = OpForget;
  ops.forget_multi = OpForgetMulti;
  ops.getattr = OpGetattr;
  ops.setattr = OpSetattr;
  ops.readlink = OpReadlink;
  ops.mknod = OpMknod;
  ops.mkdir = OpMkdir;
  ops.symlink = OpSymlink;
  ops.link = OpLink;
  ops.unlink = OpUnlink;
  ops.rmdir = OpRmdir;
  ops.rename = OpRename;
  ops.open = OpOpen;
  ops.create = OpCreate;
  ops.read = OpRead;
  ops.write_buf = OpWriteBuf;
  ops.flush = OpFlush;
  ops.release = OpRelease;
  ops.fsync = OpFsync;
  ops.opendir = OpOpendir;
  ops.readdir = OpReaddir;
  ops.readdirplus = OpReaddirplus;
  ops.releasedir = OpReleasedir;
  ops.fsyncdir = OpFsyncdir;
  ops.statfs = OpStatfs;
  ops.setxattr = OpSetxattr;
  ops.getxattr = OpGetxattr;
  ops.listxattr = OpListxattr;
  ops.removexattr = OpRemovexattr;
  ops.fallocate = OpFallocate;
  ops.lseek = OpLseek;
  return ops;
}

}  // namespace

const fuse_lowlevel_ops& Operations() {
  static const fuse_lowlevel_ops ops = MakeOps();
  return ops;
}

// ---- Fs: the inode table and start-up ----

Inode::~Inode() {
  if (fd >= 0) close(fd);
}

std::string MountCounters::ToJson() const {
  auto r = [](const std::atomic<uint64_t>& a) { return a.load(std::memory_order_relaxed); };
  nlohmann::json j = {
      {"write_ops", r(write_ops)},
      {"read_ops", r(read_ops)},
      {"bytes_written_behind", r(bytes_written_behind)},
      {"bytes_written_sync", r(bytes_written_sync)},
      {"bytes_read_ahead_hit", r(bytes_read_ahead_hit)},
      {"bytes_read_engine", r(bytes_read_engine)},
      {"write_behind_flushes", r(write_behind_flushes)},
      {"read_ahead_fetches", r(read_ahead_fetches)},
      {"errors", r(errors)},
      {"bytes_written_spliced", r(bytes_written_spliced)},
      {"bytes_splice_fallback", r(bytes_splice_fallback)},
      {"bytes_written_adopted", r(bytes_written_adopted)},
  };
  return j.dump();
}

Fs::Fs(MountOptions opts)
    : opts_(std::move(opts)),
      ctl_dir_(&wb_shared_, &ra_shared_),
      ctl_node_(&wb_shared_, &ra_shared_),
      stats_node_(&wb_shared_, &ra_shared_),
      config_node_(&wb_shared_, &ra_shared_),
      root_(&wb_shared_, &ra_shared_) {
  ctl_limits_.max_handles = opts_.ctl_max_handles;
  ctl_limits_.max_buffer_bytes = opts_.ctl_max_bytes;
}

Fs::~Fs() {
  DrainAll();
  {
    // Files still open when the session ended: the kernel will never release them.
    std::lock_guard lock(handles_mu_);
    for (OpenHandle* h : handles_) delete h;
    handles_.clear();
  }
  Stop();  // waits for every engine operation (read-ahead included)
}

void Fs::Track(OpenHandle* h) {
  std::lock_guard lock(handles_mu_);
  handles_.insert(h);
}

void Fs::Dispose(OpenHandle* h) {
  {
    std::lock_guard lock(handles_mu_);
    handles_.erase(h);
  }
  delete h;
}

Status Fs::ReservePrivileged(bool splicing) {
  if (!splicing) return Status::Ok();
  if (opts_.write_behind > 0) {
    // write_behind bytes of pipes, each holding one write_chunk extent; without
    // CAP_SYS_RESOURCE, pipe-max-size pipes (1 MiB by default), more of them.
    auto pool = PipePool::Create(opts_.write_behind, opts_.write_chunk, kMinSplicePipeBytes);
    if (pool.ok()) {
      wb_pipes_ = std::move(pool).value();
      Logger().info("spliced write-behind: {} pipes of {} bytes", wb_pipes_->count(),
                    wb_pipes_->capacity());
    } else {
      Logger().info("write-behind copies every write (no pipes for spliced extents: {})",
                    pool.status().ToString());
    }
  }
  return Status::Ok();
}

Status Fs::Start() {
  int fd = open(opts_.backing.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Status::FromErrno(errno, "open BACKING_DIR '" + opts_.backing + "'");
  root_.fd = fd;
  struct stat st {};
  if (fstat(fd, &st) != 0) return Status::FromErrno(errno, "stat BACKING_DIR");
  root_.dev = st.st_dev;
  root_.ino = st.st_ino;
  root_.type = S_IFDIR;
  root_.nlookup = 2;  // never forgotten

  clock_gettime(CLOCK_REALTIME, &started_);
  InitVirtualNodes();
  auto h = AioHandle::Create(opts_.engine);
  if (!h.ok()) return h.status().WithContext("engine");
  {
    std::lock_guard lock(engine_mu_);
    engine_ = std::shared_ptr<AioHandle>(std::move(h).value());
    engine_config_ = opts_.engine;
  }
  if (opts_.write_behind > 0) {
    const size_t n = static_cast<size_t>(opts_.write_behind / opts_.write_chunk);
    auto pool = PinnedPool::Create(static_cast<size_t>(opts_.write_chunk), n);
    if (!pool.ok()) return pool.status().WithContext("write-behind buffers (write_behind=)");
    wb_pool_ = std::move(pool).value();
  }
  // One writer thread per extent in flight; the pipes beyond that queue up behind them.
  if (wb_pipes_) splicers_ = std::make_unique<SpliceWorkers>(static_cast<int>(kSpliceThreads));
  if (opts_.read_ahead > 0) {
    const int64_t chunk = std::min<int64_t>(opts_.read_ahead, 4 << 20);
    // Room for kReadAheadWindows sequential readers' windows; more readers share what is free.
    const size_t n = static_cast<size_t>(kReadAheadWindows * opts_.read_ahead / chunk);
    auto pool = PinnedPool::Create(static_cast<size_t>(chunk), n);
    if (!pool.ok()) return pool.status().WithContext("read-ahead buffers (read_ahead=)");
    ra_pool_ = std::move(pool).value();
  }
  auto engine = [this] { return Engine(); };
  wb_shared_ = {wb_pool_.get(),    wb_pipes_.get(), splicers_.get(),
                opts_.write_chunk, engine,          &counters_};
  ra_shared_ = {ra_pool_.get(), opts_.read_ahead, engine, &counters_};
  if (opts_.async_reply) {
    // One buffer per request an O_DIRECT client can have in flight at the kernel's limit.
    auto pool = PinnedPool::Create(static_cast<size_t>(kMaxFuseRequestBytes), kAsyncReplyBuffers);
    if (!pool.ok()) return pool.status().WithContext("reply buffers (async_reply=)");
    reply_pool_ = std::move(pool).value();
  }
  return Status::Ok();
}

Status Fs::Preflight() {
  Status st = Start();
  wb_shared_ = WriteBehindShared();
  ra_shared_ = ReadAheadShared();
  reply_pool_.reset();
  ra_pool_.reset();
  wb_pool_.reset();
  {
    std::lock_guard lock(engine_mu_);
    engine_.reset();
  }
  if (root_.fd >= 0) close(root_.fd);
  root_.fd = -1;
  return st;
}

void Fs::Stop() {
  DrainAll();
  splicers_.reset();  // idle after DrainAll; joins its threads
  std::shared_ptr<AioHandle> last;
  {
    std::lock_guard lock(engine_mu_);
    last = std::move(engine_);
  }
  last.reset();  // waits for every operation of the engine and its callbacks
  std::lock_guard lock(reconfig_mu_);
  retired_.clear();  // nothing can hold them any more: the session loop has ended
}

void Fs::DrainAll() {
  if (!Engine()) return;
  std::vector<Inode*> all;
  {
    std::lock_guard lock(inodes_mu_);
    for (auto& [key, in] : inodes_) all.push_back(in.get());
  }
  // Inodes cannot be forgotten while we drain: the session loop has stopped (destroy/unmount).
  for (Inode* in : all) {
    if (S_ISREG(in->type)) {
      Status st = in->wb.Drain(/*take_error=*/false);
      if (!st.ok()) {
        Logger().error("write-behind data of inode {} lost at exit: {}", in->ino, st.ToString());
      }
    }
  }
}

Inode& Fs::GetInode(fuse_ino_t ino) {
  if (ino == FUSE_ROOT_ID) return root_;
  return *reinterpret_cast<Inode*>(ino);
}

int Fs::DoLookup(fuse_ino_t parent, const char* name, fuse_entry_param* e) {
  Inode& dir = GetInode(parent);
  int fd = openat(dir.fd, name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return errno;
  struct stat st {};
  if (fstatat(fd, "", &st, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW) != 0) {
    int err = errno;
    close(fd);
    return err;
  }
  Inode* in;
  {
    std::lock_guard lock(inodes_mu_);
    auto key = std::make_pair(st.st_dev, st.st_ino);
    auto it = inodes_.find(key);
    if (it != inodes_.end()) {
      in = it->second.get();
      close(fd);  // the inode already holds one
    } else {
      auto fresh = std::make_unique<Inode>(&wb_shared_, &ra_shared_);
      fresh->fd = fd;
      fresh->dev = st.st_dev;
      fresh->ino = st.st_ino;
      fresh->type = st.st_mode & S_IFMT;
      in = fresh.get();
      inodes_.emplace(key, std::move(fresh));
    }
    ++in->nlookup;
  }
  if (S_ISREG(st.st_mode)) in->wb.ApplyPending(&st);
  e->ino = reinterpret_cast<fuse_ino_t>(in);
  e->attr = st;
  e->attr_timeout = kTimeout;
  e->entry_timeout = kTimeout;
  return 0;
}

void Fs::Forget(fuse_ino_t ino, uint64_t n) {
  if (ino == FUSE_ROOT_ID) return;
  Inode* in = reinterpret_cast<Inode*>(ino);
  if (in->virt != VirtualNode::kNone) return;  // control nodes live as long as the Fs
  std::unique_ptr<Inode> dead;
  std::lock_guard lock(inodes_mu_);
  if (n > in->nlookup) {
    Logger().error("forget of {} lookups on inode {} that has {}", n, in->ino, in->nlookup);
    n = in->nlookup;
  }
  in->nlookup -= n;
  if (in->nlookup == 0) {
    auto it = inodes_.find({in->dev, in->ino});
    if (it != inodes_.end() && it->second.get() == in) {
      dead = std::move(it->second);
      inodes_.erase(it);
    }
  }
}

}  // namespace dnvme::fs
