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
};
inline constexpr size_t kUidResourceCount = 11;

class UidCharge;

class UidLimits {
 public:
  // The maximum of each resource, indexed by UidResource.
  using Maxima = std::array<int64_t, kUidResourceCount>;
  explicit UidLimits(const Maxima& max) : max_(max) {}
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

  int64_t Held(uid_t uid, UidResource r) const;
  int64_t Max(UidResource r) const { return max_[static_cast<size_t>(r)]; }

  // The mount option that sets `r`'s maximum, and the errno a refusal carries.
  static const char* OptionName(UidResource r);
  static int ErrnoOf(UidResource r);

 private:
  const Maxima max_;
  mutable std::mutex mu_;
  std::unordered_map<uid_t, std::array<int64_t, kUidResourceCount>> held_;  // guarded by mu_
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
  UidCharge(UidLimits* l, uid_t uid, UidResource r, int64_t n)
      : limits_(l), uid_(uid), r_(r), n_(n) {}
  UidLimits* limits_ = nullptr;
  uid_t uid_ = 0;
  UidResource r_ = UidResource::kHandles;
  int64_t n_ = 0;
};

}  // namespace dnvme::fs
