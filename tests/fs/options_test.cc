// The mount's options (fs/options.h): the command line's flags and arguments, every -o option's
// parsing, default, range check and error message, the size suffixes, -o lists (several -o, escaped
// commas, config= under explicit keys), what goes to libfuse, and the per-uid limits' defaults,
// which scale with the machine.
#include "fs/options.h"

#include <limits.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace dnvme::fs {
namespace {

Result<MountOptions> ParseArgs(std::vector<std::string> args) {
  args.insert(args.begin(), "dnvmefs");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return ParseMountOptions(static_cast<int>(argv.size()), argv.data());
}

Result<MountOptions> Parse(const std::string& opts) {
  std::vector<std::string> args = {"dnvmefs", "/backing", "/mnt"};
  if (!opts.empty()) {
    args.push_back("-o");
    args.push_back(opts);
  }
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return ParseMountOptions(static_cast<int>(argv.size()), argv.data());
}

TEST(MountOptionsLimits, DefaultsFollowTheMachine) {
  const int64_t ram = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
  EXPECT_EQ(MachineRamBytes(), ram);
  rlimit rl{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &rl), 0);
  const int64_t hard =
      rl.rlim_max == RLIM_INFINITY ? (int64_t{1} << 30) : static_cast<int64_t>(rl.rlim_max);
  auto o = Parse("");
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->ctl_max_handles, 8);
  EXPECT_EQ(o->ctl_max_bytes, ram / 4);
  EXPECT_EQ(o->ctl_max_buffers, 256);
  EXPECT_EQ(o->ctl_max_pinned, std::min<int64_t>(ram / 16, int64_t{4} << 30));
  EXPECT_EQ(o->ctl_max_pending, 1024);
  EXPECT_EQ(o->ctl_threads_per_uid, 4);
  EXPECT_EQ(o->max_files_per_uid, std::max<int64_t>(1024, hard / 16));
  EXPECT_EQ(o->broker_max_conns_per_uid, 128);
  EXPECT_EQ(o->ctl_max_opens, 1024);
  EXPECT_EQ(o->ctl_max_workers, 64);
  EXPECT_EQ(o->ctl_max_aio_events, 8192);
  EXPECT_EQ(o->max_inodes_per_uid, 4 * std::max<int64_t>(1024, hard / 16));
  // Never more than the machine has: the old default (64 GiB of registered memory per user) was
  // larger than the RAM of the machines it ran on.
  EXPECT_LE(o->ctl_max_bytes, ram);
  EXPECT_LE(o->ctl_max_pinned, ram);
}

TEST(MountOptionsLimits, EachOptionIsParsed) {
  auto o = Parse(
      "ctl_max_handles=3,ctl_max_bytes=3M,ctl_max_buffers=5,ctl_max_pinned=64M,"
      "ctl_max_pending=7,ctl_threads_per_uid=2,max_files_per_uid=99,"
      "broker_max_conns_per_uid=11,ctl_max_opens=13,ctl_max_workers=17,ctl_max_aio_events=19,"
      "max_inodes_per_uid=23");
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->ctl_max_handles, 3);
  EXPECT_EQ(o->ctl_max_bytes, 3 << 20);
  EXPECT_EQ(o->ctl_max_buffers, 5);
  EXPECT_EQ(o->ctl_max_pinned, 64 << 20);
  EXPECT_EQ(o->ctl_max_pending, 7);
  EXPECT_EQ(o->ctl_threads_per_uid, 2);
  EXPECT_EQ(o->max_files_per_uid, 99);
  EXPECT_EQ(o->broker_max_conns_per_uid, 11);
  EXPECT_EQ(o->ctl_max_opens, 13);
  EXPECT_EQ(o->ctl_max_workers, 17);
  EXPECT_EQ(o->ctl_max_aio_events, 19);
  EXPECT_EQ(o->max_inodes_per_uid, 23);
  EXPECT_TRUE(o->fuse_opts.empty()) << "a limit leaked to libfuse";
}

