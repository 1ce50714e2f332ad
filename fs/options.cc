#include "fs/options.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <optional>
#include <string_view>
#include <utility>

namespace dnvme::fs {
namespace {

// Splits "a,b=c,d" on commas; a backslash escapes a comma (as libfuse does).
std::vector<std::string> SplitOpts(std::string_view s) {
  std::vector<std::string> out;
  std::string cur;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 1 < s.size()) {
      cur += s[++i];
    } else if (s[i] == ',') {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += s[i];
    }
  }
  out.push_back(cur);
  return out;
}

std::string Absolute(const std::string& p) {
  char buf[PATH_MAX];
  if (realpath(p.c_str(), buf) != nullptr) return buf;
  return p;  // CheckDirectories reports the error with the name as given
}

}  // namespace

std::string UsageText() {
  std::string text =
      "usage: dnvmefs BACKING_DIR MOUNTPOINT [-f] [-d] [-s] [-o opt[,opt...]]\n"
      "  -f            stay in the foreground\n"
      "  -d            debug: foreground, log_level=debug and libfuse request tracing\n"
      "  -s            single-threaded request loop\n"
      "dnvmefs options (-o); the engine's (the keys of `dnvme io --config` JSON):\n";
  for (const ConfigKey& k : ConfigKeys()) {
    std::string form = k.name;
    if (k.type == ConfigValueType::kSize) form += "=SIZE";
    if (k.type == ConfigValueType::kInt) form += "=N";
    if (k.type == ConfigValueType::kBool) form += "[=0|1]";
    if (k.type == ConfigValueType::kDirect) form += "=auto|required|never";
    form.resize(std::max<size_t>(form.size() + 1, 29), ' ');
    text += "  " + form + k.help + "\n";
  }
  text +=
      "  config=FILE.json             the same JSON as `dnvme io --config`\n"
      "the mount's:\n"
      "  write_behind=SIZE            pinned memory for write-behind (0 disables; 64M)\n"
      "  write_chunk=SIZE             bytes per write-behind flush (8M)\n"
      "  read_ahead=SIZE              read-ahead per sequential reader (0 disables; 16M)\n"
      "  direct_io=off|wronly|writable  opens whose writes come from the writer's pages, not "
      "the\n"
      "                               page cache: none, write-only, all for writing (writable)\n"
      "  splice_read=0|1              splice requests; page-cache writes go to disk uncopied "
      "(1 unless\n"
      "                               direct_io=writable)\n"
      "  preload=0|1                  serve `dnvme run` clients backing-file descriptors (1)\n"
      "  splice_reply=0|1             send READ replies by vmsplice + splice, not writev (0)\n"
      "  async_reply=0|1              answer O_DIRECT reads from the engine's completion (0)\n"
      "  clone_fd=0|1                 libfuse's loop, one /dev/fuse fd per thread, no splice "
      "(0)\n"
      "  loop_threads=N               request-loop threads, 1..64 (32)\n"
      "  io_uring=0|1                 FUSE over io_uring where the kernel enables it (0)\n"
      "  uring_threads=N              io_uring: threads per queue (CPU), 1..64 (4)\n"
      "  max_request=SIZE             largest READ/WRITE request, 4K..16M in whole pages (1M; "
      "above\n"
      "                               it raise fs.fuse.max_pages_limit)\n"
      "  max_read=SIZE                largest READ request (max_request)\n"
      "  passthrough=off|direct|read|all  opens the kernel serves from the backing file "
      "itself:\n"
      "                               none, read-only O_DIRECT, read-only (default), all; "
      "kernel 6.9+, root\n"
      "per-uid limits (each user alone; docs/security.md):\n"
      "  ctl_max_handles=N            control-file handles (8)\n"
      "  ctl_max_bytes=SIZE           client memory registered (RAM/4)\n"
      "  ctl_max_buffers=N            client buffers registered, 0..16384 (256)\n"
      "  ctl_max_pinned=SIZE          pinned bounce memory of control handles (min(RAM/16, 4G))\n"
      "  ctl_max_pending=N            async control transfers not yet collected (1024)\n"
      "  ctl_threads_per_uid=N        control requests running at once, 1..64 (4)\n"
      "  max_files_per_uid=N          files the daemon holds open for a uid\n"
      "                               (max(1024, RLIMIT_NOFILE hard limit/16))\n"
      "  broker_max_conns_per_uid=N   `dnvme run` broker connections, 0..4096 (128)\n"
      "  max_inodes_per_uid=N         inodes a uid's lookups make the daemon hold (an O_PATH fd\n"
      "                               each) (max(4096, RLIMIT_NOFILE hard limit/4))\n"
      "  ctl_max_opens=N              open files of .dnvme (ctl, stats, config), 1..1048576 "
      "(1024)\n"
      "  ctl_max_workers=N            engine threads of control handles, 0..65536 (64)\n"
      "  ctl_max_aio_events=N         libaio events of control handles (workers x queue_depth),\n"
      "                               0..1073741824 (8192)\n"
      "  log_level=LEVEL log_file=PATH nonempty\n"
      "every other -o option goes to FUSE (allow_other, ro, fsname=, max_background=, ...)\n";
  return text;
}

