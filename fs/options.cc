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
#include <limits>
#include <optional>
#include <span>
#include <sstream>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>

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

const char* NameOf(int value, std::span<const OptionName> names) {
  for (const OptionName& n : names) {
    if (n.value == value) return n.name;
  }
  return "?";
}

// "off, direct, read, all": the names an enum offers (aliases left out).
std::string ListedNames(const MountOptionSpec& s, const char* sep) {
  std::string out;
  for (const OptionName& n : s.names) {
    if (n.listed) out += std::string(out.empty() ? "" : sep) + n.name;
  }
  return out;
}

// 64M, 4K, 5000: the exact value, with the largest suffix that divides it.
std::string SizeText(int64_t n) {
  int unit = 0;
  while (n != 0 && n % 1024 == 0 && unit < 4) {
    n /= 1024;
    ++unit;
  }
  static constexpr char kUnits[] = " KMGT";
  return std::to_string(n) + (unit == 0 ? "" : std::string(1, kUnits[unit]));
}

// A bound of a range: 4G-1 rather than 4294967295.
std::string BoundText(int64_t n) {
  if (n % 1024 != 0 && n < std::numeric_limits<int64_t>::max() && (n + 1) % 1024 == 0) {
    return SizeText(n + 1) + "-1";
  }
  return SizeText(n);
}

// Writes a parsed value into the row's member: `text` into a string (a log level's name), `n`
// into any other (a number, a boolean, an enum's value).
void Store(const MountOptionSpec& s, int64_t n, const std::string& text, MountOptions* o) {
  std::visit(
      [&](auto member) {
        if constexpr (!std::is_same_v<decltype(member), std::monostate>) {
          using T = std::remove_reference_t<decltype(o->*member)>;
          if constexpr (std::is_same_v<T, std::string>) o->*member = text;
          if constexpr (!std::is_same_v<T, std::string>) o->*member = static_cast<T>(n);
        }
      },
      s.field);
}

// A number within its row's bounds; the error names the option, the value and the range.
Status CheckRange(const MountOptionSpec& s, int64_t n, const std::string& text) {
  if (n >= s.min && n <= s.max && (!s.pages || n % 4096 == 0)) return Status::Ok();
  return Status::InvalidArgument("option '" + std::string(s.name) + "' must be " +
                                 OptionRangeText(s) + " (got " + text + ")");
}

// Parses one -o option by its row and sets its member.
Status ApplyOption(const MountOptionSpec& s, const std::optional<std::string>& v, MountOptions* o) {
  const std::string key = s.name, text = v.value_or("");
  int64_t n = 1;  // a flag's
  switch (s.kind) {
    case OptionKind::kBool: {
      DNVME_ASSIGN_OR_RETURN(n, ParseBoolOption(key, v));
      break;
    }
    case OptionKind::kFlag:
      break;
    case OptionKind::kInt: {
      DNVME_ASSIGN_OR_RETURN(n, ParseIntOption(key, v));
      DNVME_RETURN_IF_ERROR(CheckRange(s, n, text));
      break;
    }
    case OptionKind::kSize: {
      DNVME_ASSIGN_OR_RETURN(n, ParseSizeOption(key, v));
      DNVME_RETURN_IF_ERROR(CheckRange(s, n, text));
      break;
    }
    case OptionKind::kEnum: {
      auto it = std::find_if(s.names.begin(), s.names.end(),
                             [&](const OptionName& name) { return text == name.name; });
      if (it == s.names.end()) {
        return Status::InvalidArgument("option '" + key + "': '" + text + "' is not one of " +
                                       ListedNames(s, ", "));
      }
      Store(s, it->value, it->name, o);
      return Status::Ok();
    }
    case OptionKind::kString:
    case OptionKind::kConfig:
      if (text.empty()) return Status::InvalidArgument("option '" + key + "' needs " + s.missing);
      break;
  }
  Store(s, n, text, o);
  return Status::Ok();
}

using K = OptionKind;
using G = OptionGroup;

