// The set-user-ID / set-group-ID rule of a write, written once for every path that writes on a
// user's behalf: a WRITE through the mount (fs/fuse/ops_common.cc, KillPrivs) and a control-file
// pwrite (fs/control/transfer.cc). The daemon writes with root's CAP_FSETID, which the kernel
// would take as leave to keep the bits; a user's write must clear them as it does on ext4.
//
// Thread contract: thread-safe; acts on the file with the calling thread's credentials (the
// daemon's: the writer may not own the file).
#pragma once

#include <sys/types.h>

#include <span>

#include "dnvme/status.h"

namespace dnvme::fs {

// What a write by a process without CAP_FSETID clears on ext4 (setattr_should_drop_suidgid):
// set-user-ID always; set-group-ID when group execute is set, or when the writer (`gid`,
// supplementary `groups`) is not in the file's group. Applies it to the file open as `fd` (any
// descriptor of it, O_PATH included). Returns whether the mode changed. Whether the writer lacks
// CAP_FSETID is the caller's to decide (the kernel's FUSE_WRITE_KILL_SUIDGID, a uid other than
// 0): the rule itself does not depend on the uid.
Result<bool> DropSetIdForWriter(int fd, gid_t gid, std::span<const gid_t> groups);

}  // namespace dnvme::fs
