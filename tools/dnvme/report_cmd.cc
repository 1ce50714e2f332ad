// `dnvme report`: DeepSpeed's ds_report for dnvmefs. One line per capability, [OKAY] or [NO] with
// what to do about it, or one JSON object (--json) whose fields tests compare with what they can
// read themselves. Every check asks the system the way the engine, the mount or the GPU path
// would (io_setup, an O_DIRECT write, open("/dev/fuse"), the CUDA layer's device count, cuFile's
// dlopen and driver open, a GdsHandle's mode), so a [OKAY] means that path works here, not merely
// that a file exists. A machine without a GPU gets the reason, never a failed report.
//
// Nothing here needs root; what root changes (capabilities, /dev/fuse access) is reported as it
// is for the caller.
#include <fcntl.h>
#include <libaio.h>
#include <spdlog/fmt/fmt.h>
#include <spdlog/version.h>
#include <sys/capability.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/sysmacros.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "dnvme/config.h"
#include "dnvme/gds_handle.h"
#include "dnvme/gpu.h"
#include "dnvme/mount.h"
#include "dnvme/pinned.h"
#include "tools/dnvme/cli_util.h"
#include "tools/dnvme/commands.h"
#include "tools/dnvme/gpu_cli.h"

#ifndef DNVME_VERSION
#define DNVME_VERSION "unknown"
#endif
#ifndef DNVME_BUILD_TYPE
#define DNVME_BUILD_TYPE "unknown"
#endif
#ifndef DNVME_LIBFUSE_VERSION
#define DNVME_LIBFUSE_VERSION "unknown"
#endif

