// `dnvme io`: DeepSpeed's ds_io for one file. Writes and/or reads --size bytes between one buffer
// (pinned unless --no-pin) and DIR/FILE through an AioHandle, --warmup untimed loops then --loops
// timed ones, and reports the median per operation.
#include <fcntl.h>
#include <spdlog/fmt/fmt.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dnvme/config.h"
#include "dnvme/handle.h"
#include "dnvme/pinned.h"
#include "dnvme/status.h"
#include "tools/dnvme/cli_util.h"
#include "tools/dnvme/commands.h"

namespace dnvme::cli {
namespace {

constexpr size_t kHeapAlignment = 4096;

struct IoOptions {
  std::string dir;
  std::string size;
  std::string file = "dnvme_io.dat";
  bool write = false;
  bool read = false;
  std::string block_size;
  int queue_depth = 0;
  int intra_op_parallelism = 0;
  bool single_submit = false;
  bool overlap_events = false;
  std::string direct;
  bool fdatasync = false;
  std::string config_file;
  int loops = 3;
  int warmup = 1;
  bool validate = false;
  bool json = false;
  bool no_pin = false;

  // Set by CLI11 when the flag was given, so only explicit flags override --config.
  CLI::Option* queue_depth_opt = nullptr;
  CLI::Option* intra_op_opt = nullptr;
};

// The caller's memory for every loop: pinned (the DeepNVMe way) or a plain aligned heap block.
class IoBuffer {
 public:
  static Result<IoBuffer> Allocate(size_t size, bool pinned) {
    IoBuffer buf;
    buf.size_ = size;
    if (pinned) {
      DNVME_ASSIGN_OR_RETURN(buf.pinned_, AioHandle::new_cpu_locked_buffer(size));
      buf.data_ = buf.pinned_.bytes();
      return buf;
    }
    const size_t rounded = (size + kHeapAlignment - 1) / kHeapAlignment * kHeapAlignment;
    void* p = std::aligned_alloc(kHeapAlignment, rounded);
    if (p == nullptr) {
      return Status::ResourceExhausted(ENOMEM, fmt::format("cannot allocate {} bytes", size));
    }
    buf.heap_.reset(static_cast<char*>(p));
    buf.data_ = buf.heap_.get();
    return buf;
  }

