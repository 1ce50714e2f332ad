// The dnvmefs filesystem state: inodes, open files, the write-behind and read-ahead state, the
// engine handle and the per-mount counters.
//
// Lock order: the one list for the daemon (docs/architecture.md points here). Acquire outer to
// inner, never the reverse; locks on one line are never held together.
//   1. Fs::handles_mu_: held with another lock only by ~Fs, which deletes the handles the kernel
//      never released (a ctl session's teardown then takes 2 and below); otherwise a leaf.
//   2. CtlSession::mu_ (fs/control/control.h; held for a whole request, which reaches the core
//      through ControlCore: 3-5) | VirtualFile::m (a stats/config snapshot: Fs::StatsJson and
//      Fs::EngineConfig, 3 and 5) | an inode's OpenModes::mu (fs/fuse/passthrough.cc BeginOpen:
//      the first passthrough open drains write-behind and drops read-ahead under it, 4).
//   3. CtlSession::queue_mu_ (CtlSession::Run hands its answer over under mu_; Enqueue's starter
//      takes UidLanes::mu_ under it) | Fs::reconfig_mu_ (SetEngineConfig and StatsJson read or
//      swap the engine under it, and destroying a retired engine waits for callbacks that take 4).
//   4. an inode's WriteBehind::m_ | ReadAhead::m_ (fs/data/; never both: OpWriteBuf drops the
//      window before it writes, Fs::Read drains before it reads). A flush or fetch takes 5
//      under it: the engine pointer (Fs::Engine, engine_mu_), pinned and pipe pool leases, the
//      splice workers' queue and the engine's worker queue (submit).
//   5. leaves, nothing taken under them: Fs::engine_mu_, Fs::inodes_mu_ (an Inode is destroyed
//      after it is released, fs/fuse/inode_table.cc Forget), Fs::ctl_engines_mu_, CtlHandle::m,
//      UidLimits/UidLanes, PreloadLeases and Broker mutexes, the Pinned/Pipe/RequestBuffer pools,
//      SessionLoop::mu_.
// Engine and splice-writer completion callbacks take only a level-4 mutex (or CtlHandle::m);
// nothing holds one while waiting for the engine except through a condition variable wait
// (which releases it), so a callback can always make progress. The exception is a submit that
// finds an engine worker's slice queue full (Worker::kQueueCapacity): it waits for that worker
// under 4, so the slices in flight must stay below it (pools far smaller at sane sizes).
//
// Inode lifetime follows the kernel's lookup count (like libfuse's passthrough_hp): an inode is
// created on the first lookup of a (dev, ino) pair, each reply that hands the kernel an entry
// adds one, FORGET subtracts, and at zero the inode and its O_PATH fd go away. The kernel never
// forgets an inode that still has open files, so a FileHandle's Inode* stays valid until release.
#pragma once

#include <fuse_lowlevel.h>
#include <sys/stat.h>
#include <sys/uio.h>

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <unordered_set>
#include <vector>

#include "datapath/read_ahead.h"
#include "datapath/splice_io.h"
#include "datapath/write_behind.h"
#include "dnvme/handle.h"
#include "dnvme/pinned.h"
#include "engine/posix/file.h"
#include "fs/broker/broker.h"
#include "fs/broker/leases.h"
#include "fs/control/control.h"
#include "fs/data/counters.h"
#include "fs/limits/uid_lanes.h"
#include "fs/limits/uid_limits.h"
#include "fs/options.h"
#include "fs/transport/protocol_ext.h"
#include "fs/transport/request_buffer.h"
#include "fs/transport/request_pipe.h"
#include "fs/transport/transport.h"
#include "fs/transport/write_source.h"

namespace dnvme::fs {

// The control directory and its files (fs/control/virtual.cc): served by the daemon, never stored
// in BACKING_DIR. kNone is every real inode.
enum class VirtualNode : uint8_t { kNone, kCtlDir, kCtl, kStats, kConfig, kBroker };
inline constexpr const char* kCtlDirName = ".dnvme";

// How the kernel has this inode open (fs/fuse/passthrough.h): the counts it must agree with.
struct OpenModes {
  std::mutex mu;
  int passthrough = 0;      // opens answered FOPEN_PASSTHROUGH (guarded by mu)
  int other = 0;            // opens served through the daemon (guarded by mu)
  int32_t backing_id = -1;  // registered while passthrough > 0 (guarded by mu)
};

struct Inode {
  int fd = -1;  // O_PATH fd on the backing object; owned (-1 for virtual nodes)
  VirtualNode virt = VirtualNode::kNone;
  dev_t dev = 0;
  ino_t ino = 0;
  mode_t type = 0;       // S_IFMT bits
  uint64_t nlookup = 0;  // guarded by Fs::inodes_mu_

