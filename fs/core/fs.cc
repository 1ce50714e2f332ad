// The core's composition and its start and end: the order in which the pieces come up and go
// down (the lanes and the broker before the drain, the drain before the engines).
#include "fs/core/fs.h"

#include <chrono>
#include <vector>

namespace dnvme::fs {
namespace {

// Both kinds of per-uid lanes (control requests, FUSE requests past a uid's loop-thread share):
// `ctl_threads_per_uid` running at once, 256 queued.
UidLanes::Options LaneOptions(const MountOptions& o) {
  return UidLanes::Options{.threads_per_key = o.ctl_threads_per_uid,
                           .max_queued = 256,
                           .idle = std::chrono::milliseconds(2000),
                           .option = "ctl_threads_per_uid"};
}

}  // namespace

Fs::Fs(MountOptions opts)
    : mount_(std::move(opts)),
      uid_limits_(
          UidLimits::Maxima{mount_.opts().ctl_max_handles, mount_.opts().ctl_max_bytes,
                            mount_.opts().ctl_max_buffers, mount_.opts().ctl_max_pinned,
                            mount_.opts().ctl_max_pending, mount_.opts().max_files_per_uid,
                            mount_.opts().broker_max_conns_per_uid, mount_.opts().ctl_max_opens,
                            mount_.opts().ctl_max_workers, mount_.opts().ctl_max_aio_events,
                            mount_.opts().max_inodes_per_uid},
          FdShape::OfProcess()),
      ctl_lanes_(LaneOptions(mount_.opts())),
      request_lanes_(LaneOptions(mount_.opts())),
      inodes_(mount_.data_shared(), &uid_limits_) {}

Fs::~Fs() {
  stopping_.store(true, std::memory_order_release);
  off_loop_.Shutdown();   // its work answers requests and uses inodes
  ctl_lanes_.Shutdown();  // control requests still queued use the sessions deleted below
  request_lanes_.Shutdown();
  DrainAll();
  // Files still open when the session ended: the kernel will never release them.
  handles_.DeleteAll();
  Stop();  // waits for every engine operation (read-ahead included)
}

Status Fs::Start() {
  // Opened once, by Preflight, before the mount: the mount may cover BACKING_DIR itself (the
  // set-up that keeps it out of every other user's reach, docs/security.md).
  DNVME_RETURN_IF_ERROR(inodes_.OpenRoot(mount_.opts().backing));
  return mount_.Start();
}

Status Fs::Preflight() {
  Status st = Start();
  mount_.Release();
  // The BACKING_DIR descriptor stays for Start (see there).
  if (!st.ok()) inodes_.CloseRoot();
  return st;
}

Status Fs::StartBroker() {
  if (!mount_.opts().preload) return Status::Ok();
  auto b = Broker::Start(*this);
  if (!b.ok()) return b.status().WithContext("preload broker (-o preload=0 turns it off)");
  broker_ = std::move(b).value();
  return Status::Ok();
}

void Fs::StartPruner() {
  inodes_.StartPruner(
      [this](const std::vector<uint64_t>& ids) { return mount_.protocol().NotifyPrune(ids); });
}

void Fs::DrainAll() {
  if (!mount_.engine()) return;
  inodes_.DrainAll();
}

void Fs::Stop() {
  // Control requests answer from their lanes: they finish while the session can still take the
  // replies, and before the engines they use go. Those not yet run are answered ECANCELED
  // (Stopping()), so the wait is for the requests running now, not for every one a user queued.
  stopping_.store(true, std::memory_order_release);
  ctl_lanes_.Shutdown();
  // FUSE requests handed to a uid's lane before the loop ended: answered (the loop has ended, so
  // no new ones come).
  request_lanes_.Shutdown();
  // Opens and truncates waiting for a `dnvme run` client's writes are answered now (the broker
  // below ends the leases anyway).
  off_loop_.Shutdown();
  inodes_.StopPruner();
  broker_.reset();  // ends the clients' leases (their inodes stay pinned until then)
  DrainAll();
  mount_.Stop();
}

}  // namespace dnvme::fs
