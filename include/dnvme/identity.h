// FsIdentity: a file-system identity (fsuid, fsgid, supplementary groups) that work done on
// someone's behalf runs under, so the kernel decides for that work exactly as for its owner.
//
// Used by a daemon serving many users (dnvmefs): an engine file adopted for a writer carries the
// writer's identity (AioHandle::adopt_fd), and the engine's threads switch to it before they
// submit the file's writes, so block allocation sees the writer's fsuid (ext4 keeps its reserved
// blocks for root) and the kernel applies its own set-user-ID rules to the write.
//
// Thread contract: a plain value; immutable once shared.
#pragma once

#include <sys/types.h>

#include <vector>

namespace dnvme {

struct FsIdentity {
  uid_t uid = 0;
  gid_t gid = 0;
  std::vector<gid_t> groups;  // supplementary groups

  bool operator==(const FsIdentity& o) const {
    return uid == o.uid && gid == o.gid && groups == o.groups;
  }
};

}  // namespace dnvme
