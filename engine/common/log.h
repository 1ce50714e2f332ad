// The engine's logger: one spdlog logger named "dnvme", writing to stderr by default.
//
// Thread safety: spdlog loggers are thread-safe (the _mt sinks); Logger() may be called from any
// thread. SetLogLevel/SetLogFile are meant for start-up.
#pragma once

#include <spdlog/spdlog.h>

#include <memory>
#include <string>

#include "dnvme/log.h"
#include "dnvme/status.h"

namespace dnvme {

spdlog::logger& Logger();

}  // namespace dnvme
