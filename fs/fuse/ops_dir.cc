// FUSE ops on directories: opendir/readdir(plus)/releasedir/fsyncdir over the backing directory,
// the control directory .dnvme/ listed at the root.
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

struct DirHandle : OpenHandle {
  DIR* dp = nullptr;
  off_t offset = 0;
  ~DirHandle() override {
    if (dp) closedir(dp);
  }
};

namespace {

// An OPENDIR's handle: charged to the caller (ChargeOpen), the backing directory's stream.
Result<std::unique_ptr<DirHandle>> OpenDir(fuse_req_t req, Inode& in) {
  DNVME_ASSIGN_OR_RETURN(OpenCharge charge, ChargeOpen(req, kDirOpenFds));
  int fd = openat(in.fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Status::FromErrno(errno, "opendir");
  auto dh = std::make_unique<DirHandle>();
  dh->files = std::move(charge.files);
  dh->fds = std::move(charge.fds);
  dh->dp = fdopendir(fd);
  if (dh->dp == nullptr) {
    Status st = Status::FromErrno(errno, "fdopendir");
    close(fd);
    return st;
  }
  return dh;
}

}  // namespace

void OpOpendir(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  if (auto v = VirtualOpendir(ino, fi)) return ReplyVirtualOpen(req, ino, *v, fi);
  Result<std::unique_ptr<DirHandle>> dh = OpenDir(req, FsOf(req).inodes().Get(ino));
  if (!dh.ok()) return ReplyStatus(req, dh.status());
  fi->fh = reinterpret_cast<uint64_t>(dh.value().get());
  fi->cache_readdir = 0;
  Fs& fs = FsOf(req);
  DirHandle* raw = dh.value().release();
  fs.handles().Track(raw);
  if (!ReplyOpen(req, *fi)) fs.handles().Dispose(raw);
}

// Packs the control dir's entries into one reply of at most `size` bytes, as many as fit.
void ReplyVirtualDir(fuse_req_t req, size_t size, bool plus,
                     const std::vector<VirtualDirEntry>& entries) {
  std::string buf(size, '\0');
  size_t used = 0;
  for (const VirtualDirEntry& d : entries) {
    const size_t need =
        plus ? fuse_add_direntry_plus(req, &buf[used], size - used, d.name, &d.entry, d.next)
             : fuse_add_direntry(req, &buf[used], size - used, d.name, &d.entry.attr, d.next);
    if (need > size - used) break;  // the kernel never counted it (the lookup is not taken)
    used += need;
  }
  ReplyData(req, std::span<const char>(buf.data(), used));
}

void DoReaddir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, fuse_file_info* fi,
               bool plus) {
  if (auto v = VirtualReaddir(FsOf(req), ino, off, plus))
    return ReplyVirtualDir(req, size, plus, *v);
  Fs& fs = FsOf(req);
  auto* dh = reinterpret_cast<DirHandle*>(fi->fh);
  std::string buf(size, '\0');
  size_t used = 0;
  if (off != dh->offset) {
    seekdir(dh->dp, off);
    dh->offset = off;
  }
  Status err;
  // Past the pruner's mark entries go without a lookup: the kernel looks up those it uses, and
  // a listing of a big directory does not fill the daemon's table (InodeTable).
  const bool crowded = plus && fs.inodes().Crowded();
  while (true) {
    errno = 0;
    struct dirent* d = readdir(dh->dp);
    if (d == nullptr) {
      if (errno != 0) err = Status::FromErrno(errno, "readdir");  // else the end
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
      Status lerr;
      if (!dots && !crowded) {
        Result<fuse_entry_param> looked =
            fs.inodes().Lookup(ino, d->d_name, fuse_req_ctx(req)->uid);
        if (looked.ok()) {
          e = looked.value();
        } else {
          lerr = looked.status();
        }
      }
      if (lerr.error_number() == ENOENT) continue;  // removed while listing
      if (!lerr.ok() && lerr.error_number() != ENFILE) {
        err = lerr;
        break;
      }
      if (dots || crowded || !lerr.ok()) {
        // No lookup (node id 0): "." and "..", a crowded table, and a name over the reader's
        // share of inodes or the daemon's descriptors (its own LOOKUP will answer ENFILE).
        e = fuse_entry_param{};
        e.attr.st_ino = d->d_ino;
        e.attr.st_mode = static_cast<mode_t>(d->d_type) << 12;
      }
      need = fuse_add_direntry_plus(req, &buf[used], size - used, d->d_name, &e, d->d_off);
      if (need > size - used) {
        if (e.ino != 0) fs.inodes().Forget(e.ino, 1);  // not handed to the kernel after all
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
  if (!err.ok() && used == 0) return ReplyStatus(req, err);
  ReplyData(req, std::span<const char>(buf.data(), used));
}

void OpReaddir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, fuse_file_info* fi) {
  DoReaddir(req, ino, size, off, fi, false);
}

void OpReaddirplus(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, fuse_file_info* fi) {
  DoReaddir(req, ino, size, off, fi, true);
}

void OpReleasedir(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  if (auto v = VirtualReleasedir(ino)) return ReplyStatus(req, *v);
  FsOf(req).handles().Dispose(reinterpret_cast<DirHandle*>(fi->fh));
  ReplyStatus(req, Status::Ok());
}

void OpFsyncdir(fuse_req_t req, fuse_ino_t ino, int datasync, fuse_file_info* fi) {
  if (auto v = VirtualNoop(ino)) return ReplyStatus(req, *v);
  int fd = dirfd(reinterpret_cast<DirHandle*>(fi->fh)->dp);
  ReplyStatus(req, SyscallStatus(datasync ? fdatasync(fd) : fsync(fd), "fsync of a directory"));
}

}  // namespace dnvme::fs::ops
