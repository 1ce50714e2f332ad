// The dnvmefs filesystem state: inodes, open files, the write-behind and read-ahead state, the
// engine handle and the per-mount counters.
//
// Lock order (acquire in this order, never the reverse):
//   1. Fs::inodes_mu_  (the inode table: lookup counts, the (dev, ino) map)
//   2. Inode::m        (one inode's data-path state: write-behind extent, read-ahead window)
//   3. PinnedPool's internal mutex (taken briefly by Acquire/TryAcquire/Return)
// Engine completion callbacks run on engine worker threads and take only Inode::m (level 2); the
// FUSE threads never hold Inode::m while waiting for the engine except through a condition
// variable wait (which releases it), so a callback can always make progress.
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
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>
#include <vector>

#include "dnvme/handle.h"
#include "dnvme/pinned.h"
#include "engine/posix/file.h"
#include "fs/control.h"
#include "fs/options.h"
#include "fs/pipe.h"
#include "fs/request_buffer.h"
#include "fs/splice_io.h"

namespace dnvme::fs {

// Counters kept for the control file and logged at unmount. Relaxed atomics.
struct MountCounters {
  std::atomic<uint64_t> write_ops{0}, read_ops{0};
  std::atomic<uint64_t> bytes_written_behind{0};  // gathered into pinned chunks, flushed async
  std::atomic<uint64_t> bytes_written_sync{0};    // written through the engine before replying
  std::atomic<uint64_t> bytes_read_ahead_hit{0};  // served from the read-ahead window
  std::atomic<uint64_t> bytes_read_engine{0};     // read through the engine on demand
  std::atomic<uint64_t> write_behind_flushes{0};
  std::atomic<uint64_t> read_ahead_fetches{0};
  std::atomic<uint64_t> errors{0};
  // Spliced write-behind (fs/splice_io.h): bytes that went to the disk from the kernel's pages,
  // and spliced extents the kernel refused and the engine wrote instead.
  std::atomic<uint64_t> bytes_written_spliced{0};
  std::atomic<uint64_t> bytes_splice_fallback{0};
  // Part of bytes_written_behind written by the engine straight from the request buffer it was
  // received in (fs/request_buffer.h), without a copy into a chunk.
  std::atomic<uint64_t> bytes_written_adopted{0};
  std::string ToJson() const;
};

// One chunk of the read-ahead window of an inode.
struct RaChunk {
  int64_t offset = 0;
  int64_t length = 0;  // bytes asked for (clamped to the file size at submission)
  std::shared_ptr<PinnedPool::Lease> buf;  // the completion callback holds it too
  bool ready = false;
  Status status;
};

// The control directory and its files (fs/virtual.cc): served by the daemon, never stored in
// BACKING_DIR. kNone is every real inode.
enum class VirtualNode : uint8_t { kNone, kCtlDir, kCtl, kStats, kConfig };
inline constexpr const char* kCtlDirName = ".dnvme";

struct Inode {
  int fd = -1;  // O_PATH fd on the backing object; owned (-1 for virtual nodes)
  VirtualNode virt = VirtualNode::kNone;
  dev_t dev = 0;
  ino_t ino = 0;
  mode_t type = 0;       // S_IFMT bits
  uint64_t nlookup = 0;  // guarded by Fs::inodes_mu_