namespace dnvme::cli {
namespace {

using Json = nlohmann::ordered_json;

struct Check {
  std::string name;
  bool ok = false;
  std::string summary;  // one line: what was found
  std::string fix;      // empty when ok
  Json values = Json::object();
};

std::string ReadTrimmed(const std::string& path, bool* found = nullptr) {
  std::ifstream in(path);
  if (found != nullptr) *found = static_cast<bool>(in);
  std::string s;
  std::getline(in, s);
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

int64_t ReadInt(const std::string& path, int64_t fallback) {
  bool found = false;
  const std::string s = ReadTrimmed(path, &found);
  if (!found || s.empty()) return fallback;
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  return errno == 0 && end != s.c_str() ? v : fallback;
}

// --- checks ------------------------------------------------------------------------------------

Check CheckBuild() {
  Check c;
  c.name = "dnvmefs";
  c.values["version"] = DNVME_VERSION;
  c.values["build_type"] = DNVME_BUILD_TYPE;
#if defined(__clang__)
  c.values["compiler"] = "clang " __clang_version__;
#elif defined(__GNUC__)
  c.values["compiler"] = "gcc " __VERSION__;
#endif
#if defined(__SANITIZE_ADDRESS__)
  c.values["sanitizers"] = "address,undefined";
#elif defined(__SANITIZE_THREAD__)
  c.values["sanitizers"] = "thread";
#else
  c.values["sanitizers"] = "none";
#endif
  c.values["libfuse"] = DNVME_LIBFUSE_VERSION;
  c.values["spdlog"] =
      fmt::format("{}.{}.{}", SPDLOG_VER_MAJOR, SPDLOG_VER_MINOR, SPDLOG_VER_PATCH);
  c.values["cuda_built"] = gpu::BuiltWithCuda();
  c.values["gds_handle_built"] = true;  // always; without CUDA it refuses device memory
  // The daemon is installed next to the CLI (build/bin, PREFIX/bin).
  char self[4096];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  std::string daemon;
  if (n > 0) {
    self[n] = '\0';
    std::string dir(self);
    dir = dir.substr(0, dir.find_last_of('/'));
    if (::access((dir + "/dnvmefs").c_str(), X_OK) == 0) daemon = dir + "/dnvmefs";
  }
  c.values["dnvmefs_binary"] = daemon.empty() ? Json(nullptr) : Json(daemon);
  c.ok = !daemon.empty();
  c.summary =
      fmt::format("version {}, {} build, sanitizers {}, libfuse {}; daemon {}", DNVME_VERSION,
                  DNVME_BUILD_TYPE, c.values["sanitizers"].get<std::string>(),
                  DNVME_LIBFUSE_VERSION, daemon.empty() ? "not found" : daemon);
  if (daemon.empty()) {
    c.fix =
        "the dnvmefs daemon is not next to this dnvme binary: build it (scripts/build.sh) or "
        "install both (mount-scripts/install.sh)";
  }
  return c;
}

Check CheckLibaio(int queue_depth) {
  Check c;
  c.name = "libaio";
  const int64_t max_nr = ReadInt("/proc/sys/fs/aio-max-nr", -1);
  const int64_t nr = ReadInt("/proc/sys/fs/aio-nr", -1);
  c.values["aio_max_nr"] = max_nr;
  c.values["aio_nr"] = nr;
  io_context_t ctx{};
  const int rc = io_setup(queue_depth, &ctx);
  if (rc == 0) io_destroy(ctx);
  c.values["io_setup_ok"] = rc == 0;
  c.values["io_setup_error"] = rc == 0 ? Json(nullptr) : Json(std::strerror(-rc));
  // Each handle worker takes queue_depth events from the system-wide aio-max-nr.
  const int64_t fit = max_nr >= 0 && nr >= 0 ? (max_nr - nr) / queue_depth : -1;
  c.values["default_workers_that_fit"] = fit;
  c.ok = rc == 0;
  c.summary = rc == 0 ? fmt::format(
                            "io_setup({}) works; aio-nr {} of aio-max-nr {} ({} more "
                            "default workers fit)",
                            queue_depth, nr, max_nr, fit)
                      : fmt::format("io_setup({}) failed: {}; aio-nr {} of aio-max-nr {}",
                                    queue_depth, std::strerror(-rc), nr, max_nr);
  if (rc == -EAGAIN) {
    c.fix = "aio-max-nr is used up: sysctl -w fs.aio-max-nr=1048576 (and in /etc/sysctl.d)";
  } else if (rc != 0) {
    c.fix =
        "the kernel refuses native AIO (CONFIG_AIO off, or a seccomp filter): the engine "
        "cannot run";
  } else if (fit >= 0 && fit < 64) {
    c.ok = false;
    c.fix = "few handles fit: sysctl -w fs.aio-max-nr=1048576 (and in /etc/sysctl.d)";
  }
  return c;
}

std::string FsName(int64_t magic) {
  switch (magic) {
    case 0xEF53:
      return "ext4";
    case 0x58465342:
      return "xfs";
    case 0x9123683E:
      return "btrfs";
    case 0x01021994:
      return "tmpfs";
    case 0x65735546:
      return "fuse";
    case 0x794C7630:
      return "overlayfs";
    case 0x6969:
      return "nfs";
    case 0x2FC12FC1:
      return "zfs";
    case 0xF2F52010:
      return "f2fs";
    default:
      return fmt::format("0x{:x}", magic);
  }
}

Check CheckDirect(const std::string& dir) {
  Check c;
  c.name = "o_direct";
  c.values["dir"] = dir;
  struct statfs sfs {};
  if (::statfs(dir.c_str(), &sfs) != 0) {
    c.summary = fmt::format("{}: {}", dir, std::strerror(errno));
    c.fix = "give --dir an existing directory on the offload disk";
    return c;
  }
  c.values["filesystem"] = FsName(static_cast<int64_t>(sfs.f_type));
  // A file of our own, removed at once, so the check leaves nothing behind.
  std::string templ = dir + "/.dnvme_report.XXXXXX";
  const int fd = ::mkstemp(templ.data());
  if (fd < 0) {
    c.summary = fmt::format("cannot create a file in {}: {}", dir, std::strerror(errno));
    c.fix = "give --dir a directory you can write";
    return c;
  }
  ::unlink(templ.c_str());
  struct statx sx {};
  uint32_t mem_align = 0, offset_align = 0;
  if (::statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN)) {
    mem_align = sx.stx_dio_mem_align;
    offset_align = sx.stx_dio_offset_align;
  }
  c.values["dio_mem_align"] = mem_align;
  c.values["dio_offset_align"] = offset_align;
  // The real test: reopen with O_DIRECT and write one aligned block.
  const std::string self = fmt::format("/proc/self/fd/{}", fd);
  const int dfd = ::open(self.c_str(), O_RDWR | O_DIRECT | O_CLOEXEC);
  int err = dfd < 0 ? errno : 0;
  if (dfd >= 0) {
    void* block = nullptr;
    if (::posix_memalign(&block, 4096, 4096) == 0) {
      std::memset(block, 0, 4096);
      ssize_t w;
      do {
        w = ::pwrite(dfd, block, 4096, 0);
      } while (w < 0 && errno == EINTR);
      err = w == 4096 ? 0 : (w < 0 ? errno : EIO);
      std::free(block);
    } else {
      err = ENOMEM;
    }
    ::close(dfd);
  }
  ::close(fd);
  c.values["direct_write_ok"] = err == 0;
  c.ok = err == 0;
  if (c.ok) {
    c.summary = fmt::format("{} on {}: O_DIRECT works; alignment: memory {} B, file offset {} B{}",
                            dir, c.values["filesystem"].get<std::string>(), mem_align, offset_align,
                            mem_align == 0 ? " (not reported by the kernel)" : "");
  } else {
    c.summary = fmt::format("{} on {}: O_DIRECT refused: {}", dir,
                            c.values["filesystem"].get<std::string>(), std::strerror(err));
    c.fix =
        "this filesystem has no O_DIRECT (tmpfs, overlayfs, some FUSE): the engine falls back "
        "to buffered I/O (direct=auto). Put the offload directory on a local ext4/xfs on NVMe";
  }
  return c;
}

Check CheckMemlock(bool ipc_lock) {
  // What a mount with the default options pins (the daemon's own numbers).
  const MountRequirements mount = DefaultMountRequirements();
  const int64_t at_start = mount.pinned_at_start;
  const int64_t peak = mount.pinned_peak;
  Check c;
  c.name = "memlock";
  rlimit rl{};
  ::getrlimit(RLIMIT_MEMLOCK, &rl);
  auto limit = [](rlim_t v) {
    return v == RLIM_INFINITY ? Json(-1) : Json(static_cast<int64_t>(v));
  };
  c.values["soft_bytes"] = limit(rl.rlim_cur);
  c.values["hard_bytes"] = limit(rl.rlim_max);
  c.values["cap_ipc_lock"] = ipc_lock;
  c.values["mount_needs_bytes"] = at_start;
  c.values["mount_peak_bytes"] = peak;
  const bool unlimited = rl.rlim_cur == RLIM_INFINITY;
  const std::string soft = unlimited ? "unlimited" : FormatBytes(static_cast<int64_t>(rl.rlim_cur));
  c.ok = ipc_lock || unlimited || static_cast<int64_t>(rl.rlim_cur) >= peak;
  c.summary = fmt::format("RLIMIT_MEMLOCK {}{}; a default mount pins {} at start and up to {}",
                          soft, ipc_lock ? " (CAP_IPC_LOCK held: no limit applies)" : "",
                          FormatBytes(at_start), FormatBytes(peak));
  if (!c.ok) {
    c.fix =
        "raise the limit: `ulimit -l unlimited`, a 'memlock' line in "
        "/etc/security/limits.conf, LimitMEMLOCK=infinity in a systemd unit, or run as root "
        "(CAP_IPC_LOCK)";
  }
  return c;
}

Check CheckFuseDevice() {
  Check c;
  c.name = "fuse_device";
  struct stat st {};
  if (::stat("/dev/fuse", &st) != 0 || !S_ISCHR(st.st_mode)) {
    c.values["present"] = false;
    c.summary = "/dev/fuse is missing";
    c.fix = "modprobe fuse (in a container: pass --device /dev/fuse)";
    return c;
  }
  c.values["present"] = true;
  c.values["mode"] = fmt::format("{:04o}", st.st_mode & 07777);
  const int fd = ::open("/dev/fuse", O_RDWR | O_CLOEXEC);
  const int err = fd < 0 ? errno : 0;
  if (fd >= 0) ::close(fd);
  c.values["openable"] = err == 0;
  c.values["users_can_mount"] = (st.st_mode & 0006) == 0006;
  c.ok = err == 0;
  c.summary = fmt::format("/dev/fuse mode {}: {}{}", c.values["mode"].get<std::string>(),
                          err == 0 ? "opens" : std::string("cannot open: ") + std::strerror(err),
                          (st.st_mode & 0006) == 0006 ? "" : " (only root can mount)");
  if (!c.ok) c.fix = "run as root, or chmod 0666 /dev/fuse (Debian's udev default)";
  return c;
}

Check CheckFusermount() {
  Check c;
  c.name = "fusermount3";
  std::string found;
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path != nullptr ? path : "/usr/bin:/bin");
  for (std::string d; std::getline(dirs, d, ':');) {
    const std::string candidate = (d.empty() ? "." : d) + "/fusermount3";
    if (::access(candidate.c_str(), X_OK) == 0) {
      found = candidate;
      break;
    }
  }
  struct stat st {};
  const bool setuid_root = !found.empty() && ::stat(found.c_str(), &st) == 0 &&
                           (st.st_mode & S_ISUID) != 0 && st.st_uid == 0;
  c.values["path"] = found.empty() ? Json(nullptr) : Json(found);
  c.values["setuid_root"] = setuid_root;
  c.ok = setuid_root;
  c.summary = found.empty() ? "fusermount3 not on PATH"
                            : fmt::format("{}{}", found,
                                          setuid_root ? " (setuid root)" : " (not setuid root)");
  if (!c.ok) {
    c.fix =
        "apt-get install fuse3: the daemon mounts and unmounts through the setuid "
        "fusermount3 (auto_unmount), also as root";
  }
  return c;
}

Check CheckFuseMaxPages() {
  Check c;
  c.name = "fuse_max_pages";
  // libfuse 3.14 asks for at most 256 pages (1 MiB) per request whatever the kernel allows; a
  // dnvmefs mount asks for one page more (fs/transport/protocol_ext.h), so that a 1 MiB write
  // from a buffer that is not page-aligned (257 pages) arrives in one request, not two.
  constexpr int64_t kLibfusePages = 256;
  constexpr int64_t kMountPages = kLibfusePages + 1;
  const int64_t limit = ReadInt("/proc/sys/fs/fuse/max_pages_limit", -1);
  const int64_t kernel = limit > 0 ? limit : kLibfusePages;  // before 6.13: fixed 256
  const int64_t used = std::min(kernel, kLibfusePages);
  const int64_t page = ::sysconf(_SC_PAGESIZE);
  c.values["max_pages_limit"] = limit > 0 ? Json(limit) : Json(nullptr);
  c.values["libfuse_max_pages"] = kLibfusePages;
  c.values["max_request_bytes"] = used * page;
  c.values["mount_max_pages"] = kMountPages;
  c.values["unaligned_writes_whole"] = kernel >= kMountPages;
  c.ok = used >= kLibfusePages;
  c.summary = fmt::format(
      "kernel max_pages_limit {}; requests of up to {} (libfuse 3.14 asks for 256 pages); {}",
      limit > 0 ? std::to_string(limit) : "not exposed (256 built in)", FormatBytes(used * page),
      kernel >= kMountPages
          ? "1 MiB writes from buffers that are not page-aligned arrive whole (257 pages)"
          : fmt::format(
                "1 MiB writes from buffers that are not page-aligned arrive split in two "
                "requests{}",
                limit > 0 ? " (sysctl -w fs.fuse.max_pages_limit=257 lets them through)" : ""));
  if (!c.ok) c.fix = "sysctl -w fs.fuse.max_pages_limit=257 for 1 MiB requests";
  return c;
}

// "y"/"m" for a CONFIG_ option of the running kernel, "n" when the config says it is not set, ""
// when there is no config to read (/boot/config-RELEASE, or /proc/config.gz through gzip).
std::string KernelConfig(const std::string& option) {
  struct utsname u {};
  std::string text;
  if (uname(&u) == 0) {
    std::ifstream boot(std::string("/boot/config-") + u.release);
    if (boot) text.assign(std::istreambuf_iterator<char>(boot), {});
  }
  if (text.empty() && ::access("/proc/config.gz", R_OK) == 0) {
    if (FILE* p = ::popen("gzip -dc /proc/config.gz 2>/dev/null", "r"); p != nullptr) {
      char buf[65536];
      size_t n;
      while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) text.append(buf, n);
      ::pclose(p);
    }
  }
  if (text.empty()) return "";
  const std::string set = "\n" + option + "=";
  if (auto at = ("\n" + text).find(set); at != std::string::npos) {
    return text.substr(at + set.size() - 1, 1);
  }
  return "n";
}

