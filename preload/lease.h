// An adopted file's lease at its mount's broker: coherence calls (include/dnvme/broker.h,
// fs/broker/leases.h) and the lease's end.
//
// What this process writes around the mount is noted (NoteWritten) and announced (Announce,
// kWrote) once it landed: the daemon then drops its read-ahead and the kernel's cached pages and
// attributes of those bytes. When the lease is shared, or the file mapped, that happens after
// every write; else before this process next uses the mount for the file, and at fsync, close,
// mmap, fork and exec.
//
// Thread contract: every function is thread-safe (lock order: adopted_file.h). Broker errors
// come back as a Status carrying the broker's errno (Status::ErrnoOr turns it into the call's
// errno).
#ifndef DNVME_PRELOAD_LEASE_H_
#define DNVME_PRELOAD_LEASE_H_

#include <cstdint>

#include "dnvme/broker.h"
#include "dnvme/status.h"
#include "preload/adopted_file.h"

namespace dnvme::preload {

// One request about the file's lease (kWrote, kDrain, kClose) and its reply.
Status LeaseCall(AdoptedFile& f, broker::Op op, int64_t off, int64_t len);

// Notes that [off, off + len) was written around the mount (merged into one pending range).
void NoteWritten(AdoptedFile& f, int64_t off, int64_t len);
// Whether a range is noted and not yet announced.
bool HasPending(AdoptedFile& f);
// Waits for the write-behind, then announces the pending range (kWrote) and clears it; Ok when
// nothing is pending.
Status Announce(AdoptedFile& f);

// Marks the file mapped (mmap): from now on every direct write is announced at once.
void NoteMapped(AdoptedFile& f);
// Whether the file is mapped.
bool IsMapped(AdoptedFile& f);

// Ends the lease, once no descriptor maps to the file any more: waits for the write-behind and
// refuses later writes, frees the space reserved past the end (reserve.h), sends kClose with the
// range still pending (the daemon announces it) and closes the witness descriptor.
void EndLease(AdoptedFile& f);

}  // namespace dnvme::preload

#endif  // DNVME_PRELOAD_LEASE_H_
