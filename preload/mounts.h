// Which dnvmefs mount a descriptor's file is on, and whether `dnvme run --mount` allows it.
//
// The kernel answers (fstatfs, /proc/self/mountinfo) through a MountProbe: the one seam tests use
// to adopt files of a plain directory as if it were a mount (tests/preload/).
//
// Thread contract: every function is thread-safe, except SetMountProbeForTesting, which must run
// before any adoption (no other thread in the library).
#ifndef DNVME_PRELOAD_MOUNTS_H_
#define DNVME_PRELOAD_MOUNTS_H_

#include <sys/types.h>

#include <string>

namespace dnvme::preload {

struct MountInfo {
  dev_t dev = 0;
  std::string point;  // the mountpoint, unescaped, without a trailing '/'
};

struct MountProbe {
  // Whether `fd` is on a FUSE file system (fstatfs: FUSE_SUPER_MAGIC).
  bool (*on_fuse)(int fd);
  // The dnvmefs mount with device `dev` (/proc/self/mountinfo, fuse.dnvmefs); false if none.
  bool (*find_mount)(dev_t dev, MountInfo* out);
};

// The probe in use: the kernel's answers unless a test replaced them.
const MountProbe& Mounts();
void SetMountProbeForTesting(const MountProbe& probe);

// Whether DNVME_PRELOAD_MOUNTS lets the engine serve the mount at `point` (empty: every mount).
bool MountAllowed(const std::string& point);

}  // namespace dnvme::preload

#endif  // DNVME_PRELOAD_MOUNTS_H_
