// The mount apart from its inodes: the options, the engines (fs/core/engines.h), the pinned pools
// and pipes the data path shares (what every inode's WriteBehind and ReadAhead point to), the
// counters, and the links to the FUSE session and the transport requests arrive by.
//
// Lifetime: ReservePrivileged (before the daemon drops its capabilities), Start (after it forked),
// Stop (after every inode's write-behind is drained, before the FUSE session is destroyed). The
// Mount outlives every Inode: the shared state they point to is declared here.
//
// Thread contract: the accessors from any thread once Start returned; engine() is the hot-path
// getter (Engines::Current, one atomic load). set_session and set_transport from the main thread
// while no request runs.
#pragma once

#include <fuse_lowlevel.h>
#include <time.h>

#include <cstdlib>
#include <memory>

#include "datapath/file_data.h"
#include "datapath/splice_io.h"
#include "dnvme/handle.h"
#include "dnvme/pinned.h"
#include "fs/core/counters.h"
#include "fs/core/engines.h"
#include "fs/options.h"
#include "fs/transport/protocol_ext.h"
#include "fs/transport/request_pipe.h"
#include "fs/transport/transport.h"

namespace dnvme::fs {

class Mount {
 public:
  explicit Mount(MountOptions opts) : opts_(std::move(opts)) {}
  Mount(const Mount&) = delete;
  Mount& operator=(const Mount&) = delete;

  // Creates what needs privileges the daemon drops after mounting, pipes sized above
  // pipe-max-size: those that hold spliced write-behind extents, when the session loop splices
  // requests (`splicing`), and those for spliced replies (-o splice_reply), when replies are
  // written to /dev/fuse (`replies_to_fd`: not over io_uring). Call before DropCaps.
  Status ReservePrivileged(bool splicing, bool replies_to_fd);
  // Creates the engine and the pools and fills in what the inodes share.
  Status Start();
  // Undoes Start (a preflight in the parent, before mounting): the engine and the pools go.
  void Release();
  // Joins the splice writers and destroys the engines (waiting for every operation and its
  // completion callback, async replies included). Call after every write-behind was drained.
  void Stop();

  const MountOptions& opts() const { return opts_; }
  // libfuse connection options from -o (fuse_parse_conn_info_opts), applied in init; owned.
  void set_conn_opts(fuse_conn_info_opts* o) { conn_opts_.reset(o); }
  fuse_conn_info_opts* conn_opts() const { return conn_opts_.get(); }
  MountCounters& counters() { return counters_; }
  Engines& engines() { return engines_; }
  // The live engine, for one submission (Engines::Current).
  std::shared_ptr<AioHandle> engine() const { return engines_.Current(); }
  // When Start ran (the stats' uptime).
  const struct timespec& started() const { return started_; }

  // What every inode's WriteBehind / ReadAhead share (filled by Start).
  // What every inode's data path shares (datapath/file_data.h).
  const datapath::FileDataShared* data_shared() const { return &data_shared_; }
  // 1 MiB pinned buffers for replies answered from an engine thread (-o async_reply); null
  // without.
  PinnedPool* reply_pool() const { return reply_pool_.get(); }
  // True when page-cache WRITEs can reach the disk without a copy (pipes were reserved).
  bool SplicesWrites() const { return wb_pipes_ != nullptr; }
  // Pipes for spliced write-behind extents; null when requests are read, not spliced.
  datapath::PipePool* write_behind_pipes() const { return wb_pipes_.get(); }
  // Pipes for spliced replies (-o splice_reply); null when replies are written.
  datapath::PipePool* reply_pipes() const { return reply_pipes_.get(); }

  void set_session(fuse_session* se) { se_ = se; }
  // Null before the session exists: nothing is cached in a kernel yet.
  fuse_session* session() const { return se_; }
  // After the daemon changed an inode's attributes behind a request that does not report them
  // (a WRITE clearing set-user-ID): drop the kernel's cached attributes, keep its pages.
  void ForgetCachedAttributes(fuse_ino_t ino);

  // The transport the requests arrive by (set by main.cc before the session runs, cleared after
  // it ended): the WRITE handler asks it for the write flags and the payload's pool.
  void set_transport(Transport* t) { transport_ = t; }
  Transport* transport() const { return transport_; }
  // False when a reply must come from the thread that received the request (FUSE over io_uring):
  // control requests then run on that thread.
  bool RepliesMayBeDeferred() const;
  // What the mount negotiates beyond libfuse's protocol (passthrough), and the backing-file
  // registrations (fs/transport/protocol_ext.h).
  ProtocolExtensions& protocol() { return protocol_; }

 private:
  MountOptions opts_;
  struct FreeDeleter {
    void operator()(void* p) const { free(p); }
  };
  std::unique_ptr<fuse_conn_info_opts, FreeDeleter> conn_opts_;
  MountCounters counters_;
  Engines engines_;
  fuse_session* se_ = nullptr;
  Transport* transport_ = nullptr;
  ProtocolExtensions protocol_;
  struct timespec started_ {};

  std::unique_ptr<PinnedPool> wb_pool_;
  // Spliced write-behind extents and spliced replies (ReservePrivileged).
  std::unique_ptr<datapath::PipePool> wb_pipes_;
  std::unique_ptr<datapath::PipePool> reply_pipes_;
  // Runs spliced flushes; exists iff wb_pipes_ does.
  std::unique_ptr<datapath::SpliceWorkers> splicers_;
  std::unique_ptr<PinnedPool> ra_pool_;
  std::unique_ptr<PinnedPool> reply_pool_;  // 1 MiB buffers for async replies
  // Declared after what they point to, before every Inode (which the InodeTable, declared after
  // the Mount, owns).
  datapath::FileDataShared data_shared_;
  datapath::SpaceBudget space_budget_;  // data_shared_.budget
};

}  // namespace dnvme::fs