// Whether the running kernel's release is at least major.minor (false when uname fails).
bool KernelAtLeast(int major, int minor) {
  struct utsname u {};
  int ma = 0, mi = 0;
  if (uname(&u) != 0 || std::sscanf(u.release, "%d.%d", &ma, &mi) != 2) return false;
  return ma > major || (ma == major && mi >= minor);
}

// Whether `v` is in the set `set` (effective unless said) of `caps`.
bool CapIn(cap_t caps, cap_value_t v, cap_flag_t set = CAP_EFFECTIVE) {
  cap_flag_value_t f = CAP_CLEAR;
  return cap_get_flag(caps, v, set, &f) == 0 && f == CAP_SET;
}

// What the kernel's FUSE offers for the fast-NVMe work, and which of it a mount uses by default:
// FUSE over io_uring (-o io_uring=1 where enable_uring is on), passthrough (-o passthrough=) and
// the writeback cache (requests above 1 MiB: fuse_max_pages).
// Informational: never [NO].
Check CheckFuseKernel() {
  Check c;
  c.name = "fuse_kernel";
  c.ok = true;
  bool uring_param = false;
  const std::string uring = ReadTrimmed("/sys/module/fuse/parameters/enable_uring", &uring_param);
  const std::string uring_config = KernelConfig("CONFIG_FUSE_IO_URING");
  const std::string passthrough_config = KernelConfig("CONFIG_FUSE_PASSTHROUGH");
  auto offered = [](const std::string& config) {
    return config.empty() ? Json(nullptr) : Json(config == "y" || config == "m");
  };
  c.values["io_uring_offered"] = uring_param ? Json(true) : offered(uring_config);
  c.values["io_uring_enabled"] = uring_param && (uring == "Y" || uring == "1");
  c.values["passthrough_offered"] = offered(passthrough_config);
  c.values["writeback_cache_offered"] = true;
  // What a dnvmefs mount started here by this user asks for with its defaults: passthrough for
  // read-only opens (-o passthrough=read, fs/fuse/passthrough.h) where the kernel
  // offers it and the daemon holds CAP_SYS_ADMIN (it keeps it dormant for the backing-file
  // ioctls); unknown (null) when the kernel config cannot be read.
  bool sys_admin = false;
  if (cap_t caps = cap_get_proc(); caps != nullptr) {
    sys_admin = CapIn(caps, CAP_SYS_ADMIN, CAP_PERMITTED);
    cap_free(caps);
  }
  c.values["cap_sys_admin"] = sys_admin;
  const Json& pt = c.values["passthrough_offered"];
  const Json pt_used = pt.is_null() ? Json(nullptr) : Json(pt.get<bool>() && sys_admin);
  // direct_io opens that may still be mmapped (FUSE_DIRECT_IO_ALLOW_MMAP) came with 6.6: a mount
  // gives every open for writing direct_io there, and write-only ones elsewhere (fs/options.h).
  const bool dio_mmap = KernelAtLeast(6, 6);
  c.values["direct_io_allow_mmap_offered"] = dio_mmap;
  c.values["used"] = Json{{"io_uring", false},
                          {"passthrough", pt_used},
                          {"writeback_cache", false},
                          {"direct_io", dio_mmap ? "writable" : "wronly"}};
  auto state = [](const Json& v) {
    return v.is_null() ? std::string("unknown (no kernel config readable)")
                       : std::string(v.get<bool>() ? "offered" : "not in this kernel");
  };
  std::string uring_text = state(c.values["io_uring_offered"]);
  if (uring_param) {
    uring_text += c.values["io_uring_enabled"].get<bool>()
                      ? ", enabled"
                      : ", disabled (echo Y > /sys/module/fuse/parameters/enable_uring)";
  }
  std::string pt_text = state(pt);
  if (!pt.is_null() && pt.get<bool>()) {
    pt_text += sys_admin ? ", used for read-only opens (-o passthrough=off|direct|read|all)"
                         : ", unused: the daemon needs root (CAP_SYS_ADMIN) to register backing "
                           "files";
  }
  c.summary = fmt::format(
      "FUSE over io_uring {} (a mount uses it with -o io_uring=1; off by default: measured "
      "mixed, docs/performance.md); passthrough {}; writers' own pages (direct_io) for {} "
      "(-o direct_io=off|wronly|writable){}; writeback cache offered, not used (measured "
      "slower: docs/performance-journal.md)",
      uring_text, pt_text, dio_mmap ? "every open for writing" : "write-only opens",
      dio_mmap ? "" : " (mmap of direct_io opens needs kernel 6.6)");
  return c;
}

