// `dnvme io`: DeepSpeed's ds_io for one file. Writes and/or reads --size bytes between one buffer
// (pinned unless --no-pin) and DIR/FILE through an AioHandle, --warmup untimed loops then --loops
// timed ones, and reports the median per operation.
//
// With --gpu the buffer is device memory and a GdsHandle moves it (the bounce path, or cuFile with
// --gds); the report adds the device, the handle's mode and why, and the raw pinned host<->device
// copy rate for --size, the ceiling the bounce path cannot beat (with --disk-gibps, the measured
// rate as a fraction of min(copy rate, disk rate)).
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
#include "dnvme/gds_handle.h"
#include "dnvme/gpu.h"
#include "dnvme/handle.h"
#include "dnvme/pinned.h"
#include "dnvme/status.h"
#include "tools/dnvme/cli_util.h"
#include "tools/dnvme/commands.h"
#include "tools/dnvme/gpu_cli.h"

namespace dnvme::cli {
namespace {

constexpr size_t kHeapAlignment = 4096;

struct IoOptions {
  std::string dir;
  // ds_io's spelling of --dir; it also selects ds_io's defaults (see AddIoCommand).
  std::string folder;
  bool sequential_requests = false;  // ds_io: lock-step batches (its default is overlap_events)
  std::string engine;                // ds_io: only aio_handle is timed here
  int multi_process = 1;             // ds_io: processes; dnvme io is one
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
  GpuFlags gpu;
  double disk_gibps = 0;  // --disk-gibps: the disk's own rate, for ratio_vs_limit (0: unknown)

  // Set by CLI11 when the flag was given, so only explicit flags override --config.
  CLI::Option* queue_depth_opt = nullptr;
  bool queue_depth_given = false;  // set by a ds_io default, not a flag
  CLI::Option* intra_op_opt = nullptr;
  CLI::Option* disk_gibps_opt = nullptr;
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

// What the loops move. Host runs use `host` directly. With --gpu the handle moves `device`, and
// `host` only holds the pattern: it is copied to the device before writes and receives the device
// contents to check reads (both untimed, like the host path's pattern check).
struct IoMemory {
  IoBuffer host;
  gpu::DeviceBuffer device;

  bool on_gpu() const { return !device.empty(); }
  void* data() const { return on_gpu() ? device.data() : host.data(); }
  size_t size() const { return host.size(); }

