#include "fs/fuse/control_dir.h"

#include <fcntl.h>
#include <linux/fuse.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "dnvme/log.h"
#include "fs/core/fs.h"

namespace dnvme::fs {
namespace {

using nlohmann::json;

// Control nodes' inode numbers as the kernel shows them: far from any real ext4/xfs number.
constexpr ino_t kVirtualInoBase = 0x7fffffff00000000ULL;
// The size `ctl` claims: beyond the largest write(2) (MAX_RW_COUNT, 2 GiB less a page) from its
// stream position 0, so the kernel never sees a write past EOF, which it would serialise
// (fuse_dio_wr_exclusive_lock).
constexpr off_t kCtlFileSize = off_t{1} << 31;

struct NodeInfo {
  VirtualNode kind;
  const char* name;
  mode_t mode;
};
constexpr NodeInfo kFiles[] = {
    {VirtualNode::kCtl, "ctl", S_IFREG | 0666},        // every user: requests act as the caller
    {VirtualNode::kStats, "stats", S_IFREG | 0444},    // read-only
    {VirtualNode::kConfig, "config", S_IFREG | 0644},  // written by root or the mount's owner
    {VirtualNode::kBroker, "broker", S_IFREG | 0444},  // the preload broker's socket name
};

Inode* AsInode(fuse_ino_t ino) {
  if (ino == FUSE_ROOT_ID) return nullptr;
  return reinterpret_cast<Inode*>(ino);
}

VirtualNode KindOf(fuse_ino_t ino) {
  Inode* in = AsInode(ino);
  return in == nullptr ? VirtualNode::kNone : in->virt;
}

void FillStat(VirtualNode kind, struct stat* st, const struct timespec& t) {
  std::memset(st, 0, sizeof(*st));
  st->st_ino = kVirtualInoBase + static_cast<ino_t>(kind);
  st->st_uid = geteuid();
  st->st_gid = getegid();
  st->st_blksize = 4096;
  st->st_atim = st->st_mtim = st->st_ctim = t;
  if (kind == VirtualNode::kCtlDir) {
    st->st_mode = S_IFDIR | 0555;
    st->st_nlink = 2;
    return;
  }
  for (const NodeInfo& f : kFiles) {
    if (f.kind == kind) st->st_mode = f.mode;
  }
  st->st_nlink = 1;
  if (kind == VirtualNode::kCtl) st->st_size = kCtlFileSize;
}

fuse_entry_param EntryOf(Fs& fs, VirtualNode kind, const struct timespec& t) {
  fuse_entry_param e{};
  e.ino = reinterpret_cast<fuse_ino_t>(&fs.inodes().Virtual(kind));
  FillStat(kind, &e.attr, t);
  e.attr_timeout = kVirtualTimeout;
  e.entry_timeout = kVirtualTimeout;
  return e;
}

struct timespec Now() {
  struct timespec t {};
  clock_gettime(CLOCK_REALTIME, &t);
  return t;
}

std::string Snapshot(Fs& fs, VirtualNode kind, uid_t reader) {
  if (kind == VirtualNode::kStats) return json::parse(fs.StatsJsonFor(reader)).dump(2) + "\n";
  if (kind == VirtualNode::kBroker) return fs.BrokerAnnouncement();
  return json::parse(fs.EngineConfig().ToJson()).dump(2) + "\n";
}

// A refused open of a control file is logged, but at most one line a second for the whole daemon
// (with how many were left out since): a user who opens in a loop must not fill the log.
void LogRefusedOpen(const char* name, uid_t uid, const Status& st) {
  DNVME_LOG_THROTTLED(info, "open of {}/{} by uid {} refused: {}", kCtlDirName, name, uid,
                      st.ToString());
}

const char* NameOf(VirtualNode kind) {
  for (const NodeInfo& f : kFiles) {
    if (f.kind == kind) return f.name;
  }
  return "?";
}

// Only root and the mount's owner may change the live configuration (Fs::MayReconfigure).
Status ConfigRefused(uid_t uid) {
  return CtlError(EACCES,
                  "uid " + std::to_string(uid) + " may not write " + kCtlDirName + "/config");
}

// A ctl open whose session was never made (VirtualBindOpener not called): nothing to run as.
Status Unbound() {
  return CtlError(EBADF, std::string(kCtlDirName) + "/ctl: this open has no session");
}

}  // namespace

bool IsVirtual(fuse_ino_t ino) { return KindOf(ino) != VirtualNode::kNone; }

bool IsHiddenName(fuse_ino_t parent, const char* name) {
  return parent == FUSE_ROOT_ID && std::strcmp(name, kCtlDirName) == 0;
}

bool IsVirtualName(fuse_ino_t parent, const char* name) {
  return IsVirtual(parent) || IsHiddenName(parent, name);
}

std::optional<Result<fuse_entry_param>> VirtualLookup(Fs& fs, fuse_ino_t parent, const char* name) {
  const struct timespec t = Now();
  if (IsHiddenName(parent, name)) return EntryOf(fs, VirtualNode::kCtlDir, t);
  if (KindOf(parent) != VirtualNode::kCtlDir) return std::nullopt;
  for (const NodeInfo& f : kFiles) {
    if (std::strcmp(name, f.name) == 0) return EntryOf(fs, f.kind, t);
  }
  return Status::NotFound(std::string("no '") + name + "' in " + kCtlDirName);
}

std::optional<Result<struct stat>> VirtualGetattr(fuse_ino_t ino) {
  const VirtualNode kind = KindOf(ino);
  if (kind == VirtualNode::kNone) return std::nullopt;
  struct stat st {};
  FillStat(kind, &st, Now());
  return st;
}

std::optional<Result<struct stat>> VirtualSetattr(fuse_ino_t ino, int valid) {
  const VirtualNode kind = KindOf(ino);
  if (kind == VirtualNode::kNone) return std::nullopt;
  // `echo '{...}' > config` truncates first and `touch` sets times: harmless no-ops on a control
  // file. Ownership and modes are fixed.
  const int allowed = FUSE_SET_ATTR_SIZE | FUSE_SET_ATTR_ATIME | FUSE_SET_ATTR_MTIME |
                      FUSE_SET_ATTR_ATIME_NOW | FUSE_SET_ATTR_MTIME_NOW | FUSE_SET_ATTR_CTIME;
  if (kind == VirtualNode::kCtlDir || (valid & ~allowed) != 0) {
    return CtlError(EPERM, std::string("the attributes of ") + kCtlDirName + " are fixed");
  }
  return VirtualGetattr(ino);
}

std::optional<Status> VirtualOpen(Fs& fs, fuse_ino_t ino, const Caller& opener,
                                  fuse_file_info* fi) {
  const uid_t caller_uid = opener.uid;
  const VirtualNode kind = KindOf(ino);
  if (kind == VirtualNode::kNone) return std::nullopt;
  const int acc = fi->flags & O_ACCMODE;
  if (kind == VirtualNode::kCtlDir) {
    return CtlError(EISDIR, std::string(kCtlDirName) + " is a directory");
  }
  if ((kind == VirtualNode::kStats || kind == VirtualNode::kBroker) && acc != O_RDONLY) {
    return CtlError(EACCES, std::string(kCtlDirName) + "/" +
                                (kind == VirtualNode::kStats ? "stats" : "broker") +
                                " is read-only");
  }
  if (kind == VirtualNode::kConfig && acc != O_RDONLY && !fs.MayReconfigure(caller_uid)) {
    return ConfigRefused(caller_uid);
  }
  if (kind == VirtualNode::kCtl && (fi->flags & O_APPEND)) {
    return CtlError(EINVAL, std::string(kCtlDirName) + "/ctl takes no O_APPEND");
  }
  // Every open holds memory until RELEASE (a session: its queue and answer; a snapshot): charged
  // to the opener, root too, as every ctl_* limit (docs/security.md).
  auto charge = fs.uid_limits().Charge(caller_uid, UidResource::kControlOpens);
  if (!charge.ok()) {
    LogRefusedOpen(NameOf(kind), caller_uid, charge.status());
    return charge.status();
  }
  auto vf = std::make_unique<VirtualFile>();
  vf->kind = kind;
  vf->opens = std::move(charge).value();
  if (kind == VirtualNode::kCtl) {
    vf->session = std::make_shared<CtlSession>(fs, opener);
  } else {
    vf->snapshot = Snapshot(fs, kind, caller_uid);
  }
  // direct_io: every read and write reaches us whatever the (zero) file size says, and nothing
  // of a per-session answer lands in the shared page cache.
  fi->direct_io = 1;
  fi->keep_cache = 0;
  fi->nonseekable = kind == VirtualNode::kCtl ? 1 : 0;
  VirtualFile* raw = vf.release();
  fs.handles().Track(raw);
  fi->fh = reinterpret_cast<uint64_t>(raw);
  return Status::Ok();
}

void VirtualRead(Fs& fs, uid_t reader, size_t size, off_t off, fuse_file_info* fi,
                 VirtualReadReply reply) {
  auto* vf = reinterpret_cast<VirtualFile*>(fi->fh);
  if (vf->kind == VirtualNode::kCtl) {
    // The kernel names the reader's file table in every direct read (FUSE_READ_LOCKOWNER); a
    // read without one fills the page cache, for a fault in a mapping of ctl. It gets zeros, all
    // of `size`, at once: a session's answer must not land in pages every opener of ctl shares, a
    // short read would shrink the kernel's size of ctl, whose writes would then all take the
    // inode's lock exclusively (past EOF), and the page stays locked until answered (a write to
    // ctl in the kernel's caching mode waits for it).
    if (fi->lock_owner == 0) return reply(std::string(size, '\0'));
    if (vf->session == nullptr) return reply(Unbound());
    if (reader != vf->session->opener().uid) {
      return reply(CtlError(EPERM, "this " + std::string(kCtlDirName) + "/ctl session is uid " +
                                       std::to_string(vf->session->opener().uid) + "'s: uid " +
                                       std::to_string(reader) + " may not read its answers"));
    }
    return vf->session->Read(size, std::move(reply));
  }
  std::string bytes;
  {
    std::lock_guard lock(vf->m);
    // Reading from the start again (pread at 0, or a rewind) gets fresh numbers.
    if (off == 0) vf->snapshot = Snapshot(fs, vf->kind, reader);
    const size_t from = std::min(static_cast<size_t>(std::max<off_t>(off, 0)), vf->snapshot.size());
    const size_t n = std::min(size, vf->snapshot.size() - from);
    bytes = vf->snapshot.substr(from, n);
  }
  reply(bytes);
}

uint32_t VirtualOpenFlags(fuse_ino_t ino) {
  return KindOf(ino) == VirtualNode::kCtl ? FOPEN_PARALLEL_DIRECT_WRITES | FOPEN_STREAM : 0;
}

void VirtualWrite(Fs& fs, const Caller& caller, fuse_bufvec* bufv, fuse_file_info* fi,
                  VirtualWriteReply reply) {
  auto* vf = reinterpret_cast<VirtualFile*>(fi->fh);
  const size_t size = fuse_buf_size(bufv);
  // The dirty pages of a shared writable mapping come back as writeback (FUSE_WRITE_CACHE):
  // the kernel sends them as uid, gid and pid 0, through whichever mapper's file it picks, so
  // they name no caller (run, they were root's requests): acknowledged and dropped. A refusal
  // would be kept as the mapping's error, and the next ctl write or read of any user would fail
  // with it (EIO: the kernel flushes a mapping's pages before direct I/O).
  if (fi->writepage) return reply(size);
  // The bytes are copied out here: `bufv` belongs to the FUSE thread's request buffer.
  std::string text(size, '\0');
  fuse_bufvec dst = FUSE_BUFVEC_INIT(size);
  dst.buf[0].mem = text.data();
  const ssize_t got = fuse_buf_copy(&dst, bufv, static_cast<fuse_buf_copy_flags>(0));
  if (got < 0) {
    return reply(Status::FromErrno(static_cast<int>(-got), "reading a write to a control file"));
  }
  text.resize(static_cast<size_t>(got));
  if (vf->kind == VirtualNode::kCtl) {
    // O_APPEND set after the open (fcntl): the kernel holds the inode's lock exclusively for
    // this write, so it is answered at once rather than run.
    if (fi->flags & O_APPEND) {
      return reply(CtlError(EINVAL, std::string(kCtlDirName) + "/ctl takes no O_APPEND"));
    }
    const std::shared_ptr<CtlSession>& session = vf->session;
    if (session == nullptr) return reply(Unbound());
    // The session runs every request as its opener and refuses writers of another uid (EPERM):
    // CtlSession::Acting says why.
    if (!fs.mount().RepliesMayBeDeferred()) {
      Status run = session->Request(text, caller);
      if (!run.ok()) return reply(run);
      return reply(size);
    }
    // Answered once queued, never after the request ran: the kernel holds the ctl inode's lock
    // for a write, exclusively while someone maps ctl (its caching mode), and any other user's
    // write would wait for this one's request. The read of the answer waits instead
    // (VirtualRead); reads of ctl take no inode lock. The job holds the session: queued requests
    // still run after a release, and Fs::Stop runs every job before open files are deleted.
    const uid_t uid = caller.uid;
    Status queued = session->Enqueue(std::move(text), caller, [&fs, &session, uid] {
      return fs.ctl_lanes().Submit(uid, [s = session] { s->RunQueued(); });
    });
    if (!queued.ok()) return reply(queued);
    return reply(size);
  }
  if (vf->kind != VirtualNode::kConfig) {
    return reply(CtlError(EBADF, std::string(kCtlDirName) + "/stats is read-only"));
  }
  if (!fs.MayReconfigure(caller.uid)) return reply(ConfigRefused(caller.uid));
  auto applied = fs.SetEngineConfig(text);
  if (!applied.ok()) {
    DNVME_LOG_THROTTLED(warn, "write to {}/config refused: {}", kCtlDirName,
                        LogEscape(applied.status().ToString()));
    // EINVAL whatever the cause (a bad document, or an engine the new values could not create):
    // the old configuration stays in force.
    return reply(CtlError(EINVAL, "config refused: " + applied.status().message()));
  }
  reply(size);
}

std::optional<Status> VirtualNoop(fuse_ino_t ino) {
  if (KindOf(ino) == VirtualNode::kNone) return std::nullopt;
  return Status::Ok();
}

std::optional<Status> VirtualRelease(Fs& fs, fuse_ino_t ino, fuse_file_info* fi) {
  if (KindOf(ino) == VirtualNode::kNone) return std::nullopt;
  // The control dir's open has no VirtualFile (fh 0).
  auto* vf = reinterpret_cast<VirtualFile*>(fi->fh);
  if (vf == nullptr) return Status::Ok();
  // A ctl session waits for its in-flight transfers, then unmaps its buffers: on its owner's
  // lane, so neither this FUSE thread nor another user waits for that user's transfers. (Held
  // through a shared_ptr: lane jobs are copyable callables.)
  std::shared_ptr<CtlSession> session(std::move(vf->session));
  // The opener's ctl_max_opens unit goes with the session (or now, for a snapshot).
  auto opens = std::make_shared<UidCharge>(std::move(vf->opens));
  fs.handles().Dispose(vf);
  if (session != nullptr && fs.mount().RepliesMayBeDeferred()) {
    const uid_t owner = session->owner();
    // Never refused for a full queue: the session must go. After shutdown (not taken) it goes
    // here, with the last reference.
    (void)fs.ctl_lanes().Submit(
        owner,
        [session, opens]() mutable {
          session.reset();
          opens->Reset();
        },
        UidLanes::IfFull::kQueue);
  }
  return Status::Ok();
}

std::optional<Status> VirtualOpendir(fuse_ino_t ino, fuse_file_info* fi) {
  const VirtualNode kind = KindOf(ino);
  if (kind == VirtualNode::kNone) return std::nullopt;
  if (kind != VirtualNode::kCtlDir) {
    return CtlError(ENOTDIR, std::string("a file in ") + kCtlDirName + " is not a directory");
  }
  fi->fh = 0;
  fi->cache_readdir = 0;
  return Status::Ok();
}

std::optional<std::vector<VirtualDirEntry>> VirtualReaddir(Fs& fs, fuse_ino_t ino, off_t off,
                                                           bool plus) {
  if (KindOf(ino) != VirtualNode::kCtlDir) return std::nullopt;
  std::vector<VirtualDirEntry> entries;
  const struct timespec t = Now();
  // Entries 0 and 1 are "." and ".."; 2.. the files. `off` is the index of the next entry.
  // The offset is the caller's (lseek on the directory): any 64-bit value. Past the end, or
  // negative, there is nothing more to list; it is never narrowed before this check (a narrowed
  // 0xffffffff was -1, an index before the table).
  const off_t total = 2 + static_cast<off_t>(std::size(kFiles));
  if (off < 0 || off >= total) return entries;
  for (off_t i = off; i < total; ++i) {
    VirtualDirEntry d{};
    d.name = i == 0 ? "." : i == 1 ? ".." : kFiles[i - 2].name;
    d.next = i + 1;
    if (plus) {
      // The dots carry no inode for the kernel to look up: only their number and type.
      if (i >= 2) {
        d.entry = EntryOf(fs, kFiles[i - 2].kind, t);
      } else {
        d.entry.attr.st_ino = kVirtualInoBase;
        d.entry.attr.st_mode = S_IFDIR;
      }
    } else {
      FillStat(i >= 2 ? kFiles[i - 2].kind : VirtualNode::kCtlDir, &d.entry.attr, t);
    }
    entries.push_back(d);
  }
  return entries;
}

std::optional<Status> VirtualReleasedir(fuse_ino_t ino) {
  if (KindOf(ino) == VirtualNode::kNone) return std::nullopt;
  return Status::Ok();
}

}  // namespace dnvme::fs
