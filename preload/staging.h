// Write-behind and read-ahead of adopted files, through pinned staging buffers, on this
// process's engine (an AioHandle: parallel O_DIRECT libaio).
//
// The write-behind and the read-ahead are the data path's (datapath/file_data.h: the mount uses
// the same); this file configures them for `dnvme run` and keeps what is this library's: the
// engine and the pools (made at their first use, owned here), the lease word's count of writes in
// flight, and an error kept for the next call.
//
// Thread contract: every function is thread-safe. Lock order: adopted_file.h.
#ifndef DNVME_PRELOAD_STAGING_H_
#define DNVME_PRELOAD_STAGING_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>

#include "datapath/file_data.h"
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

// ---- the data path (datapath/file_data.h: the same as the mount's) ----

// Every adopted file's data path shares this process's engine and pools, acknowledged when
// submitted (a write that returned survives the program's exit), extents that start anywhere,
// read-ahead that tolerates a zip reader's small skips (set up by Engine()).
// Hooks that count `f`'s writes in flight in its lease word (include/dnvme/broker.h).
datapath::FlushHooks LeaseWordHooks(AdoptedFile* f);

// ---- writes ----

// Waits for the file's write-behind; returns (and takes) the first error this open file has not
// heard of (a kept one first): what fsync and the last close report.
Status WaitWrites(AdoptedFile& f);
// Keeps `err` for the next write, fsync or close unless one is kept already: a call that returns
// the bytes written before a failure leaves the failure to the next call.
void KeepFirstError(AdoptedFile& f, Status err);
// Takes the kept error (Ok if none).
Status TakeKeptError(AdoptedFile& f);
// Takes the kept error, else a write-behind error this open file has not heard of, without
// waiting: what a write checks before it reserves space.
Status TakeFirstError(AdoptedFile& f);

// Writes [buf, buf + n) at `off` through the file's data path (WritePool() must have been asked
// for first: without staging buffers the write is synchronous); returns once every byte of it is
// in the kernel: its O_DIRECT requests accepted by io_submit and its unaligned edges in the page
// cache. The kernel finishes those even if this process exits or is killed, so a write that
// returned survives the process as on ext4; the completions still come later, overlapping the
// program's next steps. Its space is reserved first (datapath/space.h): returns the bytes
// written, fewer than `n` when only they fit, or the error (ENOSPC/EDQUOT when none does).
Result<int64_t> SubmitWrite(AdoptedFile& f, const char* buf, size_t n, off_t off);

// ---- reads ----

// Reads up to `n` bytes at `off` into `buf` through the file's data path (its write-behind
// landed first; from the read-ahead as far as it holds them, the rest directly); returns the
// bytes read, 0 at the end of the file. Not read ahead: a file someone else has open (it may
// change under the window). Engine() must have been made.
Result<int64_t> ReadThrough(AdoptedFile& f, char* buf, int64_t n, int64_t off);

}  // namespace dnvme::preload

#endif  // DNVME_PRELOAD_STAGING_H_