  std::mutex m;
  std::condition_variable cv;
  // Write-behind (guarded by m): data accepted from writers, not yet on disk.
  std::shared_ptr<PinnedPool::Lease> wb_chunk;  // chunk being filled, null when none
  // Or, for page-cache-backed writers, a pipe being filled with references to the FUSE page-cache
  // pages of the data (never both at once): flushed by the splice writer without a copy.
  PipePool::Lease wb_pipe;
  // Or the request buffers themselves, one per WRITE, each holding a page-aligned payload
  // (fs/request_buffer.h): read(2) receives whose payload needs no copy to be written O_DIRECT.
  std::vector<RequestBuffer> wb_bufs;
  FileRef wb_file;                   // engine file the extent is flushed through
  int64_t wb_start = 0, wb_len = 0;  // the extent (file range) being gathered
  int wb_inflight = 0;               // flushes submitted, not completed
  int wb_adopted_inflight = 0;       // of which extents of adopted request buffers
  int64_t wb_next = -1;              // end of the last extent: a write there continues the stream
  int64_t wb_end = 0;           // end of the highest byte accepted and not yet known to be on disk
  struct timespec wb_mtime {};  // time of the last write accepted into write-behind
  Status wb_error;              // first flush error since it was last reported to a writer
  // Read-ahead (guarded by m).
  int64_t ra_next = -1;  // where the next sequential read is expected
  std::vector<std::shared_ptr<RaChunk>> ra_chunks;
  int ra_inflight = 0;

  ~Inode();
};

// Base of the per-open state handed to the kernel as fi->fh, so the daemon can free whatever the
// kernel never released (it does not send RELEASE for files still open when the daemon exits).
struct OpenHandle {
  virtual ~OpenHandle() = default;
};

// Where a write's bytes come from: libfuse's buffer vector, which is plain memory or, with splice,
// a pipe holding the request's pages (then the one copy is the read from that pipe straight
// into our pinned chunk). Consumed in order.
class WriteSource {
 public:
  explicit WriteSource(fuse_bufvec* src) : src_(src) {}
  // Moves the next `n` bytes into `dst`; false (errno set) on failure.
  bool CopyTo(char* dst, size_t n);
  // True when the bytes are still in the request pipe (the session loop spliced the request).
  bool in_pipe() const;
  // Moves up to `n` of the next bytes, as page references, into the pipe `pipe_w` without
  // blocking. Returns the bytes moved (fewer when that pipe is full) or -errno.
  int64_t SpliceTo(int pipe_w, size_t n);
  // True when the rest of the request is one page-aligned piece of the buffer the session loop
  // received it in: Adopt can take it.
  bool adoptable() const;
  // The rest of the request (exactly `n` bytes) when it is one piece of memory, marked consumed;
  // null otherwise. Valid until the handler returns.
  const char* InMemory(size_t n);
  // Takes the buffer holding the rest of the request (exactly `n` bytes) from the session loop
  // instead of copying out of it; empty when it is not adoptable or the loop's pool has no
  // buffer to replace it with.
  RequestBuffer Adopt(size_t n);

 private:
  // The rest of the request when it is one piece of memory, its size in `n`; null otherwise.
  const char* RestInMemory(size_t* n) const;
  fuse_bufvec* src_;
};

// An open control file: a ctl session, or a snapshot of stats/config being read.
struct VirtualFile : OpenHandle {
  VirtualNode kind = VirtualNode::kNone;
  std::mutex m;
  std::string snapshot;                 // stats/config: the document being read (guarded by m)
  std::unique_ptr<CtlSession> session;  // ctl only
};

struct FileHandle : OpenHandle {
  UniqueFd fd;   // the backing file, buffered (for fsync, fallocate, lseek, ftruncate)
  FileRef file;  // the engine's view (O_DIRECT + buffered fds); regular files only
  bool client_direct = false;
  bool writable = false;
  // The kernel sends this handle's writes from its page cache (not direct_io, not O_DIRECT), so
  // a spliced request carries page-aligned page references the splice writer can use as is.
  bool page_cache_writes = false;
  Inode* inode = nullptr;
};

class Fs {
 public:
  explicit Fs(MountOptions opts);
  ~Fs();

