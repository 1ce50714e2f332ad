// dnvmefs: mounts BACKING_DIR at MOUNTPOINT; large reads and writes of unmodified programs become
// parallel O_DIRECT libaio requests through the dnvme engine.
//
// Start-up order matters: parse and check everything first (a usage error mounts nothing and
// exits 2), mount, daemonize (fork), and only then create threads (engine workers, the FUSE
// loop): threads do not survive fork.
#include <fcntl.h>
#include <fuse_lowlevel.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>

#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dnvme/gpu.h"
#include "dnvme/log.h"
#include "fs/backing_access.h"
#include "fs/caps.h"
#include "fs/core/fs.h"
#include "fs/fuse/ops.h"
#include "fs/fuse_compat.h"
#include "fs/options.h"
#include "fs/transport/transport.h"

#ifndef DNVME_VERSION
#define DNVME_VERSION "unknown"
#endif

namespace {

constexpr int kExitUsage = 2;
constexpr int kExitFailure = 1;

// Owns the fuse_args built for libfuse.
class FuseArgs {
 public:
  explicit FuseArgs(const dnvme::fs::MountOptions& o) {
    Add("dnvmefs");
    if (o.debug) Add("-d");
    // The daemon runs as root for many users: the kernel must check permissions.
    std::string opts = "default_permissions,fsname=" + Escape(o.backing) + ",subtype=dnvmefs";
    // auto_unmount has a fusermount3 process, started before we drop capabilities, unmount when
    // our /dev/fuse fd closes: on exit, on SIGTERM, and after a crash. As root this is required:
    // libfuse would otherwise unmount with umount2() itself, which needs the CAP_SYS_ADMIN we drop.
    // As a user (mount.dnvmefs -o setuid=USER) it also means no dead mount is left after a crash.
    opts += ",auto_unmount";
    for (const auto& x : o.fuse_opts) opts += "," + x;
    // READs no larger than MountOptions::max_read (OpInit says the same).
    opts += ",max_read=" + std::to_string(o.max_read);
    Add("-o");
    Add(opts);
    args_ = FUSE_ARGS_INIT(static_cast<int>(argv_.size()), argv_.data());
  }
  ~FuseArgs() { fuse_opt_free_args(&args_); }
  fuse_args* get() { return &args_; }

 private:
  static std::string Escape(const std::string& s) {
    std::string r;
    for (char c : s) {
      if (c == ',' || c == '\\') r += '\\';
      r += c;
    }
    return r;
  }
  void Add(const std::string& s) {
    store_.push_back(std::make_unique<std::string>(s));
    argv_.push_back(store_.back()->data());
  }
  std::vector<std::unique_ptr<std::string>> store_;
  std::vector<char*> argv_;
  fuse_args args_{};
};

// Redirects stderr into a pipe for a short, bounded stretch (libfuse option parsing) and returns
// what was written, folded onto one line.
class StderrCapture {
 public:
  StderrCapture() {
    saved_ = dup(STDERR_FILENO);
    if (saved_ >= 0 && pipe2(pipe_, O_CLOEXEC | O_NONBLOCK) == 0) {
      fflush(stderr);
      if (dup2(pipe_[1], STDERR_FILENO) < 0) Restore();
    } else {
      pipe_[0] = pipe_[1] = -1;
    }
  }
  ~StderrCapture() { Restore(); }
  std::string Finish() {
    fflush(stderr);
    Restore();
    std::string out;
    if (pipe_[0] >= 0) {
      char buf[4096];
      ssize_t n;
      while ((n = read(pipe_[0], buf, sizeof(buf))) > 0) out.append(buf, static_cast<size_t>(n));
      close(pipe_[0]);
      pipe_[0] = -1;
    }
    for (char& c : out) {
      if (c == '\n') c = ' ';
    }
    while (!out.empty() && out.back() == ' ') out.pop_back();
    return out;
  }

