// ReadAhead: one file's window of data fetched ahead of a sequential reader. One mechanism for both
// users of the data path: the mount (a FUSE READ) and `dnvme run` (a program's read()).
//
// Why: O_DIRECT gets no read-ahead from the kernel, and FUSE asks for a cold file one request
// (<= 1 MiB) at a time, each read(2) waiting for the answer: reading each request on demand runs
// the disk at queue depth one. When reads arrive in sequence, the window (`window` bytes, in
// chunks from a pinned pool shared by every reader) is fetched with the engine's parallel O_DIRECT
// reads while the reader consumes the front of it. A reply points into the chunks (no copy) and
// keeps them alive until sent; `dnvme run` copies out of them into the program's buffer. Anything
// the window does not hold is left to the caller's on-demand read.
//
// The sequential-reader rule: a read at offset 0 starts a sequence (a program reading a file from
// its start), and so does the first read of a read-only open wherever it is (the caller says so:
// a loader that seeks past a header first); a read that starts where the last one ended, or at
// most `max_skip` bytes past it, continues it (torch.load skips each zip record's small local
// header), and so does a read inside the fetched window (FUSE requests handed over out of order,
// readers of one file interleaving). Anything else is a seek: the window ends, and only chunks
// within reach of the new place are kept.
//
// The window grows with the reader's pace: a sequence starts with `initial_window` bytes (a
// program that reads a header and stops fetches little), and each time the reader has consumed a
// whole current window since it last grew, the window doubles, up to `window`. A fast reader so
// reaches the full window within a few of its windows' time; a slow one keeps a small window and
// ties up fewer of the pool's chunks, which every reader shares.
//
// Thread contract: every method may be called from any thread; the state is guarded by one
// internal mutex, which fetch completions (engine worker threads) take too. The object must
// outlive its fetches: Quiesce() (release) or the destructor waits for them.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "datapath/counters.h"
#include "datapath/published_ptr.h"
#include "dnvme/handle.h"
#include "dnvme/pinned.h"
#include "dnvme/status.h"

namespace dnvme::datapath {

// What every file's ReadAhead shares. Owned by the user of the library (the mount, the preloaded
// library), outlives every ReadAhead.
struct ReadAheadShared {
  // Chunk-sized pinned buffers; null: read-ahead off. Atomic: `dnvme run` sets it from whichever
  // reader's thread first needs it (make_chunks), while others read it.
  PublishedPtr<PinnedPool> chunks;
  // Null, or how `chunks` comes to be: called before a window read finds `chunks` null, from the
  // reader's thread (FileData::ReadDevice). `dnvme run` makes its pool there, so a process whose
  // reads the page cache serves whole (read_policy.h) pins nothing.
  std::function<void()> make_chunks;
  int64_t window = 16 << 20;  // the most bytes fetched ahead of a sequential reader
  // The window a sequence starts with (rounded up to whole chunks, at least one); 0: the whole
  // `window` at once.
  int64_t initial_window = 0;
  int64_t max_skip = 0;  // bytes a read may skip and still continue the sequence
  // Reads of this many bytes or more are not read ahead (0: no limit): one such call keeps the
  // disk busy by itself, and copying it out of chunks costs more than it gains.
  int64_t max_read = 0;
  std::function<std::shared_ptr<AioHandle>()> engine;
  Counters* counters = nullptr;
};

// One fetched (or fetching) piece of the window.
struct RaChunk {
  int64_t offset = 0;
  int64_t length = 0;                      // bytes asked for (clamped to the file size)
  std::shared_ptr<PinnedPool::Lease> buf;  // the completion callback holds it too
  bool ready = false;                      // guarded by the owning ReadAhead's mutex
  Status status;                           // guarded by the owning ReadAhead's mutex
};

// What a read answers with: pieces of read-ahead chunks (kept alive by `pins` until the reply is
// sent) and/or of the caller's own buffer, in file order.
struct ReadReply {
  std::vector<struct iovec> iov;
  std::vector<std::shared_ptr<RaChunk>> pins;
  // Copies the pieces, in order, to `dst` (a piece already at its place there stays); returns
  // the bytes the pieces hold.
  size_t CopyTo(char* dst) const;
  // The bytes the pieces hold.
  int64_t bytes() const;
};

// One read as the window sees it.
struct WindowRead {
  int64_t off = 0;
  int64_t n = 0;          // already clamped to file_size
  int64_t file_size = 0;  // as the reader saw it after draining the file's write-behind
  // Generation() as the reader saw it before it drained the file's write-behind: when the window
  // was invalidated since, nothing is served or fetched (see Generation).
  uint64_t generation = 0;
  // This read starts a sequence wherever it is (the first read of a read-only open), as a read at
  // offset 0 always does.
  bool starts_sequence = false;
  char* copy_to = nullptr;  // non-null: copy the served bytes here (see Read)
};

class ReadAhead {
 public:
  explicit ReadAhead(const ReadAheadShared* shared) : shared_(shared) {}
  ~ReadAhead() { Quiesce(); }
  ReadAhead(const ReadAhead&) = delete;
  ReadAhead& operator=(const ReadAhead&) = delete;

