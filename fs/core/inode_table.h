// The inode table, like libfuse's passthrough_hp: the root (BACKING_DIR), every inode the kernel
// has looked up by (dev, ino), and the control directory's nodes. An fuse_ino_t is the Inode's
// address (FUSE_ROOT_ID the root).
//
// Inode lifetime follows the kernel's lookup count: an inode is created on the first lookup of a
// (dev, ino) pair, each reply that hands the kernel an entry adds one, FORGET subtracts, and at
// zero the inode and its O_PATH fd go away. The kernel never forgets an inode that still has open
// files, so a FileHandle's Inode* stays valid until release. The control plane and the broker pin
// inodes the same way (Pin/Unpin) while they work on a file behind the kernel's back. The root
// and the control nodes live as long as the table.
//
// Lock order (fs/core/fs.h): mu_ (lookup counts, the (dev, ino) map) is a leaf; an Inode is
// destroyed after it is released (Forget), so nothing an Inode's destructor takes nests under it.
//
// Thread contract: Get, Lookup, Forget, Pin, Unpin and Virtual from any thread; OpenRoot and
// CloseRoot before the session runs; DrainAll once no request can forget an inode (the session
// loop has stopped).
#pragma once

#include <fuse_lowlevel.h>
#include <sys/types.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "dnvme/status.h"
#include "fs/core/inode.h"
#include "fs/limits/uid_limits.h"

namespace dnvme::fs {

class InodeTable {
 public:
  // Every inode's data path is made with the mount's shared state, which must outlive the table.
  // `limits` (may be null: nothing charged) holds the uids' shares of the inodes (kInodes).
  explicit InodeTable(const datapath::FileDataShared* data, UidLimits* limits = nullptr);
  InodeTable(const InodeTable&) = delete;
  InodeTable& operator=(const InodeTable&) = delete;

  // Opens BACKING_DIR as the root (once: a second call keeps the descriptor the first opened, so
  // the mount may cover BACKING_DIR itself).
  Status OpenRoot(const std::string& backing);
  // Closes the root's descriptor (a preflight that failed).
  void CloseRoot();
  int root_fd() const { return root_.fd; }

  Inode& Get(fuse_ino_t ino);
  // Looks `name` up under `parent`; adds one lookup reference. Returns the entry, or why not
  // (openat's or fstatat's errno: ENOENT...). An inode the kernel did not hold yet keeps an
  // O_PATH descriptor until the kernel forgets it, charged to `looker` (not root):
  // max_inodes_per_uid each, and all users together at most half of the daemon's RLIMIT_NOFILE,
  // so that no user -- nor all of them -- can fill the daemon's descriptor table and stop root's
  // requests (docs/security.md). Over either, the lookup fails with ENFILE (logged once a second
  // at most).
  Result<fuse_entry_param> Lookup(fuse_ino_t parent, const char* name, uid_t looker);
  void Forget(fuse_ino_t ino, uint64_t n);
  // Takes a reference on the inode the kernel knows for (dev, ino), so it cannot be forgotten
  // while someone works on it; null when the kernel has never looked the file up.
  Inode* Pin(dev_t dev, ino_t ino);
  void Unpin(Inode* in) { Forget(reinterpret_cast<fuse_ino_t>(in), 1); }
  // The control directory (kCtlDir) or one of its files.
  Inode& Virtual(VirtualNode kind);
  // Flushes every regular inode's write-behind and waits (unmount, SIGTERM); a loss is logged.
  void DrainAll();

 private:
  Status ChargeNew(uid_t looker, UidCharge* out);
  // Logs a refused lookup, a line a second at most (LogThrottle).
  static void RefusedLookup(uid_t looker, const Status& why);
  // The inodes all users' lookups may hold together: half of RLIMIT_NOFILE (read each time: the
  // daemon raises it at start, an administrator may change it with prlimit).
  static int64_t UsersShare();

  const datapath::FileDataShared* const data_;
  UidLimits* const limits_;
  std::atomic<int64_t> users_inodes_{0};  // inodes holding a lookups_charge
  Inode ctl_dir_, ctl_node_, stats_node_, config_node_, broker_node_;
  std::mutex mu_;
  std::map<std::pair<dev_t, ino_t>, std::unique_ptr<Inode>> inodes_;  // guarded by mu_
  Inode root_;
};

}  // namespace dnvme::fs
