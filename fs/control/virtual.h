// The FUSE side of the control directory `<mount>/.dnvme/` (ctl, stats, config): called first by
// the operations in fs/fuse/ops_*.cc. Each Virtual* function returns true when the request
// concerned a control node and has been answered, false when the caller should go on as usual.
//
// The directory is never stored in BACKING_DIR and does not appear in the root's listing (so
// `cp -r`, `du` and `rm -rf` of the mount never touch it); it is found by name. A BACKING_DIR
// entry of the same name is hidden by it.
//
// Thread safety: as the FUSE operations; the per-open state is a VirtualFile (its own mutex).
#pragma once

#include <fuse_lowlevel.h>

namespace dnvme::fs {

bool IsVirtual(fuse_ino_t ino);
// Answers `err` when `ino` is a control node.
bool RefuseVirtual(fuse_req_t req, fuse_ino_t ino, int err);
// Answers `err` when (parent, name) names a control node or an entry inside the control dir.
bool RefuseVirtualName(fuse_req_t req, fuse_ino_t parent, const char* name, int err);
// True when `name` under `parent` is the control dir's name at the root (hidden in listings).
bool IsHiddenName(fuse_ino_t parent, const char* name);

bool VirtualLookup(fuse_req_t req, fuse_ino_t parent, const char* name);
bool VirtualGetattr(fuse_req_t req, fuse_ino_t ino);
bool VirtualSetattr(fuse_req_t req, fuse_ino_t ino, struct stat* attr, int valid);
bool VirtualOpen(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi);
bool VirtualRead(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, fuse_file_info* fi);
bool VirtualWrite(fuse_req_t req, fuse_ino_t ino, fuse_bufvec* bufv, fuse_file_info* fi);
// flush and fsync: nothing to do.
bool VirtualNoop(fuse_req_t req, fuse_ino_t ino);
bool VirtualRelease(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi);
bool VirtualOpendir(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi);
bool VirtualReaddir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, bool plus);
bool VirtualReleasedir(fuse_req_t req, fuse_ino_t ino);

}  // namespace dnvme::fs
