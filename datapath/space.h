// Space for the writes the data path acknowledges before their bytes are on disk: one file's
// reservation (SpaceReservation) and, where a file system cannot preallocate, a budget shared by
// every file of the user (SpaceBudget).
//
// Why: ext4 and tmpfs reserve space when they accept a buffered write (delayed allocation still
// reserves), so ENOSPC or EDQUOT reaches the write(2) that does not fit. A write-behind that
// acknowledges first and allocates at its flush tells a writer its bytes were written and then
// cannot land them (issue 54: through the mount a 160 MiB tmpfs acknowledged 38 MiB more than
// fit, and torch.save exited 0 with a truncated checkpoint). So before a write is acknowledged,
// the blocks its range needs exist:
//   - past the end of the file: fallocate(FALLOC_FL_KEEP_SIZE), as the writer (FileRef's write
//     identity: its quota applies, ext4's root reserve only to root), in steps ahead of a writer
//     alone on its file -- as much again as the file holds, SpaceOptions::step_min..step_max,
//     and at most a sixteenth of the space free for users, so other writers of a nearly full
//     file system are not refused for blocks this one may never use -- because ext4's fallocate
//     waits for every O_DIRECT request in flight on the inode (inode_dio_wait): each step
//     empties the write-behind's pipeline once;
//   - inside the file: blocks it holds already (written, unwritten or delayed: FIEMAP, else
//     SEEK_HOLE) need nothing; a hole gets exactly the write's range, so a sparse file stays
//     sparse;
//   - where that cannot work -- the file system has no fallocate (EOPNOTSUPP: ext4 without
//     extents, ramfs, ...), or an overwrite needs new blocks though the old ones exist (btrfs
//     copies on write; an extent shared with another file) -- the write is acknowledged early
//     only while statvfs shows room for it, for everything the user's write-behind may hold
//     unlanded and for what was allowed since statvfs was read (SpaceBudget); otherwise it is
//     written through (Grant::through), and the write itself meets the error.
// A write that fits only in part is granted that part (a short write, as ext4's buffered write
// returns the bytes that fit); the next write gets the error.
//
// `extend` (`dnvme run`): the grant also raises the file's size to the end of the write
// (ftruncate): ext4 runs O_DIRECT writes inside the file in parallel under its shared lock, and an
// extending one alone, synchronously; a process's write-behind has no other way to tell the mount
// the size it will have.
//
// What lies reserved past the end when the writers are done is freed by Trim (the mount: a
// writer's release; `dnvme run`: the end of a lease, and exit): ftruncate to the file's own size,
// which frees blocks past it on ext4, xfs and tmpfs, with the modification time put back (the
// truncate stamps it). A daemon killed before that leaves them allocated, as fallocate(2) does,
// until the file is truncated or removed.
//
// Thread contract: SpaceReservation and SpaceBudget are thread-safe (one mutex each, leaves: a
// SpaceReservation's is held across its fallocate/ftruncate/FIEMAP calls and, for Trim, taken
// under the file's WriteBehind mutex). Reserve's grant holds only while no Trim or Forget ran
// since (epoch()): FileData checks that under the WriteBehind's mutex before it accepts the bytes.
// Trim must be called only while no write of the file is in flight or can start (FileData::Trim
// arranges it).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <vector>

#include "dnvme/handle.h"
#include "dnvme/status.h"

