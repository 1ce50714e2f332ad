// The control plane behind `<mount>/.dnvme/` (docs/control-protocol.md): the `ctl` sessions and
// the `stats` / `config` documents.
//
// A CtlSession belongs to one open of `ctl`. Each write() is one request: it joins the session's
// queue and the write is answered at once; one job on a thread of the writer's uid's lane
// (fs/limits/uid_lanes.h; fs/fuse/control_dir.cc hands it over) runs the queue in order, so one
// user's long `wait` occupies only that user's threads, never a FUSE loop thread, and no write
// waits for a request to run (the kernel may hold the ctl inode's lock for the write:
// docs/security.md). The answer of the last request waits in the session for the next read(), and
// that read waits (is parked, answered by the job when the queue is empty; no thread blocks) while
// requests are queued or running. Handles (engine instances with their own parameters) and
// registered client buffers belong to the session and go away with it (release waits for its queued
// requests and in-flight operations first, on a lane).
//
// Identity: every request acts as the session's opener (the uid, gid and supplementary groups of
// the FUSE OPEN of ctl, bound when the session is made), and only a writer of the opener's uid may
// send requests (EPERM for any other): a descriptor of ctl is a capability of the process that
// opened it, as an open file is, so neither a set-user-ID program writing to a ctl descriptor it
// inherited (it would act as root) nor a process that dropped privileges after opening ctl (it
// would act as the opener) reaches more than the opener could. Paths are opened inside BACKING_DIR
// with openat2(RESOLVE_BENEATH) under that identity (setfsuid/setfsgid/setgroups on the serving
// thread only), so the kernel makes the same permission decision open(2) would, ACLs included.
// Shared-memory objects are opened the same way (docs/security.md for which /dev/shm and /proc
// names). Everything a session makes the daemon hold -- handles, their pinned bounce memory,
// registered buffers and bytes, uncollected async transfers and the files they keep open -- is
// charged to the session owner's uid in the core's UidLimits (fs/limits/uid_limits.h), so a user at
// a limit is refused alone.
//
// Thread contract: a session runs its requests one at a time, in the order they were queued (mu_);
// different sessions run in parallel. Enqueue, Read and RunQueued take only queue_mu_, never for
// long, so a FUSE thread serving a write or a read never waits for a request that is running.
// Lock order (fs/core/fs.h): mu_, then queue_mu_, then the lanes' own (Enqueue's `start` runs under
// queue_mu_).
// Completion callbacks of a session's asynchronous transfers run on engine workers and only touch
// the per-handle record list under its own mutex. Coherence work (draining the mount's
// write-behind, invalidating read-ahead and the kernel's page cache) runs on the thread serving the
// request, never in a callback, so a callback never waits for a FUSE reply.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dnvme/gds_handle.h"
#include "dnvme/gpu.h"
#include "dnvme/handle.h"
#include "fs/control/client_memory.h"
#include "fs/control/ctl_protocol.h"
#include "fs/limits/uid_limits.h"

