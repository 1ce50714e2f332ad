// `dnvme tune`: DeepSpeed's ds_nvme_tune, faster and exact. Searches the handle parameters
// (tools/dnvme/tune_search.h) by timing writes and reads of --io-size bytes in every --dir at
// once, and writes the best point as a HandleConfig JSON with exactly DeepSpeed's five "aio" keys,
// JSON-typed, which `dnvme io --config`, `dnvmefs -o config=`, the control file's config.set and
// the Python aio_handle(**cfg) all take verbatim. Every measured point goes to a CSV, and gnuplot
// draws the sweep into a PNG, both in --log-dir.
//
// With --gpu every point is measured with device buffers through GdsHandles (the bounce path, or
// cuFile with --gds; the flags mean what they mean for `dnvme io`), so the parameters found are
// the best for moving GPU memory; the config written is the same five keys.
#include <fcntl.h>
#include <spawn.h>
#include <spdlog/fmt/fmt.h>
#include <spdlog/spdlog.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
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
#include "tools/dnvme/tune_search.h"

extern char** environ;

namespace dnvme::cli {
namespace {

using tune::MeasuredPoint;
using tune::Measurement;
using tune::SearchResult;
using tune::SweepSpace;
using tune::TunePoint;

struct TuneOptions {
  std::vector<std::string> dirs;
  std::string io_size = "512M";
  bool no_read = false;
  bool no_write = false;
  std::string sweep_config;
  int loops = 3;
  std::string log_dir = "dnvme_tune_logs";
  std::string output;  // default LOG_DIR/dnvme_tune.json
  std::string search = "descent";
  double min_gain = 0.03;
  GpuFlags gpu;
  bool json = false;
  bool flush_page_cache = false;  // ds_nvme_tune's flag: reads always drop the cache here
  bool verbose = false;           // ds_nvme_tune's flag: progress is always printed
};

// One directory's share of a measurement: its file and its buffer, pinned host memory or, with
// --gpu, device memory (the host buffer is then released once the pattern is on the device).
struct Target {
  std::string path;
  PinnedBuffer buf;
  gpu::DeviceBuffer device;

