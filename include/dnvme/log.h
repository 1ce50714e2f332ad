// The project's logger: one spdlog logger named "dnvme" (stderr by default, level info), used by
// the engine and by the programs and components built on it (the mount daemon, the preload
// library, the dnvme CLI). Including this header needs spdlog (dnvme_engine links it PUBLIC).
//
// Log lines and untrusted text: a daemon log is read line by line (by people, journald, grep), so
// a user who can put a newline in a logged string could forge a whole line of any level. Every
// string a request supplies (a path, a name, a label, the message of a Status that quotes one)
// goes through LogEscape at the log call. As a backstop, the logger's own format escapes the
// control characters and invalid UTF-8 of every record (LogEscapeMode::kControlOnly), so one
// record is always one line even where a call site forgot.
//
// Thread safety: spdlog loggers are thread-safe (the _mt sinks); Logger() may be called from any
// thread. SetLogLevel/SetLogFile are meant for start-up, before handles are created. LogEscape is
// a pure function; LogThrottle is thread-safe.
#pragma once

#include <spdlog/spdlog.h>

#include <atomic>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <utility>

#include "dnvme/status.h"

namespace dnvme {

// "trace", "debug", "info", "warn", "error", "critical", "off"; anything else is InvalidArgument.
Status SetLogLevel(const std::string& level);
// Sends the log to `path` (appending) instead of stderr.
Status SetLogFile(const std::string& path);

// The logger itself (created on first use).
spdlog::logger& Logger();

enum class LogEscapeMode {
  kAll,          // untrusted text at a call site: a backslash is escaped too (unambiguous)
  kControlOnly,  // the backstop over a whole record: leaves a backslash alone, so text escaped at
                 // the call site reads the same, and escaping twice changes nothing
};

// `text` made safe for one log line: \n, \r, \t for those; \xNN for every other C0 control byte,
// DEL, a byte that is not part of valid UTF-8 (overlong forms, surrogates and code points past
// U+10FFFF included), and each byte of a C1 control (U+0080..U+009F: some terminals act on them)
// or of U+2028/U+2029 (line breaks to some viewers). Valid printable UTF-8 is kept as it is.
std::string LogEscape(std::string_view text, LogEscapeMode mode = LogEscapeMode::kAll);

// At most one log line a second from one place, however often it is reached: for refusals a user
// can repeat as fast as it likes (a log the user could fill would cost the daemon its disk and
// hide everything else). Allow() is true for the call that may log now, with how many calls were
// left out since the last line in `*skipped`. Thread-safe (atomics only).
class LogThrottle {
 public:
  bool Allow(uint64_t* skipped);

 private:
  std::atomic<int64_t> last_ns_{std::numeric_limits<int64_t>::min()};
  std::atomic<uint64_t> skipped_{0};
};

// Logs one line through `throttle` (one per call site: `static LogThrottle throttle;` beside the
// call), with how many lines like it were left out since the last one. Every line a user can cause
// at will (a refusal, a failure of the user's own request) goes through here; start-up lines and
// lines only root or the mount's owner can cause use Logger() directly.
template <typename... Args>
void LogThrottled(LogThrottle& throttle, spdlog::level::level_enum level,
                  spdlog::format_string_t<Args...> format, Args&&... args) {
  uint64_t skipped = 0;
  if (!throttle.Allow(&skipped)) return;
  std::string line = fmt::format(format, std::forward<Args>(args)...);
  if (skipped > 0) line += fmt::format(" ({} more like it not logged)", skipped);
  Logger().log(level, "{}", line);
}

// LogThrottled with a throttle of the call site's own, as one statement (as RocksDB's ROCKS_LOG_*):
//   DNVME_LOG_THROTTLED(warn, "open by uid {} refused: {}", uid, why.ToString());
#define DNVME_LOG_THROTTLED(lvl, ...)                                            \
  do {                                                                           \
    static ::dnvme::LogThrottle dnvme_log_throttle_;                             \
    ::dnvme::LogThrottled(dnvme_log_throttle_, spdlog::level::lvl, __VA_ARGS__); \
  } while (0)

}  // namespace dnvme