  // Creates what needs privileges the daemon drops after mounting: the pipes that hold spliced
  // write-behind extents (sized above pipe-max-size). Call before DropCaps, and only when the
  // session loop splices requests (`splicing`).
  Status ReservePrivileged(bool splicing);
  // Opens the backing directory and creates the engine; called in the daemon after it forked.
  Status Start();
  // Start() then undo it: run in the parent before mounting, so a configuration the engine
  // refuses (RLIMIT_MEMLOCK, aio-max-nr) fails with nothing mounted instead of in the daemon.
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
  HandleConfig EngineConfig();
  // Applies a JSON object of HandleConfig keys on top of the live configuration (new I/O uses
  // it at once; no remount). Returns the resulting configuration.
  Result<HandleConfig> SetEngineConfig(const std::string& json_patch);
  void set_session(fuse_session* se) { se_ = se; }
  // True when page-cache WRITEs can reach the disk without a copy (pipes were reserved).
  bool SplicesWrites() const { return wb_pipes_ != nullptr; }
  // For the session loop (SessionLoop::SpliceHint): true while recent large WRITEs came from the
  // kernel's page cache, whose pages splice moves without a copy.
  bool PreferSplice() const {
    return wb_pipes_ && splice_score_.load(std::memory_order_relaxed) > 0;
  }

  // ---- Control plane (fs/virtual.cc) ----
  Inode& VirtualInode(VirtualNode kind);
  CtlCounters& ctl_counters() { return ctl_counters_; }
  const CtlLimits& ctl_limits() const { return ctl_limits_; }
  static std::string version();
  // Root (uid 0) or the user the daemon runs as may change the live configuration.
  bool MayReconfigure(uid_t uid) const;
  std::string StatsJson();
  int root_fd() const { return root_.fd; }
  // Takes a reference on the inode the kernel knows for (dev, ino), so it cannot be forgotten
  // while a control transfer uses it; null when the kernel has never looked the file up.
  Inode* PinInode(dev_t dev, ino_t ino);
  void Unpin(Inode* in);
  // Lands the inode's write-behind data (and reports its sticky error without taking it).
  Status DrainForExternal(Inode& in);
  // After bytes reached the backing file outside the FUSE data path: drop read-ahead and the
  // kernel's cached pages and attributes of the inode.
  void AfterExternalWrite(Inode& in);
  // After a file was created in BACKING_DIR outside FUSE: drop the kernel's negative dentry.
  void AfterExternalCreate(const std::string& dir_rel, const std::string& name);
  // Per-uid limits of the control plane.
  Status TakeHandleQuota(uid_t uid);
  void ReleaseHandleQuota(uid_t uid);
  Status TakeBufferQuota(uid_t uid, int64_t bytes);
  void ReleaseBufferQuota(uid_t uid, int64_t bytes);
  // Control-file engines (for the stats): registered at handle.open, unregistered at close.
  void AddCtlEngine(AioHandle* h);
  void RemoveCtlEngine(AioHandle* h);

  // Open-handle bookkeeping: Track when created, Dispose at release; the rest go with Fs.
  void Track(OpenHandle* h);
  void Dispose(OpenHandle* h);

  Inode& GetInode(fuse_ino_t ino);
  // Looks `name` up under `parent` (or adopts an already open O_PATH fd), filling `e`; adds one
  // lookup reference. Returns an errno (0 on success).
  int DoLookup(fuse_ino_t parent, const char* name, fuse_entry_param* e);
  void Forget(fuse_ino_t ino, uint64_t n);

  // Write-behind and read-ahead (fs/data_path.cc). Inode::m must NOT be held by the caller.
  // Returns an errno (0 on success).
  // `scratch` (pinned, aligned, at least `size` bytes) holds data that is written synchronously.
  int Write(FileHandle& fh, WriteSource& src, size_t size, off_t off, char* scratch);
  // Flushes the inode's pending extent and waits for every flush; returns and clears the sticky
  // error when `take_error`.
  int Drain(Inode& inode, bool take_error);
  // For an O_DIRECT client: drains write-behind, then submits the read to the engine and answers
  // `req` from the completion callback (on an engine worker). Returns false, without replying,
  // when no reply buffer is free; the caller then reads synchronously.
  bool ReadAndReplyAsync(fuse_req_t req, FileHandle& fh, size_t size, off_t off);

