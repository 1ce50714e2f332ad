// Write-behind and read-ahead of adopted files, through pinned staging buffers, on this
// process's engine (an AioHandle: parallel O_DIRECT libaio).
//
// Everything here works on an AdoptedFile's write-behind fields (wm, wcv, inflight, first_err,
// ended, wb_lo/wb_hi) and read-ahead fields (rm, ahead, next_read, am, acv), its `file` and its
// lease word's `writes_inflight` and `shared`; nothing else of the library but the settings
// and counters. The engine and both pools are made at their first use and owned by this file.
//
// Thread contract: every function is thread-safe; the Locked ones need the lock they name held.
// Lock order: adopted_file.h. Engine completions run on the engine's threads and take only wm
// (a write piece) or am (a read-ahead piece).
#ifndef DNVME_PRELOAD_STAGING_H_
#define DNVME_PRELOAD_STAGING_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>

#include "dnvme/handle.h"
#include "dnvme/pinned.h"
#include "dnvme/status.h"
#include "preload/adopted_file.h"

namespace dnvme::preload {

// ---- the engine and the pinned pools ----

// The process's engine, made at the first call (the engine settings are DNVME_PRELOAD_CONFIG's,
// else queue depth 32 and 8 MiB bounce buffers per worker; always a sliding window). Null, for
// good, when it cannot be made: the mount then serves every transfer.
AioHandle* Engine();
// The engine if it was made (no attempt to make it): what a transfer on an adopted file uses.
AioHandle* EngineIfMade();

// The write-behind's staging buffers (6 x 8 MiB + a page), made at the first call; null when
// they cannot be pinned (RLIMIT_MEMLOCK): writes are then synchronous.
PinnedPool* WritePool();
// The read-ahead buffers (DNVME_PRELOAD_READAHEAD / 4 MiB, at least 2), made at the first call;
// null when read-ahead is off or they cannot be pinned.
PinnedPool* ReadPool();

// fork(): the prepare handler holds the engine's lock across the fork; the child forgets the
// engine and both pools (leaked: their threads and lock holders did not survive) and makes new
// ones on demand.
void LockEngineForFork();
void UnlockEngineAfterFork();
void ForgetEngineInChild();

// ---- write-behind ----

// Waits for the file's write-behind; returns (and clears) its first error, 0 if none.
int WaitWrites(AdoptedFile& f);
// The same without taking the error (it stays for fsync or close).
void DrainWrites(AdoptedFile& f);
// Waits for the write-behind and refuses every later write (EBADF): the lease is ending.
void EndWrites(AdoptedFile& f);
// Keeps `err` as the file's first write-behind error unless it has one already: a call that
// returns the bytes written before a failure leaves the failure to the next write, fsync or close.
void KeepFirstError(AdoptedFile& f, int err);
// Replaces the file's first write-behind error by `err` (a descriptor's close passing it on to
// the file's next fsync or close).
void SetFirstError(AdoptedFile& f, int err);
// Returns (and clears) the first write-behind error without waiting, 0 if none.
int TakeFirstError(AdoptedFile& f);

// Copies [buf, buf + n) into staging buffers and submits it at `off` (WritePool() must be
// non-null); returns 0 or an errno once every piece is in the kernel: its O_DIRECT requests
// accepted by io_submit and its unaligned edges in the page cache. The kernel finishes submitted
// requests even if this process exits or is killed (exit_aio waits for them), so a write that
// returned survives the process as on ext4 (a piece merely queued to an engine thread would die
// with it); the completions still come later, overlapping the program's next steps.
int SubmitWrite(const std::shared_ptr<AdoptedFile>& f, const char* buf, size_t n, off_t off);

// ---- read-ahead ----

// A piece of read-ahead: [off, off + len) of the file, read into `buf` at off's offset in the
// page (so the engine's requests go O_DIRECT).
struct ReadAheadPiece {
  PinnedPool::Lease buf;
  int64_t off = 0;
  int64_t len = 0;
  bool done = false;  // guarded by the file's `am`
  bool ok = false;    // guarded by the file's `am`
  const char* data() const { return buf.data() + off % 4096; }
};

// Drops the file's read-ahead once its requests are done. Caller holds f.rm.
void ForgetReadAheadLocked(AdoptedFile& f);
// The same, taking f.rm: before a write, a truncate or the end of the lease, what was read
// ahead may be stale.
void ForgetReadAhead(AdoptedFile& f);

// Reads [off, off + n) of a file of `size` bytes (n > 0, off + n <= size): from the read-ahead
// as far as it holds it, the rest directly into `buf`; then, for a sequential reader, queues the
// next bytes. Engine() must have been made.
Status ReadThrough(const std::shared_ptr<AdoptedFile>& f, char* buf, int64_t n, int64_t off,
                   int64_t size);

}  // namespace dnvme::preload

#endif  // DNVME_PRELOAD_STAGING_H_