namespace {
// -o passthrough=NAME, both ways (parsing, the stats, the error message).
constexpr std::pair<Passthrough, const char*> kPassthroughNames[] = {
    {Passthrough::kOff, "off"},
    {Passthrough::kDirect, "direct"},
    {Passthrough::kRead, "read"},
    {Passthrough::kAll, "all"}};
// -o direct_io=NAME, both ways.
constexpr std::pair<DirectIo, const char*> kDirectIoNames[] = {
    {DirectIo::kOff, "off"}, {DirectIo::kWriteOnly, "wronly"}, {DirectIo::kWritable, "writable"}};

// Looks `text` up in a table of {value, name} pairs; the error lists every name.
template <typename T, size_t N>
Result<T> ParseNamed(const std::string& key, const std::string& text,
                     const std::pair<T, const char*> (&names)[N]) {
  for (const auto& [value, name] : names) {
    if (text == name) return value;
  }
  std::string all;
  for (const auto& [value, name] : names) all += std::string(all.empty() ? "" : ", ") + name;
  return Status::InvalidArgument("option '" + key + "': '" + text + "' is not one of " + all);
}

// An integer option within [lo, hi] (the limits and thread counts): the usage error names the
// option and its range.
template <typename T>
Status ParseIntInRange(const std::string& key, const std::optional<std::string>& text, int64_t lo,
                       int64_t hi, T* out) {
  DNVME_ASSIGN_OR_RETURN(const int n, ParseIntOption(key, text));
  if (n < lo || n > hi) {
    return Status::InvalidArgument("option '" + key + "' must be " + std::to_string(lo) + ".." +
                                   std::to_string(hi));
  }
  *out = n;
  return Status::Ok();
}

// The name of `value` in such a table.
template <typename T, size_t N>
const char* NameOf(T value, const std::pair<T, const char*> (&names)[N]) {
  for (const auto& [v, name] : names) {
    if (v == value) return name;
  }
  return "?";
}

}  // namespace

int64_t MachineRamBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return int64_t{1} << 30;
  return static_cast<int64_t>(pages) * page;
}

int64_t DefaultCtlMaxBytes() { return MachineRamBytes() / 4; }

int64_t DefaultCtlMaxPinned() {
  return std::min<int64_t>(MachineRamBytes() / 16, int64_t{4} << 30);
}

int64_t DefaultMaxFilesPerUid() {
  rlimit rl{};
  int64_t hard = 1024;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
    hard = rl.rlim_max == RLIM_INFINITY ? (int64_t{1} << 30) : static_cast<int64_t>(rl.rlim_max);
  }
  return std::max<int64_t>(1024, hard / 16);
}

int64_t DefaultMaxInodesPerUid() { return DefaultMaxFilesPerUid() * 4; }

const char* DirectIoName(DirectIo d) { return NameOf(d, kDirectIoNames); }

