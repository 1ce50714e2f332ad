// The filesystem core: what the FUSE ops (fs/fuse/), the control plane (fs/control/) and the
// preload broker (fs/broker/) share, composed of
//   Mount        the options, the engines, the pools and pipes, the counters (fs/core/mount.h)
//   InodeTable   the inodes the kernel knows (fs/core/inode_table.h)
//   OpenHandles  the open files, freed at exit if the kernel never released them
//   the control plane's counters, per-uid limits and lanes, and the broker.
// The control plane and the broker see it only as ControlCore (fs/control/control.h, implemented
// in fs/core/control_core.cc) and BrokerCore (fs/broker/broker.h, fs/core/broker_core.cc); the
// FUSE ops reach the pieces through their accessors. The session's userdata is the Fs.
//
// Lock order: the one list for the daemon (docs/architecture.md and the class comments point
// here). Acquire outer to inner, never the reverse; locks on one line are never held together.
//   1. OpenHandles::mu_: held with another lock only by DeleteAll (~Fs), which deletes the handles
//      the kernel never released (a ctl session's teardown then takes 2 and below); otherwise a
//      leaf.
//   2. CtlSession::mu_ (fs/control/control.h; held for a whole request, which reaches the core
//      through ControlCore: 3-5) | VirtualFile::m (a stats/config snapshot: Fs::StatsJson and
//      Fs::EngineConfig, 3 and 5) | an inode's OpenModes::mu (fs/fuse/passthrough.cc BeginOpen:
//      the first passthrough open drains write-behind and drops read-ahead under it, 4).
//   3. CtlSession::queue_mu_ (CtlSession::Run hands its answer over under mu_; Enqueue's starter
//      takes UidLanes::mu_ under it) | Engines::reconfig_mu_ (Reconfigure swaps the engine and
//      MountStats reads the retired ones under it, and destroying a retired engine waits for
//      callbacks that take 4).
//   4. an inode's WriteBehind::m_ | ReadAhead::m_ (datapath/; never both: FileData::Write drops
//      the window before and after it writes, each under its own mutex; FileData::Read drains,
//      then reads). A flush or
//      fetch takes 5 under it: pinned and pipe pool leases, the splice workers' queue and the
//      engine's worker queue (submit). The engine pointer it submits to is an atomic load
//      (Engines::Current), no mutex.
//   5. leaves, nothing taken under them: Engines::config_mu_, InodeTable::mu_ (an Inode is
//      destroyed after it is released, InodeTable::Forget), Engines::sessions_mu_, CtlHandle::m,
//      UidLimits/UidLanes, PreloadLeases and Broker mutexes, the Pinned/Pipe/RequestBuffer pools,
//      SessionLoop::mu_, OffLoop::mu_ (its gate polls PreloadLeases with it released).
// Engine and splice-writer completion callbacks take only a level-4 mutex (or CtlHandle::m);
// nothing holds one while waiting for the engine except through a condition variable wait
// (which releases it), so a callback can always make progress. The exception is a submit that
// finds an engine worker's slice queue full (Worker::kQueueCapacity): it waits for that worker
// under 4, so the slices in flight must stay below it (pools far smaller at sane sizes).
//
// Thread contract: the accessors and the ControlCore/BrokerCore methods from any thread. Start,
// StartBroker, Preflight, DrainAll and Stop from the main thread: Start/StartBroker before the
// session runs, DrainAll and Stop after it ended (DrainAll also from the session's destroy).
#pragma once

#include <atomic>

#include <memory>
#include <string>

#include "fs/broker/broker.h"
#include "fs/control/control.h"
#include "fs/core/inode.h"
#include "fs/core/inode_table.h"
#include "fs/core/mount.h"
#include "fs/core/off_loop.h"
#include "fs/core/open_handles.h"
#include "fs/limits/uid_lanes.h"
#include "fs/limits/uid_limits.h"
#include "fs/options.h"
#include "fs/transport/session_io.h"

namespace dnvme::fs {

class Fs : public ControlCore, public BrokerCore, public SessionHost {
 public:
  explicit Fs(MountOptions opts);
  ~Fs() override;