  void* data() const { return device.empty() ? buf.data() : device.data(); }
};

std::string FileName() { return fmt::format("dnvme_tune.{}.dat", ::getpid()); }

// mkdir -p for the log directory.
Status MakeDirs(const std::string& dir) {
  std::string partial;
  size_t pos = 0;
  while (pos != std::string::npos) {
    pos = dir.find('/', pos + 1);
    partial = dir.substr(0, pos);
    if (partial.empty()) continue;
    if (::mkdir(partial.c_str(), 0755) != 0 && errno != EEXIST) {
      return Status::FromErrno(errno, "mkdir " + partial);
    }
  }
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) return Status::FromErrno(errno, dir);
  if (!S_ISDIR(st.st_mode)) return Status::InvalidArgument(dir + ": not a directory");
  if (::access(dir.c_str(), W_OK | X_OK) != 0) return Status::FromErrno(errno, dir);
  return Status::Ok();
}

// Runs one operation over every target at once (a thread per directory, each with its own
// handle: an AioHandle, or a GdsHandle for --gpu) and returns the wall time.
template <typename Handle>
Result<double> TimeOnce(OpType op, std::vector<std::unique_ptr<Handle>>& handles,
                        std::vector<Target>& targets, int64_t size) {
  std::vector<Status> results(targets.size());
  const auto start = std::chrono::steady_clock::now();
  {
    std::vector<std::jthread> threads;
    for (size_t i = 0; i < targets.size(); ++i) {
      threads.emplace_back([&, i] {
        results[i] = op == OpType::kWrite
                         ? handles[i]->sync_pwrite(targets[i].data(), size, targets[i].path)
                         : handles[i]->sync_pread(targets[i].data(), size, targets[i].path);
      });
    }
  }
  const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
  for (const Status& st : results) {
    if (!st.ok()) return st;
  }
  return elapsed.count();
}

// The median rate of `loops` timed operations, in GiB/s over all targets (handles[i] serves
// targets[i]).
template <typename Handle>
Result<double> MeasureOp(OpType op, std::vector<std::unique_ptr<Handle>>& handles,
                         std::vector<Target>& targets, int64_t size, int loops) {
  std::vector<double> seconds;
  for (int i = 0; i < loops; ++i) {
    if (op == OpType::kRead) DropPageCache();
    DNVME_ASSIGN_OR_RETURN(double s, TimeOnce(op, handles, targets, size));
    seconds.push_back(s);
  }
  const double bytes = static_cast<double>(size) * static_cast<double>(targets.size());
  return bytes / kGiB / Median(seconds);
}

// One point's writes and then reads, with handles[i] serving targets[i].
template <typename Handle>
Result<Measurement> MeasurePoint(std::vector<std::unique_ptr<Handle>>& handles,
                                 std::vector<Target>& targets, int64_t size, int loops,
                                 bool do_write, bool do_read) {
  Measurement m;
  if (do_write) {
    DNVME_ASSIGN_OR_RETURN(m.write_gib_per_s,
                           MeasureOp(OpType::kWrite, handles, targets, size, loops));
  }
  if (do_read) {
    DNVME_ASSIGN_OR_RETURN(m.read_gib_per_s,
                           MeasureOp(OpType::kRead, handles, targets, size, loops));
  }
  return m;
}

// What --gpu found before the sweep: the device and the mode its handles run in.
struct GpuSetup {
  gpu::DeviceInfo device;
  GdsOptions options;
  std::string mode;
  std::string mode_reason;
};

// The device, and a first handle to learn the mode: with --gds, Create fails here (with cuFile's
// reason) before any file is written, rather than at the first point.
Result<GpuSetup> SetUpGpu(const GpuFlags& flags) {
  GpuSetup g;
  DNVME_ASSIGN_OR_RETURN(g.device, OpenGpu(flags));
  g.options = GdsOptionsFor(flags);
  Result<std::unique_ptr<GdsHandle>> h = GdsHandle::Create(HandleConfig{}, g.options);
  if (!h.ok()) return h.status().WithContext(flags.gds ? "--gds: gds_handle" : "gds_handle");
  g.mode = GdsModeName((*h)->mode());
  g.mode_reason = (*h)->mode_reason();
  return g;
}

// --- progress --------------------------------------------------------------------------------

// A bar with the best result so far on a terminal; one plain line per point otherwise (logs, CI).
class Progress {
 public:
  explicit Progress(bool measure_write, bool measure_read)
      : tty_(::isatty(STDERR_FILENO) == 1), write_(measure_write), read_(measure_read) {}

