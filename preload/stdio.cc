// stdio under `dnvme run` (docs/preload.md): large fread/fwrite calls on a FILE of a dnvmefs file
// go to the engine like read(2)/write(2) do; everything else stays glibc's.
//
// glibc's stdio calls its own internal read/write, which no preload can interpose, so the large
// calls are taken here, at the FILE level: numpy's tofile/fromfile (np.save/np.load of an
// array) and C programs copying with fread/fwrite are one call per array or per block. The
// FILE's buffer is honoured exactly: bytes it holds are consumed first, pending writes flushed
// first, and afterwards the FILE is left as glibc leaves it after its own unbuffered transfer
// (empty buffer, offset to be asked of the kernel), so ftell, fseek, ungetc and small calls
// that follow see the same stream they would without us. The fields used are those of
// <bits/types/struct_FILE.h>, glibc's public ABI (getc/putc macros compile against them); the
// few flag bits not in that header are glibc's libio.h values, unchanged since glibc 2.1.
//
// A FILE's small writes reach the mount inside glibc (its internal write, when its buffer fills)
// where we cannot see them; so a large fwrite's direct bytes are announced before the call
// returns (they landed, the kernel's cached pages of them dropped), and no FILE write ever meets
// an unannounced direct write of its own call.
//
// Thread contract: as stdio's own -- each call holds the FILE's lock (flockfile) throughout, the
// _unlocked variants expect the caller to.
#include <dlfcn.h>
#include <stdio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "preload/internal.h"

namespace {

namespace pl = dnvme::preload;

// glibc libio.h flag bits not in the public header.
constexpr int kNoReads = 0x0004;
constexpr int kNoWrites = 0x0008;
constexpr int kInBackup = 0x0100;
constexpr int kCurrentlyPutting = 0x0800;
constexpr int kIsAppending = 0x1000;
constexpr off64_t kPosBad = -1;  // _IO_pos_BAD: "ask the kernel"

struct Stdio {
  size_t (*fread_unlocked)(void*, size_t, size_t, FILE*);
  size_t (*fwrite_unlocked)(const void*, size_t, size_t, FILE*);
  int (*fflush)(FILE*);
  int (*fflush_unlocked)(FILE*);
  int (*fclose)(FILE*);
};

Stdio& L() {
  static Stdio s = [] {
    Stdio v{};
    v.fread_unlocked =
        reinterpret_cast<decltype(v.fread_unlocked)>(dlsym(RTLD_NEXT, "fread_unlocked"));
    v.fwrite_unlocked =
        reinterpret_cast<decltype(v.fwrite_unlocked)>(dlsym(RTLD_NEXT, "fwrite_unlocked"));
    v.fflush = reinterpret_cast<decltype(v.fflush)>(dlsym(RTLD_NEXT, "fflush"));
    v.fflush_unlocked =
        reinterpret_cast<decltype(v.fflush_unlocked)>(dlsym(RTLD_NEXT, "fflush_unlocked"));
    v.fclose = reinterpret_cast<decltype(v.fclose)>(dlsym(RTLD_NEXT, "fclose"));
    return v;
  }();
  return s;
}

// Holds a FILE's lock when the caller did not (fread vs fread_unlocked).
class FileLock {
 public:
  FileLock(FILE* f, bool take) : f_(take ? f : nullptr) {
    if (f_) flockfile(f_);
  }
  ~FileLock() {
    if (f_) funlockfile(f_);
  }
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;