bool OpenGetsDirectIo(DirectIo d, int open_flags, bool mmap_ok) {
  const int acc = open_flags & O_ACCMODE;
  switch (d) {
    case DirectIo::kOff:
      return false;
    case DirectIo::kWriteOnly:
      return acc == O_WRONLY;
    case DirectIo::kWritable:
      return acc == O_WRONLY || (acc == O_RDWR && mmap_ok);
  }
  return false;
}

const char* PassthroughName(Passthrough p) { return NameOf(p, kPassthroughNames); }

Result<MountOptions> ParseMountOptions(int argc, char** argv) {
  MountOptions o;
  std::vector<std::string> positional;
  std::vector<std::string> raw_opts;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "-f") {
      o.foreground = true;
    } else if (a == "-d" || a == "--debug") {
      o.debug = true;
      o.foreground = true;
    } else if (a == "-s") {
      o.single_thread = true;
    } else if (a == "-h" || a == "--help") {
      o.show_help = true;
    } else if (a == "-V" || a == "--version") {
      o.show_version = true;
    } else if (a == "-o") {
      if (i + 1 >= argc) return Status::InvalidArgument("-o needs an argument");
      raw_opts.push_back(argv[++i]);
    } else if (a.rfind("-o", 0) == 0) {
      raw_opts.push_back(a.substr(2));
    } else if (!a.empty() && a[0] == '-') {
      return Status::InvalidArgument("unknown flag '" + a + "'");
    } else {
      positional.push_back(a);
    }
  }
  if (o.show_help || o.show_version) return o;
  if (positional.size() != 2) {
    return Status::InvalidArgument("expected BACKING_DIR and MOUNTPOINT, got " +
                                   std::to_string(positional.size()) + " argument(s)");
  }
  o.backing = Absolute(positional[0]);
  o.mountpoint = Absolute(positional[1]);

  // config= first, so explicit keys override it wherever they appear.
  std::vector<std::pair<std::string, std::optional<std::string>>> kv;
  for (const auto& group : raw_opts) {
    for (const auto& opt : SplitOpts(group)) {
      if (opt.empty()) continue;
      auto eq = opt.find('=');
      if (eq == std::string::npos) {
        kv.emplace_back(opt, std::nullopt);
      } else {
        kv.emplace_back(opt.substr(0, eq), opt.substr(eq + 1));
      }
    }
  }
  for (const auto& [k, v] : kv) {
    if (k != "config") continue;
    if (!v || v->empty()) return Status::InvalidArgument("option 'config' needs a file name");
    auto c = HandleConfig::FromJsonFile(*v);
    if (!c.ok()) return c.status();
    o.engine = c.value();
  }
  bool chunk_given = false;
  for (const auto& [k, v] : kv) {
    if (k == "config") continue;
    if (FindConfigKey(k) != nullptr) {  // an engine key (include/dnvme/config.h's table)
      DNVME_RETURN_IF_ERROR(SetConfigKeyFromText(&o.engine, k, v));
    } else if (k == "write_behind") {
      DNVME_ASSIGN_OR_RETURN(o.write_behind, ParseSizeOption(k, v));
    } else if (k == "write_chunk") {
      DNVME_ASSIGN_OR_RETURN(o.write_chunk, ParseSizeOption(k, v));
      chunk_given = true;
    } else if (k == "splice_read") {
      DNVME_ASSIGN_OR_RETURN(bool splice, ParseBoolOption(k, v));
      o.splice_read = splice;
    } else if (k == "direct_io") {
      DNVME_ASSIGN_OR_RETURN(o.direct_io, ParseNamed(k, v.value_or(""), kDirectIoNames));
    } else if (k == "preload") {
      DNVME_ASSIGN_OR_RETURN(o.preload, ParseBoolOption(k, v));
    } else if (k == "splice_reply") {
      DNVME_ASSIGN_OR_RETURN(o.splice_reply, ParseBoolOption(k, v));
    } else if (k == "async_reply") {
      DNVME_ASSIGN_OR_RETURN(o.async_reply, ParseBoolOption(k, v));
    } else if (k == "io_uring") {
      DNVME_ASSIGN_OR_RETURN(o.io_uring, ParseBoolOption(k, v));
    } else if (k == "uring_threads") {
      DNVME_RETURN_IF_ERROR(ParseIntInRange(k, v, 1, 64, &o.uring_threads));
    } else if (k == "clone_fd") {
      DNVME_ASSIGN_OR_RETURN(o.clone_fd, ParseBoolOption(k, v));
    } else if (k == "loop_threads") {
      DNVME_RETURN_IF_ERROR(ParseIntInRange(k, v, 1, kMaxFuseThreads, &o.loop_threads));
    } else if (k == "ctl_max_handles") {
      DNVME_RETURN_IF_ERROR(ParseIntInRange(k, v, 0, 4096, &o.ctl_max_handles));
    } else if (k == "ctl_max_bytes") {
      DNVME_ASSIGN_OR_RETURN(o.ctl_max_bytes, ParseSizeOption(k, v));
    } else if (k == "ctl_max_buffers") {
      // The daemon's table of client mappings has 16384 slots (fs/control/client_memory.h).
      DNVME_RETURN_IF_ERROR(ParseIntInRange(k, v, 0, 16384, &o.ctl_max_buffers));
    } else if (k == "ctl_max_pinned") {
      DNVME_ASSIGN_OR_RETURN(o.ctl_max_pinned, ParseSizeOption(k, v));
    } else if (k == "ctl_max_pending") {
      DNVME_RETURN_IF_ERROR(ParseIntInRange(k, v, 0, (int64_t{1} << 20), &o.ctl_max_pending));
    } else if (k == "ctl_threads_per_uid") {
      DNVME_RETURN_IF_ERROR(ParseIntInRange(k, v, 1, 64, &o.ctl_threads_per_uid));
    } else if (k == "max_files_per_uid") {
      DNVME_RETURN_IF_ERROR(ParseIntInRange(k, v, 1, (int64_t{1} << 30), &o.max_files_per_uid));
    } else if (k == "max_inodes_per_uid") {
      DNVME_RETURN_IF_ERROR(ParseIntInRange(k, v, 1, (int64_t{1} << 30), &o.max_inodes_per_uid));
    } else if (k == "broker_max_conns_per_uid") {
      DNVME_RETURN_IF_ERROR(ParseIntInRange(k, v, 0, 4096, &o.broker_max_conns_per_uid));
    } else if (k == "ctl_max_opens") {
      // At least one: root must always be able to open config and stats.
      DNVME_RETURN_IF_ERROR(ParseIntInRange(k, v, 1, (int64_t{1} << 20), &o.ctl_max_opens));
    } else if (k == "ctl_max_workers") {
      DNVME_RETURN_IF_ERROR(ParseIntInRange(k, v, 0, 65536, &o.ctl_max_workers));
    } else if (k == "ctl_max_aio_events") {
      DNVME_RETURN_IF_ERROR(ParseIntInRange(k, v, 0, (int64_t{1} << 30), &o.ctl_max_aio_events));
    } else if (k == "max_request") {
      DNVME_ASSIGN_OR_RETURN(o.max_request, ParseSizeOption(k, v));
      if (o.max_request < 4096 || o.max_request > kMaxRequestLimit || o.max_request % 4096 != 0) {
        return Status::InvalidArgument(
            "option 'max_request' must be whole 4 KiB pages from 4K to 16M");
      }
    } else if (k == "passthrough") {
      const std::string p = v.value_or("");
      if (p == "0") {
        o.passthrough = Passthrough::kOff;
      } else {
        DNVME_ASSIGN_OR_RETURN(o.passthrough, ParseNamed(k, p, kPassthroughNames));
      }
    } else if (k == "max_read") {
      DNVME_ASSIGN_OR_RETURN(o.max_read, ParseSizeOption(k, v));
      if (o.max_read < 4096 || o.max_read > UINT32_MAX) {
        return Status::InvalidArgument("option 'max_read' must be from 4K to 4G-1");
      }
    } else if (k == "read_ahead") {
      DNVME_ASSIGN_OR_RETURN(o.read_ahead, ParseSizeOption(k, v));
    } else if (k == "log_level") {
      static const char* kLevels[] = {"trace", "debug", "info", "warn", "error", "critical", "off"};
      bool known = false;
      for (const char* l : kLevels) known = known || (v && *v == l);
      if (!known) {
        return Status::InvalidArgument("option 'log_level': '" + v.value_or("") +
                                       "' is not one of trace, debug, info, warn, error, "
                                       "critical, off");
      }
      o.log_level = *v;
    } else if (k == "log_file") {
      if (!v || v->empty()) return Status::InvalidArgument("option 'log_file' needs a path");
      o.log_file = *v;
    } else if (k == "nonempty") {
      o.nonempty = true;
    } else {
      o.fuse_opts.push_back(v ? k + "=" + *v : k);
    }
  }
  if (o.debug) o.log_level = "debug";
  if (o.max_read == 0) o.max_read = o.max_request;
  // A small write_behind without an explicit write_chunk: use two chunks of half the size.
  if (!chunk_given && o.write_behind > 0 && o.write_behind < 2 * o.write_chunk) {
    o.write_chunk = o.write_behind / 2 / 4096 * 4096;
  }
  DNVME_RETURN_IF_ERROR(o.engine.Validate().WithContext("engine options"));
  if (o.write_behind != 0 && (o.write_chunk <= 0 || o.write_chunk % 4096 != 0)) {
    return Status::InvalidArgument("option 'write_chunk' must be a positive multiple of 4096");
  }
  if (o.write_behind != 0 && o.write_behind < 2 * o.write_chunk) {
    return Status::InvalidArgument(
        "option 'write_behind' must hold at least two write_chunk buffers (or be 0 to disable)");
  }
  if (o.clone_fd && o.max_request > kMaxFuseRequestBytes) {
    return Status::InvalidArgument(
        "option 'max_request' above 1M needs the daemon's own request loop, not clone_fd=1 "
        "(libfuse 3.14 reads requests into 1 MiB buffers)");
  }
  if (o.io_uring && o.clone_fd) {
    return Status::InvalidArgument("options 'io_uring' and 'clone_fd' pick different transports");
  }
  if (o.io_uring && o.async_reply) {
    return Status::InvalidArgument(
        "option 'async_reply' needs /dev/fuse: a ring entry's reply must come from the thread "
        "that serves it (io_uring=1)");
  }
  if (o.read_ahead < 0 || o.read_ahead % 4096 != 0) {
    return Status::InvalidArgument("option 'read_ahead' must be a multiple of 4096");
  }
  return o;
}