  datapath::WriteBehind
      wb;  // data accepted from writers, not yet on disk (datapath/write_behind.h)
  datapath::ReadAhead
      ra;                // the window fetched ahead of a sequential reader (datapath/read_ahead.h)
  OpenModes modes;       // regular files
  PreloadLeases leases;  // descriptors the broker handed to `dnvme run` clients (fs/broker/)

  Inode(const datapath::WriteBehindShared* w, const datapath::ReadAheadShared* r) : wb(w), ra(r) {}
  ~Inode();
};

// Base of the per-open state handed to the kernel as fi->fh, so the daemon can free whatever the
// kernel never released (it does not send RELEASE for files still open when the daemon exits).
struct OpenHandle {
  virtual ~OpenHandle() = default;
  // The opener's share of max_files_per_uid (docs/security.md): the descriptors this open holds
  // in the daemon are charged to it until the handle goes.
  UidCharge files;
};

// An open control file: a ctl session, or a snapshot of stats/config being read.
struct VirtualFile : OpenHandle {
  VirtualNode kind = VirtualNode::kNone;
  std::mutex m;
  std::string snapshot;                 // stats/config: the document being read (guarded by m)
  std::shared_ptr<CtlSession> session;  // ctl only; lane jobs running its queue hold it too
};

struct FileHandle : OpenHandle {
  UniqueFd fd;   // the backing file, buffered (for fsync, fallocate, lseek, ftruncate)
  FileRef file;  // the engine's view (O_DIRECT + buffered fds); regular files only
  bool client_direct = false;
  bool writable = false;
  // The kernel sends this handle's writes from its page cache (not direct_io, not O_DIRECT), so
  // a spliced request carries page-aligned page references the splice writer can use as is.
  bool page_cache_writes = false;
  // The kernel serves this open from the backing file (fs/fuse/passthrough.h): no READ or
  // WRITE of it reaches the daemon.
  bool passthrough = false;
  // This description's place in the file's write-behind errors (datapath/write_behind.h), and
  // whether it wrote (only a writer's close hears of a flush error).
  datapath::ErrorCursor wb_errors;  // used under the inode's WriteBehind mutex
  std::atomic<bool> wrote{false};
  Inode* inode = nullptr;
};

class Fs : public ControlCore, public BrokerCore {
 public:
  explicit Fs(MountOptions opts);
  ~Fs();

  // Creates what needs privileges the daemon drops after mounting, pipes sized above
  // pipe-max-size: those that hold spliced write-behind extents, when the session loop splices
  // requests (`splicing`), and those for spliced replies (-o splice_reply), when replies are
  // written to /dev/fuse (`replies_to_fd`: not over io_uring). Call before DropCaps.
  Status ReservePrivileged(bool splicing, bool replies_to_fd);
  // Opens the backing directory and creates the engine; called in the daemon after it forked.
  Status Start();
  // Start() then undo it: run in the parent before mounting, so a configuration the engine
  // refuses (RLIMIT_MEMLOCK, aio-max-nr) fails with nothing mounted instead of in the daemon.
  // Keeps BACKING_DIR's descriptor for Start, so the mount may cover BACKING_DIR itself.
  Status Preflight();
  // Flushes every inode's write-behind and waits (unmount, SIGTERM).
  void DrainAll();
  // DrainAll, then destroys the engine, which waits for every operation and its completion
  // callback (async replies included). Call before the FUSE session is destroyed.
  void Stop();

