// `dnvme ctl MOUNTPOINT ...`: drives a dnvmefs mount through its control file.
//   config get                 the live engine configuration (JSON)
//   config set FILE|JSON       apply a JSON object of settings (the tuner's output, say)
//   stats                      the mount's counters (JSON)
//   call JSON                  one raw request; prints the answer
//   bench --size S --file F    1 shared-memory buffer -> F (pwrite) and back (pread) through the
//                              daemon's engine, --loops times; prints GiB/s per direction
#include <spdlog/fmt/fmt.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "dnvme/client.h"
#include "dnvme/config.h"
#include "tools/dnvme/cli_util.h"
#include "tools/dnvme/commands.h"

namespace dnvme::cli {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// The machine's busy CPU time so far in seconds (user, nice, system, irq, softirq of /proc/stat's
// cpu line: every process and kernel thread), as bench/mount_vs_fio.sh counts it; -1 when it
// cannot be read.
double MachineCpuSeconds() {
  std::ifstream f("/proc/stat");
  std::string label;
  uint64_t user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0;
  if (!(f >> label >> user >> nice >> system >> idle >> iowait >> irq >> softirq) ||
      label != "cpu") {
    return -1;
  }
  const long tick = sysconf(_SC_CLK_TCK);
  return tick > 0 ? static_cast<double>(user + nice + system + irq + softirq) / tick : -1;
}

struct CtlOptions {
  std::string mountpoint;
  std::string config_value;
  std::string raw;
  std::string size = "1G";
  std::string file = "dnvme_ctl_bench.dat";
  std::string block_size;
  int queue_depth = 0;
  int intra_op_parallelism = 0;
  int loops = 3;
  bool no_read = false, no_write = false, json = false, keep = false;
};

int Fail(const Status& st) {
  std::cerr << "dnvme ctl: error: " << st.message() << "\n";
  return kExitFailure;
}

int RunBench(CtlClient& client, const CtlOptions& o) {
  auto size = ParseSize(o.size);
  if (!size.ok() || *size <= 0) throw UsageError("--size: '" + o.size + "' is not a size above 0");
  if (o.loops < 1) throw UsageError("--loops must be at least 1");
  if (o.no_read && o.no_write) throw UsageError("--no-read and --no-write leave nothing to do");
  auto live = client.ConfigGet();
  if (!live.ok()) return Fail(live.status());
  HandleConfig cfg = live.value();
  if (!o.block_size.empty()) {
    auto bs = ParseSize(o.block_size);
    if (!bs.ok()) throw UsageError("--block-size: " + bs.status().message());
    cfg.block_size = *bs;
  }
  if (o.queue_depth > 0) cfg.queue_depth = o.queue_depth;
  if (o.intra_op_parallelism > 0) cfg.intra_op_parallelism = o.intra_op_parallelism;
  if (Status v = cfg.Validate(); !v.ok()) throw UsageError(v.message());

  auto buf = SharedBuffer::Create(static_cast<size_t>(*size), "dnvme-ctl-bench");
  if (!buf.ok()) return Fail(buf.status());
  // Random bytes so the read-back check means something.
  std::mt19937_64 rng(0x5eed);
  for (size_t i = 0; i + 8 <= buf->size(); i += 8) {
    const uint64_t x = rng();
    std::memcpy(buf->data() + i, &x, 8);
  }
  auto handle = client.OpenHandle(cfg);
  if (!handle.ok()) return Fail(handle.status());
  auto id = client.Register(buf.value());
  if (!id.ok()) return Fail(id.status());

  std::vector<double> wr, rd, wr_cpu, rd_cpu;  // GiB/s; machine CPU seconds per transfer
  std::vector<char> check;
  for (int loop = 0; loop < o.loops; ++loop) {
    // --no-write still needs the file: written once, untimed, unless it is already big enough
    // (a previous --keep run), so a read can be timed after the caller dropped the caches.
    bool need_file = loop == 0 && o.no_write;
    if (need_file) {
      struct stat st {};
      const std::string path = o.mountpoint + "/" + o.file;
      need_file = stat(path.c_str(), &st) != 0 || st.st_size < *size;
    }
    if (!o.no_write || need_file) {
      const double cpu0 = MachineCpuSeconds();
      auto t0 = std::chrono::steady_clock::now();
      auto n = client.Pwrite(*handle, *id, 0, *size, o.file, 0);
      if (!n.ok()) return Fail(n.status());
      if (Status s = client.Fsync(o.file); !s.ok()) return Fail(s);
      const double secs =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (!o.no_write) {
        wr.push_back(static_cast<double>(*size) / kGiB / secs);
        wr_cpu.push_back(MachineCpuSeconds() - cpu0);
      }
    }
    if (!o.no_read) {
      if (loop == 0) check.assign(buf->data(), buf->data() + std::min<int64_t>(*size, 1 << 20));
      std::memset(buf->data(), 0, static_cast<size_t>(std::min<int64_t>(*size, 1 << 20)));
      const double cpu0 = MachineCpuSeconds();
      auto t0 = std::chrono::steady_clock::now();
      auto n = client.Pread(*handle, *id, 0, *size, o.file, 0);
      if (!n.ok()) return Fail(n.status());
      const double secs =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      rd.push_back(static_cast<double>(*size) / kGiB / secs);
      rd_cpu.push_back(MachineCpuSeconds() - cpu0);
      if (std::memcmp(check.data(), buf->data(), check.size()) != 0) {
        return Fail(Status::DataMismatch("the bytes read back differ from those written"));
      }
    }
  }
  (void)client.Unregister(*id);
  (void)client.CloseHandle(*handle);
  if (!o.keep) {
    const std::string path = o.mountpoint + "/" + o.file;
    if (unlink(path.c_str()) != 0) std::cerr << "dnvme ctl: could not remove " << path << "\n";
  }
  if (o.json) {
    nlohmann::json j = {
        {"size", *size}, {"loops", o.loops}, {"config", nlohmann::json::parse(cfg.ToJson())}};
    if (!wr.empty()) j["write_gibps"] = Median(wr);
    if (!rd.empty()) j["read_gibps"] = Median(rd);
    // The whole machine's CPU (every process and kernel thread: the daemon, the engine, the
    // page cache) during the timed transfers only, not the buffer's set-up; -1 when /proc/stat
    // cannot be read.
    if (!wr_cpu.empty()) j["write_machine_cpu_s"] = Median(wr_cpu);
    if (!rd_cpu.empty()) j["read_machine_cpu_s"] = Median(rd_cpu);
    std::cout << j.dump() << "\n";
  } else {
    if (!wr.empty())
      std::cout << fmt::format("ctl write {:.3f} GiB/s (median of {}, incl. fsync)\n", Median(wr),
                               wr.size());
    if (!rd.empty())
      std::cout << fmt::format("ctl read  {:.3f} GiB/s (median of {})\n", Median(rd), rd.size());
  }
  return kExitOk;
}

}  // namespace