  void Update(const SearchResult& r, size_t bound) {
    const MeasuredPoint& last = r.measured.back();
    const MeasuredPoint& best = r.measured[r.best];
    const std::string now = fmt::format("{}  {}", last.point.Label(), Rates(last.m));
    const std::string best_text = fmt::format("best {}  {}", Rates(best.m), best.point.Label());
    if (!tty_) {
      std::cerr << fmt::format("tune: point {} (of at most {}): {} | {}\n", r.measured.size(),
                               bound, now, best_text);
      return;
    }
    constexpr int kBarWidth = 24;
    const size_t n = r.measured.size();
    const int filled =
        static_cast<int>(kBarWidth * std::min(n, bound) / std::max<size_t>(bound, 1));
    std::string line = fmt::format("\r[{}{}] {:>3}/{:<3} {} | {}", std::string(filled, '#'),
                                   std::string(kBarWidth - filled, '.'), n, bound, now, best_text);
    winsize ws{};
    const size_t width =
        ::ioctl(STDERR_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0 ? ws.ws_col : 160;
    if (line.size() > width) line.resize(width);
    std::cerr << line << "\x1b[K" << std::flush;
    drawn_ = true;
  }

  void Finish() {
    if (drawn_) std::cerr << "\n";
  }

 private:
  std::string Rates(const Measurement& m) const {
    std::string s;
    if (write_) s += fmt::format("W {:.2f}", m.write_gib_per_s);
    if (read_) s += fmt::format("{}R {:.2f}", s.empty() ? "" : " ", m.read_gib_per_s);
    return s + " GiB/s";
  }
  bool tty_;
  bool write_, read_;
  bool drawn_ = false;
};

// --- outputs ---------------------------------------------------------------------------------

// Exactly DeepSpeed's "aio" keys, JSON-typed: valid verbatim in every consumer (and in a
// DeepSpeed config's "aio" section).
nlohmann::ordered_json ConfigJson(const TunePoint& p) {
  HandleConfig c;
  c.block_size = p.block_size;
  c.queue_depth = p.queue_depth;
  c.intra_op_parallelism = p.intra_op_parallelism;
  c.single_submit = p.single_submit;
  c.overlap_events = p.overlap_events;
  const nlohmann::json all = nlohmann::json::parse(c.ToJson());
  nlohmann::ordered_json j;
  for (const ConfigKey& k : ConfigKeys()) {
    if (k.deepspeed) j[k.name] = all.at(k.name);
  }
  return j;
}

Status WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  if (!out) return Status::FromErrno(errno, "cannot create " + path);
  out << text;
  out.flush();
  if (!out) return Status::FromErrno(errno == 0 ? EIO : errno, "cannot write " + path);
  return Status::Ok();
}

std::string CsvText(const SearchResult& r, bool w, bool rd) {
  std::string s =
      "index,pass,block_size,queue_depth,overlap_events,single_submit,intra_op_parallelism,"
      "write_gib_per_s,read_gib_per_s,score,label\n";
  for (size_t i = 0; i < r.measured.size(); ++i) {
    const MeasuredPoint& m = r.measured[i];
    s += fmt::format(
        "{},{},{},{},{},{},{},{},{},{:.4f},\"{}\"\n", i + 1, m.pass, m.point.block_size,
        m.point.queue_depth, m.point.overlap_events ? 1 : 0, m.point.single_submit ? 1 : 0,
        m.point.intra_op_parallelism, w ? fmt::format("{:.4f}", m.m.write_gib_per_s) : "",
        rd ? fmt::format("{:.4f}", m.m.read_gib_per_s) : "", m.m.Score(), m.point.Label());
  }
  return s;
}

// Draws the sweep with gnuplot: one bar pair per measured point, best score first. Returns the
// PNG's path, or an error saying why there is none.
Result<std::string> Plot(const SearchResult& r, const TuneOptions& o, bool w, bool rd,
                         const std::string& title) {
  std::vector<size_t> order(r.measured.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&r](size_t a, size_t b) {
    return r.measured[a].m.Score() > r.measured[b].m.Score();
  });
  std::string data;
  for (size_t i : order) {
    const MeasuredPoint& m = r.measured[i];
    // Short labels: block size, qd, overlap, single submit, parallelism; * marks the best.
    data += fmt::format("\"{}{} qd{} ov{} ss{} p{}\" {:.4f} {:.4f}\n", i == r.best ? "* " : "",
                        FormatSizeSuffix(m.point.block_size), m.point.queue_depth,
                        m.point.overlap_events ? 1 : 0, m.point.single_submit ? 1 : 0,
                        m.point.intra_op_parallelism, m.m.write_gib_per_s, m.m.read_gib_per_s);
  }
  const std::string dat = o.log_dir + "/sweep_plot.dat";
  const std::string script = o.log_dir + "/sweep_plot.gp";
  const std::string png = o.log_dir + "/sweep.png";
  DNVME_RETURN_IF_ERROR(WriteFile(dat, data));
  std::string plot;
  if (w) plot += fmt::format("'{}' using 2:xtic(1) title 'write' lc rgb '#1f77b4'", dat);
  if (rd) {
    plot += fmt::format("{}'{}' using 3{} title 'read' lc rgb '#ff7f0e'", w ? ", " : "", dat,
                        w ? "" : ":xtic(1)");
  }
  const size_t width = std::max<size_t>(900, 60 + 28 * r.measured.size());
  DNVME_RETURN_IF_ERROR(WriteFile(
      script, fmt::format("set terminal pngcairo size {},720 noenhanced font 'sans,10'\n"
                          "set output '{}'\n"
                          "set title \"{}\\n(* best; ov overlap_events, ss single_submit, "
                          "p intra_op_parallelism)\"\n"
                          "set style data histograms\n"
                          "set style histogram clustered gap 1\n"
                          "set style fill solid 0.85 border -1\n"
                          "set boxwidth 0.9\n"
                          "set xtics rotate by 90 right scale 0 font ',9'\n"
                          "set ylabel 'GiB/s (median)'\n"
                          "set yrange [0:*]\n"
                          "set grid ytics\n"
                          "set key top right\n"
                          "set bmargin 11\n"
                          "plot {}\n",
                          width, png, title, plot)));
  std::string quiet = o.log_dir + "/sweep_plot.log";
  posix_spawn_file_actions_t actions;
  if (int e = posix_spawn_file_actions_init(&actions); e != 0) {
    return Status::FromErrno(e, "posix_spawn_file_actions_init");
  }
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, quiet.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  const char* argv[] = {"gnuplot", script.c_str(), nullptr};
  pid_t pid = 0;
  const int e = posix_spawnp(&pid, "gnuplot", &actions, nullptr, const_cast<char**>(argv), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (e != 0) {
    return Status::Unsupported(
        e, fmt::format("cannot run gnuplot ({}); apt-get install gnuplot-nox", std::strerror(e)));
  }
  int wstatus = 0;
  while (::waitpid(pid, &wstatus, 0) < 0) {
    if (errno != EINTR) return Status::FromErrno(errno, "waitpid gnuplot");
  }
  if (!WIFEXITED(wstatus) || WEXITSTATUS(wstatus) != 0) {
    return Status::Internal(fmt::format("gnuplot failed (see {})", quiet));
  }
  return png;
}

// --- the command -----------------------------------------------------------------------------

int RunTune(const TuneOptions& o) {
  CheckGpuFlags(o.gpu);
  if (o.no_read && o.no_write) throw UsageError("--no-read and --no-write leave nothing to tune");
  if (o.dirs.empty()) throw UsageError("give at least one --dir");
  const int64_t size = ParseSizeFlag("--io-size", o.io_size);
  if (o.loops < 1) throw UsageError("--loops must be at least 1");
  if (o.min_gain < 0 || o.min_gain >= 1) throw UsageError("--min-gain must be in [0, 1)");
  for (const std::string& d : o.dirs) CheckDirFlag("--dir", d, DirAccess::kWrite);
  Result<tune::SearchStrategy> strategy = tune::ParseSearchStrategy(o.search);
  if (!strategy.ok()) throw UsageError("--search: " + strategy.status().message());
  SweepSpace space = SweepSpace::Default();
  if (!o.sweep_config.empty()) {
    Result<SweepSpace> s = SweepSpace::FromJsonFile(o.sweep_config);
    if (!s.ok()) throw UsageError("--sweep-config: " + s.status().message());
    space = *s;
  }
  // Before anything is created: without a device (or without cuFile for --gds) there is nothing
  // to tune, and the reason is the answer.
  GpuSetup gpu_setup;
  if (o.gpu.gpu) {
    Result<GpuSetup> g = SetUpGpu(o.gpu);
    if (!g.ok()) {
      std::cerr << "dnvme tune: error: " << g.status().ToString()
                << "; `dnvme report` shows this machine's GPU set-up\n";
      return kExitFailure;
    }
    gpu_setup = std::move(g).value();
  }
  if (Status st = MakeDirs(o.log_dir); !st.ok()) {
    throw UsageError("--log-dir: " + st.message());
  }
  const std::string output = o.output.empty() ? o.log_dir + "/dnvme_tune.json" : o.output;
  const bool do_write = !o.no_write;
  const bool do_read = !o.no_read;

  // One file and one pinned buffer per directory. Each file is written once before the sweep
  // (untimed), so every timed write is an overwrite of allocated blocks, like a checkpoint slot
  // rewritten each time, and --no-write still has a file to read. With --gpu the pattern then
  // moves to a device buffer per directory and the pinned one is given back.
  std::vector<Target> targets;
  for (const std::string& d : o.dirs) {
    Result<PinnedBuffer> buf = AioHandle::new_cpu_locked_buffer(static_cast<size_t>(size));
    if (!buf.ok()) {
      std::cerr << "dnvme tune: error: " << buf.status().ToString()
                << "; or use a smaller --io-size\n";
      return kExitFailure;
    }
    FillPattern(buf->bytes(), buf->size());
    targets.push_back(Target{d + "/" + FileName(), std::move(buf).value(), {}});
  }
  struct Cleanup {
    std::vector<Target>* t;
    ~Cleanup() {
      for (const Target& x : *t) {
        if (::unlink(x.path.c_str()) != 0 && errno != ENOENT) {
          spdlog::warn("cannot remove {}: {}", x.path, std::strerror(errno));
        }
      }
    }
  } cleanup{&targets};
  {
    Result<std::unique_ptr<AioHandle>> h = AioHandle::Create(HandleConfig{});
    if (!h.ok()) {
      std::cerr << "dnvme tune: error: " << h.status().ToString() << "\n";
      return kExitFailure;
    }
    for (Target& t : targets) {
      if (Status st = (*h)->sync_pwrite(t.buf.bytes(), size, t.path); !st.ok()) {
        std::cerr << "dnvme tune: error: preparing " << t.path << ": " << st.ToString() << "\n";
        return kExitFailure;
      }
    }
  }
  if (o.gpu.gpu) {
    for (Target& t : targets) {
      Result<gpu::DeviceBuffer> dev =
          gpu::DeviceBuffer::Allocate(static_cast<size_t>(size), gpu_setup.device.index);
      Status st =
          dev.ok() ? gpu::CopyToDevice(dev->data(), t.buf.data(), t.buf.size()) : dev.status();
      if (!st.ok()) {
        std::cerr << "dnvme tune: error: --gpu buffer for " << t.path << ": " << st.ToString()
                  << "; or use a smaller --io-size\n";
        return kExitFailure;
      }
      t.device = std::move(dev).value();
      t.buf = PinnedBuffer();
    }
  }

  tune::SearchOptions sopts;
  sopts.strategy = *strategy;
  sopts.min_gain = o.min_gain;
  const auto started = std::chrono::steady_clock::now();
  Progress progress(do_write, do_read);
  const std::string csv = o.log_dir + "/sweep.csv";
  auto measure = [&](const TunePoint& p, int /*pass*/) -> Result<Measurement> {
    // One handle per directory, created once for the point's writes and reads (creation starts
    // threads and libaio contexts, so it stays out of the timed part and is not repeated).
    const HandleConfig config = p.Apply(HandleConfig{});
    if (o.gpu.gpu) {
      std::vector<std::unique_ptr<GdsHandle>> handles;
      for (const Target& t : targets) {
        DNVME_ASSIGN_OR_RETURN(std::unique_ptr<GdsHandle> h,
                               GdsHandle::Create(config, gpu_setup.options));
        // Registered with cuFile, as DeepSpeed pins device tensors (recorded only on the bounce
        // path); deregistered when the handle goes at the end of the point.
        DNVME_RETURN_IF_ERROR(h->pin_device_buffer(t.device.data(), size));
        handles.push_back(std::move(h));
      }
      return MeasurePoint(handles, targets, size, o.loops, do_write, do_read);
    }
    std::vector<std::unique_ptr<AioHandle>> handles;
    for (size_t i = 0; i < targets.size(); ++i) {
      DNVME_ASSIGN_OR_RETURN(std::unique_ptr<AioHandle> h, AioHandle::Create(config));
      handles.push_back(std::move(h));
    }
    return MeasurePoint(handles, targets, size, o.loops, do_write, do_read);
  };
  auto on_progress = [&](const SearchResult& r, size_t bound) {
    progress.Update(r, bound);
    // Rewritten after every point, so an interrupted sweep keeps what it measured.
    if (Status st = WriteFile(csv, CsvText(r, do_write, do_read)); !st.ok()) {
      spdlog::warn("{}", st.ToString());
    }
  };
  Result<SearchResult> result = tune::RunSearch(space, sopts, measure, on_progress);
  progress.Finish();
  if (!result.ok()) {
    std::cerr << "dnvme tune: error: " << result.status().ToString() << "\n";
    return kExitFailure;
  }
  const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - started;
  const SearchResult& r = *result;
  const MeasuredPoint& best = r.measured[r.best];

  std::string dirs_text;
  for (const std::string& d : o.dirs) dirs_text += (dirs_text.empty() ? "" : ", ") + d;
  const std::string memory =
      o.gpu.gpu ? fmt::format("GPU {} memory ({} mode)", gpu_setup.device.index, gpu_setup.mode)
                : "pinned host memory";
  const std::string title =
      fmt::format("dnvme tune: {} x {} in {} from {}; {} of {} points ({} search), {} loops each",
                  o.dirs.size(), FormatSizeSuffix(size), dirs_text, memory, r.measured.size(),
                  space.GridSize(), tune::SearchStrategyName(sopts.strategy), o.loops);
  Result<std::string> png = Plot(r, o, do_write, do_read, title);
  if (!png.ok()) spdlog::warn("no sweep plot: {}", png.status().ToString());

  const auto config_json = ConfigJson(best.point);
  if (Status st = WriteFile(output, config_json.dump(2) + "\n"); !st.ok()) {
    std::cerr << "dnvme tune: error: " << st.ToString() << "\n";
    return kExitFailure;
  }

  if (o.json) {
    nlohmann::ordered_json j;
    auto point_json = [&](const MeasuredPoint& m) {
      nlohmann::ordered_json p;
      p["config"] = ConfigJson(m.point);
      if (do_write) p["write_gib_per_s"] = m.m.write_gib_per_s;
      if (do_read) p["read_gib_per_s"] = m.m.read_gib_per_s;
      p["score"] = m.m.Score();
      return p;
    };
    j["best"] = point_json(best);
    if (do_write) j["best_write"] = point_json(r.measured[r.best_write]);
    if (do_read) j["best_read"] = point_json(r.measured[r.best_read]);
    j["config_file"] = output;
    j["csv"] = csv;
    j["plot"] = png.ok() ? nlohmann::ordered_json(*png) : nlohmann::ordered_json(nullptr);
    j["search"] = tune::SearchStrategyName(sopts.strategy);
    j["points_measured"] = r.measured.size();
    j["grid_points"] = space.GridSize();
    j["io_size"] = size;
    j["dirs"] = o.dirs;
    j["loops"] = o.loops;
    j["seconds"] = elapsed.count();
    j["memory"] = o.gpu.gpu ? "gpu" : "host_pinned";
    if (o.gpu.gpu) {
      nlohmann::ordered_json g;
      g["device"] = gpu_setup.device.index;
      g["name"] = gpu_setup.device.name;
      g["pci_bus_id"] = gpu_setup.device.pci_bus_id;
      g["cufile"] = CuFilePolicyName(gpu_setup.options.cufile);
      g["cufile_compat"] = gpu_setup.options.cufile_compat;
      g["mode"] = gpu_setup.mode;
      g["mode_reason"] = gpu_setup.mode_reason;
      j["gpu"] = g;
    }
    std::cout << j.dump() << std::endl;
    return kExitOk;
  }
  std::cout << fmt::format("measured {} of {} points ({} search) in {:.1f} s\n", r.measured.size(),
                           space.GridSize(), tune::SearchStrategyName(sopts.strategy),
                           elapsed.count());
  if (o.gpu.gpu) {
    std::cout << fmt::format("gpu: {}, gds_handle mode {} ({})\n", DeviceLabel(gpu_setup.device),
                             gpu_setup.mode, gpu_setup.mode_reason);
  }
  if (do_write) {
    const MeasuredPoint& m = r.measured[r.best_write];
    std::cout << fmt::format("best write: {:.2f} GiB/s  {}\n", m.m.write_gib_per_s,
                             m.point.Label());
  }
  if (do_read) {
    const MeasuredPoint& m = r.measured[r.best_read];
    std::cout << fmt::format("best read:  {:.2f} GiB/s  {}\n", m.m.read_gib_per_s, m.point.Label());
  }
  std::cout << fmt::format("best overall ({}): {}\n",
                           do_write && do_read ? "geometric mean of write and read" : "rate",
                           best.point.Label());
  std::cout << fmt::format("config: {}\n  {}\n", output, config_json.dump());
  std::cout << fmt::format(
      "use it: dnvme io --config {0} ... | dnvmefs BACKING MNT -o config={0}"
      " | dnvme ctl MNT config set {0} | aio_handle(**json.load(open('{0}')))\n",
      output);
  std::cout << fmt::format("points: {}\n", csv);
  if (png.ok()) std::cout << fmt::format("plot:   {}\n", *png);
  return kExitOk;
}

}  // namespace

