// dnvme: the dnvmefs command-line tool. Subcommands: io, ctl, tune, report, run.
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <exception>
#include <iostream>
#include <string>
#include <vector>

#include "dnvme/log.h"
#include "tools/dnvme/commands.h"

#ifndef DNVME_VERSION
#define DNVME_VERSION "unknown"
#endif

int main(int argc, char** argv) {
  using dnvme::cli::kExitFailure;
  using dnvme::cli::kExitUsage;

  // Logs go to stderr so stdout carries only results (text or JSON lines).
  spdlog::set_default_logger(spdlog::stderr_color_st("dnvme-cli"));
  spdlog::set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%n] [%^%l%$] %v");

  CLI::App app{"dnvme: DeepNVMe-style NVMe I/O tool (dnvmefs " DNVME_VERSION ")", "dnvme"};
  app.set_version_flag("--version", std::string("dnvme ") + DNVME_VERSION);
  app.require_subcommand(1);
  std::string log_level = "info";
  app.add_option("-v,--log-level", log_level, "Log level (stderr)")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "critical", "off"}))
      ->capture_default_str();

  std::vector<dnvme::cli::Command> commands;
  commands.push_back(dnvme::cli::AddIoCommand(app));
  commands.push_back(dnvme::cli::AddCtlCommand(app));
  commands.push_back(dnvme::cli::AddTuneCommand(app));
  commands.push_back(dnvme::cli::AddReportCommand(app));
  commands.push_back(dnvme::cli::AddRunCommand(app));

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version are "errors" with exit code 0; print them the CLI11 way.
    if (e.get_exit_code() == 0) return app.exit(e);
    // Every real parse error is a usage error: one line, exit 2 (not CLI11's 105, 106, ...).
    std::cerr << "dnvme: error: " << e.what() << " (run with --help for usage)\n";
    return kExitUsage;
  }

  // The CLI's own logger and the engine's "dnvme" logger both follow -v.
  spdlog::set_level(spdlog::level::from_str(log_level));
  if (dnvme::Status st = dnvme::SetLogLevel(log_level); !st.ok()) {
    std::cerr << "dnvme: error: " << st.message() << "\n";
    return kExitUsage;
  }

  for (const auto& command : commands) {
    if (!command.app->parsed()) continue;
    try {
      return command.run();
    } catch (const dnvme::cli::UsageError& e) {
      std::cerr << "dnvme " << command.app->get_name() << ": error: " << e.what() << "\n";
      return kExitUsage;
    } catch (const std::exception& e) {
      std::cerr << "dnvme " << command.app->get_name() << ": error: " << e.what() << "\n";
      return kExitFailure;
    }
  }
  std::cerr << "dnvme: error: no subcommand given (run with --help for usage)\n";
  return kExitUsage;
}
