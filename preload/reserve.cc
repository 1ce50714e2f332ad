// Space for extending writes (reserve.h).
#include "preload/reserve.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <mutex>

#include "preload/libc.h"

namespace dnvme::preload {
namespace {

// Space reserved ahead of a writer that extends its file: as much again as the file holds, at
// least kReserveMin, at most kReserveMax. ext4's fallocate waits for every O_DIRECT request in
// flight on the inode (inode_dio_wait), so each reservation drains the write-behind once;
// growing steps keep that to a few drains per file (docs/performance-journal.md).
constexpr int64_t kReserveMin = 64 << 20;
constexpr int64_t kReserveMax = 1 << 30;

// Frees the blocks reserved past the end of the file, if its size is still `size` (nobody
// changed it since the caller looked): truncating a file to its own size frees what lies past
// it (ext4, tmpfs, xfs). Caller holds f.xm.
void TrimLocked(AdoptedFile& f, int fd, int64_t size) {
  struct stat sb {};
  if (fstat(fd, &sb) == 0 && sb.st_size == size) (void)Libc().ftruncate(fd, size);
  f.resv_lo = f.resv_hi = 0;
  f.past_eof = false;
}

// The file was shifted, punched, grown or shrunk: Reserve looks again. Caller holds f.xm.
void ForgetReservationLocked(AdoptedFile& f) {
  f.resv_lo = f.resv_hi = 0;
  f.size_set = -1;
}

}  // namespace

Status BackingFallocate(int fd, int mode, int64_t off, int64_t len) {
  int rc;
  do {
    rc = Libc().fallocate(fd, mode, off, len);
  } while (rc != 0 && errno == EINTR);
  return rc == 0 ? Status::Ok() : Status::FromErrno(errno, "fallocate of the backing file");
}

// The space is reserved past the end (fallocate KEEP_SIZE) and the size then raised with
// ftruncate: the engine's O_DIRECT requests then overwrite unwritten extents inside the file,
// which ext4 runs in parallel under its shared lock (a write past the end runs alone and
// synchronously). ext4's fallocate first waits for every O_DIRECT request in flight on the inode,
// while ftruncate does not: so a writer alone on its file reserves ahead in growing steps
// (kReserveMin..kReserveMax), and extends within the reservation with ftruncate alone; what is
// left past the end is freed when the lease ends or the process exits (TrimReservation). A file
// someone else has open gets exactly its writes' ranges (their truncates would free blocks past
// the end under a reservation). Writes inside the file reserve nothing: holes there are the
// program's own, and an error filling them comes at the next write, fsync or close.
// (The ftruncate that used to extend the file left a zero-filled tail when the space ran out
// under the write-behind.)
Status Reserve(AdoptedFile& f, int64_t off, int64_t end) {
  std::lock_guard lock(f.xm);
  const int fd = f.file.buffered_fd();
  struct stat sb {};
  if (fstat(fd, &sb) != 0) return Status::FromErrno(errno, "fstat of the backing file");
  const int64_t size = sb.st_size;
  if (end <= size) return Status::Ok();
  if (size < f.size_set) f.resv_lo = f.resv_hi = 0;  // shrunk meanwhile: blocks past it went too
  const int64_t from = std::max(off, size);
  if (!f.no_fallocate && !(from >= f.resv_lo && end <= f.resv_hi)) {
    int64_t hi = end;
    if (f.word->shared.load(std::memory_order_seq_cst) == 0) {
      hi = std::max(end, from + std::clamp(size, kReserveMin, kReserveMax));
    }
    Status st = BackingFallocate(fd, FALLOC_FL_KEEP_SIZE, from, hi - from);
    int err = st.error_number();
    if ((err == ENOSPC || err == EDQUOT) && hi > end) {  // not that much: just this write
      TrimLocked(f, fd, size);
      hi = end;
      st = BackingFallocate(fd, FALLOC_FL_KEEP_SIZE, from, end - from);
      err = st.error_number();
    }
    if (err == EOPNOTSUPP || err == ENOSYS) {
      f.no_fallocate = true;  // extended as before, by ftruncate alone
    } else if (!st.ok()) {
      TrimLocked(f, fd, size);  // what a failed fallocate allocated before it failed
      return st;
    } else {
      f.resv_lo = from;
      f.resv_hi = hi;
      f.past_eof = f.past_eof || hi > end;
    }
  }
  int rc;
  do {
    rc = Libc().ftruncate(fd, end);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) return Status::FromErrno(errno, "extending the backing file");
  f.size_set = end;
  return Status::Ok();
}

// Not while someone else has the file open: a write of theirs could extend it between our look
// at the size and the truncate to it.
void TrimReservation(AdoptedFile& f) {
  if (!f.file.valid()) return;
  std::lock_guard lock(f.xm);
  if (!f.past_eof || f.word->shared.load(std::memory_order_seq_cst) != 0) return;
  struct stat sb {};
  if (fstat(f.file.buffered_fd(), &sb) == 0) TrimLocked(f, f.file.buffered_fd(), sb.st_size);
}

// What a grow leaves past the new end is still trimmed at the end of the lease.
Status TruncateAdopted(AdoptedFile& f, int fd, off_t len) {
  std::lock_guard lock(f.xm);
  Status st = Libc().ftruncate(fd, len) == 0 ? Status::Ok() : Status::FromErrno(errno, "ftruncate");
  ForgetReservationLocked(f);
  return st;
}

Status FallocateBacking(AdoptedFile& f, int mode, off_t off, off_t len) {
  std::lock_guard lock(f.xm);
  Status st = BackingFallocate(f.file.buffered_fd(), mode, off, len);
  ForgetReservationLocked(f);  // shifted, punched or grown: Reserve looks again
  return st;
}

}  // namespace dnvme::preload
