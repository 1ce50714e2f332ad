// FileData: one file's data path -- its WriteBehind and its ReadAhead -- and the rules of using
// them, written once for both users: the mount (an Inode holds one) and `dnvme run` (an
// AdoptedFile holds one). Callers never touch the WriteBehind or the ReadAhead themselves.
//
// The rules it keeps (each was once written at every call site):
//   - A reader sees every accepted byte: a read drains the write-behind first, then clamps to the
//     file's size as it is after the drain.
//   - What the window fetched may predate a change: a read samples the read-ahead's generation
//     before it drains (ReadAhead::Generation), and every change -- a write, a truncate, a
//     fallocate, a write by someone else -- invalidates the window before it is made and again
//     once it is made, so a reader that drained in between neither serves nor fetches old bytes.
//   - The file may shrink between the size and the read (a truncate by someone the daemon does
//     not order against: a passthrough writer, another process): the engine then answers end of
//     file, and the rest is read as read(2) would answer, through the caller's buffered
//     descriptor.
//   - A read at offset 0 starts a sequential sequence, and so does the first read of a read-only
//     open wherever it is (a loader that seeks past a header first).
//   - Where the bytes come from is the ReadPolicy's (datapath/read_policy.h): the runs of the read
//     the backing file's page cache holds (or, for a file that fits in memory, should hold) are
//     read from it, the rest through the window and the engine. An O_DIRECT reader (Window::kSkip)
//     is never served from the page cache: it asked for the device.
//   - Errors of flushes reach each open file description once (ErrorCursor in OpenFile): a
//     writer's close peeks (Flush), an fsync takes (Sync), a reader hears nothing.
//   - A write acknowledged before it lands has its space first (datapath/space.h): the
//     reservation grants the write, or the part of it that fits, or tells it to go through
//     synchronously; ENOSPC/EDQUOT are the write's own errors, as on ext4. Every change
//     (Change) makes the reservation look again, and what it holds past the end is freed by
//     Trim once nothing of the file is in flight.
//
// Thread contract: every method may be called from any thread; the state is the WriteBehind's and
// the ReadAhead's, each guarded by its own mutex (never both held at once). An OpenFile is used by
// the threads serving its description; its fields are atomics or used under the WriteBehind's
// mutex. The object must outlive its flushes and fetches: Release() or the destructor waits.
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>

#include "datapath/extent_source.h"
#include "datapath/read_ahead.h"
#include "datapath/read_policy.h"
#include "datapath/space.h"
#include "datapath/write_behind.h"
#include "dnvme/handle.h"
#include "dnvme/status.h"

namespace dnvme::datapath {

// What every file's data path shares: the write-behind's and the read-ahead's pools, knobs and
// engine (the read-ahead's engine also serves the on-demand reads). Owned by the user of the
// library (the mount, the preloaded library), outlives every FileData.
struct FileDataShared {
  WriteBehindShared writes;
  ReadAheadShared reads;
  // Page cache or engine, per run of a read (kOff, the engine for everything, unless the user
  // sets it: the mount from -o read_cache, `dnvme run` from DNVME_PRELOAD_READ_CACHE).
  ReadPolicy policy;
  // How the rest of a read is read when the file shrank under it (pread(2) by default): the
  // preloaded library passes libc's own, past its interposers.
  ssize_t (*pread)(int fd, void* buf, size_t n, off_t off) = nullptr;
  // Space before acknowledgement (datapath/space.h): the mount and `dnvme run` set it.
  SpaceOptions space;
  SpaceBudget* budget = nullptr;  // for file systems without fallocate; null: write through
};

// One open file description's place in its file's data path.
struct OpenFile {
  ErrorCursor errors;                    // flush errors heard of (under the WriteBehind's mutex)
  bool read_only = false;                // set by FileData::Open
  std::atomic<bool> read_before{false};  // has read yet (the first read may start a sequence)
  std::atomic<bool> wrote{false};        // has written (only a writer's close hears of errors)
};

// How a read may use the read-ahead window.
enum class Window {
  kUse,   // serve from it and let a sequential reader's window move on
  kSkip,  // read only what is asked, now (an O_DIRECT reader asked for no caching)
  kDrop,  // as kSkip, and drop the window first: the file may change behind it (a file another
          // process has open, or mapped)
};

// One read: up to `size` bytes at `off`.
struct FileRead {
  int64_t off = 0;
  int64_t size = 0;
  Window window = Window::kUse;
  // Pinned, aligned, at least `size` bytes: where the bytes read on demand go, at their place
  // (buf + their offset in the read). With `reply` null the whole read is copied here.
  char* buf = nullptr;
  // Null: the read is copied into `buf`. Otherwise the pieces are appended here (read-ahead
  // chunks, kept alive by the reply, and `buf`), in file order; nothing is copied.
  ReadReply* reply = nullptr;
  // A buffered descriptor of the file, for the rest of a read that found the file shrunk.
  int shrunk_fd = -1;
  // Whether a cold run of a file that fits in memory may be read through the page cache
  // (ReadCache::kAuto): false for an open the mount sent to the engine because its opener's
  // memory did not fit the file (ReadPolicy::ColdReadsToEngine).
  bool may_fill = true;
  // The reader (the READ's caller; 0: this process): a fill of the page cache takes its memory,
  // so its budget decides (ReadPolicy::Fits), not the daemon's.
  pid_t reader = 0;
  // Whether the reader may learn the file's residency: false for one the kernel would refuse
  // cachestat of it (UnknownResidency: cold runs go to the device, cached or not).
  bool may_probe = true;
};

class FileData {
 public:
  // `alone`: whether nobody but this data path writes the file now (its reservation may then
  // reach ahead past the end, space.h); empty: always.
  explicit FileData(const FileDataShared* shared, FlushHooks hooks = {},
                    std::function<bool()> alone = {})
      : shared_(shared),
        wb_(&shared->writes, std::move(hooks)),
        ra_(&shared->reads),
        alone_(std::move(alone)) {}
  FileData(const FileData&) = delete;
  FileData& operator=(const FileData&) = delete;

