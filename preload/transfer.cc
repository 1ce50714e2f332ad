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
ssize_t AtOffset(int fd, Io io) {
  off_t off = lseek(fd, 0, SEEK_CUR);
  if (off < 0) return -1;
  ssize_t got = io(off);
  if (got > 0 && lseek(fd, off + got, SEEK_SET) < 0) return -1;
  return got;
}

// Before a direct transfer: the mount's write-behind data of the file lands first when some
// reached the daemon since the last drain. Ok, or the broker's error.
Status DrainMountIfDirty(AdoptedFile& f) {
  if (f.word->mount_dirty.load(std::memory_order_seq_cst) == 0) return Status::Ok();
  ProcessCounters().drains.fetch_add(1, std::memory_order_relaxed);
  return LeaseCall(f, broker::Op::kDrain, 0, 0);
}

}  // namespace

ssize_t DirectIo(const std::shared_ptr<AdoptedFile>& fp, bool write, void* buf, size_t n,
                 off_t off) {
  AdoptedFile& f = *fp;
  if ((write && !f.can_write) || (!write && !f.can_read)) {
    errno = EBADF;
    return -1;
  }
  if (write) {
    // An earlier write's error is reported now, by the next write.
    if (Status err = TakeFirstError(f); !err.ok()) {
      errno = err.ErrnoOr();
      return -1;
    }
    if (BrokerGone(*f.conn)) {
      // The daemon is gone: its mount answers ENOTCONN, and so does this write rather than go on
      // around a dead mount and be contradicted at close. What earlier writes returned is in the
      // backing file (docs/preload.md, Durability).
      ProcessCounters().errors.fetch_add(1, std::memory_order_relaxed);
      errno = ENOTCONN;
      return -1;
    }
  }
  // Someone wrote through the mount: what was read ahead may be older than the file, and the
  // mount's write-behind lands before this transfer.
  if (f.word->mount_dirty.load(std::memory_order_seq_cst) != 0) {
    f.data.Invalidate();
    ProcessCounters().drains.fetch_add(1, std::memory_order_relaxed);
    if (Status st = LeaseCall(f, broker::Op::kDrain, 0, 0); !st.ok()) {
      errno = st.ErrnoOr();
      return -1;
    }
  }
  Status st;
  ssize_t done = static_cast<ssize_t>(n);
  if (write) {
    // ext4 runs an O_DIRECT write that extends the file synchronously, one request after the
    // other (it must update the size when the data is in): reserve the space and extend the file
    // first, so the engine's requests run queue_depth deep into the new range. A reader may see
    // the new size before the bytes, as with any write still in progress.
    if (Status err = Reserve(f, off, static_cast<int64_t>(off) + static_cast<int64_t>(n));
        !err.ok()) {
      ProcessCounters().errors.fetch_add(1, std::memory_order_relaxed);
      errno = err.ErrnoOr();
      return -1;
    }
    if (WritePool() != nullptr) {
      st = SubmitWrite(f, static_cast<const char*>(buf), n, off);
      // Pieces submitted before a failure may still land: announce the range all the same.
      if (!st.ok()) NoteWritten(f, off, static_cast<int64_t>(n));
    } else {
      AioHandle* engine = EngineIfMade();
      st = f.data.Change(
          [&] { return engine->sync_pwrite(buf, static_cast<int64_t>(n), f.file, off); });
    }
  } else {
    if (IsMapped(f)) {
      // The program may have written through its mapping: those pages are the kernel's, and
      // only the mount reads them.
      return Libc().pread(f.witness, buf, n, off);
    }
    Result<int64_t> got = ReadThrough(f, static_cast<char*>(buf), static_cast<int64_t>(n), off);
    if (got.status().code() == Status::Code::kResourceExhausted) {
      // The engine could not pin bounce buffers for a buffer O_DIRECT cannot reach (an
      // unprivileged program's RLIMIT_MEMLOCK already spent): the mount reads it, slower but
      // whole, rather than the program seeing ENOMEM for a read that works without us.
      static std::atomic<bool> told{false};
      if (!told.exchange(true)) {
        dnvme::Logger().warn("dnvme run: {}; such reads go through the mount",
                             got.status().ToString());
      }
      ProcessCounters().mount_fallbacks.fetch_add(1, std::memory_order_relaxed);
      return Libc().pread(f.witness, buf, n, off);
    }
    if (got.ok()) done = static_cast<ssize_t>(*got);
    st = got.status();
  }
  if (!st.ok()) {
    ProcessCounters().errors.fetch_add(1, std::memory_order_relaxed);
    dnvme::Logger().debug("dnvme run: {}", st.ToString());
    errno = st.ErrnoOr();
    return -1;
  }
  Counters& counters = ProcessCounters();
  if (write) {
    counters.writes.fetch_add(1, std::memory_order_relaxed);
    counters.bytes_written.fetch_add(n, std::memory_order_relaxed);
    NoteWritten(f, off, static_cast<int64_t>(n));
    if (IsMapped(f) || f.word->shared.load(std::memory_order_seq_cst) != 0) {
      if (Status a = Announce(f); !a.ok()) {
        errno = a.ErrnoOr();
        return -1;
      }
    }
  } else {
    counters.reads.fetch_add(1, std::memory_order_relaxed);
    counters.bytes_read.fetch_add(static_cast<uint64_t>(done), std::memory_order_relaxed);
  }
  return done;
}

size_t IovBytes(const iovec* iov, int cnt) {
  size_t total = 0;
  for (int i = 0; i < cnt; ++i) total += iov[i].iov_len;
  return total;
}

ssize_t DirectVec(const std::shared_ptr<AdoptedFile>& f, bool write, const iovec* iov, int cnt,
                  off_t off) {
  ssize_t total = 0;
  for (int i = 0; i < cnt; ++i) {
    if (iov[i].iov_len == 0) continue;
    ssize_t got = DirectIo(f, write, iov[i].iov_base, iov[i].iov_len, off + total);
    if (got < 0 && total > 0 && write) {
      // The call returns the bytes already written; the error (a write-behind error DirectIo
      // took, say) must still reach the program: keep it for the next write, fsync or close.
      KeepFirstError(*f, Status::FromErrno(errno, "write"));
    }
    if (got < 0) return total > 0 ? total : -1;
    total += got;
    if (static_cast<size_t>(got) < iov[i].iov_len) break;
  }
  return total;
}

ssize_t DirectVecAtOffset(int fd, const std::shared_ptr<AdoptedFile>& f, bool write,
                          const iovec* iov, int cnt) {
  return AtOffset(fd, [&](off_t off) { return DirectVec(f, write, iov, cnt, off); });
}

bool DirectAtOffset(int fd, bool write, void* buf, size_t n, ssize_t* got) {
  auto f = AdoptedForTransfer(fd);
  if (!f) return false;
  *got = AtOffset(fd, [&](off_t off) { return DirectIo(f, write, buf, n, off); });
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