TEST(MountOptionsLimits, OutOfRangeIsAUsageError) {
  for (const char* bad : {"ctl_max_buffers=-1",
                          "ctl_max_buffers=16385",
                          "ctl_max_pending=-1",
                          "ctl_max_pending=1048577",
                          "ctl_threads_per_uid=0",
                          "ctl_threads_per_uid=65",
                          "max_files_per_uid=0",
                          "broker_max_conns_per_uid=-1",
                          "broker_max_conns_per_uid=4097",
                          "ctl_max_pinned=lots",
                          "ctl_max_buffers",
                          "ctl_max_handles=4097",
                          "ctl_max_opens=0",
                          "ctl_max_opens=1048577",
                          "ctl_max_workers=-1",
                          "ctl_max_workers=65537",
                          "ctl_max_aio_events=-1",
                          "ctl_max_aio_events=1073741825",
                          "max_inodes_per_uid=0",
                          "max_inodes_per_uid=1073741825"}) {
    auto o = Parse(bad);
    EXPECT_FALSE(o.ok()) << bad;
    if (!o.ok()) {
      const std::string key = std::string(bad).substr(0, std::string(bad).find('='));
      EXPECT_NE(o.status().message().find(key), std::string::npos) << o.status().message();
    }
  }
  EXPECT_TRUE(Parse("ctl_max_buffers=0,broker_max_conns_per_uid=0").ok());
  EXPECT_TRUE(Parse("ctl_max_opens=1,ctl_max_workers=0,ctl_max_aio_events=0").ok());
}

TEST(MountOptionsLimits, UsageNamesEveryLimit) {
  const std::string usage = UsageText();
  for (const char* key : {"ctl_max_handles=", "ctl_max_bytes=", "ctl_max_buffers=",
                          "ctl_max_pinned=", "ctl_max_pending=", "ctl_threads_per_uid=",
                          "max_files_per_uid=", "broker_max_conns_per_uid=", "ctl_max_opens=",
                          "ctl_max_workers=", "ctl_max_aio_events=", "max_inodes_per_uid="}) {
    EXPECT_NE(usage.find(key), std::string::npos) << key;
  }
}

// The error of `opts`, which must be refused; its message must name `want`.
void ExpectRefused(const std::string& opts, const std::string& want) {
  auto o = Parse(opts);
  ASSERT_FALSE(o.ok()) << opts << " was accepted";
  EXPECT_EQ(o.status().code(), Status::Code::kInvalidArgument) << opts;
  EXPECT_NE(o.status().message().find(want), std::string::npos)
      << opts << ": " << o.status().message() << " (expected it to name '" << want << "')";
}

TEST(MountOptionsDefaults, DataPathAndTransport) {
  auto o = Parse("");
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->backing, "/backing");
  EXPECT_EQ(o->mountpoint, "/mnt");
  EXPECT_FALSE(o->foreground || o->debug || o->single_thread || o->nonempty);
  EXPECT_FALSE(o->show_help || o->show_version);
  EXPECT_EQ(o->write_behind, 64 << 20);
  EXPECT_EQ(o->write_chunk, 8 << 20);
  EXPECT_EQ(o->read_ahead, 16 << 20);
  EXPECT_EQ(o->direct_io, DirectIo::kWritable);
  EXPECT_FALSE(o->splice_read.has_value());
  EXPECT_FALSE(o->SpliceRequests()) << "direct_io=writable turns request splicing off";
  EXPECT_TRUE(o->preload);
  EXPECT_FALSE(o->splice_reply);
  EXPECT_FALSE(o->async_reply);
  EXPECT_FALSE(o->clone_fd);
  EXPECT_FALSE(o->io_uring);
  EXPECT_EQ(o->loop_threads, 32);
  EXPECT_EQ(o->uring_threads, 4);
  EXPECT_EQ(o->max_request, kMaxFuseRequestBytes);
  EXPECT_EQ(o->max_read, o->max_request) << "max_read follows max_request when not given";
  EXPECT_EQ(o->passthrough, Passthrough::kRead);
  EXPECT_EQ(o->log_level, "info");
  EXPECT_TRUE(o->log_file.empty());
  EXPECT_TRUE(o->fuse_opts.empty());
  EXPECT_EQ(o->engine, HandleConfig());
}

TEST(MountOptionsFlags, ForegroundDebugSingleThread) {
  auto o = ParseArgs({"-f", "-s", "/b", "/m"});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_TRUE(o->foreground);
  EXPECT_TRUE(o->single_thread);
  EXPECT_FALSE(o->debug);
  auto d = ParseArgs({"/b", "-d", "/m", "-o", "log_level=error"});
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_TRUE(d->debug);
  EXPECT_TRUE(d->foreground) << "-d implies the foreground";
  EXPECT_EQ(d->log_level, "debug") << "-d wins over log_level=";
  auto dd = ParseArgs({"--debug", "/b", "/m"});
  ASSERT_TRUE(dd.ok());
  EXPECT_TRUE(dd->debug);
}

