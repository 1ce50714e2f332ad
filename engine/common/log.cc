#include "engine/common/log.h"

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>

#include <mutex>

namespace dnvme {
namespace {

std::mutex g_mu;
std::shared_ptr<spdlog::logger> g_logger;  // guarded by g_mu for replacement

std::shared_ptr<spdlog::logger> MakeDefault() {
  auto logger = spdlog::stderr_color_mt("dnvme");
  logger->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%n] [%^%l%$] %v");
  logger->set_level(spdlog::level::info);
  return logger;
}

}  // namespace

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

Status SetLogFile(const std::string& path) {
  std::shared_ptr<spdlog::logger> logger;
  try {
    auto sink = std::make_shared<spdlog::sinks::basic_file_sink_mt>(path, /*truncate=*/false);
    auto level = Logger().level();
    std::lock_guard lock(g_mu);
    spdlog::drop("dnvme");
    g_logger = std::make_shared<spdlog::logger>("dnvme", sink);
    g_logger->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%n] [%l] [%t] %v");
    g_logger->set_level(level);
    // A daemon's log file must be readable while it runs, not only at exit.
    g_logger->flush_on(spdlog::level::info);
    spdlog::register_logger(g_logger);
  } catch (const spdlog::spdlog_ex& e) {
    return Status::IoError(EIO, "cannot open log file '" + path + "': " + e.what());
  }
  return Status::Ok();
}

}  // namespace dnvme
