// WriteBehind: one file's data accepted from writers and not yet on disk.
//
// Why: without the kernel's writeback cache, FUSE sends a writer's data one request (<= 1 MiB)
// at a time and the write(2) waits for our reply. Writing each request before replying would run
// the disk at queue depth one. Instead a sequential writer's data is gathered into an extent and
// the reply goes out at once; a full extent is flushed to the engine asynchronously, which cuts it
// into block_size O_DIRECT requests. POSIX allows this: the data is visible to every reader at
// once (readers drain first) and durable after fsync (which drains, then fsyncs). A flush error is
// reported as Linux reports writeback errors (errseq_t): once to each open file description, at
// its next write, flush (close) or fsync, through the ErrorCursor the description holds; one
// description hearing of it never hides it from another, and a reader's close hears nothing.
//
// An extent is one of three kinds, never mixed (Extent::kind says which):
//   kChunk    a pinned chunk (write_chunk bytes, 4 KiB aligned) the payloads are copied into;
//   kPipe     a pipe holding references to the kernel's page-cache pages of the data (spliced
//             requests of page-cache writers): flushed by the splice writer with no copy at all;
//   kAdopted  the request buffers themselves (payloads of 256 KiB and more that the session loop
//             received page-aligned, fs/transport/request_buffer.h): one engine write per buffer.
//             The last payload may end inside a page (a writer's buffer that is not page-aligned,
//             cut by the kernel at max_pages); the write that continues it completes that page
//             in the buffer's spare bytes, so the extent goes on at an aligned offset.
// Extents start at 4 KiB-aligned file offsets so their flushes stay O_DIRECT. Two extents that
// overlap never fly at once (O_DIRECT writes complete in any order).
//
// Thread contract: every method may be called from any thread; the state is guarded by one
// internal mutex. Flush completions arrive on engine worker or splice threads and take only that
// mutex. Callers must not hold a lock the completions need (they take none but this one). The
// object must outlive its flushes: the destructor waits for them.
#pragma once

#include <sys/stat.h>
#include <time.h>

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "dnvme/handle.h"
#include "dnvme/pinned.h"
#include "dnvme/status.h"
#include "fs/data/counters.h"
#include "fs/data/splice_io.h"
#include "fs/transport/pipe.h"
#include "fs/transport/request_buffer.h"
#include "fs/transport/write_source.h"

namespace dnvme::fs {

// What every file's WriteBehind shares: the mount's pools and engine. Owned by the mount,
// outlives every WriteBehind.
struct WriteBehindShared {
  PinnedPool* chunks = nullptr;       // write_chunk-sized pinned chunks; null: write-behind off
  PipePool* pipes = nullptr;          // pipes for spliced extents; null: none
  SpliceWorkers* splicers = nullptr;  // runs spliced flushes; set iff pipes is
  int64_t write_chunk = 8 << 20;      // bytes per extent at most
  // The mount's current engine (config.set may swap it): asked once per submission.
  std::function<std::shared_ptr<AioHandle>()> engine;
  MountCounters* counters = nullptr;
};

// One open file description's place in its file's flush errors: WriteBehind tells it each error
// it has not seen, once. Owned by the description (FileHandle); used under WriteBehind's mutex.
struct ErrorCursor {
  uint64_t seen = 0;  // the flush errors (WriteBehind's count) this description has heard of
};

class WriteBehind {
 public:
  explicit WriteBehind(const WriteBehindShared* shared) : shared_(shared) {}
  ~WriteBehind();
  WriteBehind(const WriteBehind&) = delete;
  WriteBehind& operator=(const WriteBehind&) = delete;

  // Accepts `size` bytes at `off` from `src` for `file`. `page_cache_writes`: the kernel sends
  // this opener's writes from its page cache, so spliced pages may go to disk as they are.
  // Data that cannot be gathered (unaligned start, no free chunk) is written synchronously after
  // everything before it landed, from the request or via `scratch` (pinned, aligned, >= size).
  // Returns an earlier flush error `errors` has not heard of (then it has), or this write's own.
  Status Write(const FileRef& file, bool page_cache_writes, WriteSource& src, size_t size,
               int64_t off, char* scratch, ErrorCursor* errors);
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
  // Where a description opened now starts: errors before it are not its own, except one nobody
  // has heard of yet (as errseq_sample).
  ErrorCursor Sample();
  // Folds data not yet on disk into `st`: the size the file will have and the modification time
  // of the last accepted write (POSIX marks mtime at write(), not at flush).
  void ApplyPending(struct stat* st);

  // For tests and stats: flushes submitted and not completed.
  int inflight();

 private:
  enum class Kind { kNone, kChunk, kPipe, kAdopted };
  struct Extent {
    Kind kind = Kind::kNone;
    std::shared_ptr<PinnedPool::Lease> chunk;  // kChunk (its flush's callback holds it too)
    PipePool::Lease pipe;                      // kPipe
    std::vector<RequestBuffer> bufs;           // kAdopted
    FileRef file;                              // the file the extent is flushed to
    int64_t start = 0, len = 0;                // the file range gathered so far
  };

  void FlushLocked();
  void FlushAdoptedLocked(Extent e);
  // A flush completed (engine or splice thread): record its error, wake waiters.
  void FinishFlush(const Status& st, bool adopted);
  void FinishFlushLocked(const Status& st, bool adopted);
  Status DrainLocked(std::unique_lock<std::mutex>& lock, ErrorCursor* errors);
  Status ReportLocked(ErrorCursor* errors);
  Status PeekLocked(const ErrorCursor& errors);
  void RecordErrorLocked(const Status& st);
  // Gathers as much of the write as it can; returns the bytes accepted or an error.
  Result<size_t> GatherLocked(std::unique_lock<std::mutex>& lock, const FileRef& file,
                              bool page_cache_writes, WriteSource& src, size_t size, int64_t off);

  const WriteBehindShared* shared_;
  std::mutex m_;
  std::condition_variable cv_;
  // Guarded by m_:
  Extent ext_;                // being gathered (kind kNone: none)
  int inflight_ = 0;          // flushes submitted, not completed
  int adopted_inflight_ = 0;  // of which extents of adopted request buffers
  int64_t next_ = -1;         // end of the last extent: a write there continues the stream
  int64_t end_ = 0;           // end of the highest byte accepted and not yet known on disk
  struct timespec mtime_ {};  // time of the last write accepted
  Status error_;              // the latest flush error
  uint64_t error_count_ = 0;  // flush errors so far (ErrorCursor::seen counts against it)
  bool error_heard_ = true;   // some description has heard of the latest one
};

}  // namespace dnvme::fs
