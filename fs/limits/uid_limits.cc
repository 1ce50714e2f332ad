#include "fs/limits/uid_limits.h"

#include <sys/resource.h>

#include <algorithm>
#include <cerrno>
#include <string>

namespace dnvme::fs {
namespace {

struct Info {
  const char* option;
  int err;
  const char* what;  // plural noun for the message
  bool many;         // one request takes many units at once (the message says how many)
};
constexpr Info kInfo[kUidResourceCount] = {
    {"ctl_max_handles", EMFILE, "control handles open", false},
    {"ctl_max_bytes", ENOMEM, "bytes of client memory registered", true},
    {"ctl_max_buffers", EMFILE, "client buffers registered", false},
    {"ctl_max_pinned", ENOMEM, "bytes pinned by control handles", true},
    {"ctl_max_pending", EAGAIN, "control transfers not yet collected by wait", false},
    {"max_files_per_uid", EMFILE, "files held open by the daemon", false},
    {"broker_max_conns_per_uid", EMFILE, "broker connections open", false},
    {"ctl_max_opens", EMFILE, "open files of .dnvme (control sessions and snapshots)", false},
    // EAGAIN, as the kernel answers a thread (RLIMIT_NPROC) or an io_setup (aio-max-nr) over its
    // limit; the units come back when the uid closes a handle.
    {"ctl_max_workers", EAGAIN, "engine threads of control handles", true},
    {"ctl_max_aio_events", EAGAIN, "libaio events of control handles", true},
    // ENFILE: the lookup fails as one would in a process whose file table is full.
    {"max_inodes_per_uid", ENFILE, "inodes held by the kernel's lookups", false},
    // Never refused by Take (ChargeFds decides against the daemon-wide parts).
    {"RLIMIT_NOFILE", ENFILE, "of the daemon's descriptors", true},
};

const Info& InfoOf(UidResource r) { return kInfo[static_cast<size_t>(r)]; }

}  // namespace

const char* UidLimits::OptionName(UidResource r) { return InfoOf(r).option; }
int UidLimits::ErrnoOf(UidResource r) { return InfoOf(r).err; }

Status UidLimits::Take(uid_t uid, UidResource r, int64_t n) {
  if (n <= 0) return Status::Ok();
  const size_t i = static_cast<size_t>(r);
  std::lock_guard lock(mu_);
  auto& held = held_[uid];
  if (n <= max_[i] - held[i]) {
    held[i] += n;
    return Status::Ok();
  }
  const Info& info = InfoOf(r);
  const int64_t had = held[i];
  if (std::all_of(held.begin(), held.end(), [](int64_t v) { return v == 0; })) held_.erase(uid);
  std::string msg = "uid " + std::to_string(uid) + " has " + std::to_string(had) + " " + info.what +
                    "; " + (info.many ? std::to_string(n) + " more" : "one more") +
                    " would pass the limit " + info.option + "=" + std::to_string(max_[i]);
  return Status::ResourceExhausted(info.err, std::move(msg));
}

void UidLimits::Release(uid_t uid, UidResource r, int64_t n) {
  if (n <= 0) return;
  const size_t i = static_cast<size_t>(r);
  std::lock_guard lock(mu_);
  auto it = held_.find(uid);
  if (it == held_.end()) return;
  it->second[i] = std::max<int64_t>(0, it->second[i] - n);
  // Entries of uids that hold nothing go, so the table stays as small as the active users.
  if (std::all_of(it->second.begin(), it->second.end(), [](int64_t v) { return v == 0; })) {
    held_.erase(it);
  }
}

FdShape FdShape::For(int64_t limit) {
  FdShape s;
  s.limit = std::max<int64_t>(limit, 64);
  s.reserve = std::min(s.limit / 2, std::max<int64_t>(256, s.limit / 16));
  s.capacity = s.limit - s.reserve;
  s.users = s.capacity / 2;
  s.inodes = s.capacity / 4;
  s.prune_at = s.inodes / 2;
  s.prune_to = s.inodes / 4;
  return s;
}

FdShape FdShape::OfProcess() {
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY ||
      rl.rlim_cur > (rlim_t{1} << 30)) {
    return For(int64_t{1} << 30);
  }
  return For(static_cast<int64_t>(rl.rlim_cur));
}

