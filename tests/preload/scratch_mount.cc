// The stand-in mount of the preload unit tests (scratch_mount.h).
#include "tests/preload/scratch_mount.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdlib>

#include "preload/internal.h"
#include "preload/mounts.h"

namespace dnvme::preload::testing {
namespace {

using broker::Op;

std::string g_root;
std::string g_outside;
dev_t g_dev = 0;
FakeBroker* g_broker = nullptr;  // lives until exit, as the library's connection to it

bool OnFuseForTest(int fd) {
  struct stat st {};
  return fstat(fd, &st) == 0 && st.st_dev == g_dev;  // "FUSE": the scratch file system
}

bool FindMountForTest(dev_t dev, MountInfo* out) {
  if (dev != g_dev) return false;
  out->dev = dev;
  out->point = g_root;
  return true;
}

std::string MakeDir(const std::string& base, const char* name) {
  std::string tmpl = base + "/" + name + "XXXXXX";
  if (mkdtemp(tmpl.data()) == nullptr) return "";
  char real[PATH_MAX];
  return realpath(tmpl.c_str(), real) ? std::string(real) : "";
}

}  // namespace

void PreloadTest::SetUpTestSuite() {
  if (g_broker != nullptr) return;
  const char* base = std::getenv("DNVME_TEST_DIR");
  std::string dir = base && *base ? base : "/tmp";
  mkdir(dir.c_str(), 0755);
  g_root = MakeDir(dir, "preload-mount-");
  g_outside = MakeDir(dir, "preload-outside-");
  ASSERT_FALSE(g_root.empty());
  ASSERT_FALSE(g_outside.empty());
  struct stat st {};
  ASSERT_EQ(stat(g_root.c_str(), &st), 0);
  g_dev = st.st_dev;
  SetMountProbeForTesting({OnFuseForTest, FindMountForTest});
  g_broker = new FakeBroker(g_root);
}

void PreloadTest::SetUp() { g_broker->Clear(); }

void PreloadTest::TearDown() {
  for (Op op : {Op::kOpen, Op::kWrote, Op::kDrain, Op::kClose}) g_broker->FailWith(op, 0);
  g_broker->ReplySlot(FakeBroker::kAutoSlot);
  for (int fd : fds_) {
    (void)ForgetBeforeClose(fd);
    close(fd);
  }
  fds_.clear();
}

const std::string& PreloadTest::root() { return g_root; }
const std::string& PreloadTest::outside() { return g_outside; }
dev_t PreloadTest::dev() { return g_dev; }
FakeBroker& PreloadTest::broker() { return *g_broker; }

int PreloadTest::OpenFile(const std::string& dir, const std::string& name, int flags, size_t size) {
  const std::string path = dir + "/" + name;
  std::vector<char> data(size);
  for (size_t i = 0; i < size; ++i) data[i] = static_cast<char>(i * 7 + 3);
  const int w = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  EXPECT_GE(w, 0) << path;
  EXPECT_EQ(write(w, data.data(), size), static_cast<ssize_t>(size));
  close(w);
  const int fd = open(path.c_str(), flags | O_CLOEXEC);
  EXPECT_GE(fd, 0) << path;
  fds_.push_back(fd);
  return fd;
}

int PreloadTest::CloseFd(int fd) {
  std::erase(fds_, fd);
  const int err = ForgetBeforeClose(fd).ErrnoOr();  // as close(2) would report it
  close(fd);
  return err;
}

ino_t PreloadTest::InoOf(int fd) {
  struct stat st {};
  fstat(fd, &st);
  return st.st_ino;
}

}  // namespace dnvme::preload::testing