// Spliced requests (fs/transport/session_loop.h): the daemon needs 2 MiB pipes, above the default
// fs.pipe-max-size unless it holds CAP_SYS_RESOURCE when it starts.
Check CheckSplicePipes() {
  Check c;
  c.name = "splice_pipes";
  const int64_t max = ReadInt("/proc/sys/fs/pipe-max-size", -1);
  bool sys_resource = false;
  if (cap_t caps = cap_get_proc(); caps != nullptr) {
    sys_resource = CapIn(caps, CAP_SYS_RESOURCE);
    cap_free(caps);
  }
  c.values["pipe_max_size"] = max >= 0 ? Json(max) : Json(nullptr);
  c.values["cap_sys_resource"] = sys_resource;
  const int64_t need = DefaultMountRequirements().request_pipe_bytes;
  c.values["request_pipe_bytes"] = need;
  const bool possible = sys_resource || max >= need;
  c.values["splice_possible"] = possible;
  // A mount splices by default only when writers go through the page cache (-o direct_io=off or
  // wronly): with the default direct_io=writable, writes come from the writers' own pages, which
  // splicing could only copy (fs/options.h). So this is informational.
  c.ok = true;
  c.summary = fmt::format(
      "not needed by default (-o direct_io=writable reads requests); with -o direct_io=off|wronly "
      "a daemon started here {}",
      possible
          ? fmt::format("gets {} request pipes ({}): page-cache writes go to disk without a "
                        "copy in the daemon",
                        FormatBytes(need),
                        sys_resource ? "CAP_SYS_RESOURCE" : "fs.pipe-max-size " + FormatBytes(max))
          : fmt::format("reads requests instead of splicing them: fs.pipe-max-size {} and "
                        "no CAP_SYS_RESOURCE (sysctl -w fs.pipe-max-size=2097152 before "
                        "mounting)",
                        max >= 0 ? FormatBytes(max) : std::string("unknown")));
  return c;
}