Result<UidCharge> UidLimits::ChargeFds(uid_t uid, int64_t n, FdUse use) {
  if (n <= 0) return UidCharge{};
  std::lock_guard lock(mu_);
  const char* full = nullptr;
  int64_t held = 0, cap = 0;
  if (fds_held_.all + n > fds_.capacity) {
    full = "the daemon's descriptors (RLIMIT_NOFILE less its own reserve)";
    held = fds_held_.all, cap = fds_.capacity;
  } else if (uid != 0 && fds_held_.users + n > fds_.users) {
    full = "all users' share of the daemon's descriptors (the rest is root's)";
    held = fds_held_.users, cap = fds_.users;
  } else if (use == FdUse::kInode && fds_held_.inodes + n > fds_.inodes) {
    full = "the daemon's descriptors for looked-up inodes";
    held = fds_held_.inodes, cap = fds_.inodes;
  } else if (use == FdUse::kInode && uid != 0 && fds_held_.users_inodes + n > fds_.inodes / 2) {
    full = "all users' share of the daemon's descriptors for looked-up inodes (the rest is root's)";
    held = fds_held_.users_inodes, cap = fds_.inodes / 2;
  }
  if (full != nullptr) {
    return Status::ResourceExhausted(
        ENFILE, std::string(full) + " are in use: " + std::to_string(held) + " of " +
                    std::to_string(cap) + " (RLIMIT_NOFILE " + std::to_string(fds_.limit) +
                    "), uid " + std::to_string(uid) + " asked for " + std::to_string(n));
  }
  fds_held_.all += n;
  if (uid != 0) fds_held_.users += n;
  if (use == FdUse::kInode) fds_held_.inodes += n;
  if (use == FdUse::kInode && uid != 0) fds_held_.users_inodes += n;
  held_[uid][static_cast<size_t>(UidResource::kDescriptors)] += n;
  return UidCharge(this, uid, UidResource::kDescriptors, n, use);
}

void UidLimits::ReleaseFds(uid_t uid, int64_t n, FdUse use) {
  {
    std::lock_guard lock(mu_);
    fds_held_.all -= n;
    if (uid != 0) fds_held_.users -= n;
    if (use == FdUse::kInode) fds_held_.inodes -= n;
    if (use == FdUse::kInode && uid != 0) fds_held_.users_inodes -= n;
  }
  Release(uid, UidResource::kDescriptors, n);
}

UidLimits::FdHeld UidLimits::FdsHeld() const {
  std::lock_guard lock(mu_);
  return fds_held_;
}

Result<UidCharge> UidLimits::Charge(uid_t uid, UidResource r, int64_t n) {
  DNVME_RETURN_IF_ERROR(Take(uid, r, n));
  return UidCharge(this, uid, r, n);
}

int64_t UidLimits::Held(uid_t uid, UidResource r) const {
  std::lock_guard lock(mu_);
  auto it = held_.find(uid);
  return it == held_.end() ? 0 : it->second[static_cast<size_t>(r)];
}

UidCharge& UidCharge::operator=(UidCharge&& o) noexcept {
  if (this != &o) {
    Reset();
    limits_ = o.limits_;
    uid_ = o.uid_;
    r_ = o.r_;
    n_ = o.n_;
    use_ = o.use_;
    o.limits_ = nullptr;
    o.n_ = 0;
  }
  return *this;
}

void UidCharge::Reset() {
  if (limits_ != nullptr) {
    if (r_ == UidResource::kDescriptors) {
      limits_->ReleaseFds(uid_, n_, use_);
    } else {
      limits_->Release(uid_, r_, n_);
    }
  }
  limits_ = nullptr;
  n_ = 0;
}

}  // namespace dnvme::fs
