// An adopted file's lease (lease.h).
#include "preload/lease.h"

#include <algorithm>
#include <mutex>

#include "dnvme/log.h"
#include "preload/counters.h"
#include "preload/libc.h"
#include "preload/reserve.h"
#include "preload/staging.h"

namespace dnvme::preload {

Status LeaseCall(AdoptedFile& f, broker::Op op, int64_t off, int64_t len) {
  broker::Request req;
  req.op = static_cast<uint32_t>(op);
  req.lease = f.lease;
  req.offset = off;
  req.length = len;
  broker::Reply rep;
  std::lock_guard lock(f.conn->mu);
  return CallBroker(*f.conn, req, &rep, nullptr, 0, nullptr);
}

// Announced only once the bytes are in the file: a reader the kernel sends to the daemon after
// the invalidation must find them there.
Status Announce(AdoptedFile& f) {
  (void)f.data.Drain();
  int64_t lo, hi;
  {
    std::lock_guard lock(f.mu);
    lo = f.pending_lo;
    hi = f.pending_hi;
    f.pending_lo = f.pending_hi = -1;
  }
  if (lo < 0) return Status::Ok();
  ProcessCounters().invalidations.fetch_add(1, std::memory_order_relaxed);
  Status st = LeaseCall(f, broker::Op::kWrote, lo, hi - lo);
  // Not announced: the range stays pending, for the next announcement or the lease's close, so
  // the kernel's cached pages of it are dropped after all.
  if (!st.ok()) NoteWritten(f, lo, hi - lo);
  return st;
}

void NoteWritten(AdoptedFile& f, int64_t off, int64_t len) {
  std::lock_guard lock(f.mu);
  if (f.pending_lo < 0) {
    f.pending_lo = off;
    f.pending_hi = off + len;
  } else {
    f.pending_lo = std::min(f.pending_lo, off);
    f.pending_hi = std::max(f.pending_hi, off + len);
  }
}

bool HasPending(AdoptedFile& f) {
  std::lock_guard lock(f.mu);
  return f.pending_lo >= 0;
}

void NoteMapped(AdoptedFile& f) {
  std::lock_guard lock(f.mu);
  f.mapped = true;  // the mapping's pages are the kernel's: announce every write now
}

bool IsMapped(AdoptedFile& f) {
  std::lock_guard lock(f.mu);
  return f.mapped;
}

void EndLease(AdoptedFile& f) {
  f.data.Close();
  TrimReservation(f);
  int64_t lo, hi;
  {
    std::lock_guard lock(f.mu);
    lo = f.pending_lo;
    hi = f.pending_hi;
  }
  Status st = LeaseCall(f, broker::Op::kClose, lo < 0 ? 0 : lo, lo < 0 ? -1 : hi - lo);
  if (!st.ok()) dnvme::Logger().debug("dnvme run: ending a lease: {}", st.ToString());
  if (f.witness >= 0) Libc().close(f.witness);
  f.witness = -1;
}

}  // namespace dnvme::preload
