// WriteBehind: one file's data accepted from writers and not yet on disk. One mechanism for both
// users of the data path: the mount (fs/, where the writer is a FUSE WRITE) and `dnvme run`
// (preload/, where it is a program's write()).
//
// Why: a writer that waits for the disk at each call runs the disk at queue depth one. Instead a
// sequential writer's data is gathered into an extent and the call returns; a full extent is
// flushed to the engine asynchronously, which cuts it into block_size O_DIRECT requests. POSIX
// allows this: the data is visible to every reader at once (readers drain first) and durable after
// fsync (which drains, then fsyncs). A flush error is reported as Linux reports writeback errors
// (errseq_t): once to each open file description, at its next write, flush (close) or fsync,
// through the ErrorCursor the description holds; one description hearing of it never hides it
// from another, and a reader's close hears nothing.
//
// Out of space (ENOSPC, EDQUOT): an O_DIRECT request fits whole or leaves nothing, where ext4
// keeps the part of buffered data that fit. So a flush refused for space writes its bytes again,
// from its first failing request on, through the file's page cache (as the writer, in pieces
// halved down to a page): the part that fits stays in the file, which grows to cover it, and the
// flush reports ENOSPC only when some of its bytes did not fit (none lost: no error). This runs
// on the completing engine or splice thread before the flush counts as done, so no flush of the
// same pages can overtake it.
//
// When a write is acknowledged (WriteBehindShared::ack) is the one difference between the users:
//   kGathered   the mount: the daemon, not the writer, holds the data, so a write returns once its
//               bytes are in an extent (the writer may exit; the daemon flushes).
//   kSubmitted  `dnvme run`: the write-behind lives in the writer's own process, so a write returns
//               only once every byte of it is in the kernel (the engine's Submitted notice: its
//               O_DIRECT requests accepted by io_submit, its unaligned edges in the page cache).
//               The kernel finishes those even if the process then exits or is killed, so a write
//               that returned survives the writer as on ext4; the completions still come later,
//               overlapping the program's next steps.
//
// An extent is one of three kinds, never mixed (Extent::kind says which):
//   kChunk    a pinned chunk the bytes are copied into (any ExtentSource can copy);
//   kPipe     a pipe holding references to the kernel's page-cache pages of the data
//             (ExtentSource::SpliceTo): flushed by a splice writer with no copy at all;
//   kAdopted  memory the source handed over (ExtentSource::Adopt, payloads of 256 KiB and more):
//             one engine write per buffer. The last one may end inside a page; the write that
//             continues it completes that page in the buffer's spare bytes, so the extent goes on
//             at an aligned offset.
// Extents start at 4 KiB-aligned file offsets so their flushes stay O_DIRECT, unless
// `unaligned_extents`: then a chunk holds the data at its file offset's place in the page, and the
// engine writes only the partial edge pages through the page cache (a program's write() under
// `dnvme run` may start anywhere: torch.save's zip records do). Two extents whose pages overlap
// never fly at once (O_DIRECT writes complete in any order); an extent continuing the last one
// may fly beside it.
//
// Thread contract: every method may be called from any thread; the state is guarded by one
// internal mutex. Flush completions arrive on engine worker or splice threads and take only that
// mutex (and run the FlushHooks under it). Callers must not hold a lock the completions need.
// The object must outlive its flushes: the destructor waits for them.
#pragma once

#include <sys/stat.h>
#include <time.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "datapath/counters.h"
#include "datapath/extent_source.h"
#include "datapath/pipe.h"
#include "datapath/published_ptr.h"
#include "datapath/read_policy.h"
#include "datapath/splice_io.h"
#include "dnvme/handle.h"
#include "dnvme/pinned.h"
#include "dnvme/status.h"

