// The mount's options (fs/options.h): the per-uid limits' defaults, which scale with the machine,
// their parsing, their range checks and their usage lines.
#include "fs/options.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace dnvme::fs {
namespace {

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
  // Never more than the machine has: the old default (64 GiB of registered memory per user) was
  // larger than the RAM of the machines it ran on.
  EXPECT_LE(o->ctl_max_bytes, ram);
  EXPECT_LE(o->ctl_max_pinned, ram);
}

TEST(MountOptionsLimits, EachOptionIsParsed) {
  auto o = Parse(
      "ctl_max_handles=3,ctl_max_bytes=3M,ctl_max_buffers=5,ctl_max_pinned=64M,"
      "ctl_max_pending=7,ctl_threads_per_uid=2,max_files_per_uid=99,"
      "broker_max_conns_per_uid=11");
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->ctl_max_handles, 3);
  EXPECT_EQ(o->ctl_max_bytes, 3 << 20);
  EXPECT_EQ(o->ctl_max_buffers, 5);
  EXPECT_EQ(o->ctl_max_pinned, 64 << 20);
  EXPECT_EQ(o->ctl_max_pending, 7);
  EXPECT_EQ(o->ctl_threads_per_uid, 2);
  EXPECT_EQ(o->max_files_per_uid, 99);
  EXPECT_EQ(o->broker_max_conns_per_uid, 11);
  EXPECT_TRUE(o->fuse_opts.empty()) << "a limit leaked to libfuse";
}

TEST(MountOptionsLimits, OutOfRangeIsAUsageError) {
  for (const char* bad :
       {"ctl_max_buffers=-1", "ctl_max_buffers=16385", "ctl_max_pending=-1",
        "ctl_max_pending=1048577", "ctl_threads_per_uid=0", "ctl_threads_per_uid=65",
        "max_files_per_uid=0", "broker_max_conns_per_uid=-1", "broker_max_conns_per_uid=4097",
        "ctl_max_pinned=lots", "ctl_max_buffers", "ctl_max_handles=4097"}) {
    auto o = Parse(bad);
    EXPECT_FALSE(o.ok()) << bad;
    if (!o.ok()) {
      const std::string key = std::string(bad).substr(0, std::string(bad).find('='));
      EXPECT_NE(o.status().message().find(key), std::string::npos) << o.status().message();
    }
  }
  EXPECT_TRUE(Parse("ctl_max_buffers=0,broker_max_conns_per_uid=0").ok());
}

TEST(MountOptionsLimits, UsageNamesEveryLimit) {
  const std::string usage = UsageText();
  for (const char* key : {"ctl_max_handles=", "ctl_max_bytes=", "ctl_max_buffers=",
                          "ctl_max_pinned=", "ctl_max_pending=", "ctl_threads_per_uid=",
                          "max_files_per_uid=", "broker_max_conns_per_uid="}) {
    EXPECT_NE(usage.find(key), std::string::npos) << key;
  }
}

}  // namespace
}  // namespace dnvme::fs