 private:
  FILE* f_;
};

// The FILE's descriptor, -1 for one without (fmemopen, fopencookie); errno is kept (fileno sets
// it for those, and a successful call must not look failed to a program that checks errno).
int FdOf(FILE* f) {
  const int saved = errno;
  const int fd = fileno_unlocked(f);
  errno = saved;
  return fd;
}

// The same when no wide orientation or ungetc backup area complicates the FILE's buffer.
int PlainFd(FILE* f) {
  if (f->_mode > 0 || (f->_flags & kInBackup)) return -1;
  return FdOf(f);
}

// After a transfer around the buffer: the state glibc leaves after its own unbuffered read
// (fileops.c, _IO_file_xsgetn): empty get and put areas, put mode off, offset unknown.
void ResetBuffer(FILE* f) {
  f->_IO_read_base = f->_IO_read_ptr = f->_IO_read_end = f->_IO_buf_base;
  f->_IO_write_base = f->_IO_write_ptr = f->_IO_write_end = f->_IO_buf_base;
  f->_flags &= ~kCurrentlyPutting;
  f->_offset = kPosBad;
}

// The call's bytes in *n when they make a large transfer (and fit in a size_t).
bool LargeCall(size_t size, size_t nmemb, size_t* n) {
  return !__builtin_mul_overflow(size, nmemb, n) && pl::IsLarge(*n);
}

size_t Read(void* ptr, size_t size, size_t nmemb, FILE* f, bool lock) {
  size_t n = 0;
  if (size == 0 || nmemb == 0) return 0;
  if (!LargeCall(size, nmemb, &n)) {
    pl::BeforeMountUse(FdOf(f));
    FileLock held(f, lock);
    return L().fread_unlocked(ptr, size, nmemb, f);
  }
  FileLock held(f, lock);
  const int fd = PlainFd(f);
  // Pending writes (glibc would flush them first), an end already seen (glibc's EOF is sticky),
  // a write-only stream: glibc's own path.
  if (fd < 0 || f->_IO_write_ptr > f->_IO_write_base || (f->_flags & (_IO_EOF_SEEN | kNoReads))) {
    if (fd >= 0) pl::BeforeMountUse(fd);
    return L().fread_unlocked(ptr, size, nmemb, f);
  }
  char* out = static_cast<char*>(ptr);
  size_t done = 0;
  // What the buffer holds comes first; the kernel's offset is just past it.
  if (f->_IO_read_ptr != nullptr && f->_IO_read_end > f->_IO_read_ptr) {
    done = std::min(n, static_cast<size_t>(f->_IO_read_end - f->_IO_read_ptr));
    std::memcpy(out, f->_IO_read_ptr, done);
    f->_IO_read_ptr += done;
  }
  if (n - done == 0 || !pl::IsLarge(n - done)) {
    if (n > done) done += L().fread_unlocked(out + done, 1, n - done, f);
    return done / size;
  }
  ssize_t got = 0;
  if (!pl::DirectAtOffset(fd, false, out + done, n - done, &got)) {
    pl::BeforeMountUse(fd);
    done += L().fread_unlocked(out + done, 1, n - done, f);
    return done / size;
  }
  // The buffer is empty and the kernel's offset moved: the state glibc expects after a direct
  // read of its own.
  ResetBuffer(f);
  while (got > 0) {
    done += static_cast<size_t>(got);
    if (done == n) return done / size;
    // Short: the end of the file, or it shrank; ask again to tell which (as glibc does).
    if (!pl::DirectAtOffset(fd, false, out + done, n - done, &got)) {
      return (done + L().fread_unlocked(out + done, 1, n - done, f)) / size;
    }
  }
  f->_flags |= got == 0 ? _IO_EOF_SEEN : _IO_ERR_SEEN;
  return done / size;
}

size_t Write(const void* ptr, size_t size, size_t nmemb, FILE* f, bool lock) {
  size_t n = 0;
  if (size == 0 || nmemb == 0) return 0;
  if (!LargeCall(size, nmemb, &n)) {
    pl::BeforeMountWrite(FdOf(f));
    FileLock held(f, lock);
    return L().fwrite_unlocked(ptr, size, nmemb, f);
  }
  FileLock held(f, lock);
  const int fd = PlainFd(f);
  // Append mode (atomic at the end of file, the mount's job), a read-only stream: glibc's own.
  if (fd < 0 || (f->_flags & (kIsAppending | kNoWrites))) {
    if (fd >= 0) pl::BeforeMountWrite(fd);
    return L().fwrite_unlocked(ptr, size, nmemb, f);
  }
  // What the buffer holds goes first, through the mount; glibc's flush also seeks the kernel's
  // offset back over input read ahead but not consumed, so it is the stream's position after.
  pl::BeforeMountWrite(fd);
  if (L().fflush_unlocked(f) != 0) return 0;
  const char* in = static_cast<const char*>(ptr);
  size_t done = 0;
  ssize_t got = 0;
  if (!pl::DirectAtOffset(fd, true, const_cast<char*>(in), n, &got)) {
    return L().fwrite_unlocked(ptr, size, nmemb, f);
  }
  ResetBuffer(f);
  while (got > 0) {
    done += static_cast<size_t>(got);
    if (done == n) break;
    if (!pl::DirectAtOffset(fd, true, const_cast<char*>(in + done), n - done, &got)) {
      done += L().fwrite_unlocked(in + done, 1, n - done, f);
      break;
    }
  }
  if (got < 0) f->_flags |= _IO_ERR_SEEN;
  // The FILE's next small writes reach the mount behind our back (see the file comment).
  pl::BeforeMountUse(fd);
  return done / size;
}

}  // namespace

extern "C" {

size_t fread(void* ptr, size_t size, size_t nmemb, FILE* f) {
  return Read(ptr, size, nmemb, f, true);
}
size_t fread_unlocked(void* ptr, size_t size, size_t nmemb, FILE* f) {
  return Read(ptr, size, nmemb, f, false);
}
size_t fwrite(const void* ptr, size_t size, size_t nmemb, FILE* f) {
  return Write(ptr, size, nmemb, f, true);
}
size_t fwrite_unlocked(const void* ptr, size_t size, size_t nmemb, FILE* f) {
  return Write(ptr, size, nmemb, f, false);
}

int fflush(FILE* f) {
  if (f == nullptr) {
    pl::AnnounceEverything();
  } else {
    pl::BeforeMountWrite(FdOf(f));
  }
  return L().fflush(f);
}
int fflush_unlocked(FILE* f) {
  if (f != nullptr) pl::BeforeMountWrite(FdOf(f));
  return L().fflush_unlocked(f);
}

// glibc closes the descriptor inside: forget it first (its write-behind lands and is announced;
// the buffer's last bytes then go through the mount). A write-behind error is fclose's.
int fclose(FILE* f) {
  const int fd = FdOf(f);
  dnvme::Status err;
  if (fd >= 0) {
    pl::BeforeMountWrite(fd);
    err = pl::ForgetBeforeClose(fd);
  }
  const int rc = L().fclose(f);
  return pl::ErrorFirst(err, rc);  // EOF (-1) with errno for the write-behind's error
}

}  // extern "C"