Check CheckCapabilities(bool* ipc_lock) {
  Check c;
  c.name = "capabilities";
  *ipc_lock = false;
  cap_t caps = cap_get_proc();
  if (caps == nullptr) {
    c.summary = fmt::format("cap_get_proc: {}", std::strerror(errno));
    return c;
  }
  std::unique_ptr<std::remove_pointer_t<cap_t>, int (*)(void*)> owner(caps, cap_free);
  auto has = [caps](cap_value_t v) { return CapIn(caps, v); };
  *ipc_lock = has(CAP_IPC_LOCK);
  const bool sys_admin = has(CAP_SYS_ADMIN);
  c.values["uid"] = static_cast<int64_t>(::geteuid());
  c.values["cap_ipc_lock"] = *ipc_lock;
  c.values["cap_sys_admin"] = sys_admin;
  c.values["cap_setuid"] = has(CAP_SETUID);
  c.values["cap_dac_override"] = has(CAP_DAC_OVERRIDE);
  // The daemon needs CAP_SYS_ADMIN only to mount (before it drops it); a user mounts through
  // fusermount3 instead. CAP_IPC_LOCK lifts RLIMIT_MEMLOCK for pinned buffers.
  c.ok = true;
  std::vector<std::string> held;
  if (*ipc_lock) held.push_back("CAP_IPC_LOCK");
  if (sys_admin) held.push_back("CAP_SYS_ADMIN");
  if (has(CAP_SETUID)) held.push_back("CAP_SETUID");
  if (has(CAP_DAC_OVERRIDE)) held.push_back("CAP_DAC_OVERRIDE");
  std::string list;
  for (const auto& h : held) list += (list.empty() ? "" : ", ") + h;
  c.summary = fmt::format("uid {}; effective, of those dnvmefs uses: {}", ::geteuid(),
                          list.empty() ? "none" : list);
  if (!sys_admin) {
    c.summary += "; mounts go through fusermount3";
  }
  return c;
}

