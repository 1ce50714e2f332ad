// `dnvme run [--mount MNT]... [--min-bytes SIZE] [--config FILE] [--stats FILE] [--no-torch-hook]
// [--read-cache auto|resident|off] [--cache-writes] -- CMD ARGS`:
// runs CMD with libdnvme_preload.so preloaded (docs/preload.md), so its large reads and writes of
// files on dnvmefs mounts go to the backing files through its own engine, with no FUSE copy.
#include <limits.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <initializer_list>
#include <iostream>
#include <string>
#include <vector>

#include "dnvme/config.h"
#include "tools/dnvme/commands.h"

namespace dnvme::cli {

namespace {

bool Exists(const std::string& p) {
  struct stat st {};
  return stat(p.c_str(), &st) == 0;
}

// The first of `paths` (relative to this binary's directory) that exists, as an absolute path;
// "" when none does.
std::string BesideThisBinary(std::initializer_list<const char*> paths) {
  char self[4096];
  ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return "";
  std::string dir(self, static_cast<size_t>(n));
  dir = dir.substr(0, dir.rfind('/'));
  for (const char* p : paths) {
    if (Exists(dir + "/" + p)) return dir + "/" + p;
  }
  return "";
}

// The library: $DNVME_PRELOAD_LIB, else beside this binary (build/bin -> build/lib, or an
// install's bin -> lib).
std::string FindLibrary() {
  if (const char* e = getenv("DNVME_PRELOAD_LIB"); e && *e) return e;
  return BesideThisBinary({"../lib/libdnvme_preload.so", "libdnvme_preload.so"});
}

// The directory whose sitecustomize.py installs deepnvme.run_hook (torch.save on the engine):
// build/python-run beside build/bin, or an install's lib/dnvme/python-run; "" when there is none.
std::string FindPythonHook() {
  std::string site = BesideThisBinary(
      {"../python-run/sitecustomize.py", "../lib/dnvme/python-run/sitecustomize.py"});
  return site.empty() ? "" : site.substr(0, site.rfind('/'));
}

// "@name" when MNT serves a broker; throws UsageError otherwise.
void CheckMount(const std::string& mnt) {
  std::ifstream f(mnt + "/.dnvme/broker");
  if (!f) {
    throw UsageError("'" + mnt + "' is not a dnvmefs mount (no .dnvme/broker)");
  }
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (text.find("socket @") == std::string::npos) {
    throw UsageError("the mount at '" + mnt + "' does not serve `dnvme run` (-o preload=0)");
  }
}

}  // namespace

Command AddRunCommand(CLI::App& parent) {
  Command c;
  c.app = parent.add_subcommand(
      "run",
      "Run a program whose large reads and writes of files on dnvmefs mounts go straight to the "
      "backing files through its own engine (LD_PRELOAD of libdnvme_preload.so)");
  struct Opts {
    std::vector<std::string> mounts;
    std::string min_bytes = "128K";
    std::string config;
    std::string stats;
    bool no_torch_hook = false;
    std::string read_cache;
    bool cache_writes = false;
    std::vector<std::string> cmd;
  };
  auto o = std::make_shared<Opts>();
  // One value per --mount: a vector option would otherwise take the command's words too.
  c.app
      ->add_option("--mount", o->mounts,
                   "Only files on this mount (repeatable; default: every dnvmefs mount)")
      ->allow_extra_args(false);
  c.app
      ->add_option("--min-bytes", o->min_bytes,
                   "Smallest read/write done on the engine; smaller ones go through the mount")
      ->capture_default_str();
  c.app->add_option("--config", o->config, "The engine's HandleConfig JSON (as -o config=)");
  c.app->add_option("--stats", o->stats,
                    "Append each process's counters (one JSON line per process) to this file");
  c.app->add_flag("--no-torch-hook", o->no_torch_hook,
                  "Leave torch.save to torch (by default a Python program's torch.save of a file "
                  "on the mount writes through deepnvme: docs/preload.md)");
  c.app
      ->add_option("--read-cache", o->read_cache,
                   "Which reads the page cache serves: auto (what it holds, and every read of a "
                   "file that fits in half the memory available), resident (only what it holds), "
                   "off (none: every large read O_DIRECT); default auto (docs/preload.md)")
      ->check(CLI::IsMember({"auto", "resident", "off"}));
  c.app->add_flag("--cache-writes", o->cache_writes,
                  "Write files that fit in half the memory available through the page cache, so "
                  "that a read right after finds them there (off by default: slower writes)");
  c.app->add_option("cmd", o->cmd, "The command and its arguments (after --)")->required();
  c.run = [o]() -> int {
    auto min = ParseSize(o->min_bytes);
    if (!min.ok() || min.value() <= 0) {
      throw UsageError("--min-bytes '" + o->min_bytes + "': expected a size such as 64K or 1M");
    }
    std::string mounts;
    for (std::string m : o->mounts) {
      while (m.size() > 1 && m.back() == '/') m.pop_back();
      char real[PATH_MAX];
      if (realpath(m.c_str(), real) == nullptr) {
        throw UsageError("--mount '" + m + "': " + std::strerror(errno));
      }
      CheckMount(real);
      mounts += (mounts.empty() ? "" : ":") + std::string(real);
    }
    if (!o->config.empty()) {
      auto cfg = HandleConfig::FromJsonFile(o->config);
      if (!cfg.ok()) throw UsageError("--config: " + cfg.status().message());
    }
    const std::string lib = FindLibrary();
    if (lib.empty()) {
      std::cerr << "dnvme run: error: libdnvme_preload.so not found beside this binary (set "
                   "DNVME_PRELOAD_LIB)\n";
      return kExitFailure;
    }
    std::string preload = lib;
    if (const char* old = getenv("LD_PRELOAD"); old && *old) preload += std::string(":") + old;
    setenv("LD_PRELOAD", preload.c_str(), 1);
    setenv("DNVME_PRELOAD_MIN_BYTES", std::to_string(min.value()).c_str(), 1);
    if (!mounts.empty()) setenv("DNVME_PRELOAD_MOUNTS", mounts.c_str(), 1);
    if (!o->config.empty()) setenv("DNVME_PRELOAD_CONFIG", o->config.c_str(), 1);
    if (!o->stats.empty()) setenv("DNVME_PRELOAD_STATS", o->stats.c_str(), 1);
    if (!o->read_cache.empty()) setenv("DNVME_PRELOAD_READ_CACHE", o->read_cache.c_str(), 1);
    if (o->cache_writes) setenv("DNVME_PRELOAD_CACHE_WRITES", "1", 1);
    if (o->no_torch_hook) {
      setenv("DNVME_PRELOAD_TORCH", "0", 1);
    } else if (const std::string hook = FindPythonHook(); !hook.empty()) {
      std::string path = hook;
      if (const char* old = getenv("PYTHONPATH"); old && *old) path += std::string(":") + old;
      setenv("PYTHONPATH", path.c_str(), 1);
    }
    std::vector<char*> argv;
    for (auto& a : o->cmd) argv.push_back(a.data());
    argv.push_back(nullptr);
    execvp(argv[0], argv.data());
    std::cerr << "dnvme run: error: cannot run '" << o->cmd[0] << "': " << std::strerror(errno)
              << "\n";
    return errno == ENOENT ? 127 : 126;
  };
  return c;
}

}  // namespace dnvme::cli
