// An adopted file: a file of a dnvmefs mount whose large transfers this process's engine does
// on descriptors of the backing file the mount's broker handed over (docs/preload.md).
//
// One AdoptedFile per open file of the program (its file offset is the kernel's, in the
// program's own descriptor); every descriptor of that open file (dup, fcntl, an inherited one)
// maps to it in the descriptor table (descriptor_table.h). It holds one lease of the broker
// (`lease`, `word`) from adoption until the table forgets its last descriptor (EndLease).
//
// THREAD CONTRACT: shared by every thread with a descriptor of it (shared_ptr: the table, each
// transfer in progress, and each engine request of its write-behind and read-ahead hold it, so
// `file` outlives every request using it). The fields above `mu` are written before the file is
// put in the table (Adopt) and only read after, except `witness`, which EndLease closes once no
// descriptor maps to the file. The others are guarded as each says.
//
// LOCK ORDER (the process-wide locks included):
//   rm -> am, and rm -> the engine's lock (staging.cc: ReadPool may make the pool);
//   every other lock is taken alone: mu, wm, xm, a BrokerConnection's mu and the descriptor
//   table's lock are never held while taking another one. (The descriptor table's lock is also
//   taken before the engine's when fork() prepares, lifetime.cc.)
// What is held across a blocking call: rm across the engine's reads and the wait for a piece
// of read-ahead (am is released by that wait); xm across fallocate/ftruncate of the backing file
// and, in ftruncate(2), of the program's descriptor; a BrokerConnection's mu across a broker
// round trip; the descriptor table's lock across kcmp only; mu across nothing. wm is never held
// across I/O: writers wait on wcv. Engine completions run on engine threads and take only wm
// (writes) or am (read-ahead).
#ifndef DNVME_PRELOAD_ADOPTED_FILE_H_
#define DNVME_PRELOAD_ADOPTED_FILE_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>

#include "dnvme/broker.h"
#include "dnvme/handle.h"
#include "preload/broker_client.h"

namespace dnvme::preload {

struct ReadAheadPiece;  // staging.h

struct AdoptedFile {
  std::shared_ptr<BrokerConnection> conn;  // the mount's broker
  FileRef file;      // the backing file (O_DIRECT + buffered), as the broker opened it
  int witness = -1;  // our duplicate of the program's descriptor (kcmp, and the FUSE open)
  uint64_t lease = 0;
  broker::LeaseWord* word = nullptr;  // the lease's word in conn's page
  bool can_read = false, can_write = false;

  // Announcements (lease.h).
  std::mutex mu;                             // guards the three below
  int64_t pending_lo = -1, pending_hi = -1;  // written around the mount, kernel not yet told
  bool mapped = false;                       // mmap'ed: every write is announced at once

  // Write-behind (staging.h): writes copied into staging buffers and submitted return at once
  // (the program computes its next piece -- torch's CRC, say -- while the disk writes this one).
  // The first failure is kept and reported at the next write, fsync or close, as POSIX allows.
  std::mutex wm;
  std::condition_variable wcv;  // signalled (under wm) when a piece leaves flight
  int inflight = 0;             // guarded by wm
  int first_err = 0;            // guarded by wm
  // Set by EndLease once the writes drained: the lease word may belong to another file after
  // kClose, so no write may be counted in it any more (a thread still inside a transfer on a
  // descriptor another thread closed gets EBADF).
  bool ended = false;  // guarded by wm
  // The bytes the writes in flight cover, as one range (guarded by wm; valid while inflight > 0).
  // Requests in flight complete in any order, so a write over these bytes waits for them first.
  int64_t wb_lo = 0, wb_hi = 0;

  // Space for the writes that extend the file (reserve.h), serialised by `xm` (also held by
  // fallocate and ftruncate of the file, which invalidate it). Blocks [resv_lo, resv_hi) were
  // allocated past the end of the file (fallocate KEEP_SIZE) for this writer.
  std::mutex xm;
  int64_t resv_lo = 0, resv_hi = 0;  // guarded by xm; empty when equal
  int64_t size_set = -1;             // guarded by xm: the size Reserve last gave the file
  bool past_eof = false;             // guarded by xm: blocks may lie past the end (Trim frees them)
  bool no_fallocate = false;         // guarded by xm: the backing file system has no fallocate

  // Read-ahead of a sequential reader (staging.h; the kernel's read-ahead does this for a
  // buffered file, O_DIRECT gets none): the next bytes are read into pinned buffers while the
  // program works on the current ones. Reads of the file are serialised by `rm`, held across
  // the wait for a buffer; completions take only `am`. Every piece in `ahead` is waited for
  // before it is dropped (its request uses `file`).
  std::mutex rm;
  std::deque<std::shared_ptr<ReadAheadPiece>> ahead;  // guarded by rm: contiguous, ascending
  int64_t next_read = -1;                             // guarded by rm: where the last read ended
  std::mutex am;                                      // guards each piece's done and ok
  std::condition_variable acv;                        // signalled (under am) when a piece is done

  int fds = 0;  // guarded by the descriptor table's lock: the program's descriptors of it
};

}  // namespace dnvme::preload

#endif  // DNVME_PRELOAD_ADOPTED_FILE_H_