TEST(MountOptionsFlags, HelpAndVersionNeedNoDirectories) {
  for (const char* f : {"-h", "--help"}) {
    auto o = ParseArgs({f});
    ASSERT_TRUE(o.ok()) << f << ": " << o.status().ToString();
    EXPECT_TRUE(o->show_help);
  }
  for (const char* f : {"-V", "--version"}) {
    auto o = ParseArgs({f, "only-one"});
    ASSERT_TRUE(o.ok()) << f << ": " << o.status().ToString();
    EXPECT_TRUE(o->show_version);
  }
}

TEST(MountOptionsFlags, BadCommandLines) {
  auto unknown = ParseArgs({"-x", "/b", "/m"});
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("unknown flag '-x'"), std::string::npos)
      << unknown.status().message();
  auto no_arg = ParseArgs({"/b", "/m", "-o"});
  ASSERT_FALSE(no_arg.ok());
  EXPECT_NE(no_arg.status().message().find("-o needs an argument"), std::string::npos);
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{}, {"/b"}, {"/b", "/m", "/extra"}}) {
    auto o = ParseArgs(args);
    ASSERT_FALSE(o.ok()) << args.size() << " arguments accepted";
    EXPECT_NE(o.status().message().find("got " + std::to_string(args.size()) + " argument"),
              std::string::npos)
        << o.status().message();
  }
}

TEST(MountOptionsFlags, RelativeDirectoriesBecomeAbsolute) {
  char cwd[PATH_MAX];
  ASSERT_NE(getcwd(cwd, sizeof(cwd)), nullptr);
  auto o = ParseArgs({".", "no-such-dir-here"});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->backing, std::string(cwd));
  // A name realpath cannot resolve is kept as given, for CheckDirectories to report.
  EXPECT_EQ(o->mountpoint, "no-such-dir-here");
}

TEST(MountOptionsSizes, SuffixesArePowersOf1024) {
  auto o = Parse("write_behind=1G,write_chunk=64k,read_ahead=2M,max_request=512K,max_read=8192");
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->write_behind, int64_t{1} << 30);
  EXPECT_EQ(o->write_chunk, 64 << 10);
  EXPECT_EQ(o->read_ahead, 2 << 20);
  EXPECT_EQ(o->max_request, 512 << 10);
  EXPECT_EQ(o->max_read, 8192);
  auto mib = Parse("ctl_max_bytes=3MiB,ctl_max_pinned=1g");
  ASSERT_TRUE(mib.ok()) << mib.status().ToString();
  EXPECT_EQ(mib->ctl_max_bytes, 3 << 20);
  EXPECT_EQ(mib->ctl_max_pinned, int64_t{1} << 30);
}

TEST(MountOptionsSizes, BadSizesNameTheOption) {
  ExpectRefused("write_behind=12Q", "option 'write_behind'");
  ExpectRefused("write_behind=-1", "negative");
  ExpectRefused("read_ahead=", "option 'read_ahead' needs a value");
  ExpectRefused("write_chunk", "option 'write_chunk' needs a value");
  ExpectRefused("ctl_max_bytes=lots", "not a number");
  ExpectRefused("write_behind=99999999999999999999", "too large");
}

TEST(MountOptionsRanges, EachBoundIsCheckedWithItsMessage) {
  ExpectRefused("loop_threads=0", "option 'loop_threads' must be 1..64");
  ExpectRefused("loop_threads=65", "option 'loop_threads' must be 1..64");
  ExpectRefused("loop_threads=x", "option 'loop_threads': 'x' is not an integer");
  ExpectRefused("uring_threads=0", "option 'uring_threads' must be 1..64");
  ExpectRefused("uring_threads=65", "option 'uring_threads' must be 1..64");
  ExpectRefused("max_request=2K", "option 'max_request' must be whole 4 KiB pages");
  ExpectRefused("max_request=17M", "option 'max_request' must be whole 4 KiB pages");
  ExpectRefused("max_request=5000", "option 'max_request' must be whole 4 KiB pages");
  ExpectRefused("max_read=2K", "option 'max_read' must be from 4K to 4G-1");
  ExpectRefused("max_read=4G", "option 'max_read' must be from 4K to 4G-1");
  ExpectRefused("read_ahead=5000", "option 'read_ahead' must be a multiple of 4096");
  ExpectRefused("ctl_max_handles=-1", "option 'ctl_max_handles' must be 0..4096");
  ExpectRefused("max_files_per_uid=1073741825", "option 'max_files_per_uid' must be 1..");
  // The bounds themselves are accepted.
  auto o = Parse(
      "loop_threads=1,uring_threads=64,max_request=16M,max_read=4K,read_ahead=0,"
      "ctl_max_handles=4096,max_files_per_uid=1");
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->loop_threads, 1);
  EXPECT_EQ(o->uring_threads, 64);
  EXPECT_EQ(o->max_request, kMaxRequestLimit);
  EXPECT_EQ(o->max_read, 4096);
  EXPECT_EQ(o->read_ahead, 0);
  auto top = Parse("loop_threads=64");
  ASSERT_TRUE(top.ok());
  EXPECT_EQ(top->loop_threads, kMaxFuseThreads);
}

