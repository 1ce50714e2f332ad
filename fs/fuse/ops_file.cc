// FUSE ops on open files: open/create (the backing file registered with the engine once), read
// and write through the data path (fs/core/read_path.cc), flush/release/fsync (which drain the
// inode's write-behind), fallocate and lseek. Errors leave as errno only here (Status::ErrnoOr).
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

#include "engine/common/log.h"
#include "fs/caps.h"
#include "fs/core/fs.h"
#include "fs/core/read_path.h"
#include "fs/fuse/control_dir.h"
#include "fs/fuse/ops.h"
#include "fs/fuse/ops_common.h"
#include "fs/fuse/passthrough.h"
#include "fs/transport/write_source.h"

namespace dnvme::fs::ops {

// Opens the backing object of `in` with the client's flags, minus those the engine handles
// itself (O_DIRECT: the engine decides per request; O_APPEND: the kernel already turned it into
// offsets) and those that only make sense at create time. Never blocks (ReopenNoWait): an open
// that would wait for a lease to be broken -- a user's lease on its own file, which its holder
// may keep for lease-break-time, 45 s -- is answered EWOULDBLOCK at once instead of holding this
// loop thread (docs/security.md).
int OpenBacking(Inode& in, int flags, UniqueFd* out) {
  const int strip = O_DIRECT | O_APPEND | O_CREAT | O_EXCL | O_NOCTTY;
  int fd = ReopenNoWait(in.fd, (flags & ~strip) | O_CLOEXEC);
  if (fd < 0) return errno;
  out->Reset(fd);
  return 0;
}

// `write_as`: the identity a non-root writer's data is written under (WriterIdentity).
int MakeHandle(Fs& fs, Inode& in, int flags, UniqueFd fd,
               std::shared_ptr<const FsIdentity> write_as, UidCharge files, FileHandle** out) {
  auto fh = std::make_unique<FileHandle>();
  fh->files = std::move(files);
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
      Logger().warn("engine open of inode {} failed: {}", in.ino, ref.status().ToString());
      return ref.status().ErrnoOr();
    }
    fh->file = std::move(ref).value();
    fh->wb_errors = in.wb.Sample();
  }
  fh->fd = std::move(fd);
  *out = fh.release();
  fs.handles().Track(*out);
  return 0;
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
  AfterLeaseWrites(fs, in, /*share_if_busy=*/false, "the open", [req, &fs, fh, fi, entry, leased] {
    Inode& in = *fh->inode;
    const OpenMode how = S_ISREG(in.type) ? BeginOpen(fs, in, fi.flags) : OpenMode{};
    fh->passthrough = how.passthrough;
    if (leased) fs.AfterExternalWrite(in);
    int rc;
    if (entry) {
      rc = how.passthrough ? ReplyCreatePassthrough(req, *entry, fi, how.backing_id)
                           : fuse_reply_create(req, &*entry, &fi);
    } else {
      rc = how.passthrough ? ReplyOpenPassthrough(req, fi, how.backing_id)
                           : fuse_reply_open(req, &fi);
    }
    if (rc == -ENOENT) AbandonOpen(fs, fh);  // the opener was interrupted
  });
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
  UidCharge files;
  UniqueFd fd;
  int err = ChargeOpen(req, &files);
  if (!err) err = OpenBacking(in, fi->flags, &fd);
  FileHandle* fh = nullptr;
  if (!err) {
    const bool writes = (fi->flags & O_ACCMODE) != O_RDONLY;
    err = MakeHandle(fs, in, fi->flags, std::move(fd), writes ? WriterIdentity(req) : nullptr,
                     std::move(files), &fh);
  }
  if (err) {
    fuse_reply_err(req, err);
    return;
  }
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
    Logger().warn("removing '{}' after a failed create: {}", LogEscape(name), std::strerror(errno));
  }
}

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
  UidCharge files;
  if (int err = ChargeOpen(req, &files); err != 0) return (void)fuse_reply_err(req, err);
  int fd;
  bool created = true;
  {
    ActAsCaller as(req);
    if (as.error()) return (void)fuse_reply_err(req, as.error());
    fd = openat(dir.fd, name, flags | O_CREAT | O_EXCL, mode);
    if (fd < 0 && errno == EEXIST && !(fi->flags & O_EXCL)) {
      created = false;
      fd = openat(dir.fd, name, flags | O_NOFOLLOW | O_NONBLOCK);
    }
    if (fd < 0) return (void)fuse_reply_err(req, errno);
  }
  UniqueFd owned(fd);
  struct stat mine {};
  if (fstat(fd, &mine) != 0) return (void)fuse_reply_err(req, errno);
  if (!created) {
    if (!S_ISREG(mine.st_mode)) {
      return (void)fuse_reply_err(req, S_ISDIR(mine.st_mode) ? EISDIR : EEXIST);
    }
    const int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0)
      return (void)fuse_reply_err(req, errno);
  }
  fuse_entry_param e{};
  int err = fs.inodes().Lookup(parent, name, fuse_req_ctx(req)->uid, &e);
  FileHandle* fh = nullptr;
  if (!err) {
    // The name may mean another object by now: the handle is of the file we opened, and the
    // entry must agree with it.
    if (mine.st_ino != e.attr.st_ino || mine.st_dev != e.attr.st_dev) err = ESTALE;
    const bool writes = (fi->flags & O_ACCMODE) != O_RDONLY;
    if (!err) {
      err = MakeHandle(fs, fs.inodes().Get(e.ino), fi->flags, std::move(owned),
                       writes ? WriterIdentity(req) : nullptr, std::move(files), &fh);
    }
    if (err) fs.inodes().Forget(e.ino, 1);
  }
  if (err) {
    if (created) RemoveIfStill(dir, name, mine);
    fuse_reply_err(req, err);
    return;
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
                       [req](const Result<std::string>& got) {
                         if (!got.ok()) return ReplyStatus(req, got.status());
                         ReplyBuf(req, got.value());
                       });
  }
  Fs& fs = FsOf(req);
  FileHandle& fh = Fh(fi);
  MountCounters::NoteMax(fs.mount().counters().largest_read, size);
  // An O_DIRECT client (libaio at queue depth N) sends N reads at once: with async_reply they are
  // answered from the engine's completion, freeing this thread for the next one (measured slower
  // on 2 cores, see options.h, hence off by default).
  if (fh.client_direct && fs.mount().opts().async_reply &&
      ReadAsync(fs.mount(), fh, size, off, [req](Result<std::span<const char>> got) {
        if (got.ok()) {
          fuse_reply_buf(req, got.value().data(), got.value().size());
        } else {
          fuse_reply_err(req, got.status().ErrnoOr());
        }
      })) {
    return;
  }
  char* scratch = ThreadScratch(size);
  if (scratch == nullptr) {
    fuse_reply_err(req, ENOMEM);
    return;
  }
  datapath::ReadReply reply;
  Result<int64_t> n = Read(fs.mount(), fh, scratch, size, off, &reply);
  if (!n.ok()) {
    fuse_reply_err(req, n.status().ErrnoOr());
  } else {
    fuse_reply_iov(req, reply.iov.data(), static_cast<int>(reply.iov.size()));
  }
}

