// FUSE ops on open files: open/create (the backing file registered with the engine once), read
// and write through the data path (fs/core/read_path.cc), flush/release/fsync (which drain the
// inode's write-behind), fallocate and lseek. Errors travel as Status and leave through the
// Reply* helpers (ops_common.h).
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
#include <span>
#include <string>
#include <vector>

#include "dnvme/log.h"
#include "fs/caps.h"
#include "fs/core/fs.h"
#include "fs/core/read_path.h"
#include "fs/fuse/control_dir.h"
#include "fs/fuse/ops.h"
#include "fs/fuse/ops_common.h"
#include "fs/fuse/passthrough.h"

namespace dnvme::fs::ops {

// Opens the backing object of `in` with the client's flags, minus those the engine handles
// itself (O_DIRECT: the engine decides per request; O_APPEND: the kernel already turned it into
// offsets) and those that only make sense at create time. Never blocks (ReopenNoWait): an open
// that would wait for a lease to be broken -- a user's lease on its own file, which its holder
// may keep for lease-break-time, 45 s -- is answered EWOULDBLOCK at once instead of holding this
// loop thread (docs/security.md).
Result<UniqueFd> OpenBacking(Inode& in, int flags) {
  const int strip = O_DIRECT | O_APPEND | O_CREAT | O_EXCL | O_NOCTTY;
  int fd = ReopenNoWait(in.fd, (flags & ~strip) | O_CLOEXEC);
  if (fd < 0) return Status::FromErrno(errno, "open");
  return UniqueFd(fd);
}

// `write_as`: the identity a non-root writer's data is written under (WriterIdentity). The
// handle is tracked by `fs`.
Result<FileHandle*> MakeHandle(Fs& fs, Inode& in, int flags, UniqueFd fd,
                               std::shared_ptr<const FsIdentity> write_as, OpenCharge charge) {
  auto fh = std::make_unique<FileHandle>();
  fh->files = std::move(charge.files);
  fh->fds = std::move(charge.fds);
  fh->inode = &in;
  fh->client_direct = (flags & O_DIRECT) != 0;
  const int acc = flags & O_ACCMODE;
  fh->writable = acc != O_RDONLY;
  if (S_ISREG(in.type)) {
    FileAccess access = acc == O_RDONLY   ? FileAccess::kRead
                        : acc == O_WRONLY ? FileAccess::kWrite
                                          : FileAccess::kReadWrite;
    auto ref = fs.mount().engine()->adopt_fd(fd.get(), access,
                                             access == FileAccess::kRead ? nullptr : write_as);
    if (!ref.ok()) {
      DNVME_LOG_THROTTLED(warn, "engine open of inode {} failed: {}", in.ino,
                          ref.status().ToString());
      return ref.status();
    }
    fh->file = std::move(ref).value();
    in.data.Open(&fh->open, !fh->writable);
  }
  fh->fd = std::move(fd);
  FileHandle* raw = fh.release();
  fs.handles().Track(raw);
  return raw;
}

void FillOpenFlags(Fs& fs, fuse_file_info* fi, FileHandle* fh) {
  fi->keep_cache = 0;  // the page cache of this file may be stale after a truncate elsewhere
  // direct_io: the kernel puts the writer's own pages into each WRITE instead of copying them into
  // the FUSE inode's page cache first, and the request is copied once, into the daemon's reused
  // buffer (which write-behind adopts). Through the page cache a buffered write costs the writer a
  // copy into fresh page-cache pages, and the pages then stay cached (options.h, DirectIo; measured
  // in docs/performance.md). An O_RDWR open gets it only where the kernel can still mmap it
  // (FUSE_DIRECT_IO_ALLOW_MMAP); its reads then go uncached through the daemon's read-ahead.
  const bool direct = OpenGetsDirectIo(fs.mount().opts().direct_io, fi->flags,
                                       fs.mount().protocol().direct_io_mmap());
  fi->direct_io = direct ? 1 : 0;
  fi->noflush = 0;
  // Otherwise the kernel copies a write's data into its page cache first and, when the session
  // loop splices, hands us references to those pages (datapath/pipe.h). With direct_io or
  // O_DIRECT it sends the caller's own pages, which splice can only copy.
  fh->page_cache_writes = !fi->direct_io && !fh->client_direct;
}

// The open's handle goes away without a RELEASE: the reply failed (the opener was interrupted)
// or the open did.
void AbandonOpen(Fs& fs, FileHandle* fh) {
  if (S_ISREG(fh->inode->type)) EndOpen(fs, *fh->inode, fh->passthrough);
  fs.handles().Dispose(fh);
}

// The end of an open or a create (`entry`): how the kernel opens the file (passthrough or not),
// the `dnvme run` clients told, and the reply. `fi` is a copy: the request's own is gone once the
// handler returns.
//
// A `dnvme run` client writes this file around the mount (fs/broker/): a new opener must see its
// bytes, so every holder now invalidates after each write (shared: marked before the holders'
// counters are read, include/dnvme/broker.h), the writes it has in flight land (AfterLeaseWrites:
// off the loop thread), and what the kernel or the read-ahead cached until now goes before the
// open is answered (AfterExternalWrite, on the notifier thread: the kernel's invalidation waits
// for READs of this inode, which need a free loop thread; fs/core/off_loop.h). An O_TRUNC open's
// SETATTR follows it.
void FinishOpen(fuse_req_t req, Fs& fs, FileHandle* fh, fuse_file_info fi,
                std::optional<fuse_entry_param> entry) {
  Inode& in = *fh->inode;
  const bool leased = in.leases.count() > 0;
  if (leased) in.leases.MarkShared();
  const fuse_ctx* ctx = fuse_req_ctx(req);
  fh->may_probe = MaySeeResidency(fh->fd.get(), fi.flags, ctx->uid, ctx->gid);
  const Opener opener{fh->fd.get(), ctx->pid, fh->may_probe};
  AfterLeaseWrites(
      fs, in, /*share_if_busy=*/false, "the open",
      [req, &fs, fh, fi, entry, leased, opener]() mutable {
        Inode& in = *fh->inode;
        const OpenMode how = S_ISREG(in.type) ? BeginOpen(fs, in, fi.flags, opener) : OpenMode{};
        fh->passthrough = how.passthrough;
        if (how.engine) {
          // Each read(2) reaches the daemon whole (no FUSE page cache, no read-ahead of the
          // kernel's in small requests), and mmap still works (FUSE_DIRECT_IO_ALLOW_MMAP).
          fi.direct_io = 1;
          fh->engine_reads = true;
        }
        if (leased) fs.AfterExternalWrite(in);
        const bool answered = entry ? ReplyCreate(req, *entry, fi, how) : ReplyOpen(req, fi, how);
        if (!answered) AbandonOpen(fs, fh);  // the opener was interrupted
      });
}

// An OPEN's handle: the open charged to the caller, the backing file opened, the engine told.
Result<FileHandle*> OpenFileHandle(fuse_req_t req, Fs& fs, Inode& in, int flags) {
  DNVME_ASSIGN_OR_RETURN(OpenCharge charge,
                         ChargeOpen(req, S_ISREG(in.type) ? kFileOpenFds : kDirOpenFds));
  DNVME_ASSIGN_OR_RETURN(UniqueFd fd, OpenBacking(in, flags));
  const bool writes = (flags & O_ACCMODE) != O_RDONLY;
  return MakeHandle(fs, in, flags, std::move(fd), writes ? WriterIdentity(req) : nullptr,
                    std::move(charge));
}

void OpOpen(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  // The opener's groups are read from /proc: only for the control files.
  if (IsVirtual(ino)) {
    if (auto v = VirtualOpen(FsOf(req), ino, CallerOf(req), fi))
      return ReplyVirtualOpen(req, ino, *v, fi);
  }
  Fs& fs = FsOf(req);
  Inode& in = fs.inodes().Get(ino);
  // No O_TRUNC here: without atomic O_TRUNC (OpInit) the kernel truncates with a SETATTR.
  Result<FileHandle*> made = OpenFileHandle(req, fs, in, fi->flags);
  if (!made.ok()) return ReplyStatus(req, made.status());
  FileHandle* fh = made.value();
  fi->fh = reinterpret_cast<uint64_t>(fh);
  FillOpenFlags(fs, fi, fh);
  FinishOpen(req, fs, fh, *fi, std::nullopt);
}

// Removes `name` from `dir` after a create that cannot be answered, only while the name still
// means the file we made, `mine` (another request may have renamed or replaced it).
void RemoveIfStill(Inode& dir, const char* name, const struct stat& mine) {
  struct stat now {};
  if (fstatat(dir.fd, name, &now, AT_SYMLINK_NOFOLLOW) != 0 || mine.st_ino != now.st_ino ||
      mine.st_dev != now.st_dev) {
    return;
  }
  if (unlinkat(dir.fd, name, 0) != 0) {
    DNVME_LOG_THROTTLED(warn, "removing '{}' after a failed create: {}", LogEscape(name),
                        std::strerror(errno));
  }
}

namespace {

// The backing file of a CREATE, opened as the caller (ActAsCaller): made with O_EXCL
// (`*created`), or, when the name exists and the client's create is not exclusive, opened as it
// is (O_NOFOLLOW | O_NONBLOCK: ExistingFileOk checks it).
Result<UniqueFd> OpenForCreate(fuse_req_t req, Inode& dir, const char* name, int flags,
                               int client_flags, mode_t mode, bool* created) {
  ActAsCaller as(req);
  DNVME_RETURN_IF_ERROR(as.status());
  *created = true;
  int fd = openat(dir.fd, name, flags | O_CREAT | O_EXCL, mode);
  if (fd < 0 && errno == EEXIST && !(client_flags & O_EXCL)) {
    *created = false;
    fd = openat(dir.fd, name, flags | O_NOFOLLOW | O_NONBLOCK);
  }
  if (fd < 0) return Status::FromErrno(errno, "create");
  return UniqueFd(fd);
}

// A name that existed already is opened only when it is a regular file (EISDIR, EEXIST
// otherwise), then made blocking again.
Status ExistingFileOk(int fd, const struct stat& mine) {
  if (!S_ISREG(mine.st_mode)) {
    return Status::FromErrno(S_ISDIR(mine.st_mode) ? EISDIR : EEXIST,
                             "create over an existing name");
  }
  const int fl = fcntl(fd, F_GETFL);
  if (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0) {
    return Status::FromErrno(errno, "fcntl");
  }
  return Status::Ok();
}

}  // namespace

void OpCreate(fuse_req_t req, fuse_ino_t parent, const char* name, mode_t mode,
              fuse_file_info* fi) {
  if (RefuseVirtualName(req, parent, name, IsHiddenName(parent, name) ? EEXIST : EPERM)) return;
  Fs& fs = FsOf(req);
  Inode& dir = fs.inodes().Get(parent);
  const int flags = (fi->flags & ~(O_DIRECT | O_APPEND | O_NOCTTY | O_CREAT | O_EXCL)) | O_CLOEXEC;
  // O_EXCL always, so that we know whether this request made the file (and removes it again if
  // the reply fails). As the caller: the file is the caller's from its first moment, made with
  // the caller's umask, group rules and ACLs (ActAsCaller). The kernel sends CREATE for a name it
  // found missing; one that appeared since (another client, BACKING_DIR itself) is opened as
  // open(2) would -- but never through a symlink (ELOOP) nor a FIFO or device (EEXIST), which a
  // user with access to BACKING_DIR could have swapped in (docs/security.md).
  Result<OpenCharge> charged = ChargeOpen(req, kFileOpenFds);
  if (!charged.ok()) return ReplyStatus(req, charged.status());
  OpenCharge charge = std::move(charged).value();
  bool created = true;
  Result<UniqueFd> opened = OpenForCreate(req, dir, name, flags, fi->flags, mode, &created);
  if (!opened.ok()) return ReplyStatus(req, opened.status());
  UniqueFd owned = std::move(opened).value();
  struct stat mine {};
  if (fstat(owned.get(), &mine) != 0) return ReplyStatus(req, Status::FromErrno(errno, "fstat"));
  if (!created) {
    if (Status st = ExistingFileOk(owned.get(), mine); !st.ok()) return ReplyStatus(req, st);
  }
  Status st;
  fuse_entry_param e{};
  FileHandle* fh = nullptr;
  if (Result<fuse_entry_param> looked = fs.inodes().Lookup(parent, name, fuse_req_ctx(req)->uid);
      !looked.ok()) {
    st = looked.status();
  } else {
    e = looked.value();
    // The name may mean another object by now: the handle is of the file we opened, and the
    // entry must agree with it.
    if (mine.st_ino != e.attr.st_ino || mine.st_dev != e.attr.st_dev) {
      st = Status::FromErrno(ESTALE, "create: the name now means another file");
    } else {
      const bool writes = (fi->flags & O_ACCMODE) != O_RDONLY;
      Result<FileHandle*> made =
          MakeHandle(fs, fs.inodes().Get(e.ino), fi->flags, std::move(owned),
                     writes ? WriterIdentity(req) : nullptr, std::move(charge));
      if (made.ok()) {
        fh = made.value();
      } else {
        st = made.status();
      }
    }
    if (!st.ok()) fs.inodes().Forget(e.ino, 1);
  }
  if (!st.ok()) {
    if (created) RemoveIfStill(dir, name, mine);
    return ReplyStatus(req, st);
  }
  fi->fh = reinterpret_cast<uint64_t>(fh);
  FillOpenFlags(fs, fi, fh);
  // A new file has no other open; an existing one reached by CREATE (made outside the mount,
  // or a hard link the kernel has not looked up) may be passthrough already, or leased.
  FinishOpen(req, fs, fh, *fi, e);
}

void OpRead(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, fuse_file_info* fi) {
  if (IsVirtual(ino)) {
    // A ctl read may wait for its session's queued requests and be answered from the lane that
    // runs them (VirtualRead): `req` stays valid until that one reply.
    return VirtualRead(FsOf(req), fuse_req_ctx(req)->uid, size, off, fi,
                       [req](const Result<std::string>& got) { ReplyBuf(req, got); });
  }
  Fs& fs = FsOf(req);
  FileHandle& fh = Fh(fi);
  MountCounters::NoteMax(fs.mount().counters().largest_read, size);
  // An O_DIRECT client (libaio at queue depth N) sends N reads at once: with async_reply they are
  // answered from the engine's completion, freeing this thread for the next one (measured slower
  // on 2 cores, see options.h, hence off by default).
  if (fh.client_direct && fs.mount().opts().async_reply &&
      ReadAsync(fs.mount(), fh, size, off,
                [req](Result<std::span<const char>> got) { ReplyData(req, got); })) {
    return;
  }
  char* scratch = ThreadScratch(size);
  if (scratch == nullptr) return ReplyStatus(req, Status::FromErrno(ENOMEM, "read scratch buffer"));
  datapath::ReadReply reply;
  Result<int64_t> n = Read(fs.mount(), fh, scratch, size, off, &reply, fuse_req_ctx(req)->pid);
  ReplyIov(req, n.status(), reply.iov);
}

namespace {

// A WRITE of a regular file: what the writer may no longer keep (set-user-ID), then the inode's
// data path. Returns the bytes accepted.
Result<size_t> WriteFile(fuse_req_t req, fuse_ino_t ino, FileHandle& fh, IncomingWrite& write,
                         off_t off) {
  Fs& fs = FsOf(req);
  // Only a direct write's flags say who wrote (WriterUnprivileged); a page-cache write's are not
  // looked up.
  const auto flags = fh.page_cache_writes ? std::nullopt : write.write_flags();
  if (WriterUnprivileged(req, fh, flags)) {
    bool killed = false;
    if (Status st = KillPrivs(req, *fh.inode, &killed); !st.ok()) {
      return st.WithContext("clearing set-user-ID");
    }
    // The kernel keeps its cached mode through a direct write (and through the set-group-ID case
    // it leaves to us after a page-cache one): without this an exec or a permission check could
    // still see the cleared bit until the attributes time out.
    if (killed) fs.mount().ForgetCachedAttributes(ino);
  }
  const size_t size = write.size();
  MountCounters::NoteMax(fs.mount().counters().largest_write, size);
  char* scratch = ThreadScratch(size);
  if (scratch == nullptr) return Status::FromErrno(ENOMEM, "write scratch buffer");
  // Fewer bytes than asked when only they fit (datapath/space.h): the writer sees a short write,
  // and its next write the error, as on ext4.
  DNVME_ASSIGN_OR_RETURN(
      size_t accepted, fh.inode->data.Write(fh.open, fh.file, fh.page_cache_writes, write.source(),
                                            size, off, scratch));
  // Bytes now in write-behind that a `dnvme run` client's direct transfer must not pass: it
  // drains before its next one (fs/broker/leases.h).
  if (fh.inode->leases.count() > 0) fh.inode->leases.MarkMountDirty();
  return accepted;
}

}  // namespace

void OpWrite(fuse_req_t req, fuse_ino_t ino, IncomingWrite& write, off_t off, fuse_file_info* fi) {
  if (IsVirtual(ino)) {
    // A ctl request is answered later, from its writer's lane (VirtualWrite): `req` stays valid
    // until that one reply.
    return VirtualWrite(FsOf(req), CallerOf(req), &write.payload(), fi,
                        [req](const Result<size_t>& written) { ReplyWritten(req, written); });
  }
  ReplyWritten(req, WriteFile(req, ino, Fh(fi), write, off));
}

void OpFlush(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  if (auto v = VirtualNoop(ino)) return ReplyStatus(req, *v);
  // close(2): a description that wrote sees a write-behind error it has not heard of (the data
  // need not be durable yet) and its fsync still will (DrainAndPeek: a forked child's
  // close-on-exec of a copy comes here too); a reader's close hears nothing and waits for
  // nothing.
  FileHandle& fh = Fh(fi);
  if (!S_ISREG(fh.inode->type)) return ReplyStatus(req, Status::Ok());
  Status st = fh.inode->data.Flush(fh.open);
  // A writer closes: what its writes reserved past the end goes now (datapath/space.h), before
  // close(2) returns, as a file system's own close leaves no blocks past the end; another
  // descriptor that writes on reserves again. RELEASE tries once more (a writer whose close
  // came while a `dnvme run` lease lived).
  if (fh.writable && fh.open.wrote.load(std::memory_order_relaxed)) {
    TrimSpace(*fh.inode, fh.fd.get());
  }
  ReplyStatus(req, st);
}

void OpRelease(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  if (auto v = VirtualRelease(FsOf(req), ino, fi)) return ReplyStatus(req, *v);
  FileHandle* fh = &Fh(fi);
  if (S_ISREG(fh->inode->type)) {
    // Read-ahead in flight uses the inode, which may be forgotten once no file is open.
    Status st = fh->inode->data.Release();
    if (!st.ok()) {
      DNVME_LOG_THROTTLED(warn, "release of inode {}: write-behind error {}", fh->inode->ino,
                          st.ToString());
    }
    // A writer is done: what its writes reserved past the end goes (datapath/space.h). Before
    // EndOpen: while this open counts, no passthrough open, whose writes the daemon does not
    // see, can begin.
    if (fh->writable) TrimSpace(*fh->inode, fh->fd.get());
    EndOpen(FsOf(req), *fh->inode, fh->passthrough);
  }
  FsOf(req).handles().Dispose(fh);
  ReplyStatus(req, Status::Ok());
}

void OpFsync(fuse_req_t req, fuse_ino_t ino, int datasync, fuse_file_info* fi) {
  if (auto v = VirtualNoop(ino)) return ReplyStatus(req, *v);
  FileHandle& fh = Fh(fi);
  // Every description opened before a write-behind error hears of it at its fsync, once (as
  // Linux's errseq): a reader's too.
  Status st = S_ISREG(fh.inode->type) ? fh.inode->data.Sync(fh.open) : Status::Ok();
  if (st.ok()) {
    st = SyscallStatus(datasync ? fdatasync(fh.fd.get()) : fsync(fh.fd.get()), "fsync");
  }
  ReplyStatus(req, st);
}

void OpFallocate(fuse_req_t req, fuse_ino_t ino, int mode, off_t offset, off_t length,
                 fuse_file_info* fi) {
  if (RefuseVirtual(req, ino, EOPNOTSUPP)) return;
  Fs& fs = FsOf(req);
  Inode& in = fs.inodes().Get(ino);
  ReplyStatus(req, in.data.Change([&] {
    // It allocates: as the caller, so a user stops at the space users may take
    // (docs/security.md).
    ActAsCaller as(req);
    DNVME_RETURN_IF_ERROR(as.status());
    return SyscallStatus(fallocate(Fh(fi).fd.get(), mode, offset, length), "fallocate");
  }));
}

void OpLseek(fuse_req_t req, fuse_ino_t ino, off_t off, int whence, fuse_file_info* fi) {
  if (RefuseVirtual(req, ino, EINVAL)) return;
  if (Status st = FsOf(req).inodes().Get(ino).data.Drain(); !st.ok()) return ReplyStatus(req, st);
  const off_t r = lseek(Fh(fi).fd.get(), off, whence);
  ReplyLseek(req, r < 0 ? Result<off_t>(Status::FromErrno(errno, "lseek")) : Result<off_t>(r));
}

}  // namespace dnvme::fs::ops
