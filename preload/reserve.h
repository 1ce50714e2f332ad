// The preload's side of the space its writes need (datapath/space.h does the reserving, inside
// FileData::Write: `dnvme run`'s data path reserves before each write and extends the file, so
// ENOSPC and EDQUOT are that write's error and no zero-filled tail is left; docs/preload.md,
// "Durability and space"): the changes that make the reservation look again, and freeing what it
// holds past the end when this process is done with the file.
//
// Thread contract: every function is thread-safe. TruncateAdopted and FallocateBacking run inside
// FileData::Change (which lands the write-behind and forgets the reservation around them).
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

// Frees what the reservation left past the end of the file, once this process's writes to it
// are done (the lease ends, or the process exits). Not while someone else has the file open
// (the lease word's `shared`): a write of theirs could extend it under the truncate.
void TrimReservation(AdoptedFile& f);

// ftruncate(2) of the program's descriptor `fd` of the file; fails with ftruncate's errno. Run
// it in f.data.Change (a shrink frees the blocks reserved past the end).
Status TruncateAdopted(int fd, off_t len);

// fallocate(2) of the backing file in any mode; fails with fallocate's errno. Run it in
// f.data.Change.
Status FallocateBacking(AdoptedFile& f, int mode, off_t off, off_t len);

}  // namespace dnvme::preload

#endif  // DNVME_PRELOAD_RESERVE_H_
