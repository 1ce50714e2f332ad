#include "fs/core/inode_table.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "dnvme/log.h"

namespace dnvme::fs {

Inode::~Inode() {
  if (fd >= 0) close(fd);
}

void TrimSpace(Inode& in, int fd) {
  if (!S_ISREG(in.type) || !in.data.holds_reservation()) return;
  UniqueFd reopened;
  if (fd < 0) {
    reopened.Reset(ReopenNoWait(in.fd, O_WRONLY | O_CLOEXEC));
    if (!reopened.valid()) {
      Logger().debug("inode {}: no descriptor to free its reserved space: {}", in.ino,
                     std::strerror(errno));
      return;
    }
    fd = reopened.get();
  }
  Status st;
  if (!in.leases.WithoutLeases([&] { st = in.data.Trim(fd); })) return;  // the lease's client's
  if (!st.ok()) DNVME_LOG_THROTTLED(warn, "inode {}: {}", in.ino, st.ToString());
}

InodeTable::InodeTable(const datapath::FileDataShared* data, UidLimits* limits)
    : data_(data),
      limits_(limits),
      ctl_dir_(data),
      ctl_node_(data),
      stats_node_(data),
      config_node_(data),
      broker_node_(data),
      root_(data) {
  ctl_dir_.virt = VirtualNode::kCtlDir;
  ctl_dir_.type = S_IFDIR;
  ctl_node_.virt = VirtualNode::kCtl;
  stats_node_.virt = VirtualNode::kStats;
  config_node_.virt = VirtualNode::kConfig;
  broker_node_.virt = VirtualNode::kBroker;
  for (Inode* in : {&ctl_node_, &stats_node_, &config_node_, &broker_node_}) in->type = S_IFREG;
}

Status InodeTable::OpenRoot(const std::string& backing) {
  int fd = root_.fd;
  if (fd < 0) fd = open(backing.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Status::FromErrno(errno, "open BACKING_DIR '" + backing + "'");
  root_.fd = fd;
  struct stat st {};
  if (fstat(fd, &st) != 0) return Status::FromErrno(errno, "stat BACKING_DIR");
  root_.dev = st.st_dev;
  root_.ino = st.st_ino;
  root_.type = S_IFDIR;
  root_.nlookup = 2;  // never forgotten
  return Status::Ok();
}

void InodeTable::CloseRoot() {
  if (root_.fd < 0) return;
  close(root_.fd);
  root_.fd = -1;
}

Inode& InodeTable::Virtual(VirtualNode kind) {
  switch (kind) {
    case VirtualNode::kCtl:
      return ctl_node_;
    case VirtualNode::kStats:
      return stats_node_;
    case VirtualNode::kConfig:
      return config_node_;
    case VirtualNode::kBroker:
      return broker_node_;
    default:
      return ctl_dir_;
  }
}

void InodeTable::DrainAll() {
  std::vector<Inode*> all;
  {
    std::lock_guard lock(mu_);
    for (auto& [key, in] : inodes_) all.push_back(in.get());
  }
  // Inodes cannot be forgotten while we drain: the session loop has stopped (destroy/unmount).
  for (Inode* in : all) {
    if (S_ISREG(in->type)) {
      Status st = in->data.Drain();
      if (!st.ok()) {
        Logger().error("write-behind data of inode {} lost at exit: {}", in->ino, st.ToString());
      }
      // Files the kernel never released (the daemon ends with them open).
      TrimSpace(*in, -1);
    }
  }
}

Inode& InodeTable::Get(fuse_ino_t ino) {
  if (ino == FUSE_ROOT_ID) return root_;
  return *reinterpret_cast<Inode*>(ino);
}

Status InodeTable::ChargeNew(uid_t looker, Charges* out) {
  if (limits_ == nullptr) return Status::Ok();
  DNVME_ASSIGN_OR_RETURN(out->fd, limits_->ChargeFds(looker, 1, FdUse::kInode));
  if (looker != 0) {
    DNVME_ASSIGN_OR_RETURN(out->inode, limits_->Charge(looker, UidResource::kInodes));
  }
  return Status::Ok();
}

bool InodeTable::Crowded() const {
  return limits_ != nullptr && limits_->FdsHeld().inodes >= limits_->fd_shape().prune_at;
}

Result<fuse_entry_param> InodeTable::Lookup(fuse_ino_t parent, const char* name, uid_t looker) {
  Inode& dir = Get(parent);
  int fd = openat(dir.fd, name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return Status::FromErrno(errno, "lookup");
  UniqueFd owned(fd);
  struct stat st {};
  if (fstatat(fd, "", &st, AT_SYMLINK_NOFOLLOW | AT_EMPTY_PATH) != 0) {
    return Status::FromErrno(errno, "lookup");
  }
  // Whether the kernel already holds this inode is known only under mu_, which takes nothing
  // under it (fs/core/fs.h): a new inode's charges are taken before, and given back if unused.
  Charges charges;
  bool known = limits_ == nullptr;
  if (!known) {
    std::lock_guard lock(mu_);
    known = inodes_.count(std::make_pair(st.st_dev, st.st_ino)) != 0;
  }
  if (!known) {
    if (Status c = ChargeNew(looker, &charges); !c.ok()) {
      RefusedLookup(looker, c);
      PokePruner();
      return c;
    }
  }
  Inode* in;
  bool made = false;
  {
    std::lock_guard lock(mu_);
    auto key = std::make_pair(st.st_dev, st.st_ino);
    auto it = inodes_.find(key);
    if (it != inodes_.end()) {
      in = it->second.get();  // it holds a descriptor already; ours closes, the charges go back
    } else {
      auto fresh = std::make_unique<Inode>(data_);
      fresh->fd = owned.Release();
      fresh->dev = st.st_dev;
      fresh->ino = st.st_ino;
      fresh->type = st.st_mode & S_IFMT;
      fresh->fd_charge = std::move(charges.fd);
      fresh->lookups_charge = std::move(charges.inode);
      in = fresh.get();
      inodes_.emplace(key, std::move(fresh));
      made = true;
    }
    ++in->nlookup;
    in->last_lookup = ++lookup_tick_;
  }
  if (made && Crowded()) PokePruner();
  if (S_ISREG(st.st_mode)) in->data.ApplyPending(&st);
  fuse_entry_param e{};
  e.ino = reinterpret_cast<fuse_ino_t>(in);
  e.attr = st;
  // A file a `dnvme run` client holds may change behind the kernel: its attributes are not
  // cached (fs/fuse/ops_entry.cc, OpGetattr).
  e.attr_timeout = in->leases.count() > 0 ? 0.0 : kEntryTimeout;
  e.entry_timeout = kEntryTimeout;
  return e;
}

void InodeTable::Forget(fuse_ino_t ino, uint64_t n) {
  if (ino == FUSE_ROOT_ID) return;
  Inode* in = reinterpret_cast<Inode*>(ino);
  if (in->virt != VirtualNode::kNone) return;  // control nodes live as long as the table
  std::unique_ptr<Inode> dead;
  std::lock_guard lock(mu_);
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
      forgotten_.fetch_add(1, std::memory_order_relaxed);
    }
  }
}

void InodeTable::RefusedLookup(uid_t looker, const Status& why) {
  DNVME_LOG_THROTTLED(warn, "lookup by uid {} refused: {}", looker, why.ToString());
}

Inode* InodeTable::Pin(dev_t dev, ino_t ino) {
  std::lock_guard lock(mu_);
  auto it = inodes_.find({dev, ino});
  if (it == inodes_.end()) return nullptr;
  ++it->second->nlookup;
  return it->second.get();
}

void InodeTable::PokePruner() {
  if (poked_.exchange(true, std::memory_order_acq_rel)) return;  // one is on its way
  {
    std::lock_guard lock(prune_mu_);
    prune_wanted_ = true;
  }
  prune_cv_.notify_one();
}

void InodeTable::StartPruner(PruneSender send) {
  if (limits_ == nullptr) return;
  std::lock_guard lock(prune_mu_);
  if (pruner_.joinable() || prune_stop_) return;
  send_ = std::move(send);
  prune_.running = true;
  pruner_ = std::thread([this] { Prune(); });
}

void InodeTable::StopPruner() {
  {
    std::lock_guard lock(prune_mu_);
    prune_stop_ = true;
  }
  prune_cv_.notify_one();
  if (pruner_.joinable()) pruner_.join();
}

InodeTable::PruneCounters InodeTable::prune_counters() const {
  std::lock_guard lock(prune_mu_);
  return prune_;
}

std::vector<uint64_t> InodeTable::Oldest(size_t n) {
  std::vector<std::pair<uint64_t, uint64_t>> by_age;  // (last lookup, node id)
  {
    std::lock_guard lock(mu_);
    by_age.reserve(inodes_.size());
    for (const auto& [key, in] : inodes_) {
      by_age.emplace_back(in->last_lookup, reinterpret_cast<uint64_t>(in.get()));
    }
  }
  // Node ids only: an inode forgotten meanwhile is one the kernel no longer knows by that id
  // (the notification is advice; the kernel looks each id up itself).
  n = std::min(n, by_age.size());
  std::nth_element(by_age.begin(), by_age.begin() + static_cast<std::ptrdiff_t>(n), by_age.end());
  std::vector<uint64_t> ids;
  ids.reserve(n);
  for (size_t i = 0; i < n; ++i) ids.push_back(by_age[i].second);
  return ids;
}

void InodeTable::Prune() {
  const FdShape& shape = limits_->fd_shape();
  std::unique_lock lock(prune_mu_);
  while (true) {
    prune_cv_.wait(lock, [this] { return prune_wanted_ || prune_stop_; });
    if (prune_stop_) break;
    prune_wanted_ = false;
    poked_.store(false, std::memory_order_release);
    lock.unlock();
    // Rounds until the inodes are down to prune_to, or a round frees nothing (what is left is
    // in use: open files, cwds, dentries with children). The kernel evicts in the write and
    // queues the FORGETs, which the loop threads serve meanwhile.
    int64_t held = limits_->FdsHeld().inodes;
    bool stop = false, unsupported = false;
    int idle_rounds = 0;
    while (!stop && held > shape.prune_to) {
      // Twice as many after a round that freed nothing: the oldest may be in use.
      const uint64_t forgotten = forgotten_.load(std::memory_order_relaxed);
      std::vector<uint64_t> ids =
          Oldest(static_cast<size_t>(held - shape.prune_to) << std::min(idle_rounds, 8));
      Status st = send_(ids);
      lock.lock();
      ++prune_.rounds;
      prune_.asked += ids.size();
      // Time for the FORGETs the eviction queued to be served.
      prune_cv_.wait_for(lock, std::chrono::milliseconds(20), [this] { return prune_stop_; });
      stop = prune_stop_;
      lock.unlock();
      if (!st.ok()) {
        unsupported = st.code() == Status::Code::kUnsupported || st.error_number() == EINVAL;
        DNVME_LOG_THROTTLED(warn, "asking the kernel to forget idle inodes: {}", st.ToString());
        break;
      }
      // Progress is inodes forgotten, not fewer held: lookups go on meanwhile.
      idle_rounds = forgotten_.load(std::memory_order_relaxed) > forgotten ? 0 : idle_rounds + 1;
      held = limits_->FdsHeld().inodes;
      if (idle_rounds >= 3) break;
    }
    lock.lock();
    if (unsupported) {
      Logger().warn(
          "the kernel cannot be asked to forget inodes (FUSE_NOTIFY_PRUNE, protocol 7.45): "
          "past {} looked-up inodes, lookups fail with ENFILE until the kernel forgets some",
          shape.inodes);
      prune_.running = false;
      break;
    }
    if (idle_rounds >= 3) {
      // Nothing more can go now: pokes wait a second, so that a table full of inodes in use
      // does not keep this thread busy.
      prune_cv_.wait_for(lock, std::chrono::seconds(1), [this] { return prune_stop_; });
    }
  }
  prune_.running = false;
}

}  // namespace dnvme::fs