 private:
  void Restore() {
    if (saved_ >= 0) {
      dup2(saved_, STDERR_FILENO);
      close(saved_);
      saved_ = -1;
    }
    if (pipe_[1] >= 0) {
      close(pipe_[1]);
      pipe_[1] = -1;
    }
  }
  int saved_ = -1;
  int pipe_[2] = {-1, -1};
};

// Runs while the process is single-threaded (capabilities are per thread): after daemonizing,
// before the engine's workers and the FUSE loop start.
// The daemon holds descriptors for every user (open files, uncollected control transfers, broker
// connections), each user bounded by max_files_per_uid and friends: the process limit must be
// the hard one, not the login default of 1024, or one user's share would exhaust everyone's.
// Run before any thread exists (the limit is per process, read once by libraries that size
// tables from it). Returns what to log, and whether as a warning: logged only once the invocation
// is known to be good, so that a usage error stays one line.
struct LimitNote {
  bool warn = false;
  std::string text;
};
LimitNote RaiseFileLimit() {
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) {
    return {true, fmt::format("RLIMIT_NOFILE: {}", std::strerror(errno))};
  }
  if (rl.rlim_cur == rl.rlim_max) {
    return {false, fmt::format("open files: {} (RLIMIT_NOFILE, already at the hard limit)",
                               static_cast<unsigned long long>(rl.rlim_cur))};
  }
  const rlim_t before = rl.rlim_cur;
  rl.rlim_cur = rl.rlim_max;
  if (setrlimit(RLIMIT_NOFILE, &rl) != 0) {
    return {true, fmt::format("raising RLIMIT_NOFILE from {} to {}: {}",
                              static_cast<unsigned long long>(before),
                              static_cast<unsigned long long>(rl.rlim_max), std::strerror(errno))};
  }
  return {false, fmt::format("open files: RLIMIT_NOFILE raised from {} to the hard limit {}",
                             static_cast<unsigned long long>(before),
                             static_cast<unsigned long long>(rl.rlim_max))};
}

dnvme::Status DropCaps(bool passthrough) {
  auto report = dnvme::fs::DropCapabilities(dnvme::fs::DaemonKeepSet(passthrough),
                                            dnvme::fs::DaemonDormantSet(passthrough));
  if (!report.ok()) return report.status();
  dnvme::Logger().info("capabilities: {}", report.value().ToString());
  return dnvme::Status::Ok();
}

// After the capability drop: what the INIT reply adds to libfuse's (fs/transport/protocol_ext.h).
// Passthrough only when the daemon can register backing files (CAP_SYS_ADMIN permitted), saying
// why not otherwise; mmap of direct_io opens when O_RDWR opens are to get direct_io; one spare page
// per request always.
void ChooseExtensions(dnvme::fs::Fs& fs) {
  const dnvme::fs::Passthrough p = fs.mount().opts().passthrough;
  bool want = p != dnvme::fs::Passthrough::kOff;
  if (want) {
    auto cap = dnvme::fs::ScopedCapability::Raise(CAP_SYS_ADMIN);
    if (!cap.ok()) {
      dnvme::Logger().info(
          "passthrough={} off: registering backing files needs CAP_SYS_ADMIN ({}); every open "
          "goes through the daemon",
          dnvme::fs::PassthroughName(p), cap.status().ToString());
      want = false;
    }
  }
  const dnvme::fs::Transport* t = fs.mount().transport();
  fs.mount().protocol().Want(
      {.passthrough = want,
       .io_uring = t != nullptr && t->kind() == dnvme::fs::Transport::Kind::kUring,
       .direct_io_mmap = fs.mount().opts().direct_io == dnvme::fs::DirectIo::kWritable,
       .spare_page = true,
       .max_write = static_cast<uint32_t>(fs.mount().opts().max_request)});
}

}  // namespace

