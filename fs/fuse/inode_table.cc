// Fs's core: the inode table (lookup counts, (dev, ino) -> Inode, like libfuse's passthrough_hp),
// the open-handle registry, and start-up/shut-down of the pools and the engine the data path
// shares (fs/fs.h).
#include <dirent.h>
#include <fcntl.h>
#include <sched.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "engine/common/log.h"
#include "fs/caps.h"
#include "fs/control/virtual.h"
#include "fs/fs.h"
#include "fs/fuse/ops_common.h"

namespace dnvme::fs {

using ops::kTimeout;

Inode::~Inode() {
  if (fd >= 0) close(fd);
}

Fs::Fs(MountOptions opts)
    : opts_(std::move(opts)),
      uid_limits_(UidLimits::Maxima{
          opts_.ctl_max_handles, opts_.ctl_max_bytes, opts_.ctl_max_buffers, opts_.ctl_max_pinned,
          opts_.ctl_max_pending, opts_.max_files_per_uid, opts_.broker_max_conns_per_uid}),
      ctl_lanes_(UidLanes::Options{.threads_per_key = opts_.ctl_threads_per_uid,
                                   .max_queued = 256,
                                   .idle = std::chrono::milliseconds(2000),
                                   .option = "ctl_threads_per_uid"}),
      ctl_dir_(&wb_shared_, &ra_shared_),
      ctl_node_(&wb_shared_, &ra_shared_),
      stats_node_(&wb_shared_, &ra_shared_),
      config_node_(&wb_shared_, &ra_shared_),
      broker_node_(&wb_shared_, &ra_shared_),
      root_(&wb_shared_, &ra_shared_) {}

Fs::~Fs() {
  ctl_lanes_.Shutdown();  // control requests still queued use the sessions deleted below
  DrainAll();
  {
    // Files still open when the session ended: the kernel will never release them.
    std::lock_guard lock(handles_mu_);
    for (OpenHandle* h : handles_) delete h;
    handles_.clear();
  }
  Stop();  // waits for every engine operation (read-ahead included)
}

void Fs::ForgetCachedAttributes(fuse_ino_t ino) {
  if (se_ == nullptr) return;
  // A negative offset: attributes (and cached ACLs) only, no page-cache invalidation, which is
  // what makes it safe inside a WRITE handler (the kernel takes no inode lock for it).
  const int rc = fuse_lowlevel_notify_inval_inode(se_, ino, -1, 0);
  if (rc != 0 && rc != -ENOENT) {
    Logger().warn("dropping the kernel's cached attributes of inode {} failed: {}", ino,
                  std::strerror(-rc));
  }
}

void Fs::Track(OpenHandle* h) {
  std::lock_guard lock(handles_mu_);
  handles_.insert(h);
}

void Fs::Dispose(OpenHandle* h) {
  {
    std::lock_guard lock(handles_mu_);
    handles_.erase(h);
  }
  delete h;
}

Status Fs::ReservePrivileged(bool splicing, bool replies_to_fd) {
  if (opts_.splice_reply && replies_to_fd) {
    // A few replies are in flight at once (one per CPU copying); a reply that finds every pipe
    // taken is written instead. A pipe holds no memory until a reply's page references are in it.
    const int64_t bytes = RequestPipeBytes(opts_.max_request);
    auto pool = datapath::PipePool::Create(kReplyPipes * bytes, bytes, bytes);
    if (pool.ok()) {
      reply_pipes_ = std::move(pool).value();
      Logger().info("spliced replies: {} pipes of {} bytes", reply_pipes_->count(),
                    reply_pipes_->capacity());
    } else {
      Logger().warn("replies written, not spliced: {}", pool.status().ToString());
    }
  }
  if (!splicing) return Status::Ok();
  if (opts_.write_behind > 0) {
    // write_behind bytes of pipes, each holding one write_chunk extent; without
    // CAP_SYS_RESOURCE, pipe-max-size pipes (1 MiB by default), more of them.
    auto pool =
        datapath::PipePool::Create(opts_.write_behind, opts_.write_chunk, kMinSplicePipeBytes);
    if (pool.ok()) {
      wb_pipes_ = std::move(pool).value();
      Logger().info("spliced write-behind: {} pipes of {} bytes", wb_pipes_->count(),
                    wb_pipes_->capacity());
    } else {
      Logger().info("write-behind copies every write (no pipes for spliced extents: {})",
                    pool.status().ToString());
    }
  }
  return Status::Ok();
}

Status Fs::Start() {
  // Opened once, by Preflight, before the mount: the mount may cover BACKING_DIR itself (the
  // set-up that keeps it out of every other user's reach, docs/security.md).
  int fd = root_.fd;
  if (fd < 0) fd = open(opts_.backing.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Status::FromErrno(errno, "open BACKING_DIR '" + opts_.backing + "'");
  root_.fd = fd;
  struct stat st {};
  if (fstat(fd, &st) != 0) return Status::FromErrno(errno, "stat BACKING_DIR");
  root_.dev = st.st_dev;
  root_.ino = st.st_ino;
  root_.type = S_IFDIR;
  root_.nlookup = 2;  // never forgotten

  clock_gettime(CLOCK_REALTIME, &started_);
  InitVirtualNodes();
  auto h = AioHandle::Create(opts_.engine);
  if (!h.ok()) return h.status().WithContext("engine");
  {
    std::lock_guard lock(engine_mu_);
    engine_ = std::shared_ptr<AioHandle>(std::move(h).value());
    engine_config_ = opts_.engine;
  }
  if (opts_.write_behind > 0) {
    const size_t n = static_cast<size_t>(opts_.write_behind / opts_.write_chunk);
    auto pool = PinnedPool::Create(static_cast<size_t>(opts_.write_chunk), n);
    if (!pool.ok()) return pool.status().WithContext("write-behind buffers (write_behind=)");
    wb_pool_ = std::move(pool).value();
  }
  // One writer thread per extent in flight; the pipes beyond that queue up behind them.
  if (wb_pipes_)
    splicers_ = std::make_unique<datapath::SpliceWorkers>(static_cast<int>(kSpliceThreads));
  if (opts_.read_ahead > 0) {
    const int64_t chunk = std::min<int64_t>(opts_.read_ahead, 4 << 20);
    // Room for kReadAheadWindows sequential readers' windows; more readers share what is free.
    const size_t n = static_cast<size_t>(kReadAheadWindows * opts_.read_ahead / chunk);
    auto pool = PinnedPool::Create(static_cast<size_t>(chunk), n);
    if (!pool.ok()) return pool.status().WithContext("read-ahead buffers (read_ahead=)");
    ra_pool_ = std::move(pool).value();
  }
  auto engine = [this] { return Engine(); };
  wb_shared_.chunks = wb_pool_.get();
  wb_shared_.pipes = wb_pipes_.get();
  wb_shared_.splicers = splicers_.get();
  wb_shared_.write_chunk = opts_.write_chunk;
  wb_shared_.ack = datapath::Ack::kGathered;  // the daemon holds the data, not the writer
  wb_shared_.engine = engine;
  wb_shared_.counters = &counters_;
  // FUSE sends a sequential reader's requests exactly in order: no skip, and no size limit
  // (requests are <= max_request).
  ra_shared_.chunks = ra_pool_.get();
  ra_shared_.window = opts_.read_ahead;
  ra_shared_.engine = engine;
  ra_shared_.counters = &counters_;
  if (opts_.async_reply) {
    // One buffer per request an O_DIRECT client can have in flight at the kernel's limit.
    auto pool = PinnedPool::Create(static_cast<size_t>(kMaxFuseRequestBytes), kAsyncReplyBuffers);
    if (!pool.ok()) return pool.status().WithContext("reply buffers (async_reply=)");
    reply_pool_ = std::move(pool).value();
  }
  return Status::Ok();
}

Status Fs::StartBroker() {
  if (!opts_.preload) return Status::Ok();
  auto b = Broker::Start(*this);
  if (!b.ok()) return b.status().WithContext("preload broker (-o preload=0 turns it off)");
  broker_ = std::move(b).value();
  return Status::Ok();
}

int Fs::OpenCount(Inode& in) {
  std::lock_guard lock(in.modes.mu);
  return in.modes.passthrough + in.modes.other;
}

Status Fs::Preflight() {
  Status st = Start();
  wb_shared_ = datapath::WriteBehindShared();
  ra_shared_ = datapath::ReadAheadShared();
  reply_pool_.reset();
  ra_pool_.reset();
  wb_pool_.reset();
  {
    std::lock_guard lock(engine_mu_);
    engine_.reset();
  }
  // The BACKING_DIR descriptor stays for Start (see there).
  if (!st.ok() && root_.fd >= 0) {
    close(root_.fd);
    root_.fd = -1;
  }
  return st;
}

void Fs::Stop() {
  // Control requests answer from their lanes: they finish while the session can still take the
  // replies, and before the engines they use go.
  ctl_lanes_.Shutdown();
  broker_.reset();  // ends the clients' leases (their inodes stay pinned until then)
  DrainAll();
  splicers_.reset();  // idle after DrainAll; joins its threads
  std::shared_ptr<AioHandle> last;
  {
    std::lock_guard lock(engine_mu_);
    last = std::move(engine_);
  }
  last.reset();  // waits for every operation of the engine and its callbacks
  std::lock_guard lock(reconfig_mu_);
  retired_.clear();  // nothing can hold them any more: the session loop has ended
}

void Fs::DrainAll() {
  if (!Engine()) return;
  std::vector<Inode*> all;
  {
    std::lock_guard lock(inodes_mu_);
    for (auto& [key, in] : inodes_) all.push_back(in.get());
  }
  // Inodes cannot be forgotten while we drain: the session loop has stopped (destroy/unmount).
  for (Inode* in : all) {
    if (S_ISREG(in->type)) {
      Status st = in->wb.Drain(nullptr);
      if (!st.ok()) {
        Logger().error("write-behind data of inode {} lost at exit: {}", in->ino, st.ToString());
      }
    }
  }
}

Inode& Fs::GetInode(fuse_ino_t ino) {
  if (ino == FUSE_ROOT_ID) return root_;
  return *reinterpret_cast<Inode*>(ino);
}

int Fs::DoLookup(fuse_ino_t parent, const char* name, fuse_entry_param* e) {
  Inode& dir = GetInode(parent);
  int fd = openat(dir.fd, name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return errno;
  struct stat st {};
  if (fstatat(fd, "", &st, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW) != 0) {
    int err = errno;
    close(fd);
    return err;
  }
  Inode* in;
  {
    std::lock_guard lock(inodes_mu_);
    auto key = std::make_pair(st.st_dev, st.st_ino);
    auto it = inodes_.find(key);
    if (it != inodes_.end()) {
      in = it->second.get();
      close(fd);  // the inode already holds one
    } else {
      auto fresh = std::make_unique<Inode>(&wb_shared_, &ra_shared_);
      fresh->fd = fd;
      fresh->dev = st.st_dev;
      fresh->ino = st.st_ino;
      fresh->type = st.st_mode & S_IFMT;
      in = fresh.get();
      inodes_.emplace(key, std::move(fresh));
    }
    ++in->nlookup;
  }
  if (S_ISREG(st.st_mode)) in->wb.ApplyPending(&st);
  e->ino = reinterpret_cast<fuse_ino_t>(in);
  e->attr = st;
  e->attr_timeout = in->leases.count() > 0 ? 0.0 : kTimeout;  // see OpGetattr
  e->entry_timeout = kTimeout;
  return 0;
}

void Fs::Forget(fuse_ino_t ino, uint64_t n) {
  if (ino == FUSE_ROOT_ID) return;
  Inode* in = reinterpret_cast<Inode*>(ino);
  if (in->virt != VirtualNode::kNone) return;  // control nodes live as long as the Fs
  std::unique_ptr<Inode> dead;
  std::lock_guard lock(inodes_mu_);
  if (n > in->nlookup) {
    Logger().error("forget of {} lookups on inode {} that has {}", n, in->ino, in->nlookup);
    n = in->nlookup;
  }
  in->nlookup -= n;
  if (in->nlookup == 0) {
    auto it = inodes_.find({in->dev, in->ino});
    if (it != inodes_.end() && it->second.get() == in) {
      dead = std::move(it->second);
      inodes_.erase(it);
    }
  }
}

}  // namespace dnvme::fs
