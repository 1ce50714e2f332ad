// Helpers shared by the FUSE op files (fs/fuse/ops_common.h).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>

#include "dnvme/log.h"
#include "fs/caps.h"
#include "fs/core/fs.h"
#include "fs/fuse/control_dir.h"
#include "fs/fuse/ops.h"
#include "fs/fuse/ops_common.h"
#include "fs/fuse/passthrough.h"
#include "fs/setid.h"

namespace dnvme::fs::ops {

void AfterLeaseWrites(Fs& fs, Inode& in, bool share_if_busy, const char* before,
                      std::function<void()> op) {
  if (in.leases.count() == 0) return op();
  auto warn = [&in, before](bool landed) {
    if (landed) return;
    DNVME_LOG_THROTTLED(
        warn, "inode {}: a `dnvme run` client's writes did not land in {} ms; going on with {}",
        in.ino, PreloadLeases::kWriteWait.count(), before);
  };
  if (!fs.mount().RepliesMayBeDeferred()) {
    // FUSE over io_uring: the reply must leave from this thread (docs/security.md, known gap).
    warn(in.leases.WaitForWrites(share_if_busy));
    return op();
  }
  fs.off_loop().AfterLeaseWrites(&in.leases, share_if_busy,
                                 [warn, op = std::move(op)](bool landed) {
                                   warn(landed);
                                   op();
                                 });
}

Caller CallerOf(fuse_req_t req) {
  Caller c;
  const fuse_ctx* ctx = fuse_req_ctx(req);
  c.uid = ctx->uid;
  c.gid = ctx->gid;
  c.pid = ctx->pid;
  gid_t groups[64];
  int n = fuse_req_getgroups(req, 64, groups);
  if (n > 64) {
    c.groups.resize(static_cast<size_t>(n));
    n = fuse_req_getgroups(req, n, c.groups.data());
  }
  if (n > 0 && c.groups.empty()) c.groups.assign(groups, groups + n);
  if (n < 0) c.groups.clear();  // unknown (the process is gone): no supplementary groups
  if (n >= 0 && static_cast<size_t>(n) < c.groups.size()) c.groups.resize(static_cast<size_t>(n));
  return c;
}

void ReplyStatus(fuse_req_t req, const Status& st) { fuse_reply_err(req, st.ErrnoOr()); }

void ReplyEntry(fuse_req_t req, const Result<fuse_entry_param>& e) {
  if (!e.ok()) return ReplyStatus(req, e.status());
  fuse_reply_entry(req, &e.value());
}

void ReplyAttr(fuse_req_t req, const Result<struct stat>& st, double timeout) {
  if (!st.ok()) return ReplyStatus(req, st.status());
  fuse_reply_attr(req, &st.value(), timeout);
}

void ReplyBuf(fuse_req_t req, const Result<std::string>& bytes) {
  if (!bytes.ok()) return ReplyStatus(req, bytes.status());
  fuse_reply_buf(req, bytes.value().data(), bytes.value().size());
}

void ReplyData(fuse_req_t req, const Result<std::span<const char>>& bytes) {
  if (!bytes.ok()) return ReplyStatus(req, bytes.status());
  fuse_reply_buf(req, bytes.value().data(), bytes.value().size());
}

void ReplyIov(fuse_req_t req, const Status& st, std::span<const struct iovec> iov) {
  if (!st.ok()) return ReplyStatus(req, st);
  fuse_reply_iov(req, iov.data(), static_cast<int>(iov.size()));
}

void ReplyWritten(fuse_req_t req, const Result<size_t>& written) {
  if (!written.ok()) return ReplyStatus(req, written.status());
  fuse_reply_write(req, written.value());
}

void ReplyLseek(fuse_req_t req, const Result<off_t>& off) {
  if (!off.ok()) return ReplyStatus(req, off.status());
  fuse_reply_lseek(req, off.value());
}

void ReplyReadlink(fuse_req_t req, const Result<std::string>& target) {
  if (!target.ok()) return ReplyStatus(req, target.status());
  fuse_reply_readlink(req, target.value().c_str());
}

void ReplyStatfs(fuse_req_t req, const Result<struct statvfs>& sv) {
  if (!sv.ok()) return ReplyStatus(req, sv.status());
  fuse_reply_statfs(req, &sv.value());
}

void ReplyXattr(fuse_req_t req, size_t size, const Result<size_t>& got, const char* bytes) {
  if (!got.ok()) return ReplyStatus(req, got.status());
  if (size == 0) {
    fuse_reply_xattr(req, got.value());
  } else {
    fuse_reply_buf(req, bytes, got.value());
  }
}

void ReplyNone(fuse_req_t req) { fuse_reply_none(req); }

namespace {

// Sends a reply body built by hand (fs/fuse/passthrough.h); what fuse_reply_iov returns.
template <typename... Parts>
int SendParts(fuse_req_t req, Parts&... parts) {
  struct iovec iov[] = {{&parts, sizeof(parts)}...};
  return fuse_reply_iov(req, iov, static_cast<int>(sizeof...(Parts)));
}

}  // namespace

bool ReplyOpen(fuse_req_t req, const fuse_file_info& fi, const OpenMode& how, uint32_t extra) {
  int rc;
  if (how.passthrough) {
    wire::OpenOut o = PassthroughOpenOut(fi, how.backing_id);
    rc = SendParts(req, o);
  } else if (extra != 0) {
    wire::OpenOut o = OpenOutWithFlags(fi, extra);
    rc = SendParts(req, o);
  } else {
    rc = fuse_reply_open(req, &fi);
  }
  return rc != -ENOENT;
}

bool ReplyCreate(fuse_req_t req, const fuse_entry_param& e, const fuse_file_info& fi,
                 const OpenMode& how) {
  int rc;
  if (how.passthrough) {
    fuse_entry_out entry = EntryOutOf(e);
    wire::OpenOut o = PassthroughOpenOut(fi, how.backing_id);
    rc = SendParts(req, entry, o);
  } else {
    rc = fuse_reply_create(req, &e, &fi);
  }
  return rc != -ENOENT;
}

void ReplyVirtualOpen(fuse_req_t req, fuse_ino_t ino, const Status& st, fuse_file_info* fi) {
  if (!st.ok()) return ReplyStatus(req, st);
  // ctl's opens carry flags fuse_file_info cannot (VirtualOpenFlags): a reply built by hand.
  if (!ReplyOpen(req, *fi, OpenMode{}, VirtualOpenFlags(ino))) {
    (void)VirtualRelease(FsOf(req), ino, fi);
  }
}

bool RefuseVirtual(fuse_req_t req, fuse_ino_t ino, int err) {
  if (!IsVirtual(ino)) return false;
  ReplyStatus(req, Status::FromErrno(err, std::string("refused on ") + kCtlDirName));
  return true;
}

bool RefuseVirtualName(fuse_req_t req, fuse_ino_t parent, const char* name, int err) {
  if (!IsVirtualName(parent, name)) return false;
  ReplyStatus(req, Status::FromErrno(err, std::string("refused on ") + kCtlDirName));
  return true;
}

ActAsCaller::ActAsCaller(fuse_req_t req) : mask_(req) {
  if (!mask_.status().ok() || geteuid() != 0) return;
  // Root with group root is what the daemon's threads are already (and root's supplementary
  // groups decide nothing its capabilities do not): no switch, no read of its groups from /proc,
  // which cost a create or unlink by root 50-120 us (docs/performance-journal.md).
  const fuse_ctx* ctx = fuse_req_ctx(req);
  if (ctx->uid == 0 && ctx->gid == 0) return;
  const Caller c = CallerOf(req);
  auto id = ScopedFsIdentity::Enter(FsIdentity{c.uid, c.gid, c.groups});
  if (!id.ok()) {
    DNVME_LOG_THROTTLED(err, "acting as uid {}: {}", c.uid, id.status().ToString());
    // A refusal that names no errno is EPERM: the request may not be served as its caller.
    st_ = id.status().error_number() != 0
              ? id.status()
              : Status::FromErrno(EPERM, "acting as uid " + std::to_string(c.uid));
    return;
  }
  id_.emplace(std::move(id).value());
}

Result<OpenCharge> ChargeOpen(fuse_req_t req, int64_t fds) {
  const uid_t uid = fuse_req_ctx(req)->uid;
  UidLimits& limits = FsOf(req).uid_limits();
  OpenCharge c;
  // Root is trusted (docs/security.md) and its programs open as many files as they like, as on
  // ext4: the limit keeps users from starving each other and root. Its descriptors still come out
  // of the daemon's budget, which keeps a reserve for the daemon itself.
  Status st;
  if (uid != 0) {
    auto files = limits.Charge(uid, UidResource::kFiles, 1);
    if (files.ok()) {
      c.files = std::move(files).value();
    } else {
      st = files.status();
    }
  }
  if (st.ok()) {
    auto held = limits.ChargeFds(uid, fds, FdUse::kOther);
    if (held.ok()) {
      c.fds = std::move(held).value();
    } else {
      st = held.status();
    }
  }
  if (!st.ok()) {
    DNVME_LOG_THROTTLED(info, "open by pid {} uid {} refused: {}", fuse_req_ctx(req)->pid, uid,
                        st.ToString());
    return st;
  }
  return c;
}

std::shared_ptr<const FsIdentity> WriterIdentity(fuse_req_t req) {
  if (geteuid() != 0 || fuse_req_ctx(req)->uid == 0) return nullptr;
  const Caller c = CallerOf(req);
  return std::make_shared<const FsIdentity>(FsIdentity{c.uid, c.gid, c.groups});
}

void ReplyEntry(fuse_req_t req, fuse_ino_t parent, const char* name) {
  ReplyEntry(req, FsOf(req).inodes().Lookup(parent, name, fuse_req_ctx(req)->uid));
}

Result<struct stat> StatInode(Inode& in) {
  struct stat st {};
  if (fstatat(in.fd, "", &st, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW) != 0) {
    return Status::FromErrno(errno, "stat of inode " + std::to_string(in.ino));
  }
  // Data accepted by write-behind counts, though the backing file has not seen it yet.
  if (S_ISREG(st.st_mode)) in.data.ApplyPending(&st);
  return st;
}

// What a write or truncate by a process without CAP_FSETID clears on ext4
// (setattr_should_drop_suidgid): set-user-ID always; set-group-ID when group execute is set, or
// when the writer is not in the file's group. Applies it to the inode.
//
// The FUSE kernel does part of this itself -- set-user-ID, and set-group-ID with group execute,
// as a SETATTR before a page-cache write or with a truncate -- but never the third case, and
// leaves all of it to us for a direct write (which only carries FUSE_WRITE_KILL_SUIDGID).
Status KillPrivs(fuse_req_t req, Inode& in, bool* killed) {
  if (killed != nullptr) *killed = false;
  struct stat st {};
  if (fstatat(in.fd, "", &st, AT_EMPTY_PATH) != 0) {
    return Status::FromErrno(errno, "stat of inode " + std::to_string(in.ino));
  }
  // Most files have neither bit: the writer's groups (a /proc read) only when one is set. The
  // rule itself is DropSetIdForWriter's (fs/setid.h), shared with the control file's pwrite.
  if ((st.st_mode & (S_ISUID | S_ISGID)) == 0) return Status::Ok();
  const Caller c = CallerOf(req);
  auto dropped = DropSetIdForWriter(in.fd, c.gid, c.groups);
  if (!dropped.ok()) return dropped.status();
  if (killed != nullptr) *killed = dropped.value();
  return Status::Ok();
}

// Whether a WRITE comes from a process without CAP_FSETID. A direct write (an O_DIRECT client, a
// direct_io open) says so exactly with FUSE_WRITE_KILL_SUIDGID. A page-cache write never carries
// it (the kernel sets it only with FUSE_HANDLE_KILLPRIV_V2, which libfuse 3.14 cannot ask for),
// and under libfuse's own loop (clone_fd=1, which does not pass the flags on) `write_flags` is
// unknown (nullopt): there the caller counts as privileged exactly when it is root.
bool WriterUnprivileged(fuse_req_t req, const FileHandle& fh, std::optional<uint32_t> write_flags) {
  if (write_flags && !fh.page_cache_writes) return (*write_flags & FUSE_WRITE_KILL_SUIDGID) != 0;
  return fuse_req_ctx(req)->uid != 0;
}

void WarnIfKernelClampsRequests(int64_t request) {
  const int64_t pages = request / 4096;
  FILE* f = std::fopen("/proc/sys/fs/fuse/max_pages_limit", "r");
  long long limit = 256;  // before 6.13 the limit is built in
  if (f != nullptr) {
    if (std::fscanf(f, "%lld", &limit) != 1) limit = 256;
    std::fclose(f);
  }
  if (limit == pages && f == nullptr) return;  // nothing to raise before 6.13
  if (limit == pages) {
    // The spare page (fs/transport/protocol_ext.h) does not fit: a write of `request` bytes from
    // a buffer that is not page-aligned arrives as two requests (write-behind still writes both
    // from the request buffer, datapath/write_behind.h, but that is one more round trip each).
    Logger().info(
        "fs.fuse.max_pages_limit is {}: writes of {} KiB from buffers that are not page-aligned "
        "arrive as two requests (sysctl -w fs.fuse.max_pages_limit={} lets them through whole)",
        limit, request / 1024, pages + 1);
    return;
  }
  if (pages <= 256) return;  // every kernel allows 256
  if (limit < pages) {
    Logger().warn(
        "max_request={} asks for {} pages but fs.fuse.max_pages_limit is {}: the kernel sends "
        "requests of at most {} KiB (sysctl -w fs.fuse.max_pages_limit={} before mounting)",
        request, pages, limit, limit * 4, pages);
  } else {
    Logger().info("requests of up to {} KiB ({} pages)", request / 1024, pages);
  }
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

}  // namespace dnvme::fs::ops
