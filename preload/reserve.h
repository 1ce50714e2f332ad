// Space for the writes that extend an adopted file: reserved before the write (fallocate), so
// ENOSPC and EDQUOT are that write's error and no zero-filled tail is left (docs/preload.md,
// "Durability and space").
//
// Thread contract: every function is thread-safe; each takes the file's `xm` (lock order:
// adopted_file.h), except the Locked one, which needs it held.
#ifndef DNVME_PRELOAD_RESERVE_H_
#define DNVME_PRELOAD_RESERVE_H_

#include <sys/types.h>

#include <cstdint>

#include "dnvme/status.h"
#include "preload/adopted_file.h"

namespace dnvme::preload {

// fallocate of the backing file `fd`, by this process: its own quotas apply, and ext4's
// root-reserved blocks only to root. Retried on EINTR; fails with fallocate's errno.
Status BackingFallocate(int fd, int mode, int64_t off, int64_t len);

// Before a write of [off, end) that extends the file: space for it, then the new size. Ok, or
// the error (ENOSPC, EDQUOT...) with the file as it was.
Status Reserve(AdoptedFile& f, int64_t off, int64_t end);

// Frees what Reserve left past the end of the file, once this process's writes to it are done
// (the lease ends, or the process exits). Not while someone else has the file open.
void TrimReservation(AdoptedFile& f);

// ftruncate(2) of the program's descriptor `fd` of the file, under f.xm (a shrink frees the
// blocks reserved past the end, so the reservation is forgotten); fails with ftruncate's errno.
Status TruncateAdopted(AdoptedFile& f, int fd, off_t len);

// fallocate(2) of the backing file in any mode, under f.xm (the reservation is forgotten); fails
// with fallocate's errno.
Status FallocateBacking(AdoptedFile& f, int mode, off_t off, off_t len);

}  // namespace dnvme::preload

#endif  // DNVME_PRELOAD_RESERVE_H_