void OpWriteBuf(fuse_req_t req, fuse_ino_t ino, fuse_bufvec* bufv, off_t off, fuse_file_info* fi) {
  if (IsVirtual(ino)) {
    // A ctl request is answered later, from its writer's lane (VirtualWrite): `req` stays valid
    // until that one reply.
    return VirtualWrite(FsOf(req), CallerOf(req), bufv, fi,
                        [req](const Result<size_t>& written) { ReplyWritten(req, written); });
  }
  Fs& fs = FsOf(req);
  FileHandle& fh = Fh(fi);
  // What the transport knows of this request, taken once, before anything else: its write flags
  // (only a direct write's say who wrote, WriterUnprivileged; a page-cache write's are not
  // looked up) and the pool its payload may be adopted from.
  Transport* const transport = fs.mount().transport();
  const IncomingWrite incoming =
      transport ? transport->IncomingWriteOf(*bufv, !fh.page_cache_writes) : IncomingWrite{};
  if (WriterUnprivileged(req, fh, incoming.write_flags)) {
    bool killed = false;
    if (int err = KillPrivs(req, *fh.inode, &killed); err != 0) {
      fuse_reply_err(req, err);
      return;
    }
    // The kernel keeps its cached mode through a direct write (and through the set-group-ID case
    // it leaves to us after a page-cache one): without this an exec or a permission check could
    // still see the cleared bit until the attributes time out.
    if (killed) fs.mount().ForgetCachedAttributes(ino);
  }
  const size_t size = fuse_buf_size(bufv);
  MountCounters::NoteMax(fs.mount().counters().largest_write, size);
  char* scratch = ThreadScratch(size);
  if (scratch == nullptr) {
    fuse_reply_err(req, ENOMEM);
    return;
  }
  // The payload as the transport received it: the pool its memory may be adopted from, if any.
  WriteSource src(bufv, incoming.pool);
  fh.inode->ra.Invalidate();
  int err =
      fh.inode->wb.Write(fh.file, fh.page_cache_writes, src, size, off, scratch, &fh.wb_errors)
          .ErrnoOr();
  if (!err) fh.wrote = true;
  // Again now that the bytes are accepted: a reader that drained before them may have fetched
  // the old bytes meanwhile (datapath/read_ahead.h, Generation).
  fh.inode->ra.Invalidate();
  // Bytes now in write-behind that a `dnvme run` client's direct transfer must not pass: it
  // drains before its next one (fs/broker/leases.h).
  if (!err && fh.inode->leases.count() > 0) fh.inode->leases.MarkMountDirty();
  if (err) {
    fuse_reply_err(req, err);
  } else {
    fuse_reply_write(req, size);
  }
}