namespace dnvme::datapath {

// When WriteBehind::Write returns (see the file comment).
enum class Ack { kGathered, kSubmitted };

// What every file's WriteBehind shares: the pools and the engine. Owned by the user of the
// library (the mount, the preloaded library), outlives every WriteBehind.
struct WriteBehindShared {
  // Pinned chunks of at least write_chunk bytes (write_chunk + 4 KiB with unaligned_extents);
  // null: write-behind off, every write is synchronous. Atomic: `dnvme run` sets it from the
  // first writer's thread (preload/staging.cc, WritePool) while others read it.
  PublishedPtr<PinnedPool> chunks;
  PipePool* pipes = nullptr;          // pipes for spliced extents; null: none
  SpliceWorkers* splicers = nullptr;  // runs spliced flushes; set iff pipes is
  int64_t write_chunk = 8 << 20;      // bytes per extent at most
  Ack ack = Ack::kGathered;
  bool unaligned_extents = false;  // extents may start anywhere in a page (see the file comment)
  // The current engine (the mount's config.set may swap it): asked once per submission.
  std::function<std::shared_ptr<AioHandle>()> engine;
  Counters* counters = nullptr;
  // Whether a flush goes through the page cache (ReadPolicy::CachesWrites: a file that fits in
  // memory under read_cache=auto) or O_DIRECT; null: always O_DIRECT. FileData's user points it
  // at FileDataShared::policy.
  const ReadPolicy* policy = nullptr;
};

// Told of every flush of one file as it starts (before its first engine request) and as it
// completes: `dnvme run` counts them in the lease word the daemon reads (include/dnvme/broker.h).
// Both run under the WriteBehind's mutex; they must not block. Empty: nothing to tell.
struct FlushHooks {
  std::function<void()> started;
  std::function<void()> finished;
};

// One open file description's place in its file's flush errors: WriteBehind tells it each error
// it has not seen, once. Owned by the description (FileHandle); used under WriteBehind's mutex.
struct ErrorCursor {
  uint64_t seen = 0;  // the flush errors (WriteBehind's count) this description has heard of
};

class SpaceReservation;  // datapath/space.h

// How FileData's space reservation (datapath/space.h) lets a write in: `through` writes it
// synchronously (nothing reserved it: the write meets its own error); with `resv`, the grant
// holds only while resv->epoch() is still `epoch` when the write is taken in, which is checked
// under the WriteBehind's mutex, so no Trim (which runs under it) comes between.
struct WriteAdmission {
  bool through = false;
  const SpaceReservation* resv = nullptr;
  uint64_t epoch = 0;
};

class WriteBehind {
 public:
  explicit WriteBehind(const WriteBehindShared* shared, FlushHooks hooks = {})
      : shared_(shared), hooks_(std::move(hooks)) {}
  ~WriteBehind();
  WriteBehind(const WriteBehind&) = delete;
  WriteBehind& operator=(const WriteBehind&) = delete;

  // Accepts `size` bytes at `off` from `src` for `file`. `page_cache_writes`: the kernel sends
  // this opener's writes from its page cache, so spliced pages may go to disk as they are.
  // Data that cannot be gathered (unaligned start, no free chunk) is written synchronously after
  // everything before it landed, from the source's memory or via `scratch` (pinned, aligned,
  // >= size; may be null when the source is in memory). Returns an earlier flush error `errors`
  // has not heard of (then it has), or this write's own; after Close, EBADF. `*stale` (when
  // given): set, with nothing taken in, when `admit`'s grant no longer holds (ask again).
  Status Write(const FileRef& file, bool page_cache_writes, ExtentSource& src, size_t size,
               int64_t off, char* scratch, ErrorCursor* errors, const WriteAdmission& admit = {},
               bool* stale = nullptr);
  // Flushes the pending extent and waits for every flush. With `errors` (a writer's close, any
  // fsync): returns a flush error that description has not heard of, once. Without (a reader, a
  // truncate, the control file): returns the latest error while no description has heard of it
  // yet, and leaves it for them.
  Status Drain(ErrorCursor* errors);
  // Drain(&errors) that leaves `errors` where it was: what a close (FLUSH) does. The kernel sends
  // a FLUSH for every descriptor of the description closed -- a forked child's close-on-exec of
  // its copy too -- so a close shows the description's unheard error without taking it from the
  // description's own fsync, which still reports it once.
  Status DrainAndPeek(const ErrorCursor& errors);
  // A flush error `errors` has not heard of (then it has), without waiting for the flushes in
  // flight: what a write checks before it changes anything.
  Status Report(ErrorCursor* errors);
  // Drains, then refuses every later Write (EBADF): `dnvme run` ends a file's lease this way, after
  // which no flush may start (the FlushHooks' lease word may belong to another file).
  void Close();
  // Where a description opened now starts: errors before it are not its own, except one nobody
  // has heard of yet (as errseq_sample).
  ErrorCursor Sample();
  // Folds data not yet on disk into `st`: the size the file will have and the modification time
  // of the last accepted write (POSIX marks mtime at write(), not at flush).
  void ApplyPending(struct stat* st);

