// ReadAhead: one file's window of data fetched ahead of a sequential reader.
//
// Why: FUSE asks for a cold file one request (<= 1 MiB) at a time, and each read(2) waits for the
// answer, so reading each request on demand runs the disk at queue depth one. When reads arrive
// in sequence, the window (read_ahead bytes, in chunks of at most 4 MiB from a pinned pool shared
// by every reader) is fetched with the engine's parallel O_DIRECT reads while the reader consumes
// the front of it; a reply points into the chunks (no copy), and keeps them alive until sent.
// Anything the window does not hold is left to the caller's on-demand read.
//
// Thread contract: every method may be called from any thread; the state is guarded by one
// internal mutex, which fetch completions (engine worker threads) take too. The object must
// outlive its fetches: Quiesce() (release) or the destructor waits for them.
#pragma once

#include <sys/uio.h>

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

namespace dnvme::fs {

// What every file's ReadAhead shares. Owned by the mount, outlives every ReadAhead.
struct ReadAheadShared {
  PinnedPool* chunks = nullptr;  // chunk-sized pinned buffers; null: read-ahead off
  int64_t window = 16 << 20;     // bytes fetched ahead of a sequential reader
  std::function<std::shared_ptr<AioHandle>()> engine;
  MountCounters* counters = nullptr;
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
};

class ReadAhead {
 public:
  explicit ReadAhead(const ReadAheadShared* shared) : shared_(shared) {}
  ~ReadAhead() { Quiesce(); }
  ReadAhead(const ReadAhead&) = delete;
  ReadAhead& operator=(const ReadAhead&) = delete;

  // A read of `n` bytes at `off` (already clamped to `file_size`) of `file`: when it continues
  // the previous read, the window is extended; then as much of [off, off + n) as the window
  // holds, from its start, is appended to `reply` (waiting for chunks still in flight). Returns
  // the bytes appended; a failed chunk ends the served part (the caller's on-demand read then
  // reports the error properly).
  int64_t Serve(const FileRef& file, int64_t off, int64_t n, int64_t file_size, ReadReply* reply);
  // Drops the window (after writes, truncate, fallocate): chunks still in flight live on in
  // their completion callbacks.
  void Invalidate();
  // Waits for every fetch in flight, then drops the window (release).
  void Quiesce();
  // For tests: fetches submitted and not completed.
  int inflight();

 private:
  void StartLocked(const FileRef& file, int64_t from, int64_t file_size);

  const ReadAheadShared* shared_;
  std::mutex m_;
  std::condition_variable cv_;
  // Guarded by m_:
  int64_t next_ = -1;  // where the next sequential read is expected
  std::vector<std::shared_ptr<RaChunk>> chunks_;
  int inflight_ = 0;
};

}  // namespace dnvme::fs
