// What the kernel knows of the mount, as the daemon keeps it: an Inode per (dev, ino) the kernel
// has looked up (and the control directory's nodes), and the per-open state handed to the kernel
// as fi->fh (FileHandle, VirtualFile). The table that owns inodes is InodeTable
// (fs/core/inode_table.h); open handles are registered in OpenHandles (fs/core/open_handles.h).
//
// Thread contract: an Inode's fields above `data` are fixed once it is in the table, except
// nlookup (InodeTable's mutex); data, modes and leases guard themselves. A FileHandle lives from
// its open's reply to its release; the requests on it come from any FUSE thread, so what they
// change is atomic or the data path's (`open`, datapath::OpenFile).
#pragma once

#include <fuse_lowlevel.h>
#include <sys/stat.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "datapath/file_data.h"
#include "dnvme/fd.h"
#include "fs/broker/leases.h"
#include "fs/control/control.h"
#include "fs/limits/uid_limits.h"

namespace dnvme::fs {

// Attribute and entry cache time of real inodes: the backing dir changes only through us.
inline constexpr double kEntryTimeout = 1.0;

// The control directory and its files (fs/fuse/control_dir.h): served by the daemon, never stored
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
  mode_t type = 0;           // S_IFMT bits
  uint64_t nlookup = 0;      // guarded by the InodeTable's mutex
  uint64_t last_lookup = 0;  // the table's lookup tick at the last lookup (guarded the same)

  // The file's data path (regular files): data accepted from writers and not yet on disk, and the
  // window fetched ahead of a sequential reader (datapath/file_data.h).
  datapath::FileData data;
  OpenModes modes;       // regular files
  PreloadLeases leases;  // descriptors the broker handed to `dnvme run` clients (fs/broker/)
  // The share of max_inodes_per_uid of the uid whose lookup made this inode (InodeTable::Lookup),
  // and the O_PATH descriptor above out of the daemon's descriptors (root's lookups too), held for
  // it until the kernel forgets the inode.
  UidCharge lookups_charge, fd_charge;

  // The reservation may reach ahead past the end only while no `dnvme run` client holds a
  // lease (its truncates would free what lies past the end; datapath/space.h).
  explicit Inode(const datapath::FileDataShared* d)
      : data(d, {}, [this] { return leases.count() == 0; }) {}
  ~Inode();
};

// Frees the space `in`'s data path reserved past the end of the file (datapath/space.h), through
// `fd` (opened for writing; -1: reopened from in.fd), while no `dnvme run` lease can start
// (PreloadLeases::WithoutLeases). Logged, not returned: a failure only leaves the blocks
// allocated, as fallocate(2) would. Any thread (a loop thread: it waits only for the daemon's
// own flushes of the file).
void TrimSpace(Inode& in, int fd);

// Base of the per-open state handed to the kernel as fi->fh, so the daemon can free whatever the
// kernel never released (it does not send RELEASE for files still open when the daemon exits).
struct OpenHandle {
  virtual ~OpenHandle() = default;
  // The opener's share of max_files_per_uid (docs/security.md) and the descriptors this open
  // holds in the daemon (UidLimits::ChargeFds): charged to it until the handle goes.
  UidCharge files, fds;
};

// An open control file: a ctl session, or a snapshot of stats/config being read.
struct VirtualFile : OpenHandle {
  VirtualNode kind = VirtualNode::kNone;
  std::mutex m;
  std::string snapshot;                 // stats/config: the document being read (guarded by m)
  std::shared_ptr<CtlSession> session;  // ctl only; lane jobs running its queue hold it too
  // The opener's share of ctl_max_opens (docs/security.md): a session or a snapshot lives in the
  // daemon's memory until RELEASE (a session's, until its release job ran on the lane).
  UidCharge opens;
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
  // A read-only open the read policy sent to the engine (fs/fuse/passthrough.h, OpenMode): its
  // cold reads never fill the page cache.
  bool engine_reads = false;
  // Whether its opener may learn the file's residency (cachestat's rule: it could write the file;
  // fs/fuse/passthrough.h, MaySeeResidency). Reads of the handle decide without it otherwise.
  bool may_probe = true;
  // This description's place in the file's data path: its share of the flush errors, whether it
  // wrote, whether it read yet (datapath/file_data.h).
  datapath::OpenFile open;
  Inode* inode = nullptr;
};

}  // namespace dnvme::fs
