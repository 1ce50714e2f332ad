// Space before acknowledgement (datapath/space.h) on real files: ext4 (the scratch directory),
// and a small tmpfs (out of space) and a ramfs (no fallocate) of the test's own, which need root
// and skip with the reason without it.
#include "datapath/space.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "tests/datapath/data_test_util.h"

namespace dnvme::datapath::test {
namespace {

class SpaceTest : public DataPathTest {
 protected:
  void SetUp() override {
    DataPathTest::SetUp();
    opts_.reserve = true;
  }
  void TearDown() override {
    file_ = FileRef();
    if (fd_ >= 0) close(fd_);
    own_.reset();
    DataPathTest::TearDown();
  }
  // `path` (made, `size` bytes, a hole) opened by the engine, and a descriptor of our own.
  void Make(const std::string& path, int64_t size = 0) {
    fd_ = open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    ASSERT_GE(fd_, 0) << path << ": " << std::strerror(errno);
    ASSERT_EQ(ftruncate(fd_, size), 0);
    auto f = engine_->open_file(path, FileAccess::kReadWrite);
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    file_ = std::move(f).value();
  }
  struct stat Stat() {
    struct stat st {};
    EXPECT_EQ(fstat(fd_, &st), 0);
    return st;
  }
  int64_t Size() { return Stat().st_size; }
  int64_t Allocated() { return static_cast<int64_t>(Stat().st_blocks) * 512; }
  Result<SpaceReservation::Grant> Reserve(int64_t off, int64_t len, bool alone = true) {
    return resv_.Reserve(opts_, &budget_, file_, off, len, alone);
  }
  // A file system of the test's own at Path(type): false (with the reason) when it cannot mount.
  bool MountOwn(const std::string& type, const std::string& opts, std::string* why) {
    if (geteuid() != 0) {
      *why = "mounting a " + type + " needs root";
      return false;
    }
    own_ = std::make_unique<dnvme::test::Mount>(type, Path(type), type, opts);
    if (!own_->ok()) *why = own_->what();
    return own_->ok();
  }

