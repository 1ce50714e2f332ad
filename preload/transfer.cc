// Direct transfers of adopted files (transfer.h).
#include "preload/transfer.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>

#include "engine/common/log.h"
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
  // Reads see this process's writes: let its write-behind land first (the read-ahead's
  // generation is taken before: a change after the drain makes the window suspect,
  // datapath/read_ahead.h). An earlier write's error is reported now, by the next write.
  const uint64_t generation = write ? 0 : f.ra.Generation();
  if (!write) {
    DrainWrites(f);
  } else if (int err = TakeFirstError(f); err != 0) {
    errno = err;
    return -1;
  } else if (BrokerGone(*f.conn)) {
    // The daemon is gone: its mount answers ENOTCONN, and so does this write rather than go on
    // around a dead mount and be contradicted at close. What earlier writes returned is in the
    // backing file (docs/preload.md, Durability).
    ProcessCounters().errors.fetch_add(1, std::memory_order_relaxed);
    errno = ENOTCONN;
    return -1;
  }
  const bool mount_dirty = f.word->mount_dirty.load(std::memory_order_seq_cst) != 0;
  // What was read ahead may be older than the file after this write, or once someone wrote
  // through the mount.
  if (write || mount_dirty) ForgetReadAhead(f);
  if (mount_dirty) {
    ProcessCounters().drains.fetch_add(1, std::memory_order_relaxed);
    if (Status st = LeaseCall(f, broker::Op::kDrain, 0, 0); !st.ok()) {
      errno = st.ErrnoOr();
      return -1;
    }
  }
  AioHandle* engine = EngineIfMade();
  Status st;
  if (write) {
    // ext4 runs an O_DIRECT write that extends the file synchronously, one request after the
    // other (it must update the size when the data is in): reserve the space and extend the file
    // first, so the engine's requests run queue_depth deep into the new range. A reader may see
    // the new size before the bytes, as with any write still in progress.
    if (int err = Reserve(f, off, static_cast<int64_t>(off) + static_cast<int64_t>(n)); err != 0) {
      ProcessCounters().errors.fetch_add(1, std::memory_order_relaxed);
      errno = err;
      return -1;
    }
    if (WritePool() != nullptr) {
      const int err = SubmitWrite(f, static_cast<const char*>(buf), n, off);
      // Again now that the write is in: a reader that drained before it may have fetched the old
      // bytes meanwhile.
      ForgetReadAhead(f);
      if (err != 0) {
        // Pieces submitted before the failure may still land: announce the range all the same.
        NoteWritten(f, off, static_cast<int64_t>(n));
        errno = err;
        return -1;
      }
    } else {
      st = engine->sync_pwrite(buf, static_cast<int64_t>(n), f.file, off);
      ForgetReadAhead(f);
    }
  } else {
    if (IsMapped(f)) {
      // The program may have written through its mapping: those pages are the kernel's, and
      // only the mount reads them.
      return Libc().pread(f.witness, buf, n, off);
    }
    struct stat sb {};
    if (fstat(f.file.buffered_fd(), &sb) != 0) return -1;
    if (off >= sb.st_size) return 0;
    n = static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(n), sb.st_size - off));
    st = ReadThrough(f, static_cast<char*>(buf), static_cast<int64_t>(n), off, sb.st_size,
                     generation);
    if (st.code() == Status::Code::kEndOfFile) {
      // Truncated meanwhile: let the mount answer with what is there.
      return Libc().pread(f.witness, buf, n, off);
    }
    if (st.code() == Status::Code::kResourceExhausted) {
      // The engine could not pin bounce buffers for a buffer O_DIRECT cannot reach (an
      // unprivileged program's RLIMIT_MEMLOCK already spent): the mount reads it, slower but
      // whole, rather than the program seeing ENOMEM for a read that works without us.
      static std::atomic<bool> told{false};
      if (!told.exchange(true)) {
        dnvme::Logger().warn("dnvme run: {}; such reads go through the mount", st.ToString());
      }
      ProcessCounters().mount_fallbacks.fetch_add(1, std::memory_order_relaxed);
      return Libc().pread(f.witness, buf, n, off);
    }
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
    counters.bytes_read.fetch_add(n, std::memory_order_relaxed);
  }
  return static_cast<ssize_t>(n);
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
      KeepFirstError(*f, errno);
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
int FallocateAdopted(const std::shared_ptr<AdoptedFile>& f, int mode, off_t off, off_t len) {
  if (!f->can_write) {
    errno = EBADF;
    return -1;
  }
  if (BrokerGone(*f->conn)) {
    errno = ENOTCONN;  // as a write (DirectIo): the daemon is gone
    return -1;
  }
  DrainWrites(*f);
  ForgetReadAhead(*f);
  if (Status st = DrainMountIfDirty(*f); !st.ok()) {
    errno = st.ErrnoOr();
    return -1;
  }
  const int err = FallocateBacking(*f, mode, off, len);
  ForgetReadAhead(*f);  // again, after the change
  if (err != 0) {
    errno = err;
    return -1;
  }
  NoteWritten(*f, off, len);
  if (Status st = Announce(*f); !st.ok()) {
    errno = st.ErrnoOr();
    return -1;
  }
  return 0;
}

}  // namespace dnvme::preload
