// The control directory `<mount>/.dnvme/` (ctl, stats, config) as the FUSE operations in
// fs/fuse/ops_*.cc see it: each Virtual* function is asked first and says what happened as a
// value -- std::nullopt when the request does not concern a control node (the op goes on as
// usual), otherwise the outcome (a Status or a Result). Nothing here replies: the op answers,
// and a Status becomes an errno only there (Status::ErrnoOr). The refusals keep
// the errno they always had (EPERM, EACCES, EISDIR, ENOTDIR, EBADF, ENOENT, EINVAL).
//
// The directory is never stored in BACKING_DIR and does not appear in the root's listing (so
// `cp -r`, `du` and `rm -rf` of the mount never touch it); it is found by name. A BACKING_DIR
// entry of the same name is hidden by it.
//
// Thread safety: as the FUSE operations; the per-open state is a VirtualFile (its own mutex).
// The directory's inodes are the InodeTable's (fs/core/inode_table.h); its files' contents come
// from the core (Fs: stats, config, the broker's name) and the control plane (fs/control/).
#pragma once

#include <fuse_lowlevel.h>
#include <sys/stat.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "dnvme/status.h"

namespace dnvme::fs {

class Fs;
struct Caller;

// Attribute and entry cache time of the control nodes, for replies built from them.
inline constexpr double kVirtualTimeout = 1.0;

bool IsVirtual(fuse_ino_t ino);
// True when `name` under `parent` is the control dir's name at the root (hidden in listings).
bool IsHiddenName(fuse_ino_t parent, const char* name);
// True when (parent, name) names the control dir or an entry inside it: no create, link,
// unlink or rename may touch it.
bool IsVirtualName(fuse_ino_t parent, const char* name);

// The control dir (under its name at the root) or a file in it; ENOENT for any other name in it.
std::optional<Result<fuse_entry_param>> VirtualLookup(Fs& fs, fuse_ino_t parent, const char* name);
// Always a stat when `ino` is a control node. `ctl` says it is larger than any write can reach
// (2 GiB: its opens are streams, so each write starts at 0), which with
// FOPEN_PARALLEL_DIRECT_WRITES (VirtualOpenFlags) lets the kernel take the inode's lock shared.
std::optional<Result<struct stat>> VirtualGetattr(fuse_ino_t ino);
// Size and times are accepted and ignored (`echo > config` truncates first); the rest is EPERM.
std::optional<Result<struct stat>> VirtualSetattr(fuse_ino_t ino, int valid);

// On success `fi` is filled in (fh is a VirtualFile tracked by `fs`, direct_io, ...) and the op
// answers with it; if that reply fails, VirtualRelease(fs, ino, fi) undoes the open.
// `opener` (ops::CallerOf: uid, gid, supplementary groups) decides who may write config and owns
// a ctl session: every request of the session runs as its opener, and reads and writes by
// another uid are refused (EPERM; CtlSession). Made here, before the open is answered, so no
// write of the open can come first.
// A ctl open with O_APPEND is refused (EINVAL): the kernel serialises appends on the inode, so
// one user's long request would hold every other user's write.
// Every open of a file (not of the directory) is charged to the opener (ctl_max_opens,
// UidResource::kControlOpens) until its RELEASE: over the limit the open fails with EMFILE
// (logged, at most one line a second).
std::optional<Status> VirtualOpen(Fs& fs, fuse_ino_t ino, const Caller& opener, fuse_file_info* fi);
// FOPEN_* flags an open of `ino` needs beyond what fuse_file_info can say (libfuse 3.14): for
// ctl, FOPEN_PARALLEL_DIRECT_WRITES and FOPEN_STREAM, so writes by different users take the
// kernel's inode lock shared and run in parallel (fs/fuse/ops_common.cc, ReplyVirtualOpen). 0 for
// every other node.
uint32_t VirtualOpenFlags(fuse_ino_t ino);
// A read of an open control file (call only when IsVirtual(ino)), answered through `reply` with
// the bytes:
//   ctl: the session's pending answer (consumed as read): at once when the session has nothing
//     queued or running, else later, from the lane that runs its requests, once the last one is
//     done (CtlSession::Read; no thread waits meanwhile). A read into the page cache (a fault in
//     a mapping of ctl: no lock owner in `fi`) gets `size` zero bytes at once.
//   stats/config: up to `size` bytes of the snapshot at `off` (refreshed when reading from 0),
//     before this returns.
// A read of ctl by another uid than the session's opener is refused (EPERM): the answer is the
// opener's. `reply` is called exactly once, on any thread.
using VirtualReadReply = std::function<void(const Result<std::string>&)>;
void VirtualRead(Fs& fs, uid_t reader, size_t size, off_t off, fuse_file_info* fi,
                 VirtualReadReply reply);
// A write to an open control file (call only when IsVirtual(ino): gathering the caller's groups
// reads /proc, which no data write should pay for), answered through `reply` with the byte count
// to acknowledge (all of `bufv`: a refused ctl request still counts, its error is the answer
// read next) or an error.
//   ctl: the request (copied out of `bufv` first) joins the session's queue and `reply` is
//     called before this returns: a job on the caller uid's lane (Fs::ctl_lanes,
//     fs/limits/uid_lanes.h) runs the queue, and the read of the answer waits for it. A full
//     session queue (CtlSession::kMaxQueued) or a full lane is answered EAGAIN, a write with
//     O_APPEND EINVAL. Where replies cannot be deferred (FUSE over io_uring) the request runs
//     here, before the reply.
//   config: the patch is applied and answered before this returns.
// Writeback of a shared mapping (fi->writepage) names no caller: acknowledged, nothing run.
// `reply` is called exactly once, on any thread.
using VirtualWriteReply = std::function<void(const Result<size_t>&)>;
void VirtualWrite(Fs& fs, const Caller& caller, fuse_bufvec* bufv, fuse_file_info* fi,
                  VirtualWriteReply reply);
// flush and fsync: nothing to do, always OK.
std::optional<Status> VirtualNoop(fuse_ino_t ino);
// Disposes of the open's VirtualFile. A ctl session waits for its in-flight transfers first: that
// wait runs on the owner's lane, after the release has been answered.
std::optional<Status> VirtualRelease(Fs& fs, fuse_ino_t ino, fuse_file_info* fi);

// ENOTDIR for a control file; for the control dir, `fi` is filled in for the op's open reply.
std::optional<Status> VirtualOpendir(fuse_ino_t ino, fuse_file_info* fi);
// One entry of the control dir's listing: `entry` is what readdirplus sends (readdir sends
// `entry.attr`), `next` the offset of the entry after it.
struct VirtualDirEntry {
  const char* name;
  fuse_entry_param entry;
  off_t next;
};
// The control dir's entries from offset `off` on ("." and ".." first), for readdir or (`plus`)
// readdirplus; the op packs as many as fit its reply.
std::optional<std::vector<VirtualDirEntry>> VirtualReaddir(Fs& fs, fuse_ino_t ino, off_t off,
                                                           bool plus);
std::optional<Status> VirtualReleasedir(fuse_ino_t ino);

}  // namespace dnvme::fs