  // A description opened now: errors before it are not its own (except one nobody heard of).
  void Open(OpenFile* o, bool read_only);

  // Accepts `size` bytes at `off` from `src` (WriteBehind::Write) once their space is reserved,
  // the window invalidated before and after. Returns the bytes accepted (fewer than `size`: only
  // they fit, as a short write(2)), an earlier flush error `o` has not heard of, or this write's
  // own (ENOSPC/EDQUOT when nothing fits).
  Result<size_t> Write(OpenFile& o, const FileRef& file, bool page_cache_writes, ExtentSource& src,
                       size_t size, int64_t off, char* scratch);
  // A read (see FileRead): the bytes read, 0 at or past the end of the file, or the error.
  Result<int64_t> Read(OpenFile& o, const FileRef& file, const FileRead& r);
  // For a caller that submits the read itself (an O_DIRECT reader answered from the engine's
  // completion): drains, then clamps `size` at `off` to the file's size. 0 at or past the end.
  Result<int64_t> Readable(const FileRef& file, int64_t off, int64_t size);
  // The bytes at [off, off + n) as they are now, after the engine answered end of file for them:
  // what the file holds there, through `fd` (buffered).
  Result<int64_t> ReadShrunk(int fd, char* buf, int64_t n, int64_t off) const;

  // Runs `change` (a truncate, a fallocate, a write by other means) once the write-behind landed,
  // with the window invalidated and the space reservation forgotten before and after. Returns the
  // write-behind's error (then `change` does not run) or `change`'s.
  Status Change(const std::function<Status()>& change);
  // A writer outside the data path (a control-file transfer) writes the file meanwhile: no Trim
  // until it ends (a truncate to a size read before its write landed would cut it).
  void BeginOutsideWrite() { outside_writes_.fetch_add(1, std::memory_order_acq_rel); }
  void EndOutsideWrite() { outside_writes_.fetch_sub(1, std::memory_order_acq_rel); }
  // Frees what the space reservation holds past the end of the file, through `fd` (opened for
  // writing), once the write-behind landed and while no write can start (WriteBehind::RunIdle)
  // and no outside writer runs; the caller keeps every other writer out (the mount: new `dnvme
  // run` leases). Ok when there was nothing to free or it must wait for a later call (a writer
  // came meanwhile).
  Status Trim(int fd);
  // Whether Trim has anything to free.
  bool holds_reservation() { return resv_.holds_past_eof(); }
  // The file changed behind the data path (a write announced by someone else): drops the window
  // and makes the space reservation look again (it may have been truncated too).
  void Invalidate();

  // Lands the write-behind without taking errors (a reader, a truncate, lseek, utimes): the
  // latest error while no description has heard of it.
  Status Drain();
  // A flush error `o` has not heard of (then it has), without waiting: before a write changes
  // anything.
  Status Report(OpenFile& o);
  // close(2) of a description: a writer's waits and peeks at an unheard error (its fsync still
  // reports it); a reader's waits for nothing.
  Status Flush(const OpenFile& o);
  // fsync(2): lands the write-behind and takes an error `o` has not heard of.
  Status Sync(OpenFile& o);
  // Lands the write-behind, then refuses every later write (EBADF): `dnvme run`'s lease ends.
  void Close();
  // The last open of the file goes: lands the write-behind (its error returned, for the log) and
  // waits for the fetches in flight (they use the file).
  Status Release();

  // Folds data not yet on disk into `st` (size and mtime, WriteBehind::ApplyPending).
  void ApplyPending(struct stat* st) { wb_.ApplyPending(st); }
  // For tests.
  int fetches_inflight() { return ra_.inflight(); }
  int64_t window() { return ra_.window(); }

 private:
  // Readable(), and the file's size in `*file_size`.
  Result<int64_t> DrainAndClamp(const FileRef& file, int64_t off, int64_t size, int64_t* file_size);
  // One run of a read (`at` bytes into it, `len` long) from the page cache, into r.buf at its
  // place (and appended to r.reply). Fewer bytes than `len`: the file ends there now.
  Result<int64_t> ReadCached(const FileRef& file, const FileRead& r, int64_t at, int64_t len);
  // One run through the window (unless r.window says not) and the engine.
  Result<int64_t> ReadDevice(OpenFile& o, const FileRef& file, const FileRead& r, int64_t at,
                             int64_t len, int64_t file_size, uint64_t generation);

  // Write() under the reservation: asks it, then hands what it granted to the write-behind.
  Result<size_t> WriteReserved(OpenFile& o, const FileRef& file, bool page_cache_writes,
                               ExtentSource& src, size_t size, int64_t off, char* scratch);

  const FileDataShared* shared_;
  WriteBehind wb_;
  ReadAhead ra_;
  SpaceReservation resv_;
  const std::function<bool()> alone_;
  std::atomic<int> outside_writes_{0};
};

}  // namespace dnvme::datapath