Command AddTuneCommand(CLI::App& parent) {
  auto o = std::make_shared<TuneOptions>();
  CLI::App* cmd = parent.add_subcommand(
      "tune", "Find the best handle parameters for a directory (DeepSpeed ds_nvme_tune)");
  // DeepSpeed's ds_nvme_tune names are accepted beside ours (--nvme_dir, --io_size, --no_read,
  // --no_write, --sweep_config with its JSON keys, --log_dir, --flush_page_cache, --verbose).
  cmd->add_option("--dir,--nvme_dir", o->dirs,
                  "Directory to tune (repeat for several, or list them; timed together)")
      ->required();
  cmd->add_option("--io-size,--io_size", o->io_size, "Bytes per operation per directory (K/M/G)")
      ->capture_default_str();
  cmd->add_flag("--no-read,--no_read", o->no_read, "Do not time reads");
  cmd->add_flag("--no-write,--no_write", o->no_write, "Do not time writes");
  cmd->add_option("--sweep-config,--sweep_config", o->sweep_config,
                  "JSON object of parameter lists (default: the 64-point space); DeepSpeed's "
                  "keys io_parallel and sequential_requests are accepted");
  cmd->add_flag("--flush_page_cache", o->flush_page_cache,
                "ds_nvme_tune: drop the page cache before reads (always done here, as root)");
  cmd->add_flag("--verbose", o->verbose, "ds_nvme_tune: accepted; progress is always shown");
  cmd->add_option("--loops", o->loops, "Timed operations per point and direction (median)")
      ->capture_default_str();
  cmd->add_option("--log-dir,--log_dir", o->log_dir, "Where sweep.csv, sweep.png and the config go")
      ->capture_default_str();
  cmd->add_option("--output", o->output, "The config JSON (default LOG_DIR/dnvme_tune.json)");
  cmd->add_option("--search", o->search, "descent (default) or grid (every point)")
      ->capture_default_str();
  cmd->add_option("--min-gain", o->min_gain,
                  "Descent: relative gain below which a move is taken as noise")
      ->capture_default_str();
  AddGpuFlags(cmd, &o->gpu, "the tuner's buffers");
  cmd->add_flag("--json", o->json, "One JSON object on stdout instead of text");
  return Command{cmd, [o] { return RunTune(*o); }};
}

}  // namespace dnvme::cli