  char* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  struct FreeDeleter {
    void operator()(char* p) const { std::free(p); }
  };
  PinnedBuffer pinned_;
  std::unique_ptr<char, FreeDeleter> heap_;
  char* data_ = nullptr;
  size_t size_ = 0;
};

// A JSON text from the engine, embedded as an object (or as a string if it is not valid JSON).
nlohmann::ordered_json EmbedJson(const std::string& text) {
  auto parsed = nlohmann::ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) return text;
  return parsed;
}

struct OpOutcome {
  OpType op = OpType::kWrite;
  std::vector<double> seconds;  // timed loops only
  HandleStats stats;
};

void PrintOutcome(const OpOutcome& out, const IoOptions& opts, int64_t bytes,
                  const HandleConfig& config, const std::string& path) {
  const double median_s = Median(out.seconds);
  const double gib = static_cast<double>(bytes) / kGiB;
  std::vector<double> rates;
  for (double s : out.seconds) rates.push_back(gib / s);
  // The median rate is the rate of the median time (the same thing for an odd number of loops).
  const double median_rate = gib / median_s;
  const double min_rate = *std::min_element(rates.begin(), rates.end());
  const double max_rate = *std::max_element(rates.begin(), rates.end());
  const char* op_name = OpTypeName(out.op);

  if (opts.json) {
    nlohmann::ordered_json j;
    j["op"] = op_name;
    j["bytes"] = bytes;
    j["seconds"] = median_s;
    j["gib_per_s"] = median_rate;
    j["min_gib_per_s"] = min_rate;
    j["max_gib_per_s"] = max_rate;
    j["loops"] = out.seconds.size();
    j["warmup"] = opts.warmup;
    j["all_seconds"] = out.seconds;
    j["all_gib_per_s"] = rates;
    j["path"] = path;
    j["pinned"] = !opts.no_pin;
    j["validate"] = opts.validate;
    j["config"] = EmbedJson(config.ToJson());
    j["stats"] = EmbedJson(out.stats.ToJson());
    std::cout << j.dump() << std::endl;
    return;
  }
  std::cout << fmt::format(
                   "{:<5}  {}  median {:.3f} s  {:.2f} GiB/s  (min {:.2f}, max {:.2f}, {} loops)  "
                   "block_size={} qd={} intra_op_parallelism={} single_submit={} "
                   "overlap_events={} direct={} fdatasync={} pinned={} validate={}",
                   op_name, FormatBytes(bytes), median_s, median_rate, min_rate, max_rate,
                   out.seconds.size(), FormatSizeSuffix(config.block_size), config.queue_depth,
                   config.intra_op_parallelism, config.single_submit ? 1 : 0,
                   config.overlap_events ? 1 : 0, DirectPolicyName(config.direct),
                   config.fdatasync_on_write ? 1 : 0, opts.no_pin ? "no" : "yes",
                   opts.validate ? "yes" : "no")
            << std::endl;
}

// Runs warmup + loops operations of one kind on a fresh handle (so its stats are this op's).
Result<OpOutcome> RunOp(OpType op, const HandleConfig& config, const IoOptions& opts, IoBuffer& buf,
                        const std::string& path) {
  DNVME_ASSIGN_OR_RETURN(std::unique_ptr<AioHandle> handle, AioHandle::Create(config));
  OpOutcome out;
  out.op = op;
  const auto bytes = static_cast<int64_t>(buf.size());
  for (int i = 0; i < opts.warmup + opts.loops; ++i) {
    const bool timed = i >= opts.warmup;
    const std::string what = fmt::format("{} {} loop {}", timed ? "timed" : "warmup",
                                         OpTypeName(op), timed ? i - opts.warmup + 1 : i + 1);
    if (op == OpType::kRead) {
      // Clear the buffer so a read that moved nothing cannot pass the pattern check.
      if (opts.validate) std::memset(buf.data(), 0, buf.size());
      if (timed) DropPageCache();
    }
    const auto start = std::chrono::steady_clock::now();
    Status st;
    if (op == OpType::kWrite) {
      st = opts.validate ? handle->pwrite(buf.data(), bytes, path, /*validate=*/true, false)
                         : handle->sync_pwrite(buf.data(), bytes, path);
    } else {
      st = opts.validate ? handle->pread(buf.data(), bytes, path, /*validate=*/true, false)
                         : handle->sync_pread(buf.data(), bytes, path);
    }
    const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
    if (!st.ok()) return st.WithContext(what);
    if (op == OpType::kRead && opts.validate) {
      const size_t bad = FirstPatternMismatch(buf.data(), buf.size());
      if (bad != buf.size()) {
        return Status::DataMismatch(
            fmt::format("{}: {} differs from the dnvme io pattern at offset {}", what, path, bad));
      }
    }
    spdlog::debug("{}: {:.3f} s", what, elapsed.count());
    if (timed) out.seconds.push_back(elapsed.count());
  }
  out.stats = handle->stats();
  return out;
}

// The handle configuration: defaults, then --config, then explicit flags.
HandleConfig BuildConfig(const IoOptions& opts) {
  HandleConfig config;
  if (!opts.config_file.empty()) {
    Result<HandleConfig> loaded = HandleConfig::FromJsonFile(opts.config_file);
    if (!loaded.ok()) {
      throw UsageError(
          fmt::format("--config {}: {}", opts.config_file, loaded.status().ToString()));
    }
    config = *loaded;
  }
  if (!opts.block_size.empty()) config.block_size = ParseSizeFlag("--block-size", opts.block_size);
  if (opts.queue_depth_opt->count() > 0) config.queue_depth = opts.queue_depth;
  if (opts.intra_op_opt->count() > 0) config.intra_op_parallelism = opts.intra_op_parallelism;
  if (opts.single_submit) config.single_submit = true;
  if (opts.overlap_events) config.overlap_events = true;
  if (opts.fdatasync) config.fdatasync_on_write = true;
  if (!opts.direct.empty()) {
    Result<DirectPolicy> policy = ParseDirectPolicy(opts.direct);
    if (!policy.ok()) {
      throw UsageError(fmt::format("--direct '{}': {}", opts.direct, policy.status().message()));
    }
    config.direct = *policy;
  }
  if (Status st = config.Validate(); !st.ok()) throw UsageError(st.message());
  return config;
}

int Fail(const Status& st, std::string_view hint = {}) {
  std::cerr << "dnvme io: error: " << st.ToString() << hint << "\n";
  return kExitFailure;
}

int RunIo(const IoOptions& opts) {
  if (!opts.write && !opts.read) throw UsageError("give --write and/or --read");
  const int64_t size = ParseSizeFlag("--size", opts.size);
  if (opts.loops < 1) throw UsageError("--loops must be at least 1");
  if (opts.warmup < 0) throw UsageError("--warmup must not be negative");
  if (opts.file.empty() || opts.file.find('/') != std::string::npos) {
    throw UsageError(fmt::format("--file '{}': give a file name inside --dir", opts.file));
  }
  CheckDirFlag("--dir", opts.dir, opts.write ? DirAccess::kWrite : DirAccess::kRead);
  const HandleConfig config = BuildConfig(opts);
  const std::string path = opts.dir + "/" + opts.file;

  if (!opts.write) {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) {
      return Fail(Status::FromErrno(errno, path),
                  "; run `dnvme io --write` with the same --dir, --file and --size first");
    }
    if (st.st_size < size) {
      return Fail(Status::EndOfFile(
                      fmt::format("{} holds {} bytes, --size asks for {}", path, st.st_size, size)),
                  "; run `dnvme io --write` with the same --dir, --file and --size first");
    }
  }

