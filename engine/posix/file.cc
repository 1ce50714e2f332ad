#include "engine/posix/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <fstream>
#include <string>

namespace dnvme {
namespace {

uint32_t PageSize() {
  long p = sysconf(_SC_PAGESIZE);
  return p > 0 ? static_cast<uint32_t>(p) : 4096u;
}

int OpenRetry(const char* path, int flags, mode_t mode) {
  int fd;
  do {
    fd = ::open(path, flags, mode);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

// The logical block size of the device holding `dev`, from sysfs; 0 if unknown (e.g. tmpfs).
uint32_t SysfsLogicalBlockSize(dev_t dev) {
  std::string base =
      "/sys/dev/block/" + std::to_string(major(dev)) + ":" + std::to_string(minor(dev));
  for (const char* rel : {"/queue/logical_block_size", "/../queue/logical_block_size"}) {
    std::ifstream in(base + rel);
    uint32_t v = 0;
    if (in >> v && v > 0) return v;
  }
  return 0;
}

// Fills the alignment fields; returns false when the kernel says this file has no direct I/O.
bool ProbeAlignment(int fd, IoFile* f) {
  struct statx stx {};
  uint32_t mem = 0, off = 0;
  if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx) == 0) {
    if (stx.stx_mask & STATX_DIOALIGN) {
      if (stx.stx_dio_offset_align == 0) return false;  // no direct I/O on this file
      mem = stx.stx_dio_mem_align;
      off = stx.stx_dio_offset_align;
    } else {
      off = SysfsLogicalBlockSize(makedev(stx.stx_dev_major, stx.stx_dev_minor));
    }
  }
  if (off == 0) off = 4096;
  if (mem == 0) mem = off;
  f->mem_align = mem;
  f->offset_align = off;
  f->edge_align = std::max(off, PageSize());
  return true;
}

Status RefusedDirect(const IoFile& f, DirectPolicy policy, int err) {
  (void)policy;
  return Status::Unsupported(
      err, "O_DIRECT is not supported for '" + f.label +
               "' and direct=required (use direct=auto to fall back to buffered I/O)");
}

// Common tail of OpenIoFile/AdoptIoFd once the direct open was tried.
Status FinishOpen(IoFile* f, UniqueFd direct, int direct_err, DirectPolicy policy) {
  if (direct.valid()) {
    if (ProbeAlignment(direct.get(), f)) {
      f->direct_fd = direct.get();
      f->owned_direct = std::move(direct);
    } else {
      direct_err = EINVAL;
    }
  }
  if (f->direct_fd < 0 && policy != DirectPolicy::kNever) {
    if (policy == DirectPolicy::kRequired) return RefusedDirect(*f, policy, direct_err);
    f->fell_back = true;
  }
  return Status::Ok();
}

int AccessFlags(FileAccess access) {
  switch (access) {
    case FileAccess::kRead:
      return O_RDONLY;
    case FileAccess::kWrite:
      return O_WRONLY;
    case FileAccess::kReadWrite:
      return O_RDWR;
  }
  return O_RDONLY;
}

const char* AccessVerb(FileAccess access) {
  switch (access) {
    case FileAccess::kRead:
      return "open for reading";
    case FileAccess::kWrite:
      return "open for writing";
    case FileAccess::kReadWrite:
      return "open for reading and writing";
  }
  return "open";
}

}  // namespace

void UniqueFd::Reset(int fd) {
  if (fd_ >= 0) (void)::close(fd_);
  fd_ = fd;
}

Result<std::shared_ptr<IoFile>> OpenIoFile(const std::string& path, FileAccess access,
                                           DirectPolicy policy, bool want_read_fd) {
  auto f = std::make_shared<IoFile>();
  f->label = path;
  f->can_read = access != FileAccess::kWrite;
  f->can_write = access != FileAccess::kRead;
  const int base = AccessFlags(access) | (f->can_write ? O_CREAT : 0) | O_CLOEXEC;
  const char* what = AccessVerb(access);

  UniqueFd direct;
  int direct_err = 0;
  if (policy != DirectPolicy::kNever) {
    int fd = OpenRetry(path.c_str(), base | O_DIRECT, 0644);
    if (fd >= 0) {
      direct.Reset(fd);
    } else if (errno == EINVAL) {
      direct_err = EINVAL;  // the filesystem refuses O_DIRECT: policy decides below
    } else {
      return Status::FromErrno(errno, std::string(what) + " '" + path + "'");
    }
  }
  int bfd = OpenRetry(path.c_str(), base, 0644);
  if (bfd < 0) return Status::FromErrno(errno, std::string(what) + " '" + path + "'");
  f->owned_buffered.Reset(bfd);
  f->buffered_fd = bfd;
  DNVME_RETURN_IF_ERROR(FinishOpen(f.get(), std::move(direct), direct_err, policy));
  if (want_read_fd && !f->can_read) {
    int rfd = OpenRetry(path.c_str(), O_RDONLY | O_CLOEXEC, 0);
    if (rfd < 0) return Status::FromErrno(errno, "open for validation '" + path + "'");
    f->owned_read.Reset(rfd);
    f->read_fd = rfd;
  } else if (want_read_fd) {
    f->read_fd = f->buffered_fd;
  }
  return f;
}

int ReopenNoWait(int fd, int flags) {
  const std::string proc = "/proc/self/fd/" + std::to_string(fd);
  const int r = OpenRetry(proc.c_str(), flags | O_NONBLOCK, 0);
  if (r < 0 || (flags & O_NONBLOCK)) return r;
  // F_SETFL changes only the status flags (O_APPEND, O_DIRECT, O_NOATIME, O_NONBLOCK, ...):
  // those asked for, less O_NONBLOCK, are what the open set.
  if (fcntl(r, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    const int err = errno;
    close(r);
    errno = err;
    return -1;
  }
  return r;
}

Result<std::shared_ptr<IoFile>> AdoptIoFd(int fd, FileAccess access, DirectPolicy policy,
                                          bool want_read_fd) {
  auto f = std::make_shared<IoFile>();
  f->label = "fd:" + std::to_string(fd);
  f->can_read = access != FileAccess::kWrite;
  f->can_write = access != FileAccess::kRead;
  int flags = fcntl(fd, F_GETFL);
  if (flags < 0) return Status::FromErrno(errno, "fcntl(F_GETFL) on " + f->label);
  int acc = flags & O_ACCMODE;
  if (f->can_write && acc == O_RDONLY) {
    return Status::IoError(EBADF, f->label + " is not open for writing");
  }
  if (f->can_read && acc == O_WRONLY) {
    return Status::IoError(EBADF, f->label + " is not open for reading");
  }
  const std::string proc = "/proc/self/fd/" + std::to_string(fd);
  const int base = AccessFlags(access) | O_CLOEXEC;

  UniqueFd direct;
  int direct_err = 0;
  if (policy != DirectPolicy::kNever) {
    int dfd = ReopenNoWait(fd, base | O_DIRECT);
    if (dfd >= 0) {
      direct.Reset(dfd);
    } else if (errno == EINVAL) {
      direct_err = EINVAL;
    } else if (flags & O_DIRECT) {
      // /proc unusable (not mounted, or the file is not reopenable): the caller's fd is O_DIRECT
      // already, so use it as is.
      f->direct_fd = fd;
    } else {
      direct_err = errno;
    }
  }
  int bfd = ReopenNoWait(fd, base);
  if (bfd >= 0) {
    f->owned_buffered.Reset(bfd);
    f->buffered_fd = bfd;
  } else if (!(flags & O_DIRECT) && !(flags & O_APPEND)) {
    f->buffered_fd = fd;  // no /proc: the caller's own fd is fine for buffered pread/pwrite
  } else {
    return Status::FromErrno(errno, "reopen " + f->label + " through " + proc);
  }
  if (f->direct_fd >= 0) {
    if (!ProbeAlignment(f->direct_fd, f.get())) f->direct_fd = -1;
  }
  if (f->direct_fd < 0) {
    DNVME_RETURN_IF_ERROR(FinishOpen(f.get(), std::move(direct), direct_err, policy));
  }
  if (want_read_fd) {
    if (!f->can_read) {
      int rfd = ReopenNoWait(fd, O_RDONLY | O_CLOEXEC);
      if (rfd < 0) return Status::FromErrno(errno, "reopen " + f->label + " for validation");
      f->owned_read.Reset(rfd);
      f->read_fd = rfd;
    } else {
      f->read_fd = f->buffered_fd;
    }
  }
  return f;
}

Result<std::shared_ptr<IoFile>> AdoptIoFds(UniqueFd direct, UniqueFd buffered, FileAccess access,
                                           DirectPolicy policy, const std::string& label) {
  if (!buffered.valid())
    return Status::InvalidArgument("no buffered descriptor for '" + label + "'");
  auto f = std::make_shared<IoFile>();
  f->label = label;
  f->can_read = access != FileAccess::kWrite;
  f->can_write = access != FileAccess::kRead;
  f->buffered_fd = buffered.get();
  f->owned_buffered = std::move(buffered);
  const int direct_err = direct.valid() ? 0 : EINVAL;
  DNVME_RETURN_IF_ERROR(FinishOpen(f.get(), std::move(direct), direct_err, policy));
  return f;
}

Status EndOfFileStatus(int fd, const std::string& label, int64_t offset, int64_t len) {
  std::string msg = "read past end of file '" + label + "': asked for " + std::to_string(len) +
                    " bytes at offset " + std::to_string(offset);
  struct stat st {};
  if (fstat(fd, &st) == 0) msg += ", the file has " + std::to_string(st.st_size) + " bytes";
  return Status::EndOfFile(msg);
}

Status PreadFull(int fd, char* buf, int64_t len, int64_t offset, const std::string& label,
                 int64_t* done) {
  int64_t got = 0;
  Status st;
  while (got < len) {
    ssize_t r = ::pread(fd, buf + got, static_cast<size_t>(len - got), offset + got);
    if (r < 0) {
      if (errno == EINTR) continue;
      st = Status::FromErrno(errno, "read of " + std::to_string(len - got) + " bytes at offset " +
                                        std::to_string(offset + got) + " of '" + label + "'");
      break;
    }
    if (r == 0) {
      st = EndOfFileStatus(fd, label, offset, len);
      break;
    }
    got += r;
  }
  *done = got;
  return st;
}

Status PwriteFull(int fd, const char* buf, int64_t len, int64_t offset, const std::string& label,
                  int64_t* done) {
  int64_t put = 0;
  Status st;
  while (put < len) {
    ssize_t r = ::pwrite(fd, buf + put, static_cast<size_t>(len - put), offset + put);
    if (r < 0) {
      if (errno == EINTR) continue;
      st = Status::FromErrno(errno, "write of " + std::to_string(len - put) + " bytes at offset " +
                                        std::to_string(offset + put) + " of '" + label + "'");
      break;
    }
    if (r == 0) {  // pwrite never returns 0 for len > 0 on a regular file; do not spin
      st = Status::IoError(EIO, "write at offset " + std::to_string(offset + put) + " of '" +
                                    label + "' made no progress");
      break;
    }
    put += r;
  }
  *done = put;
  return st;
}

}  // namespace dnvme
