// The FUSE low-level ops table of dnvmefs, and init/destroy: what the kernel is asked for at
// INIT (request size, async I/O, splice, umask, ACLs) and why.
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

void OpInit(void* userdata, fuse_conn_info* conn) {
  Fs& fs = FsOfSession(userdata);
  // Measured on the reference VM (docs/performance-journal.md): 512 KiB-1 MiB is best, 4 MiB and
  // more lose to the daemon's own read-ahead (the kernel then floods us with parallel requests).
  // With larger requests the kernel's read-ahead must be as large, or reads stay at its size.
  const int64_t request = fs.mount().opts().max_request;
  const unsigned readahead = static_cast<unsigned>(std::max<int64_t>(request, 1 << 20));
  if (fs.mount().opts().read_ahead > 0)
    RaiseKernelReadAhead(fs.mount().opts().mountpoint, readahead);
  // max_request-sized requests (1 MiB by default), parallel reads, async direct I/O so a libaio
  // client's requests reach us concurrently, splice where the kernel offers it. libfuse 3.14
  // clamps max_write to its buffer before calling us, not after, and derives max_pages from what
  // we set here; our transport sizes its own buffers (fs/transport/transport.h).
  conn->max_write = static_cast<unsigned>(request);
  // The max_read mount option (fs/main.cc): libfuse refuses an INIT whose value differs.
  conn->max_read = static_cast<unsigned>(fs.mount().opts().max_read);
  conn->max_readahead = readahead;
  WarnIfKernelClampsRequests(request);
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
  // loop replaces (fs/transport/session_loop.h); with clone_fd's libfuse loop it would fall back to
  // read(2) anyway once CAP_SYS_RESOURCE is gone.
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
  if (fs.mount().conn_opts() != nullptr) fuse_apply_conn_info_opts(fs.mount().conn_opts(), conn);
}

void OpDestroy(void* userdata) { FsOfSession(userdata).DrainAll(); }

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
  ops.write_buf = WriteEntry<OpWrite>;
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

}  // namespace dnvme::fs::ops

namespace dnvme::fs {

const fuse_lowlevel_ops& Operations() {
  static const fuse_lowlevel_ops table = ops::MakeOps();
  return table;
}

}  // namespace dnvme::fs