constexpr const char* kGroupHeadings[] = {
    "the engine's (the keys of `dnvme io --config` JSON)", "the mount's",
    "per-uid limits (each user alone; docs/security.md)", "the daemon's"};
const char* GroupHeading(OptionGroup g) { return kGroupHeadings[static_cast<int>(g)]; }

// One line of the help or the docs: an option of either table, in words. `form`: what follows
// the name ("=SIZE", "[=0|1]", "" for a flag).
struct OptionLine {
  OptionGroup group;
  std::string name, form, range, default_value, help;
};

// The engine's default for `key`, from HandleConfig{}'s JSON (the engine table has no defaults
// of its own): {"block_size":1048576,...,"direct":"auto",...}.
std::string EngineDefault(const ConfigKey& key) {
  const std::string json = HandleConfig().ToJson();
  const std::string tag = "\"" + std::string(key.name) + "\":";
  const size_t at = json.find(tag);
  if (at == std::string::npos) return "?";
  std::string v = json.substr(at + tag.size());
  v = v.substr(0, v.find_first_of(",}"));
  if (v == "true" || v == "false") return v == "true" ? "1" : "0";
  if (!v.empty() && v.front() == '"') return v.substr(1, v.size() - 2);
  return key.type == ConfigValueType::kSize ? SizeText(std::stoll(v)) : v;
}

// Every -o option of both tables, the engine's first.
std::vector<OptionLine> OptionLines() {
  std::vector<OptionLine> lines;
  for (const ConfigKey& k : ConfigKeys()) {
    OptionLine l{G::kEngine, k.name, "", "", EngineDefault(k), k.help};
    if (k.type == ConfigValueType::kSize) l.form = "=SIZE";
    if (k.type == ConfigValueType::kInt) l.form = "=N";
    if (k.type == ConfigValueType::kBool) l.form = "[=0|1]";
    if (k.type == ConfigValueType::kDirect) l.form = "=auto|required|never";
    lines.push_back(l);
  }
  for (const MountOptionSpec& s : MountOptionTable()) {
    OptionLine l{s.group, s.name, "", OptionRangeText(s), OptionDefaultText(s), s.help};
    if (s.kind == K::kBool) l.form = "[=0|1]";
    if (s.kind == K::kInt) l.form = "=N";
    if (s.kind == K::kSize) l.form = "=SIZE";
    if (s.kind == K::kEnum) l.form = "=" + ListedNames(s, "|");
    if (s.kind == K::kString || s.kind == K::kConfig) l.form = std::string("=") + s.value_name;
    lines.push_back(l);
  }
  return lines;
}

}  // namespace

const MountOptionSpec* FindMountOption(std::string_view name) {
  for (const MountOptionSpec& s : MountOptionTable()) {
    if (name == s.name) return &s;
  }
  return nullptr;
}

std::string OptionRangeText(const MountOptionSpec& s) {
  if (s.kind == K::kInt) return std::to_string(s.min) + ".." + std::to_string(s.max);
  if (s.kind != K::kSize) return "";
  const bool bounded = s.min > 0 || s.max < std::numeric_limits<int64_t>::max();
  const std::string range = "from " + BoundText(s.min) + " to " + BoundText(s.max);
  if (s.pages) return bounded ? "whole 4 KiB pages " + range : "a multiple of 4096";
  return bounded ? range : "";
}

std::string OptionValueText(const MountOptionSpec& s, const MountOptions& o) {
  return std::visit(
      [&](auto member) -> std::string {
        if constexpr (std::is_same_v<decltype(member), std::monostate>) {
          return "";
        } else {
          const auto& v = o.*member;
          using T = std::remove_cvref_t<decltype(v)>;
          if constexpr (std::is_same_v<T, std::string>) return v;
          if constexpr (std::is_enum_v<T>) return NameOf(static_cast<int>(v), s.names);
          if constexpr (std::is_same_v<T, std::optional<bool>>) return v ? std::to_string(*v) : "";
          if constexpr (std::is_arithmetic_v<T>) {
            return s.kind == K::kSize ? SizeText(v) : std::to_string(v);
          }
        }
      },
      s.field);
}