// The GPU path as the engine sees it: the CUDA runtime this build links, the devices it finds
// (or CUDA's reason there are none) and the NVIDIA kernel driver behind them.
Check CheckGpu(bool* have_device) {
  Check c;
  c.name = "gpu";
  *have_device = false;
  const bool built = gpu::BuiltWithCuda();
  c.values["built_with_cuda"] = built;
  c.values["cuda_runtime_version"] =
      built ? Json(CudaVersionString(gpu::RuntimeVersion())) : Json(nullptr);
  bool kernel_found = false;
  const std::string kernel = ReadTrimmed("/proc/driver/nvidia/version", &kernel_found);
  c.values["nvidia_driver"] = kernel_found ? Json(kernel) : Json(nullptr);
  // DeviceCount's error message is the reason, in CUDA's words (no driver, no device, ...).
  Result<int> count = gpu::DeviceCount();
  Json devices = Json::array();
  std::vector<std::string> labels;
  for (int i = 0; count.ok() && i < *count; ++i) {
    Json d;
    d["index"] = i;
    Result<gpu::DeviceInfo> info = gpu::GetDeviceInfo(i);
    if (!info.ok()) {
      d["error"] = info.status().message();
      labels.push_back(fmt::format("{}: {}", i, info.status().message()));
      devices.push_back(d);
      continue;
    }
    d["name"] = info->name;
    d["pci_bus_id"] = info->pci_bus_id;
    d["total_memory_bytes"] = info->total_memory;
    d["compute_capability"] = fmt::format("{}.{}", info->compute_major, info->compute_minor);
    d["driver_version"] = CudaVersionString(info->driver_version);
    labels.push_back(fmt::format("{}, {}, sm {}.{}, driver {}", DeviceLabel(*info),
                                 FormatBytes(info->total_memory), info->compute_major,
                                 info->compute_minor, CudaVersionString(info->driver_version)));
    devices.push_back(d);
  }
  c.values["device_count"] = count.ok() ? *count : 0;
  c.values["devices"] = devices;
  c.values["reason"] = count.ok() ? Json(nullptr) : Json(count.status().message());
  *have_device = count.ok() && *count > 0;
  c.ok = *have_device;
  if (!built) {
    c.summary = "built without CUDA: GPU buffers (--gpu, gds_handle) are refused";
    c.fix =
        "rebuild with the CUDA toolkit installed (/usr/local/cuda, cmake -DDNVME_WITH_CUDA=ON) "
        "for the GPU paths; host I/O does not need it";
    return c;
  }
  const std::string runtime = CudaVersionString(gpu::RuntimeVersion());
  std::string list;
  for (const std::string& l : labels) list += (list.empty() ? "" : "; ") + l;
  c.summary = count.ok() ? fmt::format("CUDA runtime {} (built in); {} device{}: {}", runtime,
                                       *count, *count == 1 ? "" : "s", list)
                         : fmt::format("CUDA runtime {} (built in); no device: {}", runtime,
                                       count.status().message());
  if (!c.ok) {
    c.fix = fmt::format(
        "no usable GPU ({}): GPU buffers (--gpu, gds_handle) are unavailable; host paths are "
        "unaffected",
        kernel_found ? "the NVIDIA kernel driver is loaded" : "no NVIDIA kernel driver loaded");
  }
  return c;
}