namespace dnvme::fs {

struct Inode;

// Who sent a request: the FUSE edge fills it in from the request (ops::CallerOf in
// fs/fuse/ops_common.h); the control plane never sees the request itself.
struct Caller {
  uid_t uid = 0;
  gid_t gid = 0;
  pid_t pid = 0;
  std::vector<gid_t> groups;
};

// The daemon's version (the hello answer and the stats).
std::string DaemonVersion();

// Counters of the control file; relaxed atomics.
struct CtlCounters {
  std::atomic<uint64_t> requests{0}, request_errors{0};
  std::atomic<uint64_t> ops_read{0}, ops_written{0}, ops_failed{0};
  std::atomic<uint64_t> bytes_read{0}, bytes_written{0};
  std::atomic<uint64_t> sessions_open{0}, handles_open{0}, buffers_registered{0};
  std::atomic<uint64_t> bytes_registered{0};
  std::atomic<uint64_t> config_changes{0};
};

// Bounds of a control handle's engine parameters (docs/security.md): its bounce pool is pinned
// in the daemon, so a client may not size it at will.
inline constexpr int64_t kCtlMaxBlockSize = int64_t{64} << 20;
inline constexpr int64_t kCtlMaxBounceBytesPerWorker = int64_t{1} << 30;
// The pinned memory a handle's engine may take at most: per worker, min(max(2, bounce bytes /
// request), max(2, queue depth)) bounce buffers of the block size rounded up to 4 KiB
// (engine/handle/worker.cc, Worker::BouncePool).
int64_t PinnedEstimate(const HandleConfig& c);
// What an engine with configuration `c` makes in the daemon: threads (AioHandle: one worker per
// intra_op_parallelism, each with an eventfd and a libaio context) and libaio events (each
// worker's io_setup(queue_depth) takes queue_depth of the machine-wide fs.aio-max-nr).
struct WorkerCost {
  int64_t threads = 0;
  int64_t aio_events = 0;
};
WorkerCost EngineWorkerCost(const HandleConfig& c);
// A GPU engine (GdsHandle) with configuration `c`: its own AioHandle's workers, its dispatcher
// thread and up to intra_op_parallelism - 1 cuFile slice threads while an operation runs.
WorkerCost GdsWorkerCost(const HandleConfig& c);

// A client's GPU memory, opened from its CUDA IPC handle (buffer.register with cuda_ipc): the
// range [data, data + size) of the exported allocation. Closed with the last reference.
struct CtlGpuBuffer {
  std::unique_ptr<gpu::IpcMapping> ipc;
  char* data = nullptr;
  int64_t size = 0;
  int device = 0;
};

// One asynchronous or finished transfer of a session.
struct CtlOpRecord {
  uint64_t op_id = 0;
  bool write = false;
  std::string path;
  int64_t file_offset = 0;
  int64_t length = 0;
  int64_t bytes_done = 0;
  Status status;
  // Held until the outcome is collected: the buffer (kept mapped), the inode pin (for coherence
  // work after a write), the file.
  std::shared_ptr<ClientMapping> buffer;     // shared memory, or
  std::shared_ptr<CtlGpuBuffer> gpu_buffer;  // GPU memory
  Inode* pinned = nullptr;
  bool outside_write = false;  // ControlCore::OutsideWrite(pinned, true) was told
  FileRef file;
  // An async record counts against its uid's ctl_max_pending and max_files_per_uid until `wait`
  // collects it (the file stays open until then).
  UidCharge pending, file_charge;
  // The daemon's descriptors the transfer holds: the file's and the engine's two reopens of it.
  UidCharge fds;
};

struct CtlHandle {
  std::unique_ptr<AioHandle> engine;
  // For transfers into GPU memory: created on the first one, with the engine's configuration, on
  // the buffer's device (GDS where cuFile offers it, else the bounce path).
  std::unique_ptr<GdsHandle> gds;
  int gds_device = 0;
  std::mutex m;
  std::condition_variable cv;
  std::vector<std::shared_ptr<CtlOpRecord>> ops;  // guarded by m; submission order
  int running = 0;                                // guarded by m
  // Its place in the owner's ctl_max_handles, and its pinned estimate in ctl_max_pinned (once
  // more for the GPU engine, which sizes its own bounce buffers from the same configuration).
  UidCharge handle_charge, pinned_charge, gds_pinned_charge;
  // Its engine's threads in ctl_max_workers and their libaio events in ctl_max_aio_events
  // (WorkerCost), and the GPU engine's the same (GdsWorkerCost), taken before the engine is made
  // and given back after it is destroyed, so the uid is charged whenever the threads exist.
  UidCharge workers_charge, aio_charge, gds_workers_charge, gds_aio_charge;
  UidCharge fds_charge, gds_fds_charge;  // the workers' eventfds (the daemon's descriptors)
};

// What the control plane needs from the filesystem core, and nothing more: pinning an inode the
// kernel knows, coherence with the mount's data path (drain write-behind before a transfer,
// drop read-ahead and the kernel's cache after one), the per-uid limits, and the live engine
// configuration and stats. Fs implements it (fs/core/control_core.cc); sessions see only this.
//
// Thread contract: every method is thread-safe (called from the lane threads serving ctl requests).
class ControlCore {
 public:
  virtual ~ControlCore() = default;