  SpaceOptions opts_;
  SpaceBudget budget_;
  SpaceReservation resv_;
  FileRef file_;
  int fd_ = -1;
  std::unique_ptr<dnvme::test::Mount> own_;
};

TEST_F(SpaceTest, ALoneWriterPastTheEndReservesAStepAheadAndTrimFreesIt) {
  Make(Path("alone"));
  auto g = Reserve(0, kMiB);
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_EQ(g->bytes, kMiB);
  EXPECT_FALSE(g->through);
  EXPECT_EQ(Size(), 0);  // KEEP_SIZE: the mount reports the pending size itself
  EXPECT_GE(Allocated(), opts_.step_min);
  EXPECT_TRUE(resv_.holds_past_eof());
  const int64_t reserved = Allocated();
  ASSERT_TRUE(Reserve(kMiB, 3 * kMiB).ok());  // inside the step: nothing new
  EXPECT_EQ(Allocated(), reserved);
  // The bytes land (as a flush would), then the writer is done.
  std::vector<char> data(5 * kMiB + 7, 'x');
  ASSERT_EQ(pwrite(fd_, data.data(), data.size(), 0), static_cast<ssize_t>(data.size()));
  const struct timespec old[2] = {{0, UTIME_OMIT}, {1000000000, 0}};
  ASSERT_EQ(futimens(fd_, old), 0);
  const uint64_t epoch = resv_.epoch();
  ASSERT_TRUE(resv_.Trim(fd_).ok());
  EXPECT_NE(resv_.epoch(), epoch);  // a grant made before no longer holds
  EXPECT_FALSE(resv_.holds_past_eof());
  EXPECT_EQ(Size(), 5 * kMiB + 7);
  EXPECT_LE(Allocated(), 5 * kMiB + 8192);
  EXPECT_GE(Allocated(), 5 * kMiB);  // the file's own blocks stay
  EXPECT_EQ(Stat().st_mtim.tv_sec, 1000000000) << "the trim kept the last write's mtime";
  EXPECT_TRUE(resv_.Trim(fd_).ok());  // nothing left: no-op
}

TEST_F(SpaceTest, TheStepGrowsWithTheFileButTakesLittleOfANearlyFullFileSystem) {
  Make(Path("grown"), 100 * kMiB);
  ASSERT_TRUE(Reserve(100 * kMiB, kMiB).ok());
  EXPECT_GE(Allocated(), 100 * kMiB) << "as much again as the file holds";
  EXPECT_LE(Allocated(), 101 * kMiB + 8192);
  std::string why;
  if (!MountOwn("tmpfs", "size=64m", &why)) GTEST_SKIP() << why;
  close(fd_);
  fd_ = -1;
  Make(Path("tmpfs") + "/small");
  SpaceReservation fresh;
  ASSERT_TRUE(fresh.Reserve(opts_, &budget_, file_, 0, 4096, true).ok());
  EXPECT_GE(Allocated(), 4096);
  EXPECT_LE(Allocated(), 4 * kMiB) << "more than a sixteenth of the 64 MiB free";
}

TEST_F(SpaceTest, AWriterNotAloneGetsItsWritesRangeOnly) {
  Make(Path("shared"));
  ASSERT_TRUE(Reserve(0, kMiB, /*alone=*/false).ok());
  EXPECT_GE(Allocated(), kMiB);
  EXPECT_LE(Allocated(), kMiB + 8192);
}

TEST_F(SpaceTest, AWriteOverWrittenBlocksReservesNothing) {
  Make(Path("written"));
  std::vector<char> data(4 * kMiB, 'w');
  ASSERT_EQ(pwrite(fd_, data.data(), data.size(), 0), static_cast<ssize_t>(data.size()));
  ASSERT_EQ(fsync(fd_), 0);
  const int64_t before = Allocated();
  auto g = Reserve(kMiB, kMiB);
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->bytes, kMiB);
  EXPECT_EQ(Allocated(), before);
  EXPECT_FALSE(resv_.holds_past_eof());
}

TEST_F(SpaceTest, UnwrittenBlocksFromFallocateCountAsThere) {
  // fio lays out its files with fallocate(2): the writes then land in unwritten extents, which
  // FIEMAP reports (SEEK_HOLE would call them holes).
  Make(Path("unwritten"));
  ASSERT_EQ(fallocate(fd_, 0, 0, 32 * kMiB), 0);
  const int64_t before = Allocated();
  ASSERT_TRUE(Reserve(0, kMiB).ok());
  ASSERT_TRUE(Reserve(16 * kMiB, kMiB).ok());
  EXPECT_EQ(Allocated(), before);
}

TEST_F(SpaceTest, AHoleInsideTheFileGetsExactlyTheWritesRange) {
  Make(Path("sparse"), 256 * kMiB);
  ASSERT_LE(Allocated(), 8192);
  ASSERT_TRUE(Reserve(64 * kMiB, kMiB).ok());
  EXPECT_GE(Allocated(), kMiB);
  EXPECT_LE(Allocated(), kMiB + 8192) << "a sparse file stays sparse";
  EXPECT_EQ(Size(), 256 * kMiB);
  EXPECT_FALSE(resv_.holds_past_eof());
}

TEST_F(SpaceTest, ExtendRaisesTheSizeToTheWritesEnd) {
  opts_.extend = true;  // `dnvme run`
  Make(Path("extend"));
  ASSERT_TRUE(Reserve(0, kMiB).ok());
  EXPECT_EQ(Size(), kMiB);  // before the write-behind writes a byte
  ASSERT_TRUE(Reserve(kMiB, 2 * kMiB + 100).ok());
  EXPECT_EQ(Size(), 3 * kMiB + 100);
  const int64_t reserved = Allocated();
  EXPECT_GE(reserved, opts_.step_min);
  ASSERT_TRUE(Reserve(kMiB, kMiB).ok());  // inside: the size stays
  EXPECT_EQ(Size(), 3 * kMiB + 100);
  EXPECT_EQ(Allocated(), reserved);
  ASSERT_TRUE(resv_.Trim(fd_).ok());
  EXPECT_EQ(Size(), 3 * kMiB + 100);
  EXPECT_LE(Allocated(), 3 * kMiB + 8192);
}

TEST_F(SpaceTest, AShrinkBehindTheReservationsBackIsNoticed) {
  // Someone else shrinks the file: the blocks past the new end went with it, so the next write
  // past the end reserves again rather than trust the old range.
  opts_.extend = true;
  Make(Path("shrunk"));
  ASSERT_TRUE(Reserve(0, 2 * kMiB).ok());
  ASSERT_EQ(ftruncate(fd_, 0), 0);
  ASSERT_LE(Allocated(), 8192);
  ASSERT_TRUE(Reserve(kMiB, kMiB).ok());
  EXPECT_EQ(Size(), 2 * kMiB);
  EXPECT_GE(Allocated(), opts_.step_min);
}

TEST_F(SpaceTest, ForgetMakesTheNextWriteLookAgainAndEarlierGrantsStale) {
  // A shrink and a grow back to the same size (the size alone cannot tell): only Forget, which
  // FileData::Change calls around every truncate and fallocate, says the blocks are gone.
  Make(Path("forgotten"));
  auto g = Reserve(0, kMiB);
  ASSERT_TRUE(g.ok());
  ASSERT_EQ(ftruncate(fd_, 0), 0);
  resv_.Forget();
  EXPECT_NE(resv_.epoch(), g->epoch);
  ASSERT_LE(Allocated(), 8192);
  ASSERT_TRUE(Reserve(0, kMiB).ok());
  EXPECT_GE(Allocated(), opts_.step_min);
}

TEST_F(SpaceTest, OutOfSpaceAWriteGetsThePartThatFitsThenTheError) {
  std::string why;
  if (!MountOwn("tmpfs", "size=16m", &why)) GTEST_SKIP() << why;
  Make(Path("tmpfs") + "/small");
  // 64 MiB ahead do not fit: the write still gets its own 4 MiB.
  auto g = Reserve(0, 4 * kMiB);
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_EQ(g->bytes, 4 * kMiB);
  EXPECT_LE(Allocated(), 4 * kMiB + 8192);
  // 28 MiB more into 12 free: the part that fits, in pages, as ext4's write(2) returns it.
  g = Reserve(4 * kMiB, 28 * kMiB);
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_GT(g->bytes, 11 * kMiB);
  EXPECT_LE(g->bytes, 12 * kMiB);
  EXPECT_EQ(g->bytes % 4096, 0);
  // Nothing fits now: the writer's error.
  g = Reserve(4 * kMiB + g->bytes, kMiB);
  EXPECT_EQ(g.status().ErrnoOr(), ENOSPC);
  EXPECT_EQ(g.status().code(), Status::Code::kNoSpace);
  EXPECT_EQ(Size(), 0);
  // Freeing the reservation gives the space back.
  ASSERT_TRUE(resv_.Trim(fd_).ok());
  EXPECT_EQ(Allocated(), 0);
}

TEST_F(SpaceTest, WithoutFallocateTheBudgetDecides) {
  // ramfs has no fallocate, and statvfs shows it no space: every write goes through (it meets
  // its own error, if any), and the reservation stops asking fallocate.
  std::string why;
  if (!MountOwn("ramfs", "", &why)) GTEST_SKIP() << why;
  Make(Path("ramfs") + "/nofalloc");
  auto g = Reserve(0, kMiB);
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_TRUE(g->through);
  EXPECT_EQ(g->bytes, kMiB);
  g = Reserve(kMiB, kMiB);
  ASSERT_TRUE(g.ok());
  EXPECT_TRUE(g->through);
}

TEST_F(SpaceTest, TheBudgetKeepsRoomForWhatWriteBehindMayHold) {
  std::string why;
  if (!MountOwn("tmpfs", "size=64m", &why)) GTEST_SKIP() << why;
  Make(Path("tmpfs") + "/budget");
  const dev_t dev = Stat().st_dev;
  const int64_t unlanded = 8 * kMiB;
  // 64 MiB free: a write must leave twice what write-behind may hold unlanded, and the margin.
  const int64_t most = 64 * kMiB - 2 * unlanded - SpaceBudget::kMargin;
  EXPECT_FALSE(budget_.Allows(fd_, dev, most + 4096, unlanded));
  EXPECT_TRUE(budget_.Allows(fd_, dev, most, unlanded));
  // Space another writer takes is seen at the next look.
  std::vector<char> data(32 * kMiB, 'z');
  const int other = open((Path("tmpfs") + "/other").c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  ASSERT_GE(other, 0);
  ASSERT_EQ(write(other, data.data(), data.size()), static_cast<ssize_t>(data.size()));
  close(other);
  std::this_thread::sleep_for(SpaceBudget::kFresh * 2);
  EXPECT_FALSE(budget_.Allows(fd_, dev, most - 31 * kMiB, unlanded));
  EXPECT_TRUE(budget_.Allows(fd_, dev, most - 32 * kMiB, unlanded));
  // A descriptor statvfs refuses: no.
  EXPECT_FALSE(budget_.Allows(-1, 12345, 4096, 0));
}

TEST_F(SpaceTest, WritersExtendingTheFileAtOnceEachGetTheirSpace) {
  opts_.extend = true;
  Make(Path("racing"));
  constexpr int kThreads = 4;
  constexpr int kEach = 16;
  constexpr int64_t kPiece = 256 << 10;
  std::atomic<int> errors{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kEach; ++i) {
        const int64_t off = (int64_t{i} * kThreads + t) * kPiece;
        auto g = Reserve(off, kPiece);
        if (!g.ok() || g->bytes != kPiece) ++errors;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(Size(), kThreads * kEach * kPiece);  // the furthest end, never shrunk by another
  ASSERT_TRUE(resv_.Trim(fd_).ok());
  EXPECT_EQ(Size(), kThreads * kEach * kPiece);
}

// The fault seam (SpaceOptions::fallocate): a writer's quota that ends at kQuotaEnd of the file,
// errors, a step the file system finds too large. Set by each test before it reserves.
std::atomic<int64_t> g_quota_end{0};
std::atomic<int> g_fail_errno{0};
std::atomic<int64_t> g_refuse_longer{0};
int FakeFallocate(int fd, int mode, off_t off, off_t len) {
  if (g_fail_errno.load() != 0) {
    errno = g_fail_errno.load();
    return -1;
  }
  if (g_refuse_longer.load() > 0 && len > g_refuse_longer.load()) {
    errno = EFBIG;
    return -1;
  }
  if (g_quota_end.load() > 0 && off + len > g_quota_end.load()) {
    errno = EDQUOT;
    return -1;
  }
  return ::fallocate(fd, mode, off, len);
}

class SpaceFaultTest : public SpaceTest {
 protected:
  void SetUp() override {
    SpaceTest::SetUp();
    g_quota_end = 0;
    g_fail_errno = 0;
    g_refuse_longer = 0;
    opts_.fallocate = FakeFallocate;
  }
};

TEST_F(SpaceFaultTest, AQuotaEndsTheGrantAndThenRefusesWithEdquot) {
  Make(Path("quota"));
  g_quota_end = 5 * kMiB + 100;
  auto g = Reserve(0, 8 * kMiB);
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_EQ(g->bytes, 5 * kMiB) << "the pages under the quota";
  g = Reserve(5 * kMiB, kMiB);
  EXPECT_EQ(g.status().ErrnoOr(), EDQUOT);
  EXPECT_EQ(g.status().code(), Status::Code::kNoSpace);
  // Inside the file too: a hole past the quota is refused the same way.
  close(fd_);
  fd_ = -1;
  Make(Path("quota-hole"), 16 * kMiB);
  g = Reserve(6 * kMiB, kMiB);
  EXPECT_EQ(g.status().ErrnoOr(), EDQUOT);
  g = Reserve(4 * kMiB + 4096, 2 * kMiB);
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_EQ(g->bytes, kMiB - 4096);
}

TEST_F(SpaceFaultTest, AnotherFallocateErrorIsTheWritesError) {
  Make(Path("eio"));
  g_fail_errno = EIO;
  auto g = Reserve(0, kMiB);
  EXPECT_EQ(g.status().ErrnoOr(), EIO);
  g_fail_errno = EROFS;
  EXPECT_EQ(Reserve(0, kMiB).status().ErrnoOr(), EROFS);
  g_fail_errno = 0;
  EXPECT_TRUE(Reserve(0, kMiB).ok()) << "nothing remembered of the failures";
}

TEST_F(SpaceFaultTest, AStepTheFileSystemRefusesIsRetriedAsTheWritesOwnRange) {
  Make(Path("efbig"), 64 * kMiB);  // a step of 64 MiB ahead
  g_refuse_longer = 2 * kMiB;
  auto g = Reserve(64 * kMiB, kMiB);
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_EQ(g->bytes, kMiB);
  EXPECT_LE(Allocated(), kMiB + 8192);
}

TEST_F(SpaceFaultTest, NoFallocateSendsEveryLaterWriteToTheBudget) {
  Make(Path("nofalloc"));
  g_fail_errno = EOPNOTSUPP;
  auto g = Reserve(0, kMiB);
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  // The scratch file system has room: the budget lets the write behind.
  EXPECT_FALSE(g->through);
  g_fail_errno = 0;
  g = Reserve(kMiB, kMiB);
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(Allocated(), 0) << "fallocate asked again after EOPNOTSUPP";
}

TEST_F(SpaceTest, NotAskedToReserveGrantsEverything) {
  opts_.reserve = false;
  Make(Path("off"));
  auto g = Reserve(0, 8 * kMiB);
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->bytes, 8 * kMiB);
  EXPECT_FALSE(g->through);
  EXPECT_EQ(Allocated(), 0);
}

}  // namespace
}  // namespace dnvme::datapath::test
