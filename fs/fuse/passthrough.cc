#include "fs/fuse/passthrough.h"

#include <fcntl.h>
#include <linux/fuse.h>
#include <sys/capability.h>
#include <sys/stat.h>
#include <sys/uio.h>

#include <cmath>
#include <cstring>
#include <mutex>
#include <vector>

#include "dnvme/identity.h"
#include "dnvme/log.h"
#include "fs/caps.h"
#include "fs/transport/protocol_ext.h"

namespace dnvme::fs::ops {
namespace {

bool Wants(const MountOptions& o, int flags) {
  switch (o.passthrough) {
    case Passthrough::kOff:
      return false;
    case Passthrough::kDirect:
      return (flags & O_ACCMODE) == O_RDONLY && (flags & O_DIRECT);
    case Passthrough::kRead:
      return (flags & O_ACCMODE) == O_RDONLY;
    case Passthrough::kAll:
      return true;
  }
  return false;
}

// The identity a backing file is registered under (RegisterBacking): nobody, no groups.
constexpr uid_t kBackingUid = 65534;
constexpr gid_t kBackingGid = 65534;

// Registers the inode's backing file. nullopt (logged) when the kernel or the capability says
// no: the open then goes through the daemon.
//
// Whose credentials: the kernel keeps those of the thread that registers the backing file
// (FUSE_DEV_IOC_BACKING_OPEN takes prepare_creds()), and every passthrough open of the inode --
// a writer's too, whoever it is (the kernel wants every open of a passthrough inode to be
// passthrough, with the same backing) -- opens and writes the backing file with them. A root
// thread's would make a user's passthrough write root's: ext4's root-reserved blocks (fsuid 0
// is the reserved uid) and set-user-ID/set-group-ID bits kept (CAP_FSETID). So it is registered
// as nobody with no supplementary groups: the fsuid switch drops every file-system capability
// (CAP_FSETID among them; CAP_SYS_RESOURCE the daemon never keeps), and only what the kernel's
// own open of the backing file needs is raised again -- CAP_DAC_OVERRIDE and CAP_FOWNER (the
// kernel checked the opener's rights against the FUSE inode already; O_NOATIME wants the owner)
// -- with CAP_SYS_ADMIN for the ioctl. A passthrough writer then writes as an unprivileged
// user would: it stops at the space users may take, and ext4 clears set-user-ID (and
// set-group-ID unless the file's group is nobody's) as for any writer without CAP_FSETID. Root
// is served the same way (the safe side; docs/security.md).
std::optional<int32_t> OpenBacking(Fs& fs, Inode& in) {
  auto as = ScopedFsIdentity::Enter(FsIdentity{kBackingUid, kBackingGid, {}});
  if (!as.ok()) {
    DNVME_LOG_THROTTLED(warn, "passthrough open of inode {}: {}", in.ino, as.status().ToString());
    return std::nullopt;
  }
  std::vector<ScopedCapability> raised;
  for (cap_value_t c : {CAP_DAC_OVERRIDE, CAP_FOWNER, CAP_SYS_ADMIN}) {
    auto cap = ScopedCapability::Raise(c);
    if (!cap.ok()) {
      DNVME_LOG_THROTTLED(warn, "passthrough open of inode {}: {}", in.ino,
                          cap.status().ToString());
      return std::nullopt;
    }
    raised.push_back(std::move(cap).value());
  }
  auto id = fs.mount().protocol().OpenBacking(in.fd);
  raised.clear();  // lowered before anything is logged; `as` restores the identity after
  if (!id.ok()) {
    Logger().debug("passthrough open of inode {}: {}", in.ino, id.status().ToString());
    return std::nullopt;
  }
  return id.value();
}

void CloseBacking(Fs& fs, Inode& in, int32_t id) {
  auto cap = ScopedCapability::Raise(CAP_SYS_ADMIN);
  Status st = cap.ok() ? fs.mount().protocol().CloseBacking(id) : cap.status();
  // The kernel keeps the backing file while an inode uses it; a leaked id only holds one file
  // open until the session ends.
  if (!st.ok())
    DNVME_LOG_THROTTLED(warn, "closing backing id {} of inode {}: {}", id, in.ino, st.ToString());
}

// A read-only open whose cold reads the read policy sends to the engine (passthrough.h). Asks
// the kernel for the file's size and samples its residency: microseconds, and only for opens of
// files of engine_reads_from bytes or more.
bool EngineReads(Fs& fs, int flags, const Opener& opener) {
  const MountOptions& o = fs.mount().opts();
  if ((flags & O_ACCMODE) != O_RDONLY || opener.fd < 0 || !fs.mount().protocol().direct_io_mmap()) {
    return false;
  }
  struct stat st {};
  if (fstat(opener.fd, &st) != 0 || st.st_size < o.engine_reads_from) return false;
  return fs.mount().data_shared()->policy.ColdReadsToEngine(opener.fd, st.st_size, opener.pid,
                                                            o.engine_reads_from, opener.may_probe);
}

}  // namespace

bool MaySeeResidency(int fd, int flags, uid_t uid, gid_t gid) {
  if ((flags & O_ACCMODE) != O_RDONLY || uid == 0) return true;
  struct stat st {};
  if (fstat(fd, &st) != 0) return false;
  if (st.st_uid == uid) return true;
  if (st.st_gid == gid) return (st.st_mode & S_IWGRP) != 0;
  // Others' bits, unless a supplementary group of the user's (not known here) puts the group's
  // bits in their place: both must allow it.
  return (st.st_mode & S_IWOTH) != 0 && (st.st_mode & S_IWGRP) != 0;
}

namespace {

uint64_t TimeoutSec(double t) { return t <= 0 ? 0 : static_cast<uint64_t>(t); }
uint32_t TimeoutNsec(double t) {
  if (t <= 0) return 0;
  return static_cast<uint32_t>((t - std::floor(t)) * 1e9);
}

fuse_attr AttrOf(const struct stat& s) {
  fuse_attr a{};
  a.ino = s.st_ino;
  a.mode = s.st_mode;
  a.nlink = static_cast<uint32_t>(s.st_nlink);
  a.uid = s.st_uid;
  a.gid = s.st_gid;
  a.rdev = static_cast<uint32_t>(s.st_rdev);
  a.size = static_cast<uint64_t>(s.st_size);
  a.blksize = static_cast<uint32_t>(s.st_blksize);
  a.blocks = static_cast<uint64_t>(s.st_blocks);
  a.atime = static_cast<uint64_t>(s.st_atim.tv_sec);
  a.mtime = static_cast<uint64_t>(s.st_mtim.tv_sec);
  a.ctime = static_cast<uint64_t>(s.st_ctim.tv_sec);
  a.atimensec = static_cast<uint32_t>(s.st_atim.tv_nsec);
  a.mtimensec = static_cast<uint32_t>(s.st_mtim.tv_nsec);
  a.ctimensec = static_cast<uint32_t>(s.st_ctim.tv_nsec);
  return a;
}

}  // namespace

OpenMode BeginOpen(Fs& fs, Inode& in, int flags, const Opener& opener) {
  OpenModes& m = in.modes;
  std::lock_guard lock(m.mu);
  if (m.passthrough > 0) {
    // The kernel requires every open of a passthrough inode to be passthrough (EIO otherwise).
    ++m.passthrough;
    fs.mount().counters().passthrough_opens.fetch_add(1, std::memory_order_relaxed);
    return {true, m.backing_id};
  }
  if (EngineReads(fs, flags, opener)) {
    ++m.other;
    fs.mount().counters().engine_opens.fetch_add(1, std::memory_order_relaxed);
    return {.engine = true};
  }
  if (m.other > 0 || !Wants(fs.mount().opts(), flags) || !fs.mount().protocol().passthrough()) {
    ++m.other;
    return {};
  }
  // A passthrough reader must see every byte written so far, and nothing the daemon read ahead
  // may survive writes it does not see.
  if (Status st = in.data.Drain(); !st.ok()) {
    // Kept until a writer hears it: each open of the file until then comes here.
    DNVME_LOG_THROTTLED(debug, "inode {} opened through the daemon: write-behind {}", in.ino,
                        st.ToString());
    ++m.other;
    return {};
  }
  in.data.Invalidate();
  std::optional<int32_t> id = OpenBacking(fs, in);
  if (!id) {
    fs.mount().counters().passthrough_refused.fetch_add(1, std::memory_order_relaxed);
    ++m.other;
    return {};
  }
  m.backing_id = *id;
  m.passthrough = 1;
  fs.mount().counters().passthrough_opens.fetch_add(1, std::memory_order_relaxed);
  fs.mount().counters().backing_files.fetch_add(1, std::memory_order_relaxed);
  return {true, *id};
}

void EndOpen(Fs& fs, Inode& in, bool passthrough) {
  OpenModes& m = in.modes;
  std::lock_guard lock(m.mu);
  if (!passthrough) {
    --m.other;
    return;
  }
  if (--m.passthrough > 0) return;
  CloseBacking(fs, in, m.backing_id);
  m.backing_id = -1;
  fs.mount().counters().backing_files.fetch_sub(1, std::memory_order_relaxed);
}

wire::OpenOut PassthroughOpenOut(const fuse_file_info& fi, int32_t backing_id) {
  wire::OpenOut o{};
  o.fh = fi.fh;
  // Not FOPEN_DIRECT_IO (it would override passthrough) nor KEEP_CACHE: reads and mmap go to
  // the backing file's page cache, not the FUSE inode's.
  o.open_flags = wire::kOpenPassthrough;
  o.backing_id = backing_id;
  return o;
}

wire::OpenOut OpenOutWithFlags(const fuse_file_info& fi, uint32_t extra) {
  // What libfuse's fill_open sends for `fi`, then `extra`.
  uint32_t flags = extra;
  if (fi.direct_io) flags |= FOPEN_DIRECT_IO;
  if (fi.keep_cache) flags |= FOPEN_KEEP_CACHE;
  if (fi.nonseekable) flags |= FOPEN_NONSEEKABLE;
  if (fi.noflush) flags |= FOPEN_NOFLUSH;
  if (fi.cache_readdir) flags |= FOPEN_CACHE_DIR;
  wire::OpenOut o{};
  o.fh = fi.fh;
  o.open_flags = flags;
  return o;
}

fuse_entry_out EntryOutOf(const fuse_entry_param& e) {
  fuse_entry_out entry{};
  entry.nodeid = e.ino;
  entry.generation = e.generation;
  entry.entry_valid = TimeoutSec(e.entry_timeout);
  entry.entry_valid_nsec = TimeoutNsec(e.entry_timeout);
  entry.attr_valid = TimeoutSec(e.attr_timeout);
  entry.attr_valid_nsec = TimeoutNsec(e.attr_timeout);
  entry.attr = AttrOf(e.attr);
  return entry;
}

}  // namespace dnvme::fs::ops