std::string OptionDefaultText(const MountOptionSpec& s) {
  return s.default_text != nullptr ? s.default_text : OptionValueText(s, MountOptions());
}

std::string UsageText() {
  std::string text =
      "usage: dnvmefs BACKING_DIR MOUNTPOINT [-f] [-d] [-s] [-o opt[,opt...]]\n"
      "  -f             stay in the foreground\n"
      "  -d             debug: foreground, log_level=debug and libfuse request tracing\n"
      "  -s             single-threaded request loop\n"
      "  -h, --help     this text; --help-markdown: the -o options as docs/tuning.md's table\n"
      "  -V, --version  dnvmefs's and libfuse's versions\n"
      "dnvmefs options (-o):\n";
  constexpr size_t kColumn = 31, kWidth = 100;
  std::optional<OptionGroup> group;
  for (const OptionLine& l : OptionLines()) {
    if (l.group != group) text += std::string(GroupHeading(l.group)) + ":\n";
    group = l.group;
    std::string line = "  " + l.name + l.form;
    line.resize(std::max(line.size() + 1, kColumn), ' ');
    const std::string words = l.help + " (" + (l.range.empty() ? "" : l.range + "; ") + "default " +
                              l.default_value + ")";
    bool fresh = true;  // nothing after the option's name yet on this line
    std::istringstream in(words);
    for (std::string w; in >> w;) {
      if (!fresh && line.size() + 1 + w.size() > kWidth) {
        text += line + "\n";
        line.assign(kColumn, ' ');
        fresh = true;
      }
      line += (fresh ? "" : " ") + w;
      fresh = false;
    }
    text += line + "\n";
  }
  return text +
         "every other -o option goes to FUSE (allow_other, ro, fsname=, max_background=, ...)\n";
}

std::string OptionsMarkdown() {
  // GitHub's tables split cells on every '|', inside code spans too, unless escaped.
  auto cell = [](const std::string& s) {
    std::string out;
    for (char c : s) out += c == '|' ? std::string("\\|") : std::string(1, c);
    return out;
  };
  std::string md = "| Option | Range | Default | What it sets |\n| --- | --- | --- | --- |\n";
  std::optional<OptionGroup> group;
  for (const OptionLine& l : OptionLines()) {
    if (l.group != group) md += "| **" + cell(GroupHeading(l.group)) + "** | | | |\n";
    group = l.group;
    md += "| `" + cell(l.name + l.form) + "` | " + cell(l.range) + " | " + cell(l.default_value) +
          " | " + cell(l.help) + " |\n";
  }
  return md;
}

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

const char* DirectIoName(DirectIo d) { return NameOf(static_cast<int>(d), kDirectIoNames); }

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

const char* PassthroughName(Passthrough p) {
  return NameOf(static_cast<int>(p), kPassthroughNames);
}

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
    } else if (a == "--help-markdown") {
      o.show_help_markdown = true;
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
  if (o.show_help || o.show_help_markdown || o.show_version) return o;
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
    const MountOptionSpec* spec = FindMountOption(k);
    if (spec == nullptr || spec->kind != OptionKind::kConfig) continue;
    DNVME_RETURN_IF_ERROR(ApplyOption(*spec, v, &o));  // a file is named
    DNVME_ASSIGN_OR_RETURN(o.engine, HandleConfig::FromJsonFile(*v));
  }
  bool chunk_given = false;
  for (const auto& [k, v] : kv) {
    const MountOptionSpec* spec = FindMountOption(k);
    if (FindConfigKey(k) != nullptr) {  // an engine key (include/dnvme/config.h's table)
      DNVME_RETURN_IF_ERROR(SetConfigKeyFromText(&o.engine, k, v));
    } else if (spec != nullptr && spec->kind != OptionKind::kConfig) {
      DNVME_RETURN_IF_ERROR(ApplyOption(*spec, v, &o));
      chunk_given = chunk_given || k == "write_chunk";
    } else if (spec == nullptr) {
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