bool SameDirectory(const std::string& a, const std::string& b) {
  struct stat sa {
  }, sb{};
  return stat(a.c_str(), &sa) == 0 && stat(b.c_str(), &sb) == 0 && sa.st_dev == sb.st_dev &&
         sa.st_ino == sb.st_ino;
}

Status CheckDirectories(const MountOptions& opts) {
  for (const auto* p : {&opts.backing, &opts.mountpoint}) {
    const char* what = p == &opts.backing ? "BACKING_DIR" : "MOUNTPOINT";
    struct stat st {};
    if (stat(p->c_str(), &st) != 0) {
      return Status::FromErrno(errno, std::string(what) + " '" + *p + "'");
    }
    if (!S_ISDIR(st.st_mode)) {
      return Status::InvalidArgument(std::string(what) + " '" + *p + "' is not a directory");
    }
  }
  // The mount may cover BACKING_DIR itself: the daemon opens it before mounting, and from then
  // on nobody reaches it except through the mount (docs/security.md, "Set-up"). Its content is
  // what the mount serves, so it need not be empty.
  if (SameDirectory(opts.backing, opts.mountpoint)) return Status::Ok();
  if (!opts.nonempty) {
    DIR* d = opendir(opts.mountpoint.c_str());
    if (d == nullptr) return Status::FromErrno(errno, "MOUNTPOINT '" + opts.mountpoint + "'");
    bool empty = true;
    while (struct dirent* e = readdir(d)) {
      if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) {
        empty = false;
        break;
      }
    }
    closedir(d);
    if (!empty) {
      return Status::InvalidArgument("MOUNTPOINT '" + opts.mountpoint +
                                     "' is not empty (use -o nonempty to mount over it anyway)");
    }
  }
  return Status::Ok();
}

}  // namespace dnvme::fs
