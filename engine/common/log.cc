#include "dnvme/log.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/base_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>

#include <cerrno>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "dnvme/fd.h"

namespace dnvme {
namespace {

std::mutex g_mu;
std::shared_ptr<spdlog::logger> g_logger;  // guarded by g_mu for replacement

// Length of the valid UTF-8 sequence at the start of `s` (2 to 4), 0 when it is not one: the
// ranges of RFC 3629, so overlong forms, surrogates and code points past U+10FFFF are invalid.
size_t Utf8Length(std::string_view s) {
  const auto b = [&](size_t i) { return static_cast<unsigned char>(s[i]); };
  const auto cont = [&](size_t i) { return i < s.size() && (b(i) & 0xC0) == 0x80; };
  const unsigned char c = b(0);
  if (c >= 0xC2 && c <= 0xDF) return cont(1) ? 2 : 0;
  if (c >= 0xE0 && c <= 0xEF) {
    if (!cont(1) || !cont(2)) return 0;
    if ((c == 0xE0 && b(1) < 0xA0) || (c == 0xED && b(1) > 0x9F)) return 0;
    return 3;
  }
  if (c >= 0xF0 && c <= 0xF4) {
    if (!cont(1) || !cont(2) || !cont(3)) return 0;
    if ((c == 0xF0 && b(1) < 0x90) || (c == 0xF4 && b(1) > 0x8F)) return 0;
    return 4;
  }
  return 0;
}

// Whether the valid sequence `seq` is a C1 control (U+0080..U+009F) or U+2028/U+2029.
bool BreaksLines(std::string_view seq) {
  const auto b = [&](size_t i) { return static_cast<unsigned char>(seq[i]); };
  if (seq.size() == 2) return b(0) == 0xC2 && b(1) <= 0x9F;
  return seq.size() == 3 && b(0) == 0xE2 && b(1) == 0x80 && (b(2) == 0xA8 || b(2) == 0xA9);
}

void AppendHex(std::string& out, unsigned char c) {
  static constexpr char kHex[] = "0123456789abcdef";
  out += "\\x";
  out += kHex[c >> 4];
  out += kHex[c & 0xF];
}

// The backstop (log.h): the message part of every record, escaped for control characters and
// invalid UTF-8. A record with none of those (nearly every one) is copied as it is.
class EscapedPayload final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm& /*tm*/,
              spdlog::memory_buf_t& dest) override {
    const std::string_view text(msg.payload.data(), msg.payload.size());
    bool plain = true;
    for (char ch : text) {
      const auto c = static_cast<unsigned char>(ch);
      if (c < 0x20 || c >= 0x7F) {
        plain = false;
        break;
      }
    }
    if (plain) {
      dest.append(text.data(), text.data() + text.size());
      return;
    }
    const std::string escaped = LogEscape(text, LogEscapeMode::kControlOnly);
    dest.append(escaped.data(), escaped.data() + escaped.size());
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<EscapedPayload>();
  }
};

// `pattern` with %* for the escaped message (instead of spdlog's %v).
std::unique_ptr<spdlog::formatter> Formatter(const std::string& pattern) {
  auto f = std::make_unique<spdlog::pattern_formatter>();
  f->add_flag<EscapedPayload>('*').set_pattern(pattern);
  return f;
}

std::shared_ptr<spdlog::logger> MakeDefault() {
  auto logger = spdlog::stderr_color_mt("dnvme");
  logger->set_formatter(Formatter("[%Y-%m-%d %H:%M:%S.%e] [%n] [%^%l%$] %*"));
  logger->set_level(spdlog::level::info);
  return logger;
}

}  // namespace

std::string LogEscape(std::string_view text, LogEscapeMode mode) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c >= 0x80) {
      const size_t n = Utf8Length(text.substr(i));
      if (n == 0) {
        AppendHex(out, c);  // not UTF-8: the byte itself
        ++i;
        continue;
      }
      const std::string_view seq = text.substr(i, n);
      if (BreaksLines(seq)) {
        for (char b : seq) AppendHex(out, static_cast<unsigned char>(b));
      } else {
        out += seq;
      }
      i += n;
      continue;
    }
    switch (c) {
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\\':
        out += mode == LogEscapeMode::kAll ? "\\\\" : "\\";
        break;
      default:
        if (c < 0x20 || c == 0x7F) {
          AppendHex(out, c);
        } else {
          out += static_cast<char>(c);
        }
    }
    ++i;
  }
  return out;
}

