// FastWriter: a FastPersist-style stream writer for checkpoints.
//
// A serializer (torch.save, a tar writer, ...) produces a byte stream in many writes of every size:
// a few bytes of header, then whole tensors. Writing each piece to the file as it comes is slow
// (small, unaligned, synchronous writes through the page cache, then a long fsync). FastWriter
// copies the stream into a ring of pinned, aligned buffers (two by default: one fills while the
// other is on its way to the disk) and writes each full buffer as one asynchronous O_DIRECT
// operation through an AioHandle, which cuts it into `block_size` libaio requests, `queue_depth`
// deep, over `intra_op_parallelism` workers. Only the last buffer is partial; its unaligned tail is
// written exactly by the handle (through the page cache), so the file ends at exactly the number
// of bytes written. Close() waits for every write and fsyncs: when it returns OK, the whole stream
// is durable.
//
// Data-parallel saves: with `stripe_bytes` set, the stream is cut into stripes of that many bytes
// and this writer stores only the stripes s with s % stripe_count == stripe_index; the other bytes
// are counted and skipped (not copied). Several processes that serialize the same object, each
// with its own stripe_index, together write the whole file, each moving 1/stripe_count of the
// bytes. Only one of them should open with `truncate` (before the others open).
//
// Errors: the first failure (a refused submit, an EIO/ENOSPC completion, the fsync) is kept; it is
// returned by the next Write and by Close, and every later Write fails with it. Nothing is thrown
// and nothing aborts.
//
// Thread contract: one thread drives a FastWriter (Write, Close). Completions arrive on the
// handle's worker threads and only touch state guarded by the writer's mutex. The AioHandle must
// outlive the writer; the destructor waits for writes still in flight (without fsync).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dnvme/handle.h"
#include "dnvme/pinned.h"
#include "dnvme/status.h"

namespace dnvme {

struct FastWriterOptions {
  // Size of each pinned buffer: a multiple of 4096. One buffer is one asynchronous operation.
  size_t buffer_bytes = size_t{32} << 20;
  int num_buffers = 2;  // at least 2 so copying overlaps writing
  // Cut the file to zero length when opening (a fresh checkpoint). Off for the non-first writers
  // of a data-parallel save.
  bool truncate = true;
  // fsync in Close(). Off only for callers that fsync themselves (or measure without it).
  bool fsync_on_close = true;
  // Striping for data-parallel saves (0: this writer stores every byte). A multiple of 4096.
  int64_t stripe_bytes = 0;
  int stripe_count = 1;
  int stripe_index = 0;
  // Where the pinned buffers come from. Pinning is not free (the pages are faulted in, zeroed and
  // locked: about a second per GiB on a VM), so a program that saves often keeps a pool of
  // `buffer_bytes` buffers and lends it to every writer. When the pool has fewer than num_buffers
  // free (another writer holds them), the writer allocates its own. Null: always its own. The pool
  // must outlive the writer.
  PinnedPool* pool = nullptr;
  // Or the caller's memory (DeepSpeed's FastFileWriterConfig.pinned_tensor): num_buffers
  // consecutive buffers of buffer_bytes each, starting at `external`, which the caller keeps valid
  // and does not touch until Close() returns. Then buffer_bytes may be any positive size (DeepSpeed
  // halves a 4 KiB tensor for double buffering; the handle writes unaligned parts exactly) and
  // num_buffers may be 1 (DeepSpeed's single buffer: filling waits for each write). Not with a
  // pool.
  char* external = nullptr;

  Status Validate() const;
};

class FastWriter {
 public:
  // Opens (creating, mode 0644 before umask) `path` for writing through `handle`.
  static Result<std::unique_ptr<FastWriter>> Open(AioHandle* handle, const std::string& path,
                                                  const FastWriterOptions& options = {});
  ~FastWriter();
  FastWriter(const FastWriter&) = delete;
  FastWriter& operator=(const FastWriter&) = delete;

  // Appends `n` bytes of the stream. Returns once they are copied (or skipped, for another
  // writer's stripe); the caller may reuse its memory at once.
  Status Write(const void* data, size_t n);
  // Writes what is buffered, waits for every write, fsyncs (unless disabled) and closes the file.
  // Idempotent: a second call returns the first call's status.
  Status Close();

  int64_t position() const { return position_; }    // bytes of the stream so far
  int64_t bytes_stored() const { return stored_; }  // of those, bytes this writer writes
  bool closed() const { return closed_; }
  const std::string& path() const { return path_; }

 private:
  struct Slot {
    PinnedBuffer own;         // allocated for this writer, or
    PinnedPool::Lease lease;  // lent by FastWriterOptions::pool
    char* data = nullptr;
    size_t fill = 0;
    int64_t file_offset = 0;
    bool in_flight = false;  // guarded by mu_
  };

  FastWriter(AioHandle* handle, std::string path, FastWriterOptions options, FileRef file,
             std::vector<Slot> slots);
  // Hands the current slot to the handle and moves on to the next one, waiting until it is free.
  Status SubmitCurrent();
  void WaitAll();
  Status FirstError();

  AioHandle* const handle_;
  const std::string path_;
  const FastWriterOptions options_;
  FileRef file_;
  std::vector<Slot> slots_;
  size_t current_ = 0;
  int64_t position_ = 0;
  int64_t stored_ = 0;
  bool closed_ = false;
  Status close_status_;

  std::mutex mu_;
  std::condition_variable cv_;
  Status first_error_;  // guarded by mu_
};

}  // namespace dnvme
