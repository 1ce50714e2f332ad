// libdnvme_preload.so: what `dnvme run -- CMD` preloads (docs/preload.md). This file holds the
// interposed libc functions, thin: each hands a large transfer of an adopted file to the engine
// (transfer.h), keeps the descriptor table true across dup, close and open
// (descriptor_table.h), settles coherence before the mount serves a file
// (BeforeMountUse/BeforeMountWrite) -- or is libc's own call.
//
// For a regular file on a dnvmefs mount, a read or write of at least DNVME_PRELOAD_MIN_BYTES
// (128 KiB) is done by this process's own engine (AioHandle: parallel O_DIRECT libaio, from the
// caller's buffer when aligned, else through pinned bounce buffers) on descriptors of the backing
// file the daemon's broker handed over (include/dnvme/broker.h) -- no copy through /dev/fuse.
// Everything else (small transfers, metadata, mmap, files elsewhere, anything not understood)
// goes to libc unchanged, and so through the mount.
//
// The program keeps its own descriptor of the mount: its file offset, O_CLOEXEC, locks and
// mmap stay the kernel's. A file is adopted lazily, at the first large transfer on its descriptor
// (whatever opened it: open, fopen, a shell's redirection before exec): adoption.h.
//
// Writes are write-behind from pinned staging buffers, but a write returns only once every byte
// of it is in the kernel (the engine's Submitted notice): submitted AIO outlives the process, so
// a returned write survives exit, _exit and kill -9 as on ext4 (staging.h).
// A write's space is reserved first (fallocate, datapath/space.h): ENOSPC is that write's
// error, and it leaves no zero-filled tail.
// fallocate(2) of an adopted file goes to the backing file in every mode (docs/preload.md).
//
// Coherence (fs/broker/leases.h): before a direct transfer, data that reached the mount's
// write-behind is drained when the lease word says so; after a direct write the daemon drops its
// read-ahead and the kernel's cached pages and attributes -- at once when the lease is shared,
// else before this process next uses the mount for that file, and at fsync, close, mmap, fork and
// exec (lease.h). Attributes of a leased file are answered uncached, so stat(2) sees the size at
// once.
//
// Descriptors closed behind libc's back (fclose, close_range) are noticed: before each transfer
// on an adopted descriptor, kcmp(KCMP_FILE) compares it with the duplicate taken at adoption.
//
// These functions, and stdio.cc's, are the only ones the library means to export: the rest is
// the dnvme_preload_core archive, linked with --exclude-libs (preload/CMakeLists.txt).
//
// Thread contract: every interposed function is thread-safe; the locks and their order are in
// adopted_file.h. fork() keeps working (lifetime.h).
#include <fcntl.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstdarg>
#include <cstdint>
#include <memory>

#include "preload/adopted_file.h"
#include "preload/adoption.h"
#include "preload/descriptor_state.h"
#include "preload/descriptor_table.h"
#include "preload/internal.h"
#include "preload/libc.h"
#include "preload/lifetime.h"
#include "preload/map_fill.h"
#include "preload/reserve.h"
#include "preload/settings.h"
#include "preload/staging.h"
#include "preload/transfer.h"

namespace {

namespace pl = dnvme::preload;

mode_t ModeArg(int flags, va_list ap) {
  return (flags & (O_CREAT | __O_TMPFILE)) ? static_cast<mode_t>(va_arg(ap, int)) : 0;
}

// Fills the libc table and reads the settings while the process is still one thread, and
// installs the exit and fork hooks.
__attribute__((constructor)) void Init() {
  (void)pl::Libc();
  (void)pl::PreloadSettings();
  pl::InstallProcessHooks();
}

}  // namespace