  const MountOptions& opts() const { return opts_; }
  // libfuse connection options from -o (fuse_parse_conn_info_opts), applied in init; owned.
  void set_conn_opts(fuse_conn_info_opts* o) { conn_opts_.reset(o); }
  fuse_conn_info_opts* conn_opts() const { return conn_opts_.get(); }
  MountCounters& counters() { return counters_; }
  // The mount's engine. config.set swaps it for a new one: callers keep the returned pointer for
  // the duration of one submission only. Retired engines are destroyed once nobody holds them
  // (by the next config.set or Stop, on a thread that holds no inode lock), which also waits for
  // their in-flight operations.
  std::shared_ptr<AioHandle> Engine();
  HandleConfig EngineConfig() override;
  // Applies a JSON object of HandleConfig keys on top of the live configuration (new I/O uses
  // it at once; no remount). Returns the resulting configuration.
  Result<HandleConfig> SetEngineConfig(const std::string& json_patch) override;
  void set_session(fuse_session* se) { se_ = se; }
  // True when page-cache WRITEs can reach the disk without a copy (pipes were reserved).
  bool SplicesWrites() const { return wb_pipes_ != nullptr; }
  // Pipes for spliced replies (-o splice_reply); null when replies are written.
  datapath::PipePool* reply_pipes() const { return reply_pipes_.get(); }
  // The transport the requests arrive by (set by main.cc before the session runs, cleared after
  // it ended): the WRITE handler asks it for the write flags and the payload's pool.
  void set_transport(Transport* t) { transport_ = t; }
  Transport* transport() const { return transport_; }
  // What the mount negotiates beyond libfuse's protocol (passthrough), and the backing-file
  // registrations (fs/transport/protocol_ext.h).
  ProtocolExtensions& protocol() { return protocol_; }

  // ---- Control plane (fs/control/virtual.cc) ----
  Inode& VirtualInode(VirtualNode kind);
  CtlCounters& ctl_counters() override { return ctl_counters_; }
  // What each uid holds (fs/limits/uid_limits.h): the control file's, the broker's and the
  // mount's own opens count here ("files": Take/Release UidResource::kFiles).
  UidLimits& uid_limits() override { return uid_limits_; }
  // The lanes control requests run on, one per uid (fs/limits/uid_lanes.h); shut down by Stop.
  UidLanes& ctl_lanes() { return ctl_lanes_; }
  // False when a reply must come from the thread that received the request (FUSE over io_uring):
  // control requests then run on that thread.
  bool RepliesMayBeDeferred() const;
  // Root (uid 0) or the user the daemon runs as may change the live configuration.
  bool MayReconfigure(uid_t uid) const override;
  std::string StatsJson() override;
  int root_fd() const override { return root_.fd; }
  const std::string& mountpoint() const override { return opts_.mountpoint; }
  // Takes a reference on the inode the kernel knows for (dev, ino), so it cannot be forgotten
  // while a control transfer uses it; null when the kernel has never looked the file up.
  Inode* PinInode(dev_t dev, ino_t ino) override;
  void Unpin(Inode* in) override;
  // Lands the inode's write-behind data (and reports its sticky error without taking it).
  Status DrainForExternal(Inode& in) override;
  // After bytes reached the backing file outside the FUSE data path: drop read-ahead and the
  // kernel's cached pages and attributes of the inode.
  void AfterExternalWrite(Inode& in) override;
  // After the daemon changed an inode's attributes behind a request that does not report them
  // (a WRITE clearing set-user-ID): drop the kernel's cached attributes, keep its pages.
  void ForgetCachedAttributes(fuse_ino_t ino);
  // After a file was created in BACKING_DIR outside FUSE: drop the kernel's negative dentry.
  void AfterExternalCreate(const std::string& dir_rel, const std::string& name) override;
  // ---- The preload broker (fs/broker/broker.h) ----
  int OpenCount(Inode& in) override;
  PreloadLeases& LeasesOf(Inode& in) override { return in.leases; }
  // What `.dnvme/broker` says: the socket's name, or "" when the broker does not run.
  std::string BrokerAnnouncement() const { return broker_ ? broker_->Announcement() : ""; }
  // After the session forked into the daemon: start the broker (unless -o preload=0).
  Status StartBroker();
  // Control-file engines (for the stats): registered at handle.open, unregistered at close.
  void AddCtlEngine(AioHandle* h) override;
  void RemoveCtlEngine(AioHandle* h) override;

  // Open-handle bookkeeping: Track when created, Dispose at release; the rest go with Fs.
  void Track(OpenHandle* h);
  void Dispose(OpenHandle* h);

  Inode& GetInode(fuse_ino_t ino);
  // Looks `name` up under `parent` (or adopts an already open O_PATH fd), filling `e`; adds one
  // lookup reference. Returns an errno (0 on success).
  int DoLookup(fuse_ino_t parent, const char* name, fuse_entry_param* e);
  void Forget(fuse_ino_t ino, uint64_t n);