TEST(MountOptionsBooleans, EveryFormAndTheBareOption) {
  auto o = Parse("preload=0,splice_reply=yes,async_reply=true,clone_fd=1,splice_read=no");
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_FALSE(o->preload);
  EXPECT_TRUE(o->splice_reply);
  EXPECT_TRUE(o->async_reply);
  EXPECT_TRUE(o->clone_fd);
  ASSERT_TRUE(o->splice_read.has_value());
  EXPECT_FALSE(*o->splice_read);
  EXPECT_FALSE(o->SpliceRequests());
  auto bare = Parse("io_uring,splice_read");
  ASSERT_TRUE(bare.ok()) << bare.status().ToString();
  EXPECT_TRUE(bare->io_uring) << "a bare boolean option means true";
  EXPECT_TRUE(bare->SpliceRequests());
  ExpectRefused("preload=maybe", "option 'preload': 'maybe' is not a boolean");
  ExpectRefused("io_uring=2", "option 'io_uring'");
}

TEST(MountOptionsNames, DirectIoAndPassthrough) {
  const std::pair<const char*, DirectIo> direct[] = {
      {"off", DirectIo::kOff}, {"wronly", DirectIo::kWriteOnly}, {"writable", DirectIo::kWritable}};
  for (const auto& [name, want] : direct) {
    auto o = Parse(std::string("direct_io=") + name);
    ASSERT_TRUE(o.ok()) << name << ": " << o.status().ToString();
    EXPECT_EQ(o->direct_io, want) << name;
    EXPECT_STREQ(DirectIoName(want), name);
  }
  // Without direct_io=writable, requests are spliced by default.
  auto off = Parse("direct_io=off");
  ASSERT_TRUE(off.ok());
  EXPECT_TRUE(off->SpliceRequests());
  ExpectRefused("direct_io=on", "option 'direct_io': 'on' is not one of off, wronly, writable");
  ExpectRefused("direct_io", "is not one of");

  const std::pair<const char*, Passthrough> pass[] = {{"off", Passthrough::kOff},
                                                      {"direct", Passthrough::kDirect},
                                                      {"read", Passthrough::kRead},
                                                      {"all", Passthrough::kAll}};
  for (const auto& [name, want] : pass) {
    auto o = Parse(std::string("passthrough=") + name);
    ASSERT_TRUE(o.ok()) << name << ": " << o.status().ToString();
    EXPECT_EQ(o->passthrough, want) << name;
    EXPECT_STREQ(PassthroughName(want), name);
  }
  auto zero = Parse("passthrough=0");
  ASSERT_TRUE(zero.ok());
  EXPECT_EQ(zero->passthrough, Passthrough::kOff) << "passthrough=0 is off";
  ExpectRefused("passthrough=1", "option 'passthrough': '1' is not one of off, direct, read, all");
}

TEST(MountOptionsLogging, LevelFileAndNonempty) {
  for (const char* level : {"trace", "debug", "info", "warn", "error", "critical", "off"}) {
    auto o = Parse(std::string("log_level=") + level);
    ASSERT_TRUE(o.ok()) << level;
    EXPECT_EQ(o->log_level, level);
  }
  ExpectRefused("log_level=loud", "option 'log_level': 'loud' is not one of trace");
  ExpectRefused("log_level", "option 'log_level'");
  ExpectRefused("log_file=", "option 'log_file' needs a path");
  auto o = Parse("log_file=/tmp/x.log,nonempty");
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->log_file, "/tmp/x.log");
  EXPECT_TRUE(o->nonempty);
  EXPECT_TRUE(o->fuse_opts.empty()) << "nonempty is ours, not libfuse's";
}

