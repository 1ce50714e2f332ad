// Per-uid limits on what clients make the daemon hold (docs/security.md, "Per-uid limits"): one
// counter per uid and resource, with a maximum per resource that every uid gets. The control
// file, the broker and the mount's own opens all count here, so a user that reaches a limit is
// refused with a clear error naming the option, and no other user notices.
//
// Why per uid and not per session or connection: a user opens as many sessions or connections
// as it likes; only the uid is something it cannot multiply. Root is counted like everyone
// (daemon-wide tables keep their own reserve for root: client_memory.h, the broker).
//
// Thread contract: every method is thread-safe (one mutex, held only for the arithmetic). A
// UidCharge is a move-only owner of units taken: it gives them back when destroyed, on any
// thread; the UidLimits must outlive it.
#pragma once

#include <sys/types.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <unordered_map>

#include "dnvme/status.h"

namespace dnvme::fs {

enum class UidResource : uint8_t {
  kHandles,          // control-file handles (engines)            ctl_max_handles   EMFILE
  kRegisteredBytes,  // client memory registered, bytes           ctl_max_bytes     ENOMEM
  kBuffers,          // client buffers registered (mappings)      ctl_max_buffers   EMFILE
  kPinnedBytes,      // pinned bounce memory of control handles   ctl_max_pinned    ENOMEM
  kPending,          // async control transfers not yet collected ctl_max_pending   EAGAIN
  kFiles,            // files the daemon holds open for the uid   max_files_per_uid EMFILE
  kBrokerConns,      // broker connections                        broker_max_conns_per_uid EMFILE
  kControlOpens,     // open files of .dnvme/ (ctl sessions, stats ctl_max_opens     EMFILE
                     // and config snapshots)
  kWorkers,          // engine threads of control handles          ctl_max_workers   EAGAIN
  kAioEvents,        // libaio events of control handles' workers  ctl_max_aio_events EAGAIN
                     // (each worker's io_setup(queue_depth): the kernel's aio-max-nr)
  kInodes,           // inodes the uid's lookups made the daemon    max_inodes_per_uid ENFILE
                     // hold (an O_PATH descriptor each, until the kernel forgets them)
  kDescriptors,      // the daemon's descriptors held for the uid  (FdShape)         ENFILE
};
inline constexpr size_t kUidResourceCount = 12;

// What a charge of descriptors holds them for (the inode cap counts only kInode).
enum class FdUse : uint8_t { kInode, kOther };

// How the daemon's descriptor limit is divided (see the file comment). Worked out once, from the
// RLIMIT_NOFILE the daemon runs with (it raises the soft limit to the hard one before this).
struct FdShape {
  int64_t limit = 0;     // RLIMIT_NOFILE
  int64_t reserve = 0;   // the daemon's own: max(256, limit / 16), never charged
  int64_t capacity = 0;  // limit - reserve: every charge together
  int64_t users = 0;     // capacity / 2: every uid but root together
  int64_t inodes = 0;    // capacity / 4: every looked-up inode together
  int64_t prune_at = 0;  // inodes / 2: the inode table's pruner starts here
  int64_t prune_to = 0;  // inodes / 4: and asks the kernel to forget inodes down to here
  static FdShape For(int64_t limit);
  // For the daemon's RLIMIT_NOFILE now (an unlimited one counts as 2^30).
  static FdShape OfProcess();
};

class UidCharge;

class UidLimits {
 public:
  // The maximum of each resource, indexed by UidResource.
  using Maxima = std::array<int64_t, kUidResourceCount>;
  // `fds`: the descriptor budget (FdShape::OfProcess() in the daemon).
  explicit UidLimits(const Maxima& max, const FdShape& fds = FdShape::For(int64_t{1} << 30))
      : max_(max), fds_(fds) {}
  UidLimits(const UidLimits&) = delete;
  UidLimits& operator=(const UidLimits&) = delete;

  // Takes `n` units of `r` for `uid`, or refuses with ResourceExhausted (the resource's errno,
  // a message naming the option, the limit and what the uid holds) when the uid would hold more
  // than the maximum. n <= 0 takes nothing.
  Status Take(uid_t uid, UidResource r, int64_t n = 1);
  // Gives back units taken (never below zero).
  void Release(uid_t uid, UidResource r, int64_t n = 1);
  // Take, owned by the returned charge.
  Result<UidCharge> Charge(uid_t uid, UidResource r, int64_t n = 1);

  // Takes `n` of the daemon's descriptors for `uid` (see the file comment), owned by the returned
  // charge; ResourceExhausted (ENFILE) naming the part that is full. Root is refused only by the
  // capacity and the inode cap.
  Result<UidCharge> ChargeFds(uid_t uid, int64_t n, FdUse use);
  const FdShape& fd_shape() const { return fds_; }
  struct FdHeld {
    int64_t all = 0, users = 0, inodes = 0, users_inodes = 0;
  };
  FdHeld FdsHeld() const;

  int64_t Held(uid_t uid, UidResource r) const;
  int64_t Max(UidResource r) const { return max_[static_cast<size_t>(r)]; }

  // The mount option that sets `r`'s maximum, and the errno a refusal carries.
  static const char* OptionName(UidResource r);
  static int ErrnoOf(UidResource r);

 private:
  friend class UidCharge;
  void ReleaseFds(uid_t uid, int64_t n, FdUse use);

  const Maxima max_;
  const FdShape fds_;
  mutable std::mutex mu_;
  std::unordered_map<uid_t, std::array<int64_t, kUidResourceCount>> held_;  // guarded by mu_
  FdHeld fds_held_;                                                         // guarded by mu_
};

// Units of one resource held for one uid, given back when the charge is destroyed or Reset.
class UidCharge {
 public:
  UidCharge() = default;
  UidCharge(UidCharge&& o) noexcept { *this = std::move(o); }
  UidCharge& operator=(UidCharge&& o) noexcept;
  UidCharge(const UidCharge&) = delete;
  UidCharge& operator=(const UidCharge&) = delete;
  ~UidCharge() { Reset(); }

  void Reset();
  bool held() const { return limits_ != nullptr; }
  int64_t units() const { return n_; }

 private:
  friend class UidLimits;
  UidCharge(UidLimits* l, uid_t uid, UidResource r, int64_t n, FdUse use = FdUse::kOther)
      : limits_(l), uid_(uid), r_(r), n_(n), use_(use) {}
  UidLimits* limits_ = nullptr;
  uid_t uid_ = 0;
  UidResource r_ = UidResource::kHandles;
  int64_t n_ = 0;
  FdUse use_ = FdUse::kOther;  // kDescriptors only
};

}  // namespace dnvme::fs