int main(int argc, char** argv) {
  using dnvme::Logger;
  // cuFile forbids fork after its initialisation and a CUDA context does not survive fork: no
  // CUDA until fuse_daemonize has forked (gpu.h).
  dnvme::gpu::DeferCudaInit("dnvmefs has not daemonized yet");
  auto parsed = dnvme::fs::ParseMountOptions(argc, argv);
  if (!parsed.ok()) {
    std::fprintf(stderr, "dnvmefs: error: %s (see dnvmefs --help)\n",
                 parsed.status().message().c_str());
    return kExitUsage;
  }
  dnvme::fs::MountOptions opts = std::move(parsed).value();
  if (opts.show_help) {
    std::fputs(dnvme::fs::UsageText().c_str(), stdout);
    return 0;
  }
  if (opts.show_help_markdown) {  // the table in docs/tuning.md, generated from the same rows
    std::fputs(dnvme::fs::OptionsMarkdown().c_str(), stdout);
    return 0;
  }
  if (opts.show_version) {
    std::printf("dnvmefs %s (libfuse %s)\n", DNVME_VERSION, fuse_pkgversion());
    return 0;
  }
  if (dnvme::Status st = dnvme::fs::CheckDirectories(opts); !st.ok()) {
    std::fprintf(stderr, "dnvmefs: error: %s\n", st.message().c_str());
    return kExitUsage;
  }
  if (dnvme::Status st = dnvme::SetLogLevel(opts.log_level); !st.ok()) {
    std::fprintf(stderr, "dnvmefs: error: %s\n", st.message().c_str());
    return kExitUsage;
  }
  if (!opts.log_file.empty()) {
    if (dnvme::Status st = dnvme::SetLogFile(opts.log_file); !st.ok()) {
      std::fprintf(stderr, "dnvmefs: error: %s\n", st.message().c_str());
      return kExitUsage;
    }
  }

  // Before the Fs: its descriptor budget is a share of the limit the daemon runs with.
  const LimitNote limit_note = RaiseFileLimit();
  auto fs = std::make_unique<dnvme::fs::Fs>(opts);
  if (dnvme::Status st = fs->Preflight(); !st.ok()) {
    std::fprintf(stderr, "dnvmefs: error: %s\n", st.ToString().c_str());
    return kExitFailure;
  }
  FuseArgs args(opts);
  // libfuse reports a bad option on stderr itself; capture that so the user gets one line.
  std::string fuse_complaint;
  fuse_session* se = nullptr;
  {
    StderrCapture capture;
    fs->mount().set_conn_opts(fuse_parse_conn_info_opts(args.get()));
    // The userdata is the Fs as the transport's SessionHost (fs/transport/session_io.h).
    se = fuse_session_new(args.get(), &dnvme::fs::Operations(), sizeof(fuse_lowlevel_ops),
                          static_cast<dnvme::fs::SessionHost*>(fs.get()));
    fuse_complaint = capture.Finish();
  }
  if (se == nullptr) {
    std::fprintf(stderr, "dnvmefs: error: invalid FUSE options: %s\n",
                 fuse_complaint.empty() ? "rejected by libfuse" : fuse_complaint.c_str());
    return kExitUsage;
  }
  if (!fuse_complaint.empty()) std::fprintf(stderr, "%s\n", fuse_complaint.c_str());
  // Only once the invocation is known to be good (a usage error stays one line).
  if (limit_note.warn) {
    Logger().warn("{}", limit_note.text);
  } else {
    Logger().info("{}", limit_note.text);
  }
  for (const std::string& why :
       dnvme::fs::BackingExposure(opts.backing, opts.mountpoint, geteuid())) {
    Logger().warn("{}", why);
  }
  fs->mount().set_session(se);  // for the control file's cache invalidations
  int rc = kExitFailure;
  if (fuse_set_signal_handlers(se) != 0) {
    std::fprintf(stderr, "dnvmefs: error: cannot install signal handlers\n");
  } else if (fuse_session_mount(se, opts.mountpoint.c_str()) != 0) {
    std::fprintf(stderr, "dnvmefs: error: mounting %s failed (see messages above)\n",
                 opts.mountpoint.c_str());
  } else if (int io_rc = dnvme::fs::SetCustomIo(se, dnvme::fs::SessionIo(), fuse_session_fd(se));
             io_rc != 0) {
    // Our replies go through SessionIo, which negotiates what libfuse 3.14 cannot.
    std::fprintf(stderr, "dnvmefs: error: fuse_session_custom_io: %s\n", std::strerror(-io_rc));
    fuse_session_unmount(se);
  } else {
    fs->mount().protocol().set_device_fd(fuse_session_fd(se));
    // The parent of fuse_daemonize exits once the child is set up; the mount is live already.
    const bool daemonized = fuse_daemonize(opts.foreground ? 1 : 0) == 0;
    // Forked for good: CUDA (and cuFile) may start from now on, on the first GPU registration
    // through the control file.
    if (daemonized) dnvme::gpu::AllowCudaInit();
    // The transport (fs/transport/transport.h) and its pipes come before the capability drop:
    // pipes big enough for a 1 MiB request need CAP_SYS_RESOURCE.
    std::unique_ptr<dnvme::fs::Transport> transport;
    dnvme::Status loop_st;
    if (daemonized) {
      dnvme::fs::TransportOptions t;
      t.threads = opts.single_thread ? 1 : opts.loop_threads;
      t.splice = opts.SpliceRequests();
      t.direct_io = opts.direct_io;
      t.clone_fd = opts.clone_fd;
      t.adoptable = opts.AdoptableRequestBuffers();
      t.max_request = opts.max_request;
      t.libfuse_max_threads = dnvme::fs::kMaxFuseThreads;
      t.protocol = &fs->mount().protocol();
      t.io_uring = opts.io_uring;
      t.uring_threads = opts.uring_threads;
      auto created = dnvme::fs::CreateTransport(se, t);
      if (created.ok()) {
        transport = std::move(created).value();
        using Kind = dnvme::fs::Transport::Kind;
        loop_st = fs->mount().ReservePrivileged(transport->kind() == Kind::kSplice,
                                                transport->kind() != Kind::kUring);
      } else {
        loop_st = created.status();
      }
      // Spliced requests pay only when write-behind can keep their pages in pipes; without
      // those pipes (write_behind=0, or none could be made) they would be copied out of the
      // request pipe, which costs more than reading them.
      if (loop_st.ok() && transport->kind() == dnvme::fs::Transport::Kind::kSplice &&
          !fs->mount().SplicesWrites()) {
        Logger().info("requests read(2), not spliced: write-behind has no pipes to keep them");
        transport.reset();
        t.splice = false;
        created = dnvme::fs::CreateTransport(se, t);
        if (created.ok()) {
          transport = std::move(created).value();
        } else {
          loop_st = created.status();
        }
      }
      if (loop_st.ok()) {
        fs->mount().set_transport(transport.get());
        // A quarter of the loop threads stays free of any one uid's requests: the rest of that
        // uid's run on its own lane (docs/security.md, "Nobody waits for another user").
        dnvme::fs::Fs* const core = fs.get();
        transport->ShareLoopThreads(t.threads / 4, [core](uid_t uid, std::function<void()> job) {
          return core->request_lanes().Submit(uid, std::move(job)).ok();
        });
      }
    }
    if (!daemonized) {
      Logger().error("daemonize failed");
    } else if (!loop_st.ok()) {
      Logger().error("session loop set-up failed: {}", loop_st.ToString());
    } else if (auto caps = DropCaps(opts.passthrough != dnvme::fs::Passthrough::kOff); !caps.ok()) {
      Logger().error("dropping capabilities failed: {}", caps.ToString());
    } else if (dnvme::Status st = fs->Start(); !st.ok()) {
      Logger().error("start-up failed: {}", st.ToString());
    } else if (dnvme::Status bst = fs->StartBroker(); !bst.ok()) {
      Logger().error("start-up failed: {}", bst.ToString());
    } else {
      fs->StartPruner();
      ChooseExtensions(*fs);  // before the loop runs: INIT is its first request
      Logger().info("mounted {} at {} (engine {}; transport {}: {})", opts.backing, opts.mountpoint,
                    opts.engine.ToJson(), dnvme::fs::TransportKindName(transport->kind()),
                    transport->Describe());
      const int loop_rc = transport->Run();
      fs->DrainAll();
      Logger().info("session loop ended ({}); unmounting {}: stats {}", loop_rc, opts.mountpoint,
                    fs->StatsJson());
      // The loop returns the signal number when SIGTERM/SIGINT/SIGHUP ended it: a clean exit.
      const bool by_signal = loop_rc == SIGTERM || loop_rc == SIGINT || loop_rc == SIGHUP;
      // ENODEV / ECONNABORTED: the kernel ended the connection because the filesystem was
      // unmounted (a lazy unmount whose last file closed, or fusermount3 -u): also a clean end.
      const bool unmounted = loop_rc == -ENODEV || loop_rc == -ECONNABORTED;
      rc = (loop_rc == 0 || by_signal || unmounted) ? 0 : kExitFailure;
      fs->Stop();  // no engine callback may reply into a destroyed session
      fs->mount().set_transport(nullptr);
    }
    fuse_session_unmount(se);
  }
  fuse_remove_signal_handlers(se);
  fuse_session_destroy(se);
  fs.reset();
  return rc;
}
