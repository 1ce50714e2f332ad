// The dnvme CLI's subcommands and their shared conventions.
//
// Each subcommand registers itself on the top-level CLI11 app and returns a Command whose run()
// is called by main() once parsing succeeded and that subcommand was chosen. Exit codes are the
// same for every subcommand: 0 success, 1 runtime failure (an I/O error, pinning refused), 2 usage
// error (a bad flag or value; CLI11's own parse errors included). Results go to stdout; logs
// (spdlog) go to stderr.
//
// Thread safety: used from main()'s thread only.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <stdexcept>
#include <string>

namespace dnvme::cli {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;

// Thrown by a subcommand's run() for a bad flag value found after parsing; main() prints the
// message on one line and exits with kExitUsage.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct Command {
  CLI::App* app = nullptr;   // the subcommand, owned by the top-level app
  std::function<int()> run;  // returns the exit code; may throw UsageError
};

// `dnvme io`: the DeepSpeed ds_io equivalent (tools/dnvme/io_cmd.cc).
Command AddIoCommand(CLI::App& parent);
// `dnvme ctl`: config get/set, stats, raw requests and a transfer benchmark through a mount's
// control file (tools/dnvme/ctl_cmd.cc).
Command AddCtlCommand(CLI::App& parent);
// `dnvme tune`: the handle-parameter search (DeepSpeed ds_nvme_tune) (tools/dnvme/tune_cmd.cc).
Command AddTuneCommand(CLI::App& parent);
// `dnvme report`: what this machine can do, one line per capability (DeepSpeed ds_report)
// (tools/dnvme/report_cmd.cc).
Command AddReportCommand(CLI::App& parent);
// `dnvme run -- CMD`: CMD with libdnvme_preload.so preloaded (tools/dnvme/run_cmd.cc,
// docs/preload.md).
Command AddRunCommand(CLI::App& parent);

}  // namespace dnvme::cli