  // Takes a reference on the inode the kernel knows for (dev, ino), so it cannot be forgotten
  // while a transfer uses it; null when the kernel has never looked the file up.
  virtual Inode* PinInode(dev_t dev, ino_t ino) = 0;
  virtual void Unpin(Inode* in) = 0;
  // Lands the inode's write-behind data (its sticky error is reported, not taken).
  virtual Status DrainForExternal(Inode& in) = 0;
  // After bytes reached the backing file outside the FUSE data path: drop read-ahead and the
  // kernel's cached pages and attributes of the inode.
  virtual void AfterExternalWrite(Inode& in) = 0;
  // A write of the inode's file outside the data path begins (`running`) or ends: the mount
  // frees no space it reserved past the file's end meanwhile (datapath/space.h: a truncate to a
  // size read before that write landed would cut it). Nothing by default (tests' cores).
  virtual void OutsideWrite(Inode& /*in*/, bool /*running*/) {}
  // After a file was created in BACKING_DIR outside FUSE: drop the kernel's negative dentry.
  virtual void AfterExternalCreate(const std::string& dir_rel, const std::string& name) = 0;

  // Per-uid limits across all sessions (and the broker, and the mount's own opens).
  virtual UidLimits& uid_limits() = 0;
  virtual CtlCounters& ctl_counters() = 0;

  // The mount's engine configuration (config.get/config.set) and its stats; session engines
  // register for the stats while they live.
  virtual HandleConfig EngineConfig() = 0;
  virtual Result<HandleConfig> SetEngineConfig(const std::string& json_patch) = 0;
  virtual bool MayReconfigure(uid_t uid) const = 0;
  virtual std::string StatsJson() = 0;
  // What `reader` is shown: StatsJson, less what would tell one user about another's files (the
  // read path's decisions) unless the reader may reconfigure the mount (fs/core/stats.cc).
  virtual std::string StatsJsonFor(uid_t /*reader*/) { return StatsJson(); }
  virtual void AddCtlEngine(AioHandle* h) = 0;
  virtual void RemoveCtlEngine(AioHandle* h) = 0;

  // BACKING_DIR (an O_PATH fd: paths of requests resolve beneath it) and the mountpoint (which
  // absolute paths of requests must lie under).
  virtual int root_fd() const = 0;
  virtual const std::string& mountpoint() const = 0;

  // The daemon is stopping: a request not yet run is answered ECANCELED instead of run, so a
  // user's queue of large transfers cannot hold the unmount (and everyone's stat) for minutes.
  virtual bool Stopping() const { return false; }
};

class CtlSession {
 public:
  // Requests a session holds queued (written, not yet run) at most, and their bytes (a request
  // beyond either is refused, EAGAIN; the first is always taken): a client writes a request or a
  // few, then reads.
  static constexpr size_t kMaxQueued = 64;
  static constexpr size_t kMaxQueuedBytes = size_t{1} << 20;
  // Hands over one job that calls RunQueued (on the writer's lane); a refusal is the write's.
  using Starter = std::function<Status()>;
  // Answers a read: the bytes of the answer (errors are for the edge to turn into errno).
  using ReadReply = std::function<void(const Result<std::string>&)>;

  // `opener`: who opened ctl (its uid, gid and groups at the OPEN): every request runs as it.
  CtlSession(ControlCore& core, Caller opener);
  ~CtlSession();  // waits for in-flight transfers, unmaps buffers, gives the limits back

  // Queues one request (the bytes of one write()) behind the session's others; `writer` is the
  // process that wrote it (EPERM, nothing queued, when its uid is not the opener's; otherwise the
  // request runs as the opener, the writer's pid only names it in the log). When the session
  // is idle (nothing queued or running), `start` is called, with queue_mu_ held (it must only hand
  // the job over), and its refusal is returned with nothing queued. EAGAIN when kMaxQueued
  // requests or kMaxQueuedBytes wait already.
  Status Enqueue(std::string text, const Caller& writer, const Starter& start);
  // The job `start` handed over: runs the queued requests in order until none is left, then
  // answers the reads parked meanwhile, in their order.
  void RunQueued();
  // A read of up to `size` bytes of the answer (consumed as read; empty at its end): answered
  // here when nothing is queued or running, else parked and answered by RunQueued once the queue
  // is empty (with the last request's answer). `reply` is called exactly once.
  void Read(size_t size, ReadReply reply);
  // Processes one request on this thread, outside the queue (where a reply cannot come from
  // another thread: FUSE over io_uring); the answer replaces the pending one. A writer of
  // another uid than the opener's is refused (EPERM) as by Enqueue, and nothing runs.
  Status Request(std::string_view text, const Caller& writer);
  // The uid that opened the session: its limits are charged.
  uid_t owner() const { return opener_.uid; }
  // Who opened the session: every request acts as it.
  const Caller& opener() const { return opener_; }