TEST(MountOptionsLists, UnknownOptionsGoToFuseInOrder) {
  auto o = Parse("allow_other,fsname=dn,write_behind=0,max_background=64,ro");
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->fuse_opts,
            (std::vector<std::string>{"allow_other", "fsname=dn", "max_background=64", "ro"}));
  EXPECT_EQ(o->write_behind, 0);
}

TEST(MountOptionsLists, SeveralDashOAttachedFormsEscapesAndEmptyItems) {
  auto o = ParseArgs({"/b", "/m", "-o", "loop_threads=2,,", "-oread_ahead=4K", "-o",
                      "fsname=a\\,b,loop_threads=3"});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->loop_threads, 3) << "the last one given wins";
  EXPECT_EQ(o->read_ahead, 4096) << "-oKEY=VALUE, attached";
  EXPECT_EQ(o->fuse_opts, std::vector<std::string>{"fsname=a,b"}) << "a backslash escapes a comma";
}

TEST(MountOptionsWriteBehind, ChunkFollowsASmallPoolAndTheirRules) {
  auto small = Parse("write_behind=4M");
  ASSERT_TRUE(small.ok()) << small.status().ToString();
  EXPECT_EQ(small->write_chunk, 2 << 20) << "two chunks of half the pool";
  auto odd = Parse("write_behind=12K");  // half of it rounded down to whole pages
  ASSERT_TRUE(odd.ok()) << odd.status().ToString();
  EXPECT_EQ(odd->write_chunk, 4096);
  ExpectRefused("write_behind=4M,write_chunk=3M", "must hold at least two write_chunk buffers");
  ExpectRefused("write_chunk=5000", "option 'write_chunk' must be a positive multiple of 4096");
  ExpectRefused("write_behind=4K", "option 'write_chunk' must be a positive multiple of 4096");
  auto off = Parse("write_behind=0,write_chunk=5000");
  ASSERT_TRUE(off.ok()) << "write_behind=0 disables the chunk checks: " << off.status().ToString();
}

TEST(MountOptionsConflicts, TransportsThatDoNotMix) {
  ExpectRefused("clone_fd=1,max_request=2M", "option 'max_request' above 1M needs");
  ExpectRefused("io_uring=1,clone_fd=1", "options 'io_uring' and 'clone_fd'");
  ExpectRefused("io_uring=1,async_reply=1", "option 'async_reply' needs /dev/fuse");
  EXPECT_TRUE(Parse("clone_fd=1,max_request=1M").ok());
  EXPECT_TRUE(Parse("io_uring=1,max_request=2M").ok());
}

TEST(MountOptionsEngine, KeysAndConfigFileWithExplicitKeysWinning) {
  auto o = Parse("block_size=64K,queue_depth=16,single_submit");
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->engine.block_size, 64 << 10);
  EXPECT_EQ(o->engine.queue_depth, 16);
  EXPECT_TRUE(o->engine.single_submit);
  EXPECT_TRUE(o->fuse_opts.empty()) << "engine keys leaked to libfuse";
  ExpectRefused("queue_depth=0", "engine options");
  ExpectRefused("queue_depth=many", "option 'queue_depth'");

  char path[] = "/tmp/dnvme-options-test-XXXXXX";
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  close(fd);
  {
    std::ofstream f(path);
    f << R"({"block_size": "256K", "queue_depth": 8})";
  }
  // config= is read first wherever it appears: the explicit key after it and before it win.
  auto c = Parse(std::string("queue_depth=32,config=") + path);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->engine.block_size, 256 << 10);
  EXPECT_EQ(c->engine.queue_depth, 32);
  unlink(path);
  ExpectRefused("config=", "option 'config' needs a file name");
  auto missing = Parse("config=/nonexistent/dnvme.json");
  EXPECT_FALSE(missing.ok());
}

// ---- Every row of the table (MountOptionTable), by its kind ----

// A JSON file of engine keys that lives as long as the test, for config= rows.
class ConfigFile {
 public:
  ConfigFile() {
    const int fd = mkstemp(path_);
    if (fd >= 0) close(fd);
    std::ofstream(path_) << R"({"queue_depth": 8})";
  }
  ~ConfigFile() { unlink(path_); }
  std::string path() const { return path_; }

 private:
  char path_[64] = "/tmp/dnvme-options-table-XXXXXX";
};

// A number or a size as -o writes it; -1 for text that is neither.
int64_t SizeOf(const std::string& text) {
  auto n = ParseSize(text);
  return n.ok() ? n.value() : -1;
}

