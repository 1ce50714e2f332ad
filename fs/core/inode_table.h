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
// Every inode's O_PATH descriptor is charged to the daemon's descriptor budget (UidLimits::
// ChargeFds, root's lookups too): the kernel keeps looked-up inodes in its dentry cache long after
// anyone uses them, and a listing of a big directory would otherwise fill the daemon's table. So
// the table runs a pruner: once the inodes pass FdShape::prune_at it asks the kernel to forget
// the least recently looked-up ones (FUSE_NOTIFY_PRUNE, sent by `send`), down to prune_to. The
// kernel drops only dentries nobody uses, so an inode open or in some process's cwd stays.
// READDIRPLUS stops looking entries up past prune_at (its lookups are only a guess at what will be
// used), so explicit lookups have the room between prune_at and the cap while the kernel forgets.
//
// Lock order (fs/core/fs.h): mu_ (lookup counts, the (dev, ino) map) is a leaf; an Inode is
// destroyed after it is released (Forget), so nothing an Inode's destructor takes nests under it.
// prune_mu_ is a leaf too (the pruner takes mu_ and the budget's lock only with it released).
//
// Thread contract: Get, Lookup, Forget, Pin, Unpin, Virtual and Crowded from any thread; OpenRoot
// and CloseRoot before the session runs; StartPruner once the session is mounted, StopPruner
// before it is destroyed (any thread but the pruner); DrainAll once no request can forget an
// inode (the session loop has stopped).
#pragma once

#include <fuse_lowlevel.h>
#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

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
  ~InodeTable() { StopPruner(); }

  // Opens BACKING_DIR as the root (once: a second call keeps the descriptor the first opened, so
  // the mount may cover BACKING_DIR itself).
  Status OpenRoot(const std::string& backing);
  // Closes the root's descriptor (a preflight that failed).
  void CloseRoot();
  int root_fd() const { return root_.fd; }

  Inode& Get(fuse_ino_t ino);
  // Looks `name` up under `parent`; adds one lookup reference. Returns the entry, or why not
  // (openat's or fstatat's errno: ENOENT...). An inode the kernel did not hold yet keeps an
  // O_PATH descriptor until the kernel forgets it, charged to `looker`: one of the daemon's
  // descriptors (root's too: UidLimits::ChargeFds, with its cap on all inodes) and, for a user,
  // one of max_inodes_per_uid, so that no user -- nor all of them, nor root's listing of their
  // files -- can fill the daemon's descriptor table and stop everyone's requests
  // (docs/security.md). Over any, the lookup fails with ENFILE (logged once a second at most).
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

  // The inodes have passed the pruner's mark: a lookup only worth making if used (READDIRPLUS)
  // is better left to the kernel's own LOOKUP.
  bool Crowded() const;
  // Starts the pruner thread; `send` asks the kernel to forget the node ids given
  // (ProtocolExtensions::NotifyPrune). An Unsupported answer stops pruning for good (logged).
  using PruneSender = std::function<Status(const std::vector<uint64_t>&)>;
  void StartPruner(PruneSender send);
  void StopPruner();
  struct PruneCounters {
    uint64_t rounds = 0, asked = 0;
    bool running = false;
  };
  PruneCounters prune_counters() const;

 private:
  struct Charges {
    UidCharge fd, inode;
  };
  Status ChargeNew(uid_t looker, Charges* out);
  // Logs a refused lookup, a line a second at most (LogThrottle).
  static void RefusedLookup(uid_t looker, const Status& why);
  void PokePruner();
  void Prune();
  // The node ids of the `n` inodes looked up longest ago.
  std::vector<uint64_t> Oldest(size_t n);

  const datapath::FileDataShared* const data_;
  UidLimits* const limits_;
  Inode ctl_dir_, ctl_node_, stats_node_, config_node_, broker_node_;
  mutable std::mutex mu_;
  std::map<std::pair<dev_t, ino_t>, std::unique_ptr<Inode>> inodes_;  // guarded by mu_
  uint64_t lookup_tick_ = 0;                                          // guarded by mu_
  Inode root_;

  mutable std::mutex prune_mu_;
  std::condition_variable prune_cv_;
  PruneSender send_;                    // guarded by prune_mu_ (set before the thread starts)
  bool prune_wanted_ = false;           // guarded by prune_mu_
  bool prune_stop_ = false;             // guarded by prune_mu_
  PruneCounters prune_;                 // guarded by prune_mu_
  std::atomic<bool> poked_{false};      // a poke is on its way (keeps lookups off prune_mu_)
  std::atomic<uint64_t> forgotten_{0};  // inodes the kernel forgot (the pruner's progress)
  std::thread pruner_;
};

}  // namespace dnvme::fs