namespace dnvme::datapath {

// The user's choice (FileDataShared::space).
struct SpaceOptions {
  bool reserve = false;  // writes are acknowledged before they land: reserve first
  bool extend = false;   // a grant also extends the file to the write's end (see above)
  // Every byte the user's write-behind can hold acknowledged and not yet on disk (its chunks,
  // adopted buffers and pipes): what SpaceBudget keeps free beyond a write.
  int64_t unlanded_max = 0;
  // The step ahead of a lone writer past the end: the file's size, clamped to these.
  int64_t step_min = int64_t{8} << 20;
  int64_t step_max = int64_t{1} << 30;
  // The fault seam: tests stand in for fallocate(2) (-1 with errno set, as it fails); null: it.
  int (*fallocate)(int fd, int mode, off_t off, off_t len) = nullptr;
};

// Free space of the file systems a user writes to, as statvfs shows it, less what was allowed
// since it was read. One per user of the data path (the mount, a `dnvme run` process).
class SpaceBudget {
 public:
  // Whether `len` more bytes may be written behind to the file system `dev` (of `fd`) while
  // `unlanded` bytes may be in flight: statvfs's f_bavail (users' space: conservative for root)
  // must cover the write, twice `unlanded` (what was pending when statvfs was read and what is
  // pending now), kMargin and everything allowed since. Reads statvfs again after kFresh, and
  // before it says no. False also when statvfs fails (the write is then written through).
  bool Allows(int fd, dev_t dev, int64_t len, int64_t unlanded);

  static constexpr std::chrono::milliseconds kFresh{20};
  static constexpr int64_t kMargin = int64_t{8} << 20;  // metadata, another writer's burst

 private:
  struct Look {
    dev_t dev = 0;
    std::chrono::steady_clock::time_point at;
    int64_t avail = 0;    // bytes, when read
    int64_t allowed = 0;  // bytes allowed since
  };
  static constexpr size_t kLooks = 16;  // file systems remembered (oldest forgotten)
  std::mutex mu_;
  std::vector<Look> looks_;  // guarded by mu_
};

class SpaceReservation {
 public:
  struct Grant {
    int64_t bytes = 0;     // of the write, from its start, that may be acknowledged early
    bool through = false;  // write them through: no reservation or budget covers them
    uint64_t epoch = 0;    // epoch() when granted
  };

  // Space for `len` bytes at `off` of `file` (its buffered descriptor), before a write of them is
  // acknowledged. `alone`: nobody else has the file open (a step may be reserved past its end:
  // another opener's truncate would free it under us). A grant of fewer bytes: only they fit.
  // ENOSPC/EDQUOT (the writer's error) when none does; other errors of fallocate, ftruncate or
  // fstat as they come (EROFS, EIO, EPERM, EFBIG).
  Result<Grant> Reserve(const SpaceOptions& opts, SpaceBudget* budget, const FileRef& file,
                        int64_t off, int64_t len, bool alone);
  // The file changed behind the reservation (truncated, punched, shifted, written by another
  // process): the next write looks again, and grants made before are stale.
  void Forget();
  // Frees the blocks reserved past the end of the file through `fd` (opened for writing), keeping
  // its modification time. Ok when there was nothing to free. The caller guarantees that no write
  // of the file is in flight or starts meanwhile.
  Status Trim(int fd);
  // Whether blocks may lie reserved past the end of the file (Trim has something to do).
  bool holds_past_eof();
  // Bumped by Forget and Trim: a grant of an earlier epoch no longer holds.
  uint64_t epoch() const { return epoch_.load(std::memory_order_acquire); }

 private:
  // Marks [a, b) as backed, joining the range known so far when they touch.
  void CoverLocked(int64_t a, int64_t b);
  void ForgetLocked();
  // `extend`: raises the file (of `size` bytes) to `end` when it is shorter.
  Status ExtendLocked(int fd, int64_t size, int64_t end);
  // The budget decides for `len` bytes: acknowledged early (extending the file when asked), or
  // written through.
  Result<Grant> BudgetLocked(const SpaceOptions& opts, SpaceBudget* budget, const FileRef& file,
                             int64_t off, int64_t len, int64_t size, dev_t dev);

  std::mutex mu_;
  // Guarded by mu_:
  int64_t lo_ = 0, hi_ = 0;         // [lo_, hi_): every block there exists or is reserved
  int64_t size_seen_ = -1;          // the size at the last look or grant (smaller: shrunk since)
  bool past_eof_ = false;           // blocks may lie reserved past the end
  bool no_fallocate_ = false;       // the file system refused fallocate (EOPNOTSUPP): budget only
  int copies_on_write_ = -1;        // -1: not known yet; 1: overwrites need new blocks (btrfs)
  std::atomic<uint64_t> epoch_{0};  // written under mu_
};

}  // namespace dnvme::datapath