Command AddCtlCommand(CLI::App& parent) {
  auto o = std::make_shared<CtlOptions>();
  CLI::App* app = parent.add_subcommand("ctl", "Drive a dnvmefs mount through MOUNT/.dnvme/ctl");
  app->add_option("mountpoint", o->mountpoint, "The dnvmefs mount")->required();
  app->require_subcommand(1);
  CLI::App* config = app->add_subcommand("config", "The live engine configuration");
  config->require_subcommand(1);
  CLI::App* get = config->add_subcommand("get", "Print it (JSON)");
  CLI::App* set = config->add_subcommand("set", "Apply a JSON object (a file or inline)");
  set->add_option("config", o->config_value, "FILE.json or '{\"queue_depth\": 64}'")->required();
  CLI::App* stats = app->add_subcommand("stats", "Print the mount's counters (JSON)");
  CLI::App* call = app->add_subcommand("call", "Send one raw request; print the answer");
  call->add_option("request", o->raw, "One JSON object")->required();
  CLI::App* bench = app->add_subcommand("bench", "Shared memory <-> file through the daemon");
  bench->add_option("--size", o->size, "Bytes per transfer (K/M/G)")->capture_default_str();
  bench->add_option("--file", o->file, "File inside the mount")->capture_default_str();
  bench->add_option("--block-size", o->block_size, "Handle block size (default: the live one)");
  bench->add_option("--queue-depth", o->queue_depth, "Handle queue depth");
  bench->add_option("--intra-op-parallelism", o->intra_op_parallelism, "Handle workers");
  bench->add_option("--loops", o->loops, "Timed loops (median printed)")->capture_default_str();
  bench->add_flag("--no-read", o->no_read, "Write only");
  bench->add_flag("--no-write", o->no_write,
                  "Read only (an untimed write creates the file unless it exists)");
  bench->add_flag("--keep", o->keep, "Keep the file");
  bench->add_flag("--json", o->json, "One JSON line");

  Command cmd;
  cmd.app = app;
  cmd.run = [o, get, set, stats, call, bench]() -> int {
    auto client = CtlClient::Open(o->mountpoint);
    if (!client.ok()) return Fail(client.status());
    if (get->parsed()) {
      auto c = client->ConfigGet();
      if (!c.ok()) return Fail(c.status());
      std::cout << nlohmann::json::parse(c->ToJson()).dump(2) << "\n";
      return kExitOk;
    }
    if (set->parsed()) {
      std::string text = o->config_value;
      if (!text.empty() && text.front() != '{') {
        std::ifstream in(text);
        if (!in) throw UsageError("cannot read config file '" + text + "'");
        std::stringstream ss;
        ss << in.rdbuf();
        text = ss.str();
      }
      auto c = client->ConfigSet(text);
      if (!c.ok()) {
        if (c.status().error_number() == EINVAL) throw UsageError(c.status().message());
        return Fail(c.status());
      }
      std::cout << nlohmann::json::parse(c->ToJson()).dump(2) << "\n";
      return kExitOk;
    }
    if (stats->parsed()) {
      auto s = client->Stats();
      if (!s.ok()) return Fail(s.status());
      std::cout << nlohmann::json::parse(s.value()).dump(2) << "\n";
      return kExitOk;
    }
    if (call->parsed()) {
      auto a = client->Call(o->raw);
      if (!a.ok()) return Fail(a.status());
      std::cout << a.value();
      return kExitOk;
    }
    if (bench->parsed()) return RunBench(client.value(), *o);
    throw UsageError("no ctl subcommand given");
  };
  return cmd;
}

}  // namespace dnvme::cli