 private:
  // What a registered buffer holds of its owner's limits (ctl_max_buffers, ctl_max_bytes).
  struct BufferCharges {
    UidCharge count, bytes;
  };
  Result<std::string> Dispatch(const CtlRequest& r, const Caller& caller);
  Result<std::string> OpenHandle(const CtlRequest& r);
  Result<std::string> CloseHandle(int64_t id);
  Result<std::string> Register(const CtlRequest& r, const Caller& caller);
  Result<std::string> RegisterCuda(const CtlRequest& r, BufferCharges charges);
  Result<std::string> Unregister(int64_t id);
  Result<std::string> Transfer(const CtlRequest& r, const Caller& caller);
  Result<std::string> Wait(int64_t id);
  // The identity a request of `writer` runs with: the opener's (with the writer's pid, for the
  // log), or EPERM when `writer` is another uid.
  Result<Caller> Acting(const Caller& writer) const;
  Result<std::string> Fsync(const CtlRequest& r, const Caller& caller);
  // Collects finished records of `h`: coherence work and unpinning; returns their JSON.
  std::string Collect(std::vector<std::shared_ptr<CtlOpRecord>> done);
  void FinishRecord(CtlOpRecord& rec);
  // Waits for `h`'s transfers, finishes their records and gives the handle's engine and quota
  // back (the caller then drops `h`); returns how many outcomes were never collected.
  size_t ReleaseHandle(CtlHandle& h);
  // Keeps a new buffer's charges and counts it; returns its id.
  int64_t KeepBuffer(BufferCharges charges, int64_t size);
  // Gives a buffer's charges and counters back (the caller then drops the mapping).
  void ReleaseBuffer(int64_t id, int64_t size);
  // The handle's GdsHandle for GPU buffers on `device`, created on first use.
  // `caller`: the first GPU transfer's, whose identity the handle's writes then take.
  Result<GdsHandle*> GpuEngine(CtlHandle& h, int device, const Caller& caller);

  struct QueuedRequest {
    std::string text;  // empty when `bytes` is over kMaxRequestBytes (refused by its size)
    size_t bytes;      // as written
    Caller caller;
  };
  // Request, for a request of `bytes` bytes whose `text` may have been dropped (see QueuedRequest).
  void Run(std::string_view text, size_t bytes, const Caller& caller);
  struct ParkedRead {
    size_t size;
    ReadReply reply;
  };
  // Up to `size` bytes of the answer from where the last read stopped; needs queue_mu_.
  std::string TakeAnswerLocked(size_t size);

  ControlCore& fs_;  // the core, through the interface above only
  const Caller opener_;
  std::mutex queue_mu_;  // guards the queue, the parked reads and the answer (never held for long)
  std::deque<QueuedRequest> queue_;
  size_t queued_bytes_ = 0;
  bool running_ = false;  // a RunQueued job is handed over or running: the queue will be emptied
  std::vector<ParkedRead> parked_;
  std::string answer_;
  size_t answer_pos_ = 0;
  std::mutex mu_;  // serialises requests; guards everything below
  int64_t next_handle_ = 1, next_buffer_ = 1;
  uint64_t next_op_ = 1;
  std::map<int64_t, std::unique_ptr<CtlHandle>> handles_;
  std::map<int64_t, std::shared_ptr<ClientMapping>> buffers_;
  std::map<int64_t, std::shared_ptr<CtlGpuBuffer>> gpu_buffers_;  // ids shared with buffers_
  std::map<int64_t, BufferCharges> buffer_charges_;  // every buffer of both maps, by id
};

}  // namespace dnvme::fs
