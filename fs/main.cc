// dnvmefs: mounts BACKING_DIR at MOUNTPOINT; large reads and writes of unmodified programs become
// parallel O_DIRECT libaio requests through the dnvme engine.
//
// Start-up order matters: parse and check everything first (a usage error mounts nothing and
// exits 2), mount, daemonize (fork), and only then create threads (engine workers, the FUSE
// loop): threads do not survive fork.
#include <fuse_lowlevel.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "dnvme/log.h"
#include "engine/common/log.h"
#include "fs/caps.h"
#include "fs/fs.h"
#include "fs/options.h"

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
    for (const auto& x : o.fuse_opts) opts += "," + x;
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

// Runs while the process is single-threaded (capabilities are per thread): after daemonizing,
// before the engine's workers and the FUSE loop start.
dnvme::Status DropCaps() {
  auto report = dnvme::fs::DropCapabilities(dnvme::fs::DaemonKeepSet());
  if (!report.ok()) return report.status();
  dnvme::Logger().info("capabilities: {}", report.value().ToString());
  return dnvme::Status::Ok();
}

}  // namespace

int main(int argc, char** argv) {
  using dnvme::Logger;
  auto parsed = dnvme::fs::ParseMountOptions(argc, argv);
  if (!parsed.ok()) {
    std::fprintf(stderr, "dnvmefs: error: %s\n%s", parsed.status().message().c_str(),
                 dnvme::fs::UsageText());
    return kExitUsage;
  }
  dnvme::fs::MountOptions opts = std::move(parsed).value();
  if (opts.show_help) {
    std::fputs(dnvme::fs::UsageText(), stdout);
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

  auto fs = std::make_unique<dnvme::fs::Fs>(opts);
  FuseArgs args(opts);
  fuse_session* se =
      fuse_session_new(args.get(), &dnvme::fs::Operations(), sizeof(fuse_lowlevel_ops), fs.get());
  if (se == nullptr) {
    std::fprintf(stderr, "dnvmefs: error: invalid FUSE options (see messages above)\n");
    return kExitUsage;
  }
  int rc = kExitFailure;
  if (fuse_set_signal_handlers(se) != 0) {
    std::fprintf(stderr, "dnvmefs: error: cannot install signal handlers\n");
  } else if (fuse_session_mount(se, opts.mountpoint.c_str()) != 0) {
    std::fprintf(stderr, "dnvmefs: error: mounting %s failed (see messages above)\n",
                 opts.mountpoint.c_str());
  } else {
    // The parent of fuse_daemonize exits once the child is set up; the mount is live already.
    if (fuse_daemonize(opts.foreground ? 1 : 0) != 0) {
      Logger().error("daemonize failed");
    } else if (auto caps = DropCaps(); !caps.ok()) {
      Logger().error("dropping capabilities failed: {}", caps.ToString());
    } else if (dnvme::Status st = fs->Start(); !st.ok()) {
      Logger().error("start-up failed: {}", st.ToString());
    } else {
      Logger().info("mounted {} at {} (engine {})", opts.backing, opts.mountpoint,
                    opts.engine.ToJson());
      int loop_rc;
      if (opts.single_thread) {
        loop_rc = fuse_session_loop(se);
      } else {
        fuse_loop_config* cfg = fuse_loop_cfg_create();
        fuse_loop_cfg_set_clone_fd(cfg, 1);
        fuse_loop_cfg_set_idle_threads(cfg, 16);
        fuse_loop_cfg_set_max_threads(cfg, 64);
        loop_rc = fuse_session_loop_mt(se, cfg);
        fuse_loop_cfg_destroy(cfg);
      }
      fs->DrainAll();
      Logger().info("unmounting {}: counters {} engine {}", opts.mountpoint,
                    fs->counters().ToJson(), fs->engine().stats().ToJson());
      rc = loop_rc == 0 ? 0 : kExitFailure;
    }
    fuse_session_unmount(se);
  }
  fuse_remove_signal_handlers(se);
  fuse_session_destroy(se);
  fs.reset();
  return rc;
}
