// Fs as BrokerCore (fs/broker/broker.h): what the preload broker asks of the core beyond what the
// control plane asks too (pinning, draining and the kernel's caches: fs/core/control_core.cc).
#include <mutex>

#include "fs/core/fs.h"

namespace dnvme::fs {

int Fs::OpenCount(Inode& in) {
  std::lock_guard lock(in.modes.mu);
  return in.modes.passthrough + in.modes.other;
}

}  // namespace dnvme::fs