  spdlog::debug("{} {} at {} ({}), warmup {}, loops {}, config {}",
                opts.write && opts.read ? "write+read" : (opts.write ? "write" : "read"),
                FormatBytes(size), path, opts.no_pin ? "unpinned" : "pinned", opts.warmup,
                opts.loops, config.ToJson());
  Result<IoBuffer> buf = IoBuffer::Allocate(static_cast<size_t>(size), !opts.no_pin);
  if (!buf.ok()) {
    return Fail(buf.status(), opts.no_pin ? "" : "; or pass --no-pin to use unpinned memory");
  }
  FillPattern(buf->data(), buf->size());

  std::vector<OpType> ops;
  if (opts.write) ops.push_back(OpType::kWrite);
  if (opts.read) ops.push_back(OpType::kRead);
  for (OpType op : ops) {
    Result<OpOutcome> out = RunOp(op, config, opts, *buf, path);
    if (!out.ok()) return Fail(out.status());
    PrintOutcome(*out, opts, size, config, path);
  }
  return kExitOk;
}

}  // namespace

Command AddIoCommand(CLI::App& parent) {
  auto opts = std::make_shared<IoOptions>();
  CLI::App* io = parent.add_subcommand(
      "io", "Time writes and/or reads of one file through an AioHandle (DeepSpeed ds_io)");
  io->add_option("--dir", opts->dir, "Directory to put the file in")->required();
  io->add_option("--size", opts->size, "Bytes per operation (K/M/G suffixes)")->required();
  io->add_flag("--write", opts->write, "Time writes");
  io->add_flag("--read", opts->read, "Time reads (of a file written before, or by --write)");
  io->add_option("--file", opts->file, "File name inside --dir")->capture_default_str();
  io->add_option("--block-size", opts->block_size, "Bytes per libaio request (default 1M)");
  opts->queue_depth_opt =
      io->add_option("--queue-depth", opts->queue_depth, "Requests in flight per worker (128)");
  opts->intra_op_opt = io->add_option("--intra-op-parallelism", opts->intra_op_parallelism,
                                      "Worker threads per operation (1)");
  io->add_flag("--single-submit", opts->single_submit, "One io_submit per request");
  io->add_flag("--overlap-events", opts->overlap_events, "Sliding window instead of batches");
  io->add_option("--direct", opts->direct, "O_DIRECT policy: auto|required|never (auto)");
  io->add_flag("--fdatasync", opts->fdatasync, "fdatasync at the end of every write");
  io->add_option("--config", opts->config_file,
                 "HandleConfig JSON file; explicit flags override it");
  io->add_option("--loops", opts->loops, "Timed loops per operation")->capture_default_str();
  io->add_option("--warmup", opts->warmup, "Untimed loops before them")->capture_default_str();
  io->add_flag("--validate", opts->validate, "Check the data (timings include the check)");
  io->add_flag("--json", opts->json, "One JSON object per line per operation");
  io->add_flag("--no-pin", opts->no_pin, "Use a 4096-aligned heap buffer instead of pinned memory");
  return Command{io, [opts] { return RunIo(*opts); }};
}

}  // namespace dnvme::cli
