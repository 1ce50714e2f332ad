// DefaultMountRequirements (include/dnvme/mount.h): the pinned bytes the default options lock
// (fs/options.h) and the pipe a spliced request needs (fs/transport/request_pipe.h). Kept apart
// from options.cc, so the options depend on nothing of the transport that reads them.
#include "dnvme/mount.h"
#include "fs/options.h"
#include "fs/transport/request_pipe.h"

namespace dnvme {

MountRequirements DefaultMountRequirements() {
  const fs::MountOptions defaults;
  return {defaults.PinnedAtStart(), defaults.PinnedPeak(), fs::kRequestPipeBytes};
}

}  // namespace dnvme