  // What a read answers with: pieces of read-ahead chunks (kept alive by `pins` until the reply
  // is sent) and/or of the caller's scratch buffer, in file order.
  struct ReadReply {
    std::vector<struct iovec> iov;
    std::vector<std::shared_ptr<RaChunk>> pins;
  };
  // Reads up to `size` bytes at `off`; `scratch` (at least `size` bytes, pinned and aligned) takes
  // what is read on demand. Returns bytes read (the iovecs in `reply` add up to it) or -errno.
  ssize_t Read(FileHandle& fh, char* scratch, size_t size, off_t off, ReadReply* reply);
  // Waits for the inode's read-ahead in flight (its callbacks use the inode): release.
  void QuiesceReadAhead(Inode& inode);
  // Drops read-ahead data (after writes, truncate, fallocate).
  void InvalidateReadAhead(Inode& inode);
  // Folds write-behind data not yet on disk into `st`: the size the file will have, and the
  // modification time of the last accepted write (POSIX marks mtime at write(), not at flush).
  void ApplyPending(Inode& inode, struct stat* st);

 private:
  void FlushExtentLocked(Inode& inode, std::unique_lock<std::mutex>& lock);
  // A flush of `ip` completed (engine or splice writer thread): record its error, wake waiters.
  // `adopted`: it was an extent of adopted request buffers.
  void FinishFlush(Inode* ip, const Status& st, bool adopted = false);
  // The same with Inode::m held, without the wake-up.
  void FinishFlushLocked(Inode& inode, const Status& st, bool adopted);
  // Submits an extent of adopted request buffers, one engine write each; the extent completes
  // (FinishFlush) when the last does.
  void FlushAdoptedLocked(Inode& inode, std::vector<RequestBuffer> bufs, const FileRef& file,
                          int64_t start);
  // With Inode::m held: flush the pending extent, wait for every flush, return the sticky error
  // (clearing it when `take_error`).
  int DrainLocked(Inode& inode, std::unique_lock<std::mutex>& lock, bool take_error);
  int TakeErrorLocked(Inode& inode);  // returns and clears the sticky error (0 if none)
  void InvalidateReadAheadLocked(Inode& inode);
  void StartReadAheadLocked(Inode& inode, FileHandle& fh, int64_t from, int64_t file_size);

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
  // +1 per large page-cache WRITE, -1 per large WRITE of the caller's own pages, kept within
  // [-kSpliceScoreLimit, kSpliceScoreLimit]: a few requests of the other kind flip the mode.
  static constexpr int kSpliceScoreLimit = 8;
  std::atomic<int> splice_score_{1};
  void NoteWriteKind(bool page_cache);
  struct timespec started_ {};

  CtlCounters ctl_counters_;
  CtlLimits ctl_limits_;
  std::mutex quota_mu_;
  std::map<uid_t, std::pair<int64_t, int64_t>> quota_;  // uid -> (handles, bytes); quota_mu_
  std::mutex ctl_engines_mu_;
  std::unordered_set<AioHandle*> ctl_engines_;  // guarded by ctl_engines_mu_
  HandleStats ctl_closed_stats_;                // guarded by ctl_engines_mu_
  Inode ctl_dir_, ctl_node_, stats_node_, config_node_;
  void ReapRetiredLocked();
  void InitVirtualNodes();
  std::unique_ptr<PinnedPool> wb_pool_;
  std::unique_ptr<PipePool> wb_pipes_;       // spliced write-behind extents (ReservePrivileged)
  std::unique_ptr<SpliceWorkers> splicers_;  // runs spliced flushes; exists iff wb_pipes_ does
  std::unique_ptr<PinnedPool> ra_pool_;
  std::unique_ptr<PinnedPool> reply_pool_;  // 1 MiB buffers for async replies
  int64_t ra_chunk_ = 0;

  std::mutex handles_mu_;
  std::unordered_set<OpenHandle*> handles_;  // guarded by handles_mu_

  std::mutex inodes_mu_;
  std::map<std::pair<dev_t, ino_t>, std::unique_ptr<Inode>> inodes_;  // guarded by inodes_mu_
  Inode root_;
};

// The FUSE low-level operations table (fs/fuse_ops.cc).
const fuse_lowlevel_ops& Operations();

}  // namespace dnvme::fs
