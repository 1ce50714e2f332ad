// Direct transfers of adopted files (transfer.h).
#include "preload/transfer.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>

#include "dnvme/log.h"
#include "preload/adoption.h"
#include "preload/counters.h"
#include "preload/internal.h"
#include "preload/lease.h"
#include "preload/libc.h"
#include "preload/reserve.h"
#include "preload/staging.h"

namespace dnvme::preload {
namespace {

// `io(off)` (a direct pread/pwrite-like transfer) at the descriptor's offset -- the kernel's, in
// the program's descriptor -- which it advances.
template <typename Io>
Result<int64_t> AtOffset(int fd, Io io) {
  const off_t off = lseek(fd, 0, SEEK_CUR);
  if (off < 0) return Status::FromErrno(errno, "lseek");
  Result<int64_t> got = io(off);
  if (got.ok() && *got > 0 && lseek(fd, off + *got, SEEK_SET) < 0) {
    return Status::FromErrno(errno, "lseek");
  }
  return got;
}

// What the mount reads (a mapped file, bounce buffers the engine could not pin).
Result<int64_t> ReadThroughMount(AdoptedFile& f, void* buf, size_t n, off_t off) {
  const ssize_t got = Libc().pread(f.witness, buf, n, off);
  if (got < 0) return Status::FromErrno(errno, "read through the mount");
  return static_cast<int64_t>(got);
}

// Before a direct transfer: the mount's write-behind data of the file lands first when some
// reached the daemon since the last drain. Ok, or the broker's error.
Status DrainMountIfDirty(AdoptedFile& f) {
  if (f.word->mount_dirty.load(std::memory_order_seq_cst) == 0) return Status::Ok();
  ProcessCounters().drains.fetch_add(1, std::memory_order_relaxed);
  return LeaseCall(f, broker::Op::kDrain, 0, 0);
}

}  // namespace

Result<int64_t> DirectIo(const std::shared_ptr<AdoptedFile>& fp, bool write, void* buf, size_t n,
                         off_t off) {
  AdoptedFile& f = *fp;
  if ((write && !f.can_write) || (!write && !f.can_read)) {
    return Status::FromErrno(EBADF, write ? "write of a file not open for writing"
                                          : "read of a file not open for reading");
  }
  Counters& counters = ProcessCounters();
  if (write) {
    // An earlier write's error is reported now, by the next write.
    DNVME_RETURN_IF_ERROR(TakeFirstError(f));
    if (BrokerGone(*f.conn)) {
      // The daemon is gone: its mount answers ENOTCONN, and so does this write rather than go on
      // around a dead mount and be contradicted at close. What earlier writes returned is in the
      // backing file (docs/preload.md, Durability).
      counters.errors.fetch_add(1, std::memory_order_relaxed);
      return Status::FromErrno(ENOTCONN, "write: the mount's daemon is gone");
    }
  }
  // Someone wrote through the mount: what was read ahead may be older than the file, and the
  // mount's write-behind lands before this transfer.
  if (f.word->mount_dirty.load(std::memory_order_seq_cst) != 0) {
    f.data.Invalidate();
    DNVME_RETURN_IF_ERROR(DrainMountIfDirty(f));
  }
  Result<int64_t> done = static_cast<int64_t>(n);
  if (write) {
    // The data path reserves the write's space and extends the file first (datapath/space.h):
    // ENOSPC/EDQUOT are this write's, and ext4 runs the engine's O_DIRECT requests queue_depth
    // deep inside the file (an extending one runs alone, synchronously). A reader may see the new
    // size before the bytes, as with any write still in progress. Without write-behind buffers
    // the data path writes synchronously.
    (void)WritePool();
    done = SubmitWrite(f, static_cast<const char*>(buf), n, off);
    // Pieces submitted before a failure may still land: announce the range all the same.
    if (!done.ok()) NoteWritten(f, off, static_cast<int64_t>(n));
    if (done.ok()) n = static_cast<size_t>(*done);  // fewer when only they fit
  } else if (IsMapped(f)) {
    // The program may have written through its mapping: those pages are the kernel's, and only
    // the mount reads them.
    return ReadThroughMount(f, buf, n, off);
  } else {
    done = ReadThrough(f, static_cast<char*>(buf), static_cast<int64_t>(n), off);
    if (done.status().code() == Status::Code::kResourceExhausted) {
      // The engine could not pin bounce buffers for a buffer O_DIRECT cannot reach (an
      // unprivileged program's RLIMIT_MEMLOCK already spent): the mount reads it, slower but
      // whole, rather than the program seeing ENOMEM for a read that works without us.
      static std::atomic<bool> told{false};
      if (!told.exchange(true)) {
        dnvme::Logger().warn("dnvme run: {}; such reads go through the mount",
                             done.status().ToString());
      }
      counters.mount_fallbacks.fetch_add(1, std::memory_order_relaxed);
      return ReadThroughMount(f, buf, n, off);
    }
  }
  if (!done.ok()) {
    counters.errors.fetch_add(1, std::memory_order_relaxed);
    dnvme::Logger().debug("dnvme run: {}", done.status().ToString());
    return done;
  }
  if (write) {
    counters.writes.fetch_add(1, std::memory_order_relaxed);
    counters.bytes_written.fetch_add(n, std::memory_order_relaxed);
    NoteWritten(f, off, static_cast<int64_t>(n));
    if (IsMapped(f) || f.word->shared.load(std::memory_order_seq_cst) != 0) {
      DNVME_RETURN_IF_ERROR(Announce(f));
    }
  } else {
    counters.reads.fetch_add(1, std::memory_order_relaxed);
    counters.bytes_read.fetch_add(static_cast<uint64_t>(*done), std::memory_order_relaxed);
  }
  return done;
}

size_t IovBytes(const iovec* iov, int cnt) {
  size_t total = 0;
  for (int i = 0; i < cnt; ++i) total += iov[i].iov_len;
  return total;
}

Result<int64_t> DirectVec(const std::shared_ptr<AdoptedFile>& f, bool write, const iovec* iov,
                          int cnt, off_t off) {
  int64_t total = 0;
  for (int i = 0; i < cnt; ++i) {
    if (iov[i].iov_len == 0) continue;
    Result<int64_t> got = DirectIo(f, write, iov[i].iov_base, iov[i].iov_len, off + total);
    if (!got.ok()) {
      if (total == 0) return got;
      // The call returns the bytes already written; the error (a write-behind error DirectIo
      // took, say) must still reach the program: keep it for the next write, fsync or close.
      if (write) KeepFirstError(*f, got.status());
      return total;
    }
    total += *got;
    if (static_cast<size_t>(*got) < iov[i].iov_len) break;
  }
  return total;
}

Result<int64_t> DirectVecAtOffset(int fd, const std::shared_ptr<AdoptedFile>& f, bool write,
                                  const iovec* iov, int cnt) {
  return AtOffset(fd, [&](off_t off) { return DirectVec(f, write, iov, cnt, off); });
}

bool DirectAtOffset(int fd, bool write, void* buf, size_t n, ssize_t* got) {
  auto f = AdoptedForTransfer(fd);
  if (!f) return false;
  Result<int64_t> moved = AtOffset(fd, [&](off_t off) { return DirectIo(f, write, buf, n, off); });
  *got = BytesOrFail(moved);
  return true;
}

// The FUSE kernel refuses every mode but KEEP_SIZE, PUNCH_HOLE and ZERO_RANGE before the daemon
// sees them (so COLLAPSE_RANGE and INSERT_RANGE would fail with EOPNOTSUPP through the mount).
// This process's writes land first (the call may move or drop their bytes), and the change is
// announced at once, as a write seen by others is (the kernel drops its cached pages and
// attributes of the whole file).
Status FallocateAdopted(const std::shared_ptr<AdoptedFile>& f, int mode, off_t off, off_t len) {
  if (!f->can_write) return Status::FromErrno(EBADF, "fallocate of a file not open for writing");
  // As a write (DirectIo): the daemon is gone.
  if (BrokerGone(*f->conn))
    return Status::FromErrno(ENOTCONN, "fallocate: the mount's daemon is gone");
  DNVME_RETURN_IF_ERROR(f->data.Change([&] {
    DNVME_RETURN_IF_ERROR(DrainMountIfDirty(*f));
    return FallocateBacking(*f, mode, off, len);
  }));
  NoteWritten(*f, off, len);
  return Announce(*f);
}

}  // namespace dnvme::preload
