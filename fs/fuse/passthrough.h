// FUSE passthrough per open: whether the kernel serves an open file from the backing file itself
// (read, write, splice and mmap with no request to the daemon and no copy through /dev/fuse) or
// through the daemon (the engine's write-behind and read-ahead).
//
// Why per open, and which: a read through the daemon pays the kernel's reply copy
// (docs/performance-journal.md, "Fast device: where the time goes"); through passthrough it is
// the backing filesystem's own read. An O_DIRECT reader then gets the device's O_DIRECT speed
// (measured 1.4-1.7x the daemon's on both reference devices). A buffered reader gets ext4's
// page-cache read, which for files written with O_DIRECT -- every file the mount wrote -- was
// slower than the daemon's engine read-ahead on the RAM device (docs/performance.md). A writer
// gains from the daemon (write-behind from pinned buffers in parallel O_DIRECT). Hence
// -o passthrough=direct (the default where the kernel and the daemon's capabilities allow it):
// read-only O_DIRECT opens; =read every read-only open; =all every open; =off none.
// An O_DIRECT reader through passthrough gets ext4's O_DIRECT rules: buffers, offsets and sizes
// aligned to the logical block size (EINVAL otherwise), where the daemon took any.
//
// What the kernel requires (fs/fuse/iomode.c, 6.9+), and how the per-inode counts keep to it:
//   - while one open of an inode is passthrough, every new open of it must be passthrough too,
//     with the same backing file, or it fails with EIO: so once an inode has passthrough opens,
//     writers get passthrough as well (their writes then bypass the engine);
//   - a passthrough open fails while the inode has page-cache opens. The daemon also refuses it
//     while any other open exists (direct_io ones included): their writes wait in write-behind,
//     which a passthrough reader would not see.
//   The kernel drops its own count before it sends RELEASE, so counting down at RELEASE keeps
//   ours at or above its own: never a decision it refuses.
// Before the first passthrough open, the inode's write-behind is landed (a reader must see every
// byte written before) and its read-ahead dropped (passthrough writers would make it stale).
//
// Capability: FUSE_DEV_IOC_BACKING_OPEN/CLOSE need CAP_SYS_ADMIN. The daemon keeps it only when
// passthrough is asked for, out of the effective set, raised on the one thread around the ioctl
// (fs/caps.h); the backing file is then opened by the kernel with the daemon's credentials.
//
// Thread contract: BeginOpen/EndOpen from any FUSE handler; an inode's counts are guarded by its
// OpenModes::mu (lock order, fs/core/fs.h: level 2, before the inode's WriteBehind/ReadAhead).
#pragma once

#include <fuse_lowlevel.h>
#include <linux/fuse.h>

#include <cstdint>

#include "fs/core/fs.h"
#include "fs/transport/protocol_ext.h"

namespace dnvme::fs::ops {

struct OpenMode {
  bool passthrough = false;
  int32_t backing_id = -1;
  // Not passthrough: a read-only open of a large cold file whose reads the daemon serves from the
  // engine (datapath/read_policy.h, ColdReadsToEngine), sent with FOPEN_DIRECT_IO so that each
  // read(2) reaches the daemon whole and nothing is cached twice.
  bool engine = false;
};

// Who opens, for the read policy: the open's backing descriptor (residency is asked of it) and
// the opener's pid (its memory cgroup is where passthrough reads would be charged).
struct Opener {
  int fd = -1;
  pid_t pid = 0;
  bool may_probe = true;  // MaySeeResidency
};

// Whether an open by `uid` (primary group `gid`) with open(2) flags `flags` of the file behind
// `fd` may base decisions on the file's residency, by cachestat(2)'s rule for that user: an open
// for writing, root, the file's owner, or a user the mode lets write it (its primary group or
// others; a write allowed only by a supplementary group or an ACL counts as not: the safe side,
// which costs such a reader only the page cache's speed on files larger than its memory).
bool MaySeeResidency(int fd, int flags, uid_t uid, gid_t gid);

// Decides how the kernel opens `in` (regular files) for open(2) flags `flags`, and counts the
// open; every BeginOpen is matched by one EndOpen with the same `passthrough`. A read-only open
// goes to the engine instead of passthrough when the mount's read policy says so for this file
// and its opener, and the kernel lets direct_io opens be mmapped (FUSE_DIRECT_IO_ALLOW_MMAP);
// an inode with passthrough opens keeps its every open passthrough (the kernel's rule above).
OpenMode BeginOpen(Fs& fs, Inode& in, int flags, const Opener& opener);
void EndOpen(Fs& fs, Inode& in, bool passthrough);

// The bodies of the open and create replies libfuse 3.14 cannot build: its fuse_reply_open and
// fuse_reply_create have no backing_id, and its fuse_file_info no FOPEN_* flag beyond direct_io,
// keep_cache, nonseekable, noflush and cache_readdir. ReplyOpen and ReplyCreate
// (fs/fuse/ops_common.h) send them.
// A passthrough open's fuse_open_out.
wire::OpenOut PassthroughOpenOut(const fuse_file_info& fi, int32_t backing_id);
// What libfuse sends for `fi` (its fill_open), with the FOPEN_* flags `extra` (e.g.
// FOPEN_PARALLEL_DIRECT_WRITES, FOPEN_STREAM) on top.
wire::OpenOut OpenOutWithFlags(const fuse_file_info& fi, uint32_t extra);
// The fuse_entry_out of a create's reply (libfuse's fill_entry).
fuse_entry_out EntryOutOf(const fuse_entry_param& e);

}  // namespace dnvme::fs::ops
