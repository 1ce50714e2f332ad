// What the stdio interposers (stdio.cc) use of libdnvme_preload.so's core; interposers.cc uses
// them too. Defined in settings.cc (IsLarge), transfer.cc (DirectAtOffset) and
// descriptor_table.cc (the rest).
//
// Thread contract: every function is thread-safe, as the interposed functions are.
#ifndef DNVME_PRELOAD_INTERNAL_H_
#define DNVME_PRELOAD_INTERNAL_H_

#include <sys/types.h>

#include <cerrno>
#include <cstddef>

#include "dnvme/status.h"

namespace dnvme::preload {

// Whether a transfer of `n` bytes is large enough for the engine (DNVME_PRELOAD_MIN_BYTES).
bool IsLarge(size_t n);

// A transfer of [buf, buf + n) at `fd`'s file offset by the engine, as read(2)/write(2) would do
// it (the offset advances; a read stops at end of file). Returns false, doing nothing, when the
// mount is to serve `fd`; else true with *got = the bytes moved or -1 (errno set).
bool DirectAtOffset(int fd, bool write, void* buf, size_t n, ssize_t* got);

// Before the mount serves `fd`: this process's direct writes of its file are announced (they
// landed and the kernel's cached pages were dropped).
void BeforeMountUse(int fd);

// The same before the mount writes `fd`'s file; what was read ahead of it is dropped too.
void BeforeMountWrite(int fd);

// Before fd is closed behind libc's interposable close (fclose): forgets it; returns the first
// error of its file's write-behind when it was the file's last descriptor, else Ok.
Status ForgetBeforeClose(int fd);

// Every adopted file's pending announcement (fflush(NULL)).
void AnnounceEverything();

// Where a Status meets errno: the interposed functions (interposers.cc, stdio.cc) alone call
// these; the core returns Status and Result.
// Fails a libc-shaped call with `st`: errno = st.ErrnoOr() (EIO when it carries none); -1.
inline int FailWith(const Status& st) {
  errno = st.ErrnoOr();
  return -1;
}
// The bytes of a libc-shaped transfer: `moved`, or FailWith its error.
inline ssize_t BytesOrFail(const Result<int64_t>& moved) {
  return moved.ok() ? static_cast<ssize_t>(moved.value()) : FailWith(moved.status());
}
// 0 for Ok, else FailWith(st): a call whose whole outcome is `st`.
inline int ZeroOrFail(const Status& st) { return st.ok() ? 0 : FailWith(st); }
// A call's result after libc's `rc`: an earlier error `first` (a write-behind error), if any, is
// what it reports.
inline int ErrorFirst(const Status& first, int rc) { return first.ok() ? rc : FailWith(first); }

}  // namespace dnvme::preload

#endif  // DNVME_PRELOAD_INTERNAL_H_
