#include "fs/core/mount.h"

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "dnvme/log.h"

namespace dnvme::fs {

Status Mount::ReservePrivileged(bool splicing, bool replies_to_fd) {
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

Status Mount::Start() {
  clock_gettime(CLOCK_REALTIME, &started_);
  if (Status st = engines_.Start(opts_.engine); !st.ok()) return st.WithContext("engine");
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
  // The data path asks for the engine once per submission: straight from the Engines, whose
  // getter is one atomic load (config.set may swap the engine meanwhile).
  auto engine = [this] { return engines_.Current(); };
  data_shared_.writes.chunks = wb_pool_.get();
  data_shared_.writes.pipes = wb_pipes_.get();
  data_shared_.writes.splicers = splicers_.get();
  data_shared_.writes.write_chunk = opts_.write_chunk;
  data_shared_.writes.ack = datapath::Ack::kGathered;  // the daemon holds the data, not the writer
  data_shared_.writes.engine = engine;
  data_shared_.writes.counters = &counters_;
  // FUSE sends a sequential reader's requests exactly in order: no skip, and no size limit
  // (requests are <= max_request).
  data_shared_.reads.chunks = ra_pool_.get();
  data_shared_.reads.window = opts_.read_ahead;
  // A sequence starts with one chunk and grows with the reader (datapath/read_ahead.h): a
  // program that reads a header of a large file fetches 4 MiB, not the whole window.
  data_shared_.reads.initial_window = std::min<int64_t>(opts_.read_ahead, kReadAheadFirstWindow);
  data_shared_.reads.engine = engine;
  data_shared_.reads.counters = &counters_;
  data_shared_.policy.mode = opts_.read_cache;
  data_shared_.policy.cache_writes = opts_.cache_writes;
  data_shared_.writes.policy = &data_shared_.policy;
  // Space before acknowledgement (datapath/space.h): a WRITE is answered before its bytes land,
  // so they get their blocks first. What write-behind can hold unlanded: its chunks, as many
  // bytes again of adopted request buffers (write_behind / max_request spares), and its pipes.
  data_shared_.space.reserve = opts_.write_behind > 0;
  data_shared_.space.unlanded_max = opts_.write_behind * (wb_pipes_ ? 3 : 2);
  data_shared_.budget = &space_budget_;
  if (opts_.async_reply) {
    // One buffer per request an O_DIRECT client can have in flight at the kernel's limit.
    auto pool = PinnedPool::Create(static_cast<size_t>(kMaxFuseRequestBytes), kAsyncReplyBuffers);
    if (!pool.ok()) return pool.status().WithContext("reply buffers (async_reply=)");
    reply_pool_ = std::move(pool).value();
  }
  return Status::Ok();
}

void Mount::Release() {
  data_shared_.writes = datapath::WriteBehindShared();
  data_shared_.reads = datapath::ReadAheadShared();
  reply_pool_.reset();
  ra_pool_.reset();
  wb_pool_.reset();
  engines_.Reset();
}

void Mount::Stop() {
  splicers_.reset();  // idle after the drain; joins its threads
  engines_.Stop();
}

void Mount::ForgetCachedAttributes(fuse_ino_t ino) {
  if (se_ == nullptr) return;
  // A negative offset: attributes (and cached ACLs) only, no page-cache invalidation, which is
  // what makes it safe inside a WRITE handler (the kernel takes no inode lock for it).
  const int rc = fuse_lowlevel_notify_inval_inode(se_, ino, -1, 0);
  if (rc != 0 && rc != -ENOENT) {
    Logger().warn("dropping the kernel's cached attributes of inode {} failed: {}", ino,
                  std::strerror(-rc));
  }
}

bool Mount::RepliesMayBeDeferred() const {
  // A ring entry must be answered by the thread serving it (fs/transport/uring_loop.h).
  return transport_ == nullptr || transport_->kind() != Transport::Kind::kUring;
}

}  // namespace dnvme::fs
