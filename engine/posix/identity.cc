#include "dnvme/identity.h"

#include <linux/capability.h>
#include <sys/fsuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <optional>
#include <string>

#include "dnvme/log.h"

namespace dnvme {
namespace {

struct CapData {
  __user_cap_data_struct d[2] = {};
};

Status CapGet(CapData* out) {
  __user_cap_header_struct hdr{_LINUX_CAPABILITY_VERSION_3, 0};
  if (syscall(SYS_capget, &hdr, out->d) != 0) return Status::FromErrno(errno, "capget");
  return Status::Ok();
}

// Puts back `effective`, keeping the thread's permitted and inheritable sets as they are now.
Status SetEffective(const uint32_t effective[2]) {
  CapData now;
  DNVME_RETURN_IF_ERROR(CapGet(&now));
  if (now.d[0].effective == effective[0] && now.d[1].effective == effective[1]) {
    return Status::Ok();
  }
  now.d[0].effective = effective[0];
  now.d[1].effective = effective[1];
  __user_cap_header_struct hdr{_LINUX_CAPABILITY_VERSION_3, 0};
  if (syscall(SYS_capset, &hdr, now.d) != 0) return Status::FromErrno(errno, "capset");
  return Status::Ok();
}

uid_t CurrentFsuid() { return static_cast<uid_t>(setfsuid(static_cast<uid_t>(-1))); }
gid_t CurrentFsgid() { return static_cast<gid_t>(setfsgid(static_cast<gid_t>(-1))); }

// Records the calling thread's identity into `s` (not yet switched).
Status Save(ScopedFsIdentity::Saved* s) {
  const int n = getgroups(0, nullptr);
  if (n < 0) return Status::FromErrno(errno, "getgroups");
  s->groups.resize(static_cast<size_t>(n));
  if (n > 0 && getgroups(n, s->groups.data()) < 0) return Status::FromErrno(errno, "getgroups");
  CapData caps;
  DNVME_RETURN_IF_ERROR(CapGet(&caps));
  s->effective[0] = caps.d[0].effective;
  s->effective[1] = caps.d[1].effective;
  s->fsuid = CurrentFsuid();
  s->fsgid = CurrentFsgid();
  return Status::Ok();
}

// setfsuid/setfsgid report nothing useful: each switch is read back.
Status Apply(const FsIdentity& who) {
  if (syscall(SYS_setgroups, who.groups.size(), who.groups.data()) != 0) {
    return Status::FromErrno(errno, "setgroups for uid " + std::to_string(who.uid));
  }
  setfsgid(who.gid);
  if (CurrentFsgid() != who.gid) {
    return Status::FromErrno(EPERM, "cannot take gid " + std::to_string(who.gid));
  }
  setfsuid(who.uid);
  if (CurrentFsuid() != who.uid) {
    return Status::FromErrno(EPERM, "cannot take uid " + std::to_string(who.uid));
  }
  return Status::Ok();
}

// Restores `s`; aborts when the thread cannot get its identity back.
void Restore(const ScopedFsIdentity::Saved& s) {
  setfsuid(s.fsuid);
  setfsgid(s.fsgid);
  const bool groups_ok = syscall(SYS_setgroups, s.groups.size(), s.groups.data()) == 0;
  Status caps = SetEffective(s.effective);
  if (!groups_ok || !caps.ok() || CurrentFsuid() != s.fsuid || CurrentFsgid() != s.fsgid) {
    Logger().critical("could not restore a thread's own identity after acting for a user ({})",
                      caps.ok() ? "setfsuid/setfsgid/setgroups" : caps.ToString());
    std::abort();
  }
}

// Refusal for a process that cannot switch; OK (no switch needed) when it already is `who`.
Result<bool> NeedsSwitch(const FsIdentity& who) {
  if (geteuid() == 0) return true;
  if (who.uid == geteuid()) return false;
  return Status::FromErrno(EPERM, "the process runs as uid " + std::to_string(geteuid()) +
                                      " and cannot act for uid " + std::to_string(who.uid));
}

}  // namespace

Result<ScopedFsIdentity> ScopedFsIdentity::Enter(const FsIdentity& who) {
  ScopedFsIdentity s;
  DNVME_ASSIGN_OR_RETURN(bool needed, NeedsSwitch(who));
  if (!needed) return s;
  DNVME_RETURN_IF_ERROR(Save(&s.saved_));
  s.saved_.switched = true;  // from here the destructor restores, also after a failed Apply
  DNVME_RETURN_IF_ERROR(Apply(who));
  return s;
}

Result<ScopedFsIdentity> ScopedFsIdentity::EnterIf(const FsIdentity* who) {
  if (who == nullptr) return ScopedFsIdentity();
  return Enter(*who);
}

ScopedFsIdentity::ScopedFsIdentity(ScopedFsIdentity&& o) noexcept : saved_(std::move(o.saved_)) {
  o.saved_.switched = false;
}

ScopedFsIdentity::~ScopedFsIdentity() {
  if (saved_.switched) Restore(saved_);
}

Status SwitchThreadFsIdentity(const FsIdentity* want) {
  struct ThreadState {
    ScopedFsIdentity::Saved own;  // own.switched: the thread runs as `current`
    std::optional<FsIdentity> current;
  };
  thread_local ThreadState t;
  if (want == nullptr) {
    if (t.own.switched) {
      Restore(t.own);
      t.own.switched = false;
      t.current.reset();
    }
    return Status::Ok();
  }
  if (t.own.switched && t.current && *t.current == *want) return Status::Ok();
  DNVME_ASSIGN_OR_RETURN(bool needed, NeedsSwitch(*want));
  if (!needed) return Status::Ok();
  if (!t.own.switched) {
    DNVME_RETURN_IF_ERROR(Save(&t.own));
    t.own.switched = true;
  }
  t.current.reset();
  if (Status st = Apply(*want); !st.ok()) {
    Restore(t.own);
    t.own.switched = false;
    return st;
  }
  t.current = *want;
  return Status::Ok();
}

Result<uint64_t> ThreadEffectiveCapabilities() {
  CapData caps;
  DNVME_RETURN_IF_ERROR(CapGet(&caps));
  return (static_cast<uint64_t>(caps.d[1].effective) << 32) | caps.d[0].effective;
}

}  // namespace dnvme