// The refusal of `opts` must be a usage error naming the option and holding each of `words`.
void ExpectRefusedWith(const MountOptionSpec& s, const std::string& opts,
                       const std::vector<std::string>& words) {
  auto o = Parse(opts);
  ASSERT_FALSE(o.ok()) << opts << " was accepted";
  EXPECT_EQ(o.status().code(), Status::Code::kInvalidArgument) << opts;
  const std::string& m = o.status().message();
  EXPECT_NE(m.find("option '" + std::string(s.name) + "'"), std::string::npos) << opts << ": " << m;
  for (const std::string& w : words) {
    EXPECT_NE(m.find(w), std::string::npos) << opts << ": " << m << " (expected '" << w << "')";
  }
}

TEST(MountOptionTable, RowsAreWellFormed) {
  std::set<std::string> names;
  for (const MountOptionSpec& s : MountOptionTable()) {
    SCOPED_TRACE(s.name);
    EXPECT_TRUE(names.insert(s.name).second) << "two rows named " << s.name;
    EXPECT_EQ(FindConfigKey(s.name), nullptr) << "an engine key of the same name would win";
    EXPECT_EQ(FindMountOption(s.name), &s);
    EXPECT_NE(std::string(s.help), "");
    EXPECT_EQ(std::holds_alternative<std::monostate>(s.field), s.kind == OptionKind::kConfig)
        << "every row but config= sets a member";
    if (s.kind == OptionKind::kInt) {
      EXPECT_LE(s.min, s.max);
      EXPECT_LE(s.max, INT_MAX) << "integers are parsed as int";
    }
    if (s.kind == OptionKind::kEnum) {
      EXPECT_FALSE(s.names.empty());
    }
    if (s.kind == OptionKind::kString || s.kind == OptionKind::kConfig) {
      EXPECT_NE(s.value_name, nullptr);
      EXPECT_NE(s.missing, nullptr);
    }
  }
  EXPECT_EQ(FindMountOption("allow_other"), nullptr);
  EXPECT_EQ(FindMountOption("block_size"), nullptr);
}

// The default each row's help gives is what parsing no option yields; where the help gives it in
// words, the value those words describe.
TEST(MountOptionTable, EachDefault) {
  auto o = Parse("");
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  const MountOptions plain;
  const std::map<std::string, std::function<bool(const MountOptions&)>> in_words = {
      {"config", [](const MountOptions& m) { return m.engine == HandleConfig(); }},
      {"splice_read", [](const MountOptions& m) { return !m.splice_read.has_value(); }},
      {"max_read", [](const MountOptions& m) { return m.max_read == m.max_request; }},
      {"ctl_max_bytes",
       [](const MountOptions& m) { return m.ctl_max_bytes == MachineRamBytes() / 4; }},
      {"ctl_max_pinned",
       [](const MountOptions& m) {
         return m.ctl_max_pinned == std::min<int64_t>(MachineRamBytes() / 16, int64_t{4} << 30);
       }},
      {"max_files_per_uid",
       [](const MountOptions& m) { return m.max_files_per_uid == DefaultMaxFilesPerUid(); }},
      {"max_inodes_per_uid",
       [](const MountOptions& m) { return m.max_inodes_per_uid == 4 * m.max_files_per_uid; }},
      {"log_file", [](const MountOptions& m) { return m.log_file.empty(); }},
      {"nonempty", [](const MountOptions& m) { return !m.nonempty; }},
  };
  for (const MountOptionSpec& s : MountOptionTable()) {
    SCOPED_TRACE(s.name);
    EXPECT_FALSE(OptionDefaultText(s).empty());
    if (s.default_text == nullptr) {
      EXPECT_EQ(OptionValueText(s, *o), OptionDefaultText(s));
      EXPECT_EQ(OptionValueText(s, plain), OptionDefaultText(s));
    } else {
      ASSERT_TRUE(in_words.count(s.name)) << "a default in words the test does not check";
      EXPECT_TRUE(in_words.at(s.name)(*o)) << OptionDefaultText(s);
    }
  }
}