extern "C" {

ssize_t read(int fd, void* buf, size_t n) {
  ssize_t got;
  if (pl::IsLarge(n) && pl::DirectAtOffset(fd, false, buf, n, &got)) return got;
  pl::BeforeMountUse(fd);
  return pl::Libc().read(fd, buf, n);
}

ssize_t write(int fd, const void* buf, size_t n) {
  ssize_t got;
  if (pl::IsLarge(n) && pl::DirectAtOffset(fd, true, const_cast<void*>(buf), n, &got)) {
    return got;
  }
  pl::BeforeMountWrite(fd);
  return pl::Libc().write(fd, buf, n);
}

ssize_t pread(int fd, void* buf, size_t n, off_t off) {
  if (pl::IsLarge(n) && pl::StateOf(fd) != pl::kNotOurs && off >= 0) {
    if (auto r = pl::AdoptedForTransfer(fd))
      return pl::BytesOrFail(pl::DirectIo(r, false, buf, n, off));
  }
  pl::BeforeMountUse(fd);
  return pl::Libc().pread(fd, buf, n, off);
}
ssize_t pread64(int fd, void* buf, size_t n, off_t off) { return pread(fd, buf, n, off); }

ssize_t pwrite(int fd, const void* buf, size_t n, off_t off) {
  if (pl::IsLarge(n) && pl::StateOf(fd) != pl::kNotOurs && off >= 0) {
    if (auto r = pl::AdoptedForTransfer(fd))
      return pl::BytesOrFail(pl::DirectIo(r, true, const_cast<void*>(buf), n, off));
  }
  pl::BeforeMountWrite(fd);
  return pl::Libc().pwrite(fd, buf, n, off);
}
ssize_t pwrite64(int fd, const void* buf, size_t n, off_t off) { return pwrite(fd, buf, n, off); }

ssize_t readv(int fd, const iovec* iov, int cnt) {
  if (cnt > 0 && pl::IsLarge(pl::IovBytes(iov, cnt)) && pl::StateOf(fd) != pl::kNotOurs) {
    if (auto r = pl::AdoptedForTransfer(fd)) {
      return pl::BytesOrFail(pl::DirectVecAtOffset(fd, r, false, iov, cnt));
    }
  }
  pl::BeforeMountUse(fd);
  return pl::Libc().readv(fd, iov, cnt);
}

ssize_t writev(int fd, const iovec* iov, int cnt) {
  if (cnt > 0 && pl::IsLarge(pl::IovBytes(iov, cnt)) && pl::StateOf(fd) != pl::kNotOurs) {
    if (auto r = pl::AdoptedForTransfer(fd)) {
      return pl::BytesOrFail(pl::DirectVecAtOffset(fd, r, true, iov, cnt));
    }
  }
  pl::BeforeMountWrite(fd);
  return pl::Libc().writev(fd, iov, cnt);
}

ssize_t preadv(int fd, const iovec* iov, int cnt, off_t off) {
  if (cnt > 0 && off >= 0 && pl::IsLarge(pl::IovBytes(iov, cnt)) &&
      pl::StateOf(fd) != pl::kNotOurs) {
    if (auto r = pl::AdoptedForTransfer(fd))
      return pl::BytesOrFail(pl::DirectVec(r, false, iov, cnt, off));
  }
  pl::BeforeMountUse(fd);
  return pl::Libc().preadv(fd, iov, cnt, off);
}
ssize_t preadv64(int fd, const iovec* iov, int cnt, off_t off) { return preadv(fd, iov, cnt, off); }

ssize_t pwritev(int fd, const iovec* iov, int cnt, off_t off) {
  if (cnt > 0 && off >= 0 && pl::IsLarge(pl::IovBytes(iov, cnt)) &&
      pl::StateOf(fd) != pl::kNotOurs) {
    if (auto r = pl::AdoptedForTransfer(fd))
      return pl::BytesOrFail(pl::DirectVec(r, true, iov, cnt, off));
  }
  pl::BeforeMountWrite(fd);
  return pl::Libc().pwritev(fd, iov, cnt, off);
}
ssize_t pwritev64(int fd, const iovec* iov, int cnt, off_t off) {
  return pwritev(fd, iov, cnt, off);
}

// The flags (RWF_*) ask for things only the kernel's path gives (RWF_APPEND, RWF_NOWAIT...):
// with any flag, or the current offset (-1), the mount serves the call.
ssize_t preadv2(int fd, const iovec* iov, int cnt, off_t off, int flags) {
  if (flags == 0 && off >= 0) return preadv(fd, iov, cnt, off);
  pl::BeforeMountUse(fd);
  return pl::Libc().preadv2(fd, iov, cnt, off, flags);
}
ssize_t preadv64v2(int fd, const iovec* iov, int cnt, off_t off, int flags) {
  return preadv2(fd, iov, cnt, off, flags);
}
ssize_t pwritev2(int fd, const iovec* iov, int cnt, off_t off, int flags) {
  if (flags == 0 && off >= 0) return pwritev(fd, iov, cnt, off);
  pl::BeforeMountWrite(fd);
  return pl::Libc().pwritev2(fd, iov, cnt, off, flags);
}
ssize_t pwritev64v2(int fd, const iovec* iov, int cnt, off_t off, int flags) {
  return pwritev2(fd, iov, cnt, off, flags);
}

int open(const char* path, int flags, ...) {
  va_list ap;
  va_start(ap, flags);
  const mode_t mode = ModeArg(flags, ap);
  va_end(ap);
  return pl::OpenedDescriptor(pl::Libc().open(path, flags, mode));
}
int open64(const char* path, int flags, ...) {
  va_list ap;
  va_start(ap, flags);
  const mode_t mode = ModeArg(flags, ap);
  va_end(ap);
  return pl::OpenedDescriptor(pl::Libc().open64(path, flags, mode));
}
int openat(int dirfd, const char* path, int flags, ...) {
  va_list ap;
  va_start(ap, flags);
  const mode_t mode = ModeArg(flags, ap);
  va_end(ap);
  return pl::OpenedDescriptor(pl::Libc().openat(dirfd, path, flags, mode));
}
int openat64(int dirfd, const char* path, int flags, ...) {
  va_list ap;
  va_start(ap, flags);
  const mode_t mode = ModeArg(flags, ap);
  va_end(ap);
  return pl::OpenedDescriptor(pl::Libc().openat64(dirfd, path, flags, mode));
}
int creat(const char* path, mode_t mode) {
  return pl::OpenedDescriptor(pl::Libc().creat(path, mode));
}
int creat64(const char* path, mode_t mode) {
  return pl::OpenedDescriptor(pl::Libc().creat64(path, mode));
}

int close(int fd) {
  // A write-behind error of the file's last descriptor is close's.
  const dnvme::Status err = pl::ForgetBeforeClose(fd);
  return pl::ErrorFirst(err, pl::Libc().close(fd));
}

int dup(int fd) {
  pl::BeforeMountUse(fd);
  return pl::Duplicated(fd, pl::Libc().dup(fd));
}

int dup2(int fd, int nfd) {
  pl::BeforeMountUse(fd);
  // dup2 closes nfd first, silently (an error of its file is lost, as close's would be).
  if (fd != nfd && pl::StateOf(nfd) == pl::kOurs) (void)pl::DropDescriptor(nfd);
  const int rc = pl::Libc().dup2(fd, nfd);
  return fd == nfd ? rc : pl::Duplicated(fd, rc);
}

int dup3(int fd, int nfd, int flags) {
  pl::BeforeMountUse(fd);
  if (fd != nfd && pl::StateOf(nfd) == pl::kOurs) (void)pl::DropDescriptor(nfd);
  return pl::Duplicated(fd, pl::Libc().dup3(fd, nfd, flags));
}

// fcntl's third argument is an int, a long or a pointer by command; passing it on as a pointer
// hands every one over unchanged (the x86-64 and aarch64 calling conventions carry each in a full
// register). Python's os.dup is F_DUPFD_CLOEXEC.
int fcntl(int fd, int cmd, ...) {
  va_list ap;
  va_start(ap, cmd);
  void* arg = va_arg(ap, void*);
  va_end(ap);
  switch (cmd) {
    case F_DUPFD:
    case F_DUPFD_CLOEXEC:
      pl::BeforeMountUse(fd);
      return pl::Duplicated(
          fd, pl::Libc().fcntl(fd, cmd, static_cast<int>(reinterpret_cast<intptr_t>(arg))));
    case F_SETFL: {
      // Appends must stay atomic at the end of the file: the mount serves it from now on. What
      // this process wrote directly lands first; a failure of it is this call's (flags unset).
      if ((reinterpret_cast<intptr_t>(arg) & O_APPEND) && pl::StateOf(fd) == pl::kOurs) {
        if (dnvme::Status err = pl::Disown(fd); !err.ok()) return pl::FailWith(err);
      }
      return pl::Libc().fcntl(fd, cmd, static_cast<int>(reinterpret_cast<intptr_t>(arg)));
    }
    default:
      return pl::Libc().fcntl(fd, cmd, arg);
  }
}
int fcntl64(int fd, int cmd, ...) {
  va_list ap;
  va_start(ap, cmd);
  void* arg = va_arg(ap, void*);
  va_end(ap);
  return fcntl(fd, cmd, arg);
}

// The kernel copies these through the mount: it must see this process's direct writes of the
// source first, and what was read ahead of the destination is stale after them.
ssize_t copy_file_range(int in, off64_t* in_off, int out, off64_t* out_off, size_t len,
                        unsigned flags) {
  pl::BeforeMountUse(in);
  pl::BeforeMountWrite(out);
  return pl::Libc().copy_file_range(in, in_off, out, out_off, len, flags);
}
ssize_t sendfile(int out, int in, off_t* off, size_t count) {
  pl::BeforeMountUse(in);
  pl::BeforeMountWrite(out);
  return pl::Libc().sendfile(out, in, off, count);
}
ssize_t sendfile64(int out, int in, off64_t* off, size_t count) {
  return sendfile(out, in, off, count);
}
ssize_t splice(int in, off64_t* in_off, int out, off64_t* out_off, size_t len, unsigned flags) {
  pl::BeforeMountUse(in);
  pl::BeforeMountWrite(out);
  return pl::Libc().splice(in, in_off, out, out_off, len, flags);
}

int fsync(int fd) {
  const dnvme::Status err = pl::LandWrites(fd);
  // The kernel's view first; the daemon's fsync covers the direct bytes too.
  pl::BeforeMountUse(fd);
  return pl::ErrorFirst(err, pl::Libc().fsync(fd));
}

int fdatasync(int fd) {
  const dnvme::Status err = pl::LandWrites(fd);
  pl::BeforeMountUse(fd);
  return pl::ErrorFirst(err, pl::Libc().fdatasync(fd));
}

int ftruncate(int fd, off_t len) {
  pl::BeforeMountUse(fd);
  std::shared_ptr<pl::AdoptedFile> r =
      pl::StateOf(fd) == pl::kOurs ? pl::LookupAdopted(fd) : nullptr;
  if (!r) return pl::Libc().ftruncate(fd, len);
  // This process's writes land first and the read-ahead window goes before and after
  // (datapath/file_data.h, Change).
  return pl::ZeroOrFail(r->data.Change([&] { return pl::TruncateAdopted(fd, len); }));
}
int ftruncate64(int fd, off_t len) { return ftruncate(fd, len); }

// Every mode reaches the backing file for an adopted file: the FUSE kernel refuses all but
// KEEP_SIZE, PUNCH_HOLE and ZERO_RANGE before the daemon sees them (so COLLAPSE_RANGE and
// INSERT_RANGE would fail with EOPNOTSUPP through the mount). This process's writes land first
// (the call may move or drop their bytes), what the mount's write-behind holds is drained into
// the file, and the change is announced at once, as a write seen by others is (the kernel drops
// its cached pages and attributes of the whole file).
int fallocate(int fd, int mode, off_t off, off_t len) {
  std::shared_ptr<pl::AdoptedFile> r =
      pl::StateOf(fd) == pl::kNotOurs ? nullptr : pl::AdoptedForTransfer(fd);
  if (!r) {
    pl::BeforeMountWrite(fd);
    return pl::Libc().fallocate(fd, mode, off, len);
  }
  return pl::ZeroOrFail(pl::FallocateAdopted(r, mode, off, len));
}
int fallocate64(int fd, int mode, off_t off, off_t len) { return fallocate(fd, mode, off, len); }

void* mmap(void* addr, size_t len, int prot, int flags, int fd, off_t off) {
  pl::BeforeMap(fd);
  void* p = pl::Libc().mmap(addr, len, prot, flags, fd, off);
  // Never for anonymous memory (allocators map theirs through here, maybe before our
  // constructor ran): nothing of ours runs for it.
  if (p != MAP_FAILED && fd >= 0 && (flags & MAP_ANONYMOUS) == 0) {
    const int saved = errno;
    pl::AfterMap(p, len, prot, fd, off);
    errno = saved;
  }
  return p;
}
void* mmap64(void* addr, size_t len, int prot, int flags, int fd, off_t off) {
  return mmap(addr, len, prot, flags, fd, off);
}

int execve(const char* path, char* const argv[], char* const envp[]) {
  pl::AnnounceEverything();
  return pl::Libc().execve(path, argv, envp);
}
int execv(const char* path, char* const argv[]) {
  pl::AnnounceEverything();
  return pl::Libc().execv(path, argv);
}
int execvp(const char* file, char* const argv[]) {
  pl::AnnounceEverything();
  return pl::Libc().execvp(file, argv);
}
int execvpe(const char* file, char* const argv[], char* const envp[]) {
  pl::AnnounceEverything();
  return pl::Libc().execvpe(file, argv, envp);
}
int posix_spawn(pid_t* pid, const char* path, const posix_spawn_file_actions_t* fa,
                const posix_spawnattr_t* attr, char* const argv[], char* const envp[]) {
  pl::AnnounceEverything();
  return pl::Libc().posix_spawn(pid, path, fa, attr, argv, envp);
}
int posix_spawnp(pid_t* pid, const char* file, const posix_spawn_file_actions_t* fa,
                 const posix_spawnattr_t* attr, char* const argv[], char* const envp[]) {
  pl::AnnounceEverything();
  return pl::Libc().posix_spawnp(pid, file, fa, attr, argv, envp);
}

}  // extern "C"