  // The one read entry: serves as much of [r.off, r.off + r.n) of `file` as the window holds,
  // from its start (waiting for chunks still in flight), after extending the window when the read
  // continues or starts a sequence (see the file comment). Returns the bytes served; a failed
  // chunk ends them (the caller's on-demand read then reports the error properly). The pieces
  // are appended to `reply`, pointing into the chunks it keeps alive -- or, with `r.copy_to`,
  // copied there, and when the window held the whole read the chunks it emptied go straight back
  // to the window for the bytes after it (a reply keeps its chunks until it is sent, so the window
  // refills at the next read).
  // Nothing of the rest is read: that is the caller's (datapath/file_data.h).
  int64_t Read(const FileRef& file, const WindowRead& r, ReadReply* reply);
  // How many times the window was invalidated. A reader samples it before it drains the file's
  // write-behind and hands it to Read: a fetch started between that drain and a change to the
  // file (a write gathered after the drain, a truncate, a fallocate) reads the old bytes, so
  // every change invalidates the window after it is made (the write accepted, the truncate
  // done), and a reader whose sample predates that serves and fetches nothing.
  uint64_t Generation();
  // Drops the window (after writes, truncate, fallocate: once the change is made, see
  // Generation): chunks still in flight live on in their completion callbacks.
  void Invalidate();
  // Waits for every fetch in flight, then drops the window (release).
  void Quiesce();
  // For tests: fetches submitted and not completed.
  int inflight();
  // For tests: the current window's bytes (0: no sequence).
  int64_t window();

 private:
  int64_t Serve(const FileRef& file, const WindowRead& r, ReadReply* reply);
  void StartLocked(const FileRef& file, int64_t from, int64_t file_size);
  // A sequence starts (`start`) or goes on after a read of `n` bytes: sets or grows window_.
  void PaceLocked(bool start, int64_t n);
  // The chunk holding byte `pos`, or null (chunks never overlap).
  std::shared_ptr<RaChunk> ChunkAtLocked(int64_t pos) const;
  // Drops the fetched chunks wholly behind `pos`: the reader will not ask for them again.
  void DropBehindLocked(int64_t pos);

  const ReadAheadShared* shared_;
  std::mutex m_;
  std::condition_variable cv_;
  // Guarded by m_:
  int64_t next_ = -1;        // where the next sequential read is expected
  int64_t window_ = 0;       // the current window (0: no sequence)
  int64_t consumed_ = 0;     // bytes the reader consumed since the window last grew
  uint64_t generation_ = 0;  // Invalidate() calls so far
  std::vector<std::shared_ptr<RaChunk>> chunks_;
  int inflight_ = 0;
};

}  // namespace dnvme::datapath