spdlog::logger& Logger() {
  std::lock_guard lock(g_mu);
  if (!g_logger) {
    g_logger = spdlog::get("dnvme");
    if (!g_logger) g_logger = MakeDefault();
  }
  return *g_logger;
}

Status SetLogLevel(const std::string& level) {
  auto lvl = spdlog::level::from_str(level);
  // from_str maps unknown names to "off"; only accept "off" when it was asked for.
  if (lvl == spdlog::level::off && level != "off") {
    return Status::InvalidArgument("unknown log level '" + level +
                                   "' (trace, debug, info, warn, error, critical, off)");
  }
  Logger().set_level(lvl);
  return Status::Ok();
}

namespace {

// A sink that appends every record to a descriptor of its own, opened by SetLogFile (spdlog's
// file sink opens by name itself, following a symlink a user may have planted in its directory).
// Thread safety: base_sink serializes sink_it_ and flush_ with its mutex.
class FdSink final : public spdlog::sinks::base_sink<std::mutex> {
 public:
  explicit FdSink(UniqueFd fd) : fd_(std::move(fd)) {}

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    spdlog::memory_buf_t line;
    formatter_->format(msg, line);
    const char* p = line.data();
    size_t left = line.size();
    while (left > 0) {
      ssize_t n = write(fd_.get(), p, left);
      if (n < 0 && errno == EINTR) continue;
      // A full disk or a log file that fails loses log lines, never the daemon: nothing to tell.
      if (n <= 0) return;
      p += n;
      left -= static_cast<size_t>(n);
    }
  }
  void flush_() override {}  // write(2) leaves nothing buffered here

 private:
  UniqueFd fd_;
};

// The log file, opened without following a symlink in its last component, refused unless it is
// a regular file with one link, and (for a daemon running as root) owned by the daemon: a root
// daemon told `log_file=/tmp/x.log` must not append to a file another user placed or linked there.
Result<UniqueFd> OpenLogFile(const std::string& path) {
  // O_NONBLOCK: a FIFO planted at the name must not hang the daemon's start (ENXIO instead); it
  // means nothing to a regular file.
  UniqueFd fd(open(path.c_str(),
                   O_WRONLY | O_APPEND | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_NOCTTY,
                   0640));
  if (!fd.valid()) {
    return Status::FromErrno(errno, errno == ELOOP ? "log file '" + path + "' is a symlink"
                                                   : "cannot open log file '" + path + "'");
  }
  struct stat st {};
  if (fstat(fd.get(), &st) != 0)
    return Status::FromErrno(errno, "fstat of log file '" + path + "'");
  if (!S_ISREG(st.st_mode) || st.st_nlink != 1) {
    return Status::InvalidArgument("log file '" + path +
                                   "' is not a regular file with one link: refused");
  }
  if (st.st_uid != geteuid()) {
    return Status::InvalidArgument("log file '" + path + "' belongs to uid " +
                                   std::to_string(st.st_uid) + ", not to this process (uid " +
                                   std::to_string(geteuid()) + "): refused");
  }
  return fd;
}

}  // namespace

Status SetLogFile(const std::string& path) {
  DNVME_ASSIGN_OR_RETURN(UniqueFd fd, OpenLogFile(path));
  try {
    auto sink = std::make_shared<FdSink>(std::move(fd));
    auto level = Logger().level();
    std::lock_guard lock(g_mu);
    spdlog::drop("dnvme");
    g_logger = std::make_shared<spdlog::logger>("dnvme", sink);
    g_logger->set_formatter(Formatter("[%Y-%m-%d %H:%M:%S.%e] [%n] [%l] [%t] %*"));
    g_logger->set_level(level);
    // A daemon's log file must be readable while it runs, not only at exit.
    g_logger->flush_on(spdlog::level::info);
    spdlog::register_logger(g_logger);
  } catch (const spdlog::spdlog_ex& e) {
    return Status::IoError(EIO, "cannot use log file '" + path + "': " + e.what());
  }
  return Status::Ok();
}

bool LogThrottle::Allow(uint64_t* skipped) {
  const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now().time_since_epoch())
                          .count();
  int64_t last = last_ns_.load(std::memory_order_relaxed);
  if ((last != std::numeric_limits<int64_t>::min() && now - last < 1'000'000'000) ||
      !last_ns_.compare_exchange_strong(last, now, std::memory_order_relaxed)) {
    skipped_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  *skipped = skipped_.exchange(0, std::memory_order_relaxed);
  return true;
}

}  // namespace dnvme
