// Logging controls for programs that embed the engine (the dnvme CLI, the mount daemon).
//
// The engine logs through one spdlog logger named "dnvme" (stderr by default, level info).
// Thread safety: call these at start-up, before handles are created; logging itself is
// thread-safe.
#pragma once

#include <string>

#include "dnvme/status.h"

namespace dnvme {

// "trace", "debug", "info", "warn", "error", "critical", "off"; anything else is InvalidArgument.
Status SetLogLevel(const std::string& level);
// Sends the engine's log to `path` (appending) instead of stderr.
Status SetLogFile(const std::string& path);

}  // namespace dnvme