  // Zeroes what the handle reads into, so a read that moved nothing cannot pass the check.
  Status Clear() {
    if (on_gpu()) return gpu::MemsetDevice(device.data(), 0, device.size());
    std::memset(host.data(), 0, host.size());
    return Status::Ok();
  }
  // The first offset that differs from the pattern, or size().
  Result<size_t> FirstMismatch() {
    if (on_gpu()) {
      DNVME_RETURN_IF_ERROR(gpu::CopyToHost(host.data(), device.data(), device.size())
                                .WithContext("copying the read data back to check it"));
    }
    return FirstPatternMismatch(host.data(), host.size());
  }
};

// The GPU facts every --gpu result line carries: measured once per run, before the timed loops.
struct GpuFacts {
  gpu::DeviceInfo device;
  GdsOptions options;
  std::string mode;          // GdsModeName of the handle's mode
  std::string mode_reason;   // GdsHandle::mode_reason
  double h2d_gib_per_s = 0;  // raw pinned host -> device copy of --size bytes
  double d2h_gib_per_s = 0;  // and back
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
  std::string stats_json;       // HandleStats, or GdsStats (with the engine's inside) for --gpu
};

// The pinned copy rate in the direction an operation moves GPU memory: a write takes it off the
// device (device -> host -> disk), a read puts it on (disk -> host -> device).
double CopyRateFor(OpType op, const GpuFacts& g) {
  return op == OpType::kWrite ? g.d2h_gib_per_s : g.h2d_gib_per_s;
}

void PrintOutcome(const OpOutcome& out, const IoOptions& opts, int64_t bytes,
                  const HandleConfig& config, const std::string& path, const GpuFacts* gpu) {
  const double median_s = Median(out.seconds);
  const double gib = static_cast<double>(bytes) / kGiB;
  std::vector<double> rates;
  for (double s : out.seconds) rates.push_back(gib / s);
  // The median rate is the rate of the median time (the same thing for an odd number of loops).
  const double median_rate = gib / median_s;
  const double min_rate = *std::min_element(rates.begin(), rates.end());
  const double max_rate = *std::max_element(rates.begin(), rates.end());
  const char* op_name = OpTypeName(out.op);
  // The bound on this rate with GPU memory: the slower of the copy and the disk. The disk's rate
  // is only known when the caller measured it (bench/gpu_io.sh runs fio for that).
  const double copy_rate = gpu != nullptr ? CopyRateFor(out.op, *gpu) : 0;
  const bool have_limit = gpu != nullptr && opts.disk_gibps > 0 && copy_rate > 0;
  const double limit = have_limit ? std::min(copy_rate, opts.disk_gibps) : 0;

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
    j["memory"] = gpu != nullptr ? "gpu" : (opts.no_pin ? "host" : "host_pinned");
    j["validate"] = opts.validate;
    j["config"] = EmbedJson(config.ToJson());
    j["stats"] = EmbedJson(out.stats_json);
    if (gpu != nullptr) {
      nlohmann::ordered_json g;
      g["device"] = gpu->device.index;
      g["name"] = gpu->device.name;
      g["pci_bus_id"] = gpu->device.pci_bus_id;
      g["cufile"] = CuFilePolicyName(gpu->options.cufile);
      g["cufile_compat"] = gpu->options.cufile_compat;
      g["mode"] = gpu->mode;
      g["mode_reason"] = gpu->mode_reason;
      g["h2d_gib_per_s"] = gpu->h2d_gib_per_s;
      g["d2h_gib_per_s"] = gpu->d2h_gib_per_s;
      g["copy_gib_per_s"] = copy_rate;
      if (opts.disk_gibps > 0) g["disk_gib_per_s"] = opts.disk_gibps;
      if (have_limit) {
        g["limit_gib_per_s"] = limit;
        g["ratio_vs_limit"] = median_rate / limit;
      }
      j["gpu"] = g;
    }
    std::cout << j.dump() << std::endl;
    return;
  }
  std::cout << fmt::format(
                   "{:<5}  {}  median {:.3f} s  {:.2f} GiB/s  (min {:.2f}, max {:.2f}, {} loops)  "
                   "block_size={} qd={} intra_op_parallelism={} single_submit={} "
                   "overlap_events={} direct={} fdatasync={} pinned={} validate={}{}",
                   op_name, FormatBytes(bytes), median_s, median_rate, min_rate, max_rate,
                   out.seconds.size(), FormatSizeSuffix(config.block_size), config.queue_depth,
                   config.intra_op_parallelism, config.single_submit ? 1 : 0,
                   config.overlap_events ? 1 : 0, DirectPolicyName(config.direct),
                   config.fdatasync_on_write ? 1 : 0, opts.no_pin ? "no" : "yes",
                   opts.validate ? "yes" : "no",
                   gpu != nullptr ? fmt::format(" gpu={} mode={}", gpu->device.index, gpu->mode)
                                  : "")
            << std::endl;
  if (gpu == nullptr) return;
  const char* direction = out.op == OpType::kWrite ? "device->host" : "host->device";
  std::cout << fmt::format(
                   "       gpu {}: mode {} ({}); pinned copy of {}: host->device {:.2f} GiB/s, "
                   "device->host {:.2f} GiB/s",
                   DeviceLabel(gpu->device), gpu->mode, gpu->mode_reason, FormatBytes(bytes),
                   gpu->h2d_gib_per_s, gpu->d2h_gib_per_s)
            << std::endl;
  if (have_limit) {
    std::cout << fmt::format(
                     "       limit min({} {:.2f}, disk {:.2f}) = {:.2f} GiB/s; ratio_vs_limit "
                     "{:.3f}",
                     direction, copy_rate, opts.disk_gibps, limit, median_rate / limit)
              << std::endl;
  }
}

// Runs warmup + loops operations of one kind on `handle` (an AioHandle, or a GdsHandle for
// --gpu: the same calls).
template <typename Handle>
Result<OpOutcome> RunLoops(OpType op, Handle& handle, const IoOptions& opts, IoMemory& mem,
                           const std::string& path) {
  OpOutcome out;
  out.op = op;
  const auto bytes = static_cast<int64_t>(mem.size());
  for (int i = 0; i < opts.warmup + opts.loops; ++i) {
    const bool timed = i >= opts.warmup;
    const std::string what = fmt::format("{} {} loop {}", timed ? "timed" : "warmup",
                                         OpTypeName(op), timed ? i - opts.warmup + 1 : i + 1);
    if (op == OpType::kRead) {
      if (opts.validate) DNVME_RETURN_IF_ERROR(mem.Clear().WithContext(what));
      if (timed) DropPageCache();
    }
    const auto start = std::chrono::steady_clock::now();
    Status st;
    if (op == OpType::kWrite) {
      st = opts.validate ? handle.pwrite(mem.data(), bytes, path, /*validate=*/true, false)
                         : handle.sync_pwrite(mem.data(), bytes, path);
    } else {
      st = opts.validate ? handle.pread(mem.data(), bytes, path, /*validate=*/true, false)
                         : handle.sync_pread(mem.data(), bytes, path);
    }
    const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
    if (!st.ok()) return st.WithContext(what);
    if (op == OpType::kRead && opts.validate) {
      Result<size_t> bad = mem.FirstMismatch();
      if (!bad.ok()) return bad.status().WithContext(what);
      if (*bad != mem.size()) {
        return Status::DataMismatch(
            fmt::format("{}: {} differs from the dnvme io pattern at offset {}", what, path, *bad));
      }
    }
    spdlog::debug("{}: {:.3f} s", what, elapsed.count());
    if (timed) out.seconds.push_back(elapsed.count());
  }
  out.stats_json = handle.stats().ToJson();
  return out;
}

// A fresh handle per operation kind, so its stats are this op's.
Result<OpOutcome> RunOp(OpType op, const HandleConfig& config, const IoOptions& opts, IoMemory& mem,
                        const std::string& path) {
  DNVME_ASSIGN_OR_RETURN(std::unique_ptr<AioHandle> handle, AioHandle::Create(config));
  return RunLoops(op, *handle, opts, mem, path);
}

Result<std::unique_ptr<GdsHandle>> CreateGdsHandle(const HandleConfig& config,
                                                   const IoOptions& opts) {
  Result<std::unique_ptr<GdsHandle>> handle = GdsHandle::Create(config, GdsOptionsFor(opts.gpu));
  if (!handle.ok()) {
    return handle.status().WithContext(opts.gpu.gds ? "--gds: gds_handle" : "gds_handle");
  }
  return handle;
}

Result<OpOutcome> RunGpuOp(OpType op, const HandleConfig& config, const IoOptions& opts,
                           IoMemory& mem, const std::string& path) {
  DNVME_ASSIGN_OR_RETURN(std::unique_ptr<GdsHandle> handle, CreateGdsHandle(config, opts));
  // Registered with cuFile like DeepSpeed's pinned device tensors (only recorded on the bounce
  // path); an unregistered buffer would make cuFile stage through its own buffers and time
  // something else. The handle deregisters it when it is destroyed.
  DNVME_RETURN_IF_ERROR(
      handle->pin_device_buffer(mem.device.data(), static_cast<int64_t>(mem.device.size()))
          .WithContext("pin_device_buffer"));
  return RunLoops(op, *handle, opts, mem, path);
}

// Everything --gpu reports besides the timings: the device, the mode a handle with these options
// gets (Create fails here, before any I/O, when --gds cannot be honoured), and the raw copy rates.
Result<GpuFacts> GatherGpuFacts(const HandleConfig& config, const IoOptions& opts, int64_t size) {
  GpuFacts g;
  DNVME_ASSIGN_OR_RETURN(g.device, OpenGpu(opts.gpu));
  g.options = GdsOptionsFor(opts.gpu);
  {
    DNVME_ASSIGN_OR_RETURN(std::unique_ptr<GdsHandle> handle, CreateGdsHandle(config, opts));
    g.mode = GdsModeName(handle->mode());
    g.mode_reason = handle->mode_reason();
  }
  constexpr int kCopyRepeats = 3;  // best of: the ceiling, not a typical copy
  for (const bool to_device : {true, false}) {
    Result<double> rate =
        gpu::MeasureCopyRate(static_cast<size_t>(size), to_device, kCopyRepeats, g.device.index);
    if (!rate.ok()) {
      return rate.status().WithContext(fmt::format("measuring the pinned {} copy rate",
                                                   to_device ? "host->device" : "device->host"));
    }
    (to_device ? g.h2d_gib_per_s : g.d2h_gib_per_s) = *rate / kGiB;
  }
  return g;
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
  if (opts.queue_depth_opt->count() > 0 || opts.queue_depth_given) {
    config.queue_depth = opts.queue_depth;
  }
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

// ds_io's flags mean what they mean in ds_io: with --folder, the defaults are ds_io's (write
// unless --read, overlap_events unless --sequential_requests, queue_depth 32, and a read of a
// file that is not there writes it first, as ds_io creates its read file).
IoOptions ApplyDsIoNames(IoOptions opts, bool* write_missing_read_file) {
  *write_missing_read_file = false;
  if (!opts.engine.empty() && opts.engine != "aio_handle") {
    throw UsageError(fmt::format(
        "--engine {}: dnvme io times the aio_handle engine only (for torch.save-style writers "
        "use bench/checkpoint.py)",
        opts.engine));
  }
  if (opts.multi_process != 1) {
    throw UsageError(
        "--multi_process: dnvme io is one process; start one per directory, or time several "
        "directories together with `dnvme tune --dir A --dir B`");
  }
  if (opts.sequential_requests && opts.overlap_events) {
    throw UsageError("--sequential_requests and --overlap-events contradict each other");
  }
  if (opts.folder.empty()) {
    if (opts.dir.empty()) throw UsageError("give --dir DIR (or ds_io's --folder DIR)");
    return opts;
  }
  if (!opts.dir.empty()) throw UsageError("give --dir or ds_io's --folder, not both");
  opts.dir = opts.folder;
  if (!opts.write && !opts.read) opts.write = true;
  if (!opts.write) *write_missing_read_file = true;
  if (opts.config_file.empty()) {
    if (!opts.sequential_requests) opts.overlap_events = true;
    if (opts.queue_depth_opt->count() == 0) {
      opts.queue_depth = 32;
      opts.queue_depth_given = true;
    }
  }
  return opts;
}

int RunIo(const IoOptions& given) {
  bool write_missing_read_file = false;
  IoOptions opts = ApplyDsIoNames(given, &write_missing_read_file);
  if (!opts.write && !opts.read) throw UsageError("give --write and/or --read");
  const int64_t size = ParseSizeFlag("--size", opts.size);
  if (opts.loops < 1) throw UsageError("--loops must be at least 1");
  if (opts.warmup < 0) throw UsageError("--warmup must not be negative");
  CheckGpuFlags(opts.gpu);
  if (opts.gpu.gpu && opts.no_pin) {
    throw UsageError("--no-pin chooses host memory; --gpu uses GPU memory (give one of them)");
  }
  if (opts.disk_gibps_opt->count() > 0) {
    if (!opts.gpu.gpu) {
      throw UsageError("--disk-gibps is for --gpu runs (the bound in ratio_vs_limit)");
    }
    if (!(opts.disk_gibps > 0)) {
      throw UsageError(fmt::format("--disk-gibps must be positive, got {}", opts.disk_gibps));
    }
  }
  if (opts.file.empty() || opts.file.find('/') != std::string::npos) {
    throw UsageError(fmt::format("--file '{}': give a file name inside --dir", opts.file));
  }
  CheckDirFlag("--dir", opts.dir, opts.write ? DirAccess::kWrite : DirAccess::kRead);
  const HandleConfig config = BuildConfig(opts);
  const std::string path = opts.dir + "/" + opts.file;

  if (!opts.write) {
    struct stat st {};
    const bool missing = ::stat(path.c_str(), &st) != 0;
    const int stat_errno = errno;
    if ((missing || st.st_size < size) && write_missing_read_file) {
      std::cerr << fmt::format(
          "dnvme io: {} is not there (or too short): writing it first, as ds_io does\n", path);
      opts.write = true;
    } else if (missing) {
      return Fail(Status::FromErrno(stat_errno, path),
                  "; run `dnvme io --write` with the same --dir, --file and --size first");
    } else if (st.st_size < size) {
      return Fail(Status::EndOfFile(
                      fmt::format("{} holds {} bytes, --size asks for {}", path, st.st_size, size)),
                  "; run `dnvme io --write` with the same --dir, --file and --size first");
    }
  }

  // The device comes first: without one there is nothing to allocate, and the reason is the
  // whole answer.
  GpuFacts facts;
  if (opts.gpu.gpu) {
    Result<GpuFacts> g = GatherGpuFacts(config, opts, size);
    if (!g.ok()) return Fail(g.status(), "; `dnvme report` shows this machine's GPU set-up");
    facts = std::move(g).value();
  }

  spdlog::debug("{} {} at {} ({}), warmup {}, loops {}, config {}",
                opts.write && opts.read ? "write+read" : (opts.write ? "write" : "read"),
                FormatBytes(size), path,
                opts.gpu.gpu ? fmt::format("GPU {}, {}", facts.device.index, facts.mode)
                             : (opts.no_pin ? "unpinned" : "pinned"),
                opts.warmup, opts.loops, config.ToJson());
  IoMemory mem;
  // With --gpu the host copy of the pattern is never handed to the engine: no need to pin it
  // (and so no RLIMIT_MEMLOCK for it).
  Result<IoBuffer> buf =
      IoBuffer::Allocate(static_cast<size_t>(size), !opts.no_pin && !opts.gpu.gpu);
  if (!buf.ok()) {
    return Fail(buf.status(),
                opts.no_pin || opts.gpu.gpu ? "" : "; or pass --no-pin to use unpinned memory");
  }
  mem.host = std::move(buf).value();
  FillPattern(mem.host.data(), mem.host.size());
  if (opts.gpu.gpu) {
    Result<gpu::DeviceBuffer> dev =
        gpu::DeviceBuffer::Allocate(static_cast<size_t>(size), facts.device.index);
    if (!dev.ok()) return Fail(dev.status().WithContext("--gpu buffer"));
    mem.device = std::move(dev).value();
    if (Status st = gpu::CopyToDevice(mem.device.data(), mem.host.data(), mem.size()); !st.ok()) {
      return Fail(st.WithContext("copying the pattern to the GPU"));
    }
  }

  std::vector<OpType> ops;
  if (opts.write) ops.push_back(OpType::kWrite);
  if (opts.read) ops.push_back(OpType::kRead);
  for (OpType op : ops) {
    Result<OpOutcome> out =
        opts.gpu.gpu ? RunGpuOp(op, config, opts, mem, path) : RunOp(op, config, opts, mem, path);
    if (!out.ok()) return Fail(out.status());
    PrintOutcome(*out, opts, size, config, path, opts.gpu.gpu ? &facts : nullptr);
  }
  return kExitOk;
}

}  // namespace

Command AddIoCommand(CLI::App& parent) {
  auto opts = std::make_shared<IoOptions>();
  CLI::App* io = parent.add_subcommand(
      "io", "Time writes and/or reads of one file through an AioHandle (DeepSpeed ds_io)");
  // DeepSpeed's ds_io names are accepted beside ours (--io_size, --block_size, --queue_depth,
  // --io_parallel, --single_submit, --warmup_loops, --use_gds), so its users' scripts run with the
  // command name changed; --folder also brings ds_io's defaults (ApplyDsIoNames).
  io->add_option("--dir", opts->dir, "Directory to put the file in");
  io->add_option("--folder", opts->folder,
                 "ds_io's --dir, with ds_io's defaults: write unless --read, overlap_events "
                 "unless --sequential_requests, queue depth 32");
  io->add_option("--size,--io_size", opts->size, "Bytes per operation (K/M/G suffixes)")
      ->required();
  io->add_flag("--write", opts->write, "Time writes");
  io->add_flag("--read", opts->read, "Time reads (of a file written before, or by --write)");
  io->add_option("--file", opts->file, "File name inside --dir")->capture_default_str();
  io->add_option("--block-size,--block_size", opts->block_size,
                 "Bytes per libaio request (default 1M)");
  opts->queue_depth_opt = io->add_option("--queue-depth,--queue_depth", opts->queue_depth,
                                         "Requests in flight per worker (128)");
  opts->intra_op_opt =
      io->add_option("--intra-op-parallelism,--io_parallel", opts->intra_op_parallelism,
                     "Worker threads per operation (1)");
  io->add_flag("--single-submit,--single_submit", opts->single_submit, "One io_submit per request");
  io->add_flag("--overlap-events,--overlap_events", opts->overlap_events,
               "Sliding window instead of batches");
  io->add_flag("--sequential_requests", opts->sequential_requests,
               "ds_io: lock-step batches (the default of --dir; with --folder it turns "
               "overlap_events off)");
  io->add_option("--engine", opts->engine, "ds_io: aio_handle (the only engine timed here)");
  io->add_option("--multi_process", opts->multi_process, "ds_io: processes (1 here)");
  io->add_option("--direct", opts->direct, "O_DIRECT policy: auto|required|never (auto)");
  io->add_flag("--fdatasync", opts->fdatasync, "fdatasync at the end of every write");
  io->add_option("--config", opts->config_file,
                 "HandleConfig JSON file; explicit flags override it");
  io->add_option("--loops", opts->loops, "Timed loops per operation")->capture_default_str();
  io->add_option("--warmup,--warmup_loops", opts->warmup, "Untimed loops before them")
      ->capture_default_str();
  io->add_flag("--validate", opts->validate, "Check the data (timings include the check)");
  io->add_flag("--json", opts->json, "One JSON object per line per operation");
  io->add_flag("--no-pin", opts->no_pin, "Use a 4096-aligned heap buffer instead of pinned memory");
  AddGpuFlags(io, &opts->gpu, "the I/O buffer");
  opts->disk_gibps_opt = io->add_option(
      "--disk-gibps", opts->disk_gibps,
      "With --gpu: the disk's own rate (GiB/s, e.g. fio's); adds ratio_vs_limit = rate / "
      "min(copy rate, disk rate)");
  return Command{io, [opts] { return RunIo(*opts); }};
}

}  // namespace dnvme::cli
