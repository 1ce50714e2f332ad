#include "fs/core/inode_table.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
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

int64_t InodeTable::UsersShare() {
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return int64_t{1} << 30;
  return static_cast<int64_t>(rl.rlim_cur) / 2;
}

Status InodeTable::ChargeNew(uid_t looker, UidCharge* out) {
  if (looker == 0 || limits_ == nullptr) return Status::Ok();
  const int64_t share = UsersShare();
  if (users_inodes_.load(std::memory_order_relaxed) >= share) {
    return Status::ResourceExhausted(
        ENFILE, "users' lookups hold " + std::to_string(users_inodes_.load()) +
                    " inodes, half of the daemon's descriptor limit (RLIMIT_NOFILE " +
                    std::to_string(share * 2) + "): the rest is root's");
  }
  DNVME_ASSIGN_OR_RETURN(*out, limits_->Charge(looker, UidResource::kInodes));
  return Status::Ok();
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
  // under it (fs/core/fs.h): a new inode's charge is taken before, and given back if unused.
  // Root's lookups are not charged: no first look.
  UidCharge charge;
  bool known = looker == 0 || limits_ == nullptr;
  if (!known) {
    std::lock_guard lock(mu_);
    known = inodes_.count(std::make_pair(st.st_dev, st.st_ino)) != 0;
  }
  if (!known) {
    if (Status c = ChargeNew(looker, &charge); !c.ok()) {
      RefusedLookup(looker, c);
      return c;
    }
  }
  Inode* in;
  {
    std::lock_guard lock(mu_);
    auto key = std::make_pair(st.st_dev, st.st_ino);
    auto it = inodes_.find(key);
    if (it != inodes_.end()) {
      in = it->second.get();  // it holds a descriptor already; ours closes, the charge goes back
    } else {
      auto fresh = std::make_unique<Inode>(data_);
      fresh->fd = owned.Release();
      fresh->dev = st.st_dev;
      fresh->ino = st.st_ino;
      fresh->type = st.st_mode & S_IFMT;
      if (charge.held()) {
        fresh->lookups_charge = std::move(charge);
        users_inodes_.fetch_add(1, std::memory_order_relaxed);
      }
      in = fresh.get();
      inodes_.emplace(key, std::move(fresh));
    }
    ++in->nlookup;
  }
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
      if (dead->lookups_charge.held()) users_inodes_.fetch_sub(1, std::memory_order_relaxed);
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

}  // namespace dnvme::fs