// cuFile as a GdsHandle loads it (dlopen of GdsOptions' default library, then cuFileDriverOpen),
// and the mode a handle with the default policy (cufile=auto) gets on device 0, found by creating
// one: the engine's own decision, not a guess from the set-up.
Check CheckCufile(bool have_device, const std::string& no_device_reason) {
  Check c;
  c.name = "cufile";
  const GdsOptions defaults;
  c.values["library"] = defaults.cufile_library;
  const CuFileProbe d = ProbeCuFile(defaults.cufile_library);
  const bool found = d.found;
  c.values["found"] = found;
  c.values["loaded"] = d.loaded;
  c.values["error"] = d.loaded ? Json(nullptr) : Json(d.error);
  c.values["version"] = d.loaded && d.version > 0 ? Json(d.version) : Json(nullptr);
  bool nvfs_file = false;
  const std::string nvfs_version = ReadTrimmed("/proc/driver/nvidia-fs/version", &nvfs_file);
  c.values["nvidia_fs"] = nvfs_file ? Json(nvfs_version) : Json(nullptr);
  c.values["nvidia_fs_loaded"] = d.loaded ? d.nvfs_loaded : nvfs_file;
  c.values["nvfs_driver_version"] = d.loaded && d.nvfs_major > 0
                                        ? Json(fmt::format("{}.{}", d.nvfs_major, d.nvfs_minor))
                                        : Json(nullptr);
  c.values["p2pdma"] = d.loaded && d.p2pdma;

  std::string mode_text;
  if (!have_device) {
    c.values["mode"] = nullptr;
    c.values["mode_reason"] = "no device: " + no_device_reason;
    mode_text = "none, no device (see gpu)";
  } else {
    GdsOptions probe;
    probe.bounce_chunk_bytes = 4 << 20;  // the smallest staging: this handle never moves data
    Result<std::unique_ptr<GdsHandle>> h = GdsHandle::Create(HandleConfig{}, probe);
    if (h.ok()) {
      c.values["mode"] = GdsModeName((*h)->mode());
      c.values["mode_reason"] = (*h)->mode_reason();
      mode_text = fmt::format("{} ({})", GdsModeName((*h)->mode()), (*h)->mode_reason());
      c.ok = (*h)->mode() == GdsMode::kGds || (*h)->mode() == GdsMode::kP2pDma;
    } else {
      c.values["mode"] = nullptr;
      c.values["mode_reason"] = "gds_handle: " + h.status().message();
      mode_text = "none, gds_handle fails: " + h.status().message();
    }
  }
  std::string lib_text;
  if (d.loaded) {
    lib_text = fmt::format("{} loaded (version {}); nvidia-fs {}; p2pdma {}", d.library,
                           d.version > 0 ? std::to_string(d.version) : "unknown",
                           d.nvfs_loaded ? (nvfs_file ? nvfs_version : "loaded") : "not loaded",
                           d.p2pdma ? "yes" : "no");
  } else {
    lib_text = fmt::format("{}; nvidia-fs {}", d.error, nvfs_file ? nvfs_version : "not loaded");
  }
  c.summary = fmt::format("{}; gds_handle mode: {}", lib_text, mode_text);
  if (!c.ok) {
    if (!found) {
      c.fix =
          "install NVIDIA GDS (libcufile, nvidia-fs) for GPUDirect Storage; without it --gpu "
          "moves GPU memory through the CUDA bounce path";
    } else if (!have_device) {
      c.fix = "no usable GPU: see the gpu check";
    } else if (!d.loaded) {
      c.fix = "cuFile is installed but its driver does not open (the reason is above)";
    } else {
      c.fix =
          "cuFile offers only compat mode: load nvidia-fs (modprobe nvidia-fs) or enable P2PDMA "
          "(\"use_pci_p2pdma\": true in /etc/cufile.json) for GPUDirect Storage; meanwhile the "
          "bounce path is used";
    }
  }
  return c;
}