  Mount& mount() { return mount_; }
  InodeTable& inodes() { return inodes_; }
  OpenHandles& handles() { return handles_; }
  // The lanes control requests run on, one per uid (fs/limits/uid_lanes.h); shut down by Stop.
  UidLanes& ctl_lanes() { return ctl_lanes_; }
  // The lanes a uid's FUSE requests run on once it occupies its share of the loop threads
  // (Transport::ShareLoopThreads). Not the control lanes: a control job may block in a kernel
  // notification (an entry's invalidation waits for the directory's lock) that a FUSE request
  // queued behind it on the same lane would have to answer first.
  UidLanes& request_lanes() { return request_lanes_; }
  // Lease waits and kernel notifications, off the loop threads (fs/core/off_loop.h); shut down
  // by Stop.
  OffLoop& off_loop() { return off_loop_; }

  // Opens the backing directory and starts the mount (engine, pools); called in the daemon after
  // it forked.
  Status Start();
  // Start() then undo it: run in the parent before mounting, so a configuration the engine
  // refuses (RLIMIT_MEMLOCK, aio-max-nr) fails with nothing mounted instead of in the daemon.
  // Keeps BACKING_DIR's descriptor for Start, so the mount may cover BACKING_DIR itself.
  Status Preflight();
  // After the session forked into the daemon: start the broker (unless -o preload=0).
  Status StartBroker();
  // After the session forked into the daemon: start the inode table's pruner (the kernel is
  // asked to forget idle inodes through the session's /dev/fuse; InodeTable). Stop ends it.
  void StartPruner();
  // Flushes every inode's write-behind and waits (unmount, SIGTERM); nothing before Start.
  void DrainAll();
  // Ends the control lanes and the broker, DrainAll, then stops the mount (which waits for every
  // engine operation and its completion callback, async replies included). Call before the FUSE
  // session is destroyed.
  void Stop();
  // What `.dnvme/broker` says: the socket's name, or "" when the broker does not run.
  std::string BrokerAnnouncement() const { return broker_ ? broker_->Announcement() : ""; }

  // ---- ControlCore (fs/core/control_core.cc; the first four serve the broker too) ----
  Inode* PinInode(dev_t dev, ino_t ino) override { return inodes_.Pin(dev, ino); }
  void Unpin(Inode* in) override { inodes_.Unpin(in); }
  Status DrainForExternal(Inode& in) override;
  void AfterExternalWrite(Inode& in) override;
  void OutsideWrite(Inode& in, bool running) override {
    running ? in.data.BeginOutsideWrite() : in.data.EndOutsideWrite();
  }
  void AfterExternalCreate(const std::string& dir_rel, const std::string& name) override;
  UidLimits& uid_limits() override { return uid_limits_; }
  CtlCounters& ctl_counters() override { return ctl_counters_; }
  HandleConfig EngineConfig() override { return mount_.engines().config(); }
  Result<HandleConfig> SetEngineConfig(const std::string& json_patch) override;
  // Root (uid 0) or the user the daemon runs as may change the live configuration.
  bool MayReconfigure(uid_t uid) const override;
  std::string StatsJson() override;  // fs/core/stats.cc
  std::string StatsJsonFor(uid_t reader) override;
  void AddCtlEngine(AioHandle* h) override { mount_.engines().AddSessionEngine(h); }
  void RemoveCtlEngine(AioHandle* h) override { mount_.engines().RemoveSessionEngine(h); }
  int root_fd() const override { return inodes_.root_fd(); }
  const std::string& mountpoint() const override { return mount_.opts().mountpoint; }
  bool Stopping() const override { return stopping_.load(std::memory_order_acquire); }

  // ---- BrokerCore (fs/core/broker_core.cc) ----
  int OpenCount(Inode& in) override;
  PreloadLeases& LeasesOf(Inode& in) override { return in.leases; }

  // ---- SessionHost (fs/transport/session_io.h: the session's I/O) ----
  ProtocolExtensions& session_protocol() override { return mount_.protocol(); }
  Transport* session_transport() override { return mount_.transport(); }
  datapath::PipePool* session_reply_pipes() override { return mount_.reply_pipes(); }
  ReplyCounters& session_reply_counters() override { return mount_.counters(); }

 private:
  std::atomic<bool> stopping_{false};  // set first thing in Stop()
  // Declared before the inodes: they point to its shared write-behind and read-ahead state.
  Mount mount_;
  CtlCounters ctl_counters_;
  // Declared before everything that holds charges of it (sessions, the broker) and the lanes.
  UidLimits uid_limits_;
  UidLanes ctl_lanes_;
  UidLanes request_lanes_;
  OffLoop off_loop_;
  InodeTable inodes_;
  OpenHandles handles_;
  // Declared after every Inode (destroyed before them: its connections unpin inodes); Stop()
  // ends it before the engine.
  std::unique_ptr<Broker> broker_;
};

}  // namespace dnvme::fs
