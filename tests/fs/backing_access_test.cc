// Who besides the daemon can reach BACKING_DIR (fs/backing_access.h), and the mount over its own
// backing directory (CheckDirectories, SameDirectory): the set-ups docs/security.md asks for
// are quiet, the reachable one is named with the way out.
#include "fs/backing_access.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include <gtest/gtest.h>

#include "fs/options.h"

namespace dnvme::fs {
namespace {

class BackingAccessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* root = std::getenv("DNVME_TEST_DIR");
    std::string base = root != nullptr ? root : "/var/tmp/dnvme-test";
    std::filesystem::create_directories(base);
    std::string tmpl = base + "/backing_access.XXXXXX";
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
    // Every directory above the scratch directory must be searchable by others for the
    // "reachable" case to mean something; skip where the machine's layout is stricter.
    for (std::filesystem::path p = dir_; p != p.root_path(); p = p.parent_path()) {
      struct stat st {};
      if (stat(p.parent_path().c_str(), &st) == 0 && !(st.st_mode & S_IXOTH)) {
        GTEST_SKIP() << p.parent_path() << " is not searchable by others here";
      }
    }
    ASSERT_EQ(chmod(dir_.c_str(), 0755), 0);
    backing_ = dir_ + "/backing";
    mnt_ = dir_ + "/mnt";
    ASSERT_EQ(mkdir(backing_.c_str(), 0755), 0);
    ASSERT_EQ(mkdir(mnt_.c_str(), 0755), 0);
  }
  void TearDown() override {
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }
  std::string dir_, backing_, mnt_;
};

bool Mentions(const std::vector<std::string>& why, const std::string& what) {
  for (const auto& w : why) {
    if (w.find(what) != std::string::npos) return true;
  }
  return false;
}

TEST_F(BackingAccessTest, AReachableBackingDirIsNamedWithTheWayOut) {
  auto why = BackingExposure(backing_, mnt_, geteuid());
  ASSERT_FALSE(why.empty());
  EXPECT_TRUE(Mentions(why, "can be reached by every user")) << why[0];
  EXPECT_TRUE(Mentions(why, "mount over BACKING_DIR itself")) << why[0];
}

TEST_F(BackingAccessTest, AParentOnlyTheOwnerSearchesHidesIt) {
  ASSERT_EQ(chmod(dir_.c_str(), 0700), 0);
  EXPECT_EQ(BackingExposure(backing_, mnt_, geteuid()), std::vector<std::string>{});
}

TEST_F(BackingAccessTest, AMountOverItselfHidesIt) {
  EXPECT_EQ(BackingExposure(backing_, backing_, geteuid()), std::vector<std::string>{});
}

TEST_F(BackingAccessTest, WritableByOthersIsSaidEvenWhenHidden) {
  ASSERT_EQ(chmod(backing_.c_str(), 0777), 0);
  auto why = BackingExposure(backing_, backing_, geteuid());
  EXPECT_TRUE(Mentions(why, "writable by every user")) << (why.empty() ? "" : why[0]);
}

TEST_F(BackingAccessTest, TheMountMayCoverItsOwnBackingDirEvenWhenNotEmpty) {
  ASSERT_TRUE(std::filesystem::create_directory(backing_ + "/sub"));
  MountOptions o;
  o.backing = backing_;
  o.mountpoint = backing_;
  EXPECT_TRUE(CheckDirectories(o).ok()) << CheckDirectories(o).ToString();
  EXPECT_TRUE(SameDirectory(backing_, backing_ + "/sub/.."));
  EXPECT_FALSE(SameDirectory(backing_, mnt_));
  // A separate, non-empty mount point is still refused without -o nonempty.
  o.mountpoint = dir_;
  EXPECT_FALSE(CheckDirectories(o).ok());
}

}  // namespace
}  // namespace dnvme::fs