// --- output ------------------------------------------------------------------------------------

int RunReport(const std::string& dir, bool json) {
  // A directory we cannot write is still worth a report (o_direct says why it is [NO]).
  CheckDirFlag("--dir", dir, DirAccess::kAny);

  std::vector<Check> checks;
  checks.push_back(CheckBuild());
  checks.push_back(CheckLibaio(HandleConfig{}.queue_depth));
  checks.push_back(CheckDirect(dir));
  bool ipc_lock = false;
  Check caps = CheckCapabilities(&ipc_lock);
  checks.push_back(CheckMemlock(ipc_lock));
  checks.push_back(CheckFuseDevice());
  checks.push_back(CheckFusermount());
  checks.push_back(CheckFuseMaxPages());
  checks.push_back(CheckFuseKernel());
  checks.push_back(CheckSplicePipes());
  checks.push_back(std::move(caps));
  // Never fails for want of a GPU: the reasons are the report.
  bool have_device = false;
  Check gpu = CheckGpu(&have_device);
  const std::string no_device_reason =
      gpu.values["reason"].is_string() ? gpu.values["reason"].get<std::string>() : gpu.summary;
  checks.push_back(std::move(gpu));
  checks.push_back(CheckCufile(have_device, no_device_reason));

  if (json) {
    Json j;
    j["version"] = DNVME_VERSION;
    j["dir"] = dir;
    Json all = Json::object();
    for (const Check& c : checks) {
      Json o;
      o["ok"] = c.ok;
      o["summary"] = c.summary;
      o["fix"] = c.fix.empty() ? Json(nullptr) : Json(c.fix);
      for (const auto& [k, v] : c.values.items()) o[k] = v;
      all[c.name] = o;
    }
    j["checks"] = all;
    std::cout << j.dump() << std::endl;
    return kExitOk;
  }
  std::cout << fmt::format("dnvme report (dnvmefs {})\n", DNVME_VERSION);
  for (const Check& c : checks) {
    std::cout << fmt::format("{:<7}{:<15}{}\n", c.ok ? "[OKAY]" : "[NO]", c.name, c.summary);
    if (!c.ok && !c.fix.empty()) std::cout << fmt::format("{:22}fix: {}\n", "", c.fix);
  }
  return kExitOk;
}

}  // namespace

Command AddReportCommand(CLI::App& parent) {
  auto dir = std::make_shared<std::string>(".");
  auto json = std::make_shared<bool>(false);
  CLI::App* cmd = parent.add_subcommand(
      "report", "What this machine can do for dnvmefs, one line per capability (ds_report)");
  cmd->add_option("--dir", *dir, "Directory to check O_DIRECT on (the offload directory)")
      ->capture_default_str();
  cmd->add_flag("--json", *json, "One JSON object instead of text");
  return Command{cmd, [dir, json] { return RunReport(*dir, *json); }};
}

}  // namespace dnvme::cli