  // Lands everything, then runs `fn` under the mutex while nothing is pending or in flight (no
  // extent, no flush, no synchronous write), so no write of this file can be taken in while it
  // runs: what freeing the space reserved past the end needs (FileData::Trim). False, without
  // running it, when writers kept coming (`fn` must not block for long: every write of the file
  // waits for it).
  bool RunIdle(const std::function<void()>& fn);

  // For tests and stats: flushes submitted and not completed.
  int inflight();

 private:
  enum class Kind { kNone, kChunk, kPipe, kAdopted };
  struct Extent {
    Kind kind = Kind::kNone;
    std::shared_ptr<PinnedPool::Lease> chunk;          // kChunk (its flush's callback holds it too)
    PipePool::Lease pipe;                              // kPipe
    std::vector<std::unique_ptr<AdoptedBuffer>> bufs;  // kAdopted
    FileRef file;                                      // the file the extent is flushed to
    int64_t start = 0, len = 0;                        // the file range gathered so far
    int64_t lead = 0;  // kChunk: where in the chunk the data starts (start % 4 KiB, or 0)
  };
  class SubmitLatch;

  // Starts the pending extent's flush. `latch` (kSubmitted; null otherwise): counts its engine
  // writes until each is in the kernel.
  using Latch = std::shared_ptr<SubmitLatch>;
  void FlushLocked(const Latch& latch);
  void FlushAdoptedLocked(Extent e, const Latch& latch);
  // One engine write of a flush; with `latch`, counted until it is in the kernel.
  // Through the page cache when shared_->policy says so for the file (fstat: its size now).
  Status SubmitFlushWrite(AioHandle& engine, const char* data, int64_t n, const FileRef& file,
                          int64_t at, Completion done, const Latch& latch);
  // A flush completed (engine or splice thread): record its error, wake waiters.
  void FinishFlush(const Status& st, bool adopted);
  void FinishFlushLocked(const Status& st, bool adopted);
  Status DrainLocked(std::unique_lock<std::mutex>& lock, ErrorCursor* errors);
  Status ReportLocked(ErrorCursor* errors);
  Status PeekLocked(const ErrorCursor& errors);
  void RecordErrorLocked(const Status& st);
  // Gathers as much of the write as it can; returns the bytes accepted or an error.
  Result<size_t> GatherLocked(std::unique_lock<std::mutex>& lock, const FileRef& file,
                              bool page_cache_writes, ExtentSource& src, size_t size, int64_t off,
                              const Latch& latch);
  // Waits while bytes [pos, end), about to join an extent, share pages with a flush in flight
  // (the page at `pos` may be shared when the bytes continue the last extent: both write it
  // through the page cache). Returns whether it waited: the caller then looks again.
  bool WaitForOverlapLocked(std::unique_lock<std::mutex>& lock, int64_t pos, int64_t end);
  void NoteFlightLocked(int64_t start, int64_t len);

  const WriteBehindShared* shared_;
  const FlushHooks hooks_;
  std::mutex m_;
  std::condition_variable cv_;
  // Guarded by m_:
  Extent ext_;                // being gathered (kind kNone: none)
  int inflight_ = 0;          // flushes submitted, not completed
  int adopted_inflight_ = 0;  // of which extents of adopted request buffers
  int sync_inflight_ = 0;     // synchronous writes running (outside the mutex)
  int64_t next_ = -1;         // end of the last extent: a write there continues the stream
  int64_t flight_lo_ = 0;     // the pages the flushes in flight cover, as one range (valid
  int64_t flight_hi_ = 0;     // while inflight_ > 0)
  bool closed_ = false;       // Close() ran
  int64_t end_ = 0;           // end of the highest byte accepted and not yet known on disk
  struct timespec mtime_ {};  // time of the last write accepted
  Status error_;              // the latest flush error
  uint64_t error_count_ = 0;  // flush errors so far (ErrorCursor::seen counts against it)
  bool error_heard_ = true;   // some description has heard of the latest one
};

}  // namespace dnvme::datapath