// Valid values of each row: its bounds, every name, every boolean form; the member then holds
// the value (read back through OptionValueText, as -o would take it again).
TEST(MountOptionTable, EachValidValue) {
  ConfigFile config;
  const MountOptions plain;
  for (const MountOptionSpec& s : MountOptionTable()) {
    SCOPED_TRACE(s.name);
    const std::string key = s.name;
    std::vector<std::pair<std::string, std::string>> cases;  // -o text, the value it gives
    switch (s.kind) {
      case OptionKind::kBool:
        cases = {{key, "1"},        {key + "=1", "1"},  {key + "=yes", "1"},  {key + "=true", "1"},
                 {key + "=0", "0"}, {key + "=no", "0"}, {key + "=false", "0"}};
        break;
      case OptionKind::kFlag:
        cases = {{key, "1"}};
        break;
      case OptionKind::kInt:
        cases = {{key + "=" + std::to_string(s.min), std::to_string(s.min)},
                 {key + "=" + std::to_string(s.max), std::to_string(s.max)}};
        break;
      case OptionKind::kSize:
        if (s.min > 0 || s.max < std::numeric_limits<int64_t>::max()) {
          cases = {{key + "=" + std::to_string(s.min), std::to_string(s.min)},
                   {key + "=" + std::to_string(s.max), std::to_string(s.max)}};
        } else {  // unbounded: twice the default, which every rule between options allows
          const int64_t twice = 2 * SizeOf(OptionValueText(s, plain));
          cases = {{key + "=" + std::to_string(twice), std::to_string(twice)}};
        }
        break;
      case OptionKind::kEnum:
        for (const OptionName& n : s.names) {
          std::string want = n.name;
          for (const OptionName& m : s.names) {
            if (m.listed && m.value == n.value) want = m.name;  // an alias reads as its name
          }
          cases.push_back({key + "=" + n.name, want});
        }
        break;
      case OptionKind::kString:
        cases = {{key + "=/tmp/some\\,where", "/tmp/some,where"}};  // an escaped comma
        break;
      case OptionKind::kConfig:
        break;
    }
    for (const auto& [opts, want] : cases) {
      auto o = Parse(opts);
      ASSERT_TRUE(o.ok()) << opts << ": " << o.status().ToString();
      const std::string got = OptionValueText(s, *o);
      if (s.kind == OptionKind::kInt || s.kind == OptionKind::kSize) {
        EXPECT_EQ(SizeOf(got), SizeOf(want)) << opts << " read back as " << got;
      } else {
        EXPECT_EQ(got, want) << opts;
      }
      EXPECT_TRUE(o->fuse_opts.empty()) << opts << " went to libfuse";
    }
    if (s.kind == OptionKind::kConfig) {
      auto o = Parse(key + "=" + config.path());
      ASSERT_TRUE(o.ok()) << o.status().ToString();
      EXPECT_EQ(o->engine.queue_depth, 8);
    }
  }
  // A flag takes any value as the bare option (as before the table).
  auto o = Parse("nonempty=0");
  ASSERT_TRUE(o.ok());
  EXPECT_TRUE(o->nonempty);
}

// Out-of-range and garbage values of each row are usage errors naming the option, and range
// errors give the value and the allowed range.
TEST(MountOptionTable, EachBadValueIsRefused) {
  for (const MountOptionSpec& s : MountOptionTable()) {
    SCOPED_TRACE(s.name);
    const std::string key = s.name;
    const std::string range = OptionRangeText(s);
    auto out_of_range = [&](int64_t n) {
      ExpectRefusedWith(s, key + "=" + std::to_string(n),
                        {"must be " + range, "(got " + std::to_string(n) + ")"});
    };
    switch (s.kind) {
      case OptionKind::kBool:
        ExpectRefusedWith(s, key + "=maybe", {"'maybe' is not a boolean"});
        ExpectRefusedWith(s, key + "=2", {"'2'"});
        break;
      case OptionKind::kFlag:
        break;
      case OptionKind::kInt:
        ExpectRefusedWith(s, key + "=x", {"'x' is not an integer"});
        ExpectRefusedWith(s, key + "=3M", {"is not an integer"});
        ExpectRefusedWith(s, key + "=", {"needs a value"});
        ExpectRefusedWith(s, key, {"needs a value"});
        out_of_range(s.min - 1);
        out_of_range(s.max + 1);
        break;
      case OptionKind::kSize:
        ExpectRefusedWith(s, key + "=lots", {"not a number"});
        ExpectRefusedWith(s, key + "=-1", {"negative"});
        ExpectRefusedWith(s, key + "=12Q", {"unknown unit"});
        ExpectRefusedWith(s, key, {"needs a value"});
        if (s.min > 0) out_of_range(s.min - 1);
        if (s.max < std::numeric_limits<int64_t>::max()) out_of_range(s.max + 1);
        if (s.pages) out_of_range(std::max<int64_t>(s.min, 4096) + 512);
        break;
      case OptionKind::kEnum: {
        std::string listed;
        for (const OptionName& n : s.names) {
          if (n.listed) listed += (listed.empty() ? "" : ", ") + std::string(n.name);
        }
        ExpectRefusedWith(s, key + "=bogus", {"'bogus' is not one of " + listed});
        ExpectRefusedWith(s, key, {"is not one of " + listed});
        break;
      }
      case OptionKind::kString:
      case OptionKind::kConfig:
        ExpectRefusedWith(s, key + "=", {std::string("needs ") + s.missing});
        ExpectRefusedWith(s, key, {std::string("needs ") + s.missing});
        break;
    }
  }
}