  // The data path (fs/data/data_path.cc): the inode's WriteBehind and ReadAhead, and the engine.
  // (A WRITE goes from fs/fuse/ops_file.cc straight to the inode's WriteBehind.)
  // For an O_DIRECT client: drains write-behind, then submits the read to the engine. `done`
  // runs once, on an engine worker (or on this thread when the read fails or ends before it is
  // submitted), with the bytes read -- valid only during the call -- or the error; it replies.
  // Returns false, without calling `done`, when no reply buffer is free: read synchronously.
  using ReadDone = std::function<void(Result<std::span<const char>>)>;
  bool ReadAsync(FileHandle& fh, size_t size, off_t off, ReadDone done);
  // Reads up to `size` bytes at `off` (readers see every accepted byte: write-behind is drained
  // first); `scratch` (at least `size` bytes, pinned and aligned) takes what is read on demand.
  // Returns the bytes read (the iovecs in `reply` add up to it).
  Result<int64_t> Read(FileHandle& fh, char* scratch, size_t size, off_t off,
                       datapath::ReadReply* reply);

 private:
  MountOptions opts_;
  struct FreeDeleter {
    void operator()(void* p) const { free(p); }
  };
  std::unique_ptr<fuse_conn_info_opts, FreeDeleter> conn_opts_;
  MountCounters counters_;
  std::mutex engine_mu_;
  std::shared_ptr<AioHandle> engine_;  // guarded by engine_mu_
  HandleConfig engine_config_;         // guarded by engine_mu_
  std::mutex reconfig_mu_;             // one config.set at a time; guards the two below
  std::vector<std::shared_ptr<AioHandle>> retired_;
  HandleStats retired_stats_;  // of destroyed engines, for the stats
  fuse_session* se_ = nullptr;
  Transport* transport_ = nullptr;
  ProtocolExtensions protocol_;
  struct timespec started_ {};

  CtlCounters ctl_counters_;
  // Declared before everything that holds charges of it (sessions, the broker) and the lanes.
  UidLimits uid_limits_;
  UidLanes ctl_lanes_;
  std::mutex ctl_engines_mu_;
  std::unordered_set<AioHandle*> ctl_engines_;  // guarded by ctl_engines_mu_
  HandleStats ctl_closed_stats_;                // guarded by ctl_engines_mu_
  void ReapRetiredLocked();
  void InitVirtualNodes();
  std::unique_ptr<PinnedPool> wb_pool_;
  std::unique_ptr<datapath::PipePool>
      wb_pipes_;  // spliced write-behind extents (ReservePrivileged)
  std::unique_ptr<datapath::PipePool> reply_pipes_;  // spliced replies (ReservePrivileged)
  std::unique_ptr<datapath::SpliceWorkers>
      splicers_;  // runs spliced flushes; exists iff wb_pipes_ does
  std::unique_ptr<PinnedPool> ra_pool_;
  std::unique_ptr<PinnedPool> reply_pool_;  // 1 MiB buffers for async replies
  // What every inode's WriteBehind / ReadAhead share (filled by Start; declared before every
  // Inode, so they outlive them).
  datapath::WriteBehindShared wb_shared_;
  datapath::ReadAheadShared ra_shared_;
  Inode ctl_dir_, ctl_node_, stats_node_, config_node_, broker_node_;

  std::mutex handles_mu_;
  std::unordered_set<OpenHandle*> handles_;  // guarded by handles_mu_

  std::mutex inodes_mu_;
  std::map<std::pair<dev_t, ino_t>, std::unique_ptr<Inode>> inodes_;  // guarded by inodes_mu_
  Inode root_;
  // Declared after every Inode (destroyed before them: its connections unpin inodes); Stop()
  // ends it before the engine.
  std::unique_ptr<Broker> broker_;
};

// The FUSE low-level operations table (fs/fuse/ops_table.cc; the ops in fs/fuse/ops_*.cc).
const fuse_lowlevel_ops& Operations();
// The session's /dev/fuse I/O (fuse_session_custom_io, userdata the Fs): plain read, writev and
// splice, with the Fs's ProtocolExtensions shown each request libfuse reads itself and given
// each reply to extend (fs/transport/protocol_ext.h).
const fuse_custom_io& SessionIo();

}  // namespace dnvme::fs