void OpFlush(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  if (auto v = VirtualNoop(ino)) return ReplyStatus(req, *v);
  // close(2): a description that wrote sees a write-behind error it has not heard of (the data
  // need not be durable yet) and its fsync still will (DrainAndPeek: a forked child's
  // close-on-exec of a copy comes here too); a reader's close hears nothing and waits for
  // nothing.
  FileHandle& fh = Fh(fi);
  int err =
      S_ISREG(fh.inode->type) && fh.wrote ? fh.inode->wb.DrainAndPeek(fh.wb_errors).ErrnoOr() : 0;
  fuse_reply_err(req, err);
}

void OpRelease(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  if (auto v = VirtualRelease(FsOf(req), ino, fi)) return ReplyStatus(req, *v);
  FileHandle* fh = &Fh(fi);
  if (S_ISREG(fh->inode->type)) {
    Status st = fh->inode->wb.Drain(nullptr);
    if (!st.ok()) {
      Logger().warn("release of inode {}: write-behind error {}", fh->inode->ino, st.ToString());
    }
    // Read-ahead in flight uses the inode, which may be forgotten once no file is open.
    fh->inode->ra.Quiesce();
    EndOpen(FsOf(req), *fh->inode, fh->passthrough);
  }
  FsOf(req).handles().Dispose(fh);
  fuse_reply_err(req, 0);
}

void OpFsync(fuse_req_t req, fuse_ino_t ino, int datasync, fuse_file_info* fi) {
  if (auto v = VirtualNoop(ino)) return ReplyStatus(req, *v);
  FileHandle& fh = Fh(fi);
  // Every description opened before a write-behind error hears of it at its fsync, once (as
  // Linux's errseq): a reader's too.
  int err = S_ISREG(fh.inode->type) ? fh.inode->wb.Drain(&fh.wb_errors).ErrnoOr() : 0;
  if (!err) {
    int rc = datasync ? fdatasync(fh.fd.get()) : fsync(fh.fd.get());
    if (rc != 0) err = errno;
  }
  fuse_reply_err(req, err);
}

void OpFallocate(fuse_req_t req, fuse_ino_t ino, int mode, off_t offset, off_t length,
                 fuse_file_info* fi) {
  if (RefuseVirtual(req, ino, EOPNOTSUPP)) return;
  Fs& fs = FsOf(req);
  Inode& in = fs.inodes().Get(ino);
  int err = in.wb.Drain(nullptr).ErrnoOr();
  in.ra.Invalidate();
  if (!err) {
    // It allocates: as the caller, so a user stops at the space users may take (docs/security.md).
    ActAsCaller as(req);
    err = as.error();
    if (!err && fallocate(Fh(fi).fd.get(), mode, offset, length) != 0) err = errno;
  }
  in.ra.Invalidate();  // after the change too (datapath/read_ahead.h, Generation)
  fuse_reply_err(req, err);
}

void OpLseek(fuse_req_t req, fuse_ino_t ino, off_t off, int whence, fuse_file_info* fi) {
  if (RefuseVirtual(req, ino, EINVAL)) return;
  Fs& fs = FsOf(req);
  int err = fs.inodes().Get(ino).wb.Drain(nullptr).ErrnoOr();
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

}  // namespace dnvme::fs::ops