TEST(MountOptionTable, HelpListsEveryRowWithItsRangeAndDefault) {
  const std::string usage = UsageText();
  for (const MountOptionSpec& s : MountOptionTable()) {
    SCOPED_TRACE(s.name);
    const size_t at = usage.find("\n  " + std::string(s.name));
    ASSERT_NE(at, std::string::npos) << usage;
    // The row's words, from its line and the indented lines it wraps onto.
    std::istringstream lines(usage.substr(at + 1));
    std::string line, text, words, w;
    std::getline(lines, text);
    while (std::getline(lines, line) && line.rfind(std::string(31, ' '), 0) == 0) text += line;
    for (std::istringstream in(text); in >> w;) words += w + " ";
    if (!OptionRangeText(s).empty()) {
      EXPECT_NE(words.find("(" + OptionRangeText(s) + ";"), std::string::npos) << words;
    }
    EXPECT_NE(words.find("default " + OptionDefaultText(s) + ")"), std::string::npos) << words;
  }
  for (const ConfigKey& k : ConfigKeys()) {
    EXPECT_NE(usage.find("\n  " + std::string(k.name)), std::string::npos) << k.name;
  }
  for (const std::string& line : {std::string("  -d "), std::string("every other -o option")}) {
    EXPECT_NE(usage.find(line), std::string::npos) << line;
  }
  auto md = ParseArgs({"--help-markdown"});
  ASSERT_TRUE(md.ok()) << md.status().ToString();
  EXPECT_TRUE(md->show_help_markdown);
  EXPECT_FALSE(md->show_help);
}

// docs/tuning.md's table of mount options is OptionsMarkdown(), word for word: change a row and
// this fails until the docs are regenerated (`dnvmefs --help-markdown`).
TEST(MountOptionTable, DocsTableIsGeneratedFromTheRows) {
  // The source tree: from this file's name (absolute, or relative to the build directory the
  // test runs in), else the first directory above the working or scratch directory with the docs.
  std::vector<std::string> roots;
  const std::string here = __FILE__;
  roots.push_back(here.substr(0, here.rfind("tests/fs/")));
  char cwd[PATH_MAX] = "";
  const char* scratch = getenv("DNVME_TEST_DIR");  // ctest's: a folder of the build directory
  for (const char* start : {static_cast<const char*>(getcwd(cwd, sizeof(cwd))), scratch}) {
    if (start == nullptr) continue;
    for (std::string d = start; !d.empty(); d = d.substr(0, d.rfind('/'))) roots.push_back(d + "/");
  }
  std::string doc;
  for (const std::string& root : roots) {
    std::ifstream f(root + "docs/tuning.md");
    if (!f) continue;
    std::stringstream text;
    text << f.rdbuf();
    doc = text.str();
    break;
  }
  ASSERT_FALSE(doc.empty()) << "docs/tuning.md not found from " << here << " or " << cwd;
  const std::string begin = "<!-- BEGIN dnvmefs --help-markdown";
  const std::string end = "<!-- END dnvmefs --help-markdown -->";
  const size_t b = doc.find(begin);
  ASSERT_NE(b, std::string::npos) << "docs/tuning.md lost its marker " << begin;
  const size_t from = doc.find('\n', b) + 1;
  const size_t to = doc.find(end, from);
  ASSERT_NE(to, std::string::npos) << "docs/tuning.md lost its marker " << end;
  EXPECT_EQ(doc.substr(from, to - from), OptionsMarkdown())
      << "docs/tuning.md's table of mount options is not the table's: replace the lines between "
         "the markers with the output of `dnvmefs --help-markdown`";
}

}  // namespace
}  // namespace dnvme::fs
