// What a dnvmefs mount asks of the machine, for tools that check it before mounting
// (`dnvme report`): the daemon's own numbers, so the tools never restate them.
//
// Thread safety: pure functions.
#pragma once

#include <cstdint>

namespace dnvme {

struct MountRequirements {
  // Pinned (mlock'ed) bytes a mount with the default options locks when it starts, and at most
  // once every request-loop thread has its request buffer and every engine worker its bounce
  // buffers: what RLIMIT_MEMLOCK must allow (or CAP_IPC_LOCK).
  int64_t pinned_at_start = 0;
  int64_t pinned_peak = 0;
  // The pipe capacity a spliced request needs: above the default fs.pipe-max-size, so the
  // daemon needs that sysctl raised or CAP_SYS_RESOURCE when it starts.
  int64_t request_pipe_bytes = 0;
};

MountRequirements DefaultMountRequirements();

}  // namespace dnvme
