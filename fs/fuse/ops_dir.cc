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

#include "engine/common/log.h"
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

void OpOpendir(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  if (auto v = VirtualOpendir(ino, fi)) return ReplyVirtualOpen(req, ino, *v, fi);
  Inode& in = FsOf(req).inodes().Get(ino);
  UidCharge files;
  if (int err = ChargeOpen(req, &files); err != 0) return (void)fuse_reply_err(req, err);
  int fd = openat(in.fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    fuse_reply_err(req, errno);
    return;
  }
  auto dh = std::make_unique<DirHandle>();
  dh->files = std::move(files);
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
  fs.handles().Track(raw);
  if (fuse_reply_open(req, fi) == -ENOENT) fs.handles().Dispose(raw);
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
  fuse_reply_buf(req, buf.data(), used);
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
      const int lerr = dots ? 0 : fs.inodes().Lookup(ino, d->d_name, fuse_req_ctx(req)->uid, &e);
      if (lerr == ENOENT) continue;  // removed while listing
      if (lerr != 0 && lerr != ENFILE) {
        err = lerr;
        break;
      }
      if (dots || lerr == ENFILE) {
        // No lookup (node id 0): "." and "..", and a name over the reader's share of inodes
        // (max_inodes_per_uid; its own LOOKUP will answer ENFILE).
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
  if (auto v = VirtualReleasedir(ino)) return ReplyStatus(req, *v);
  FsOf(req).handles().Dispose(reinterpret_cast<DirHandle*>(fi->fh));
  fuse_reply_err(req, 0);
}

void OpFsyncdir(fuse_req_t req, fuse_ino_t ino, int datasync, fuse_file_info* fi) {
  if (auto v = VirtualNoop(ino)) return ReplyStatus(req, *v);
  int fd = dirfd(reinterpret_cast<DirHandle*>(fi->fh)->dp);
  int rc = datasync ? fdatasync(fd) : fsync(fd);
  fuse_reply_err(req, rc == 0 ? 0 : errno);
}

}  // namespace dnvme::fs::ops
