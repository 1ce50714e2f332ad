// Space for extending writes (preload/reserve.h) on real files: ext4 (the scratch directory),
// and a small tmpfs and a ramfs for ENOSPC and a file system without fallocate (those need
// root, and skip with the reason without it). The adopted file is made by hand (its backing
// file opened by the process's engine, a lease word of its own): no broker is involved.
#include "preload/reserve.h"

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

#include "preload/staging.h"
#include "tests/engine/test_util.h"

namespace dnvme::preload {
namespace {

using dnvme::test::kMiB;

constexpr int64_t kReserveMin = 64 * kMiB;  // reserve.cc: a lone writer reserves at least this

class ReserveTest : public dnvme::test::ScratchTest {
 protected:
  void TearDown() override {
    f_.reset();  // before the word its hooks point to
    close(program_fd_);
    mount_.reset();
    ScratchTest::TearDown();
  }

  // A file at `path` of `size` bytes, adopted by hand, and the program's own descriptor of it.
  void Make(const std::string& path, int64_t size = 0) {
    const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    ASSERT_GE(fd, 0) << path << ": " << strerror(errno);
    ASSERT_EQ(ftruncate(fd, size), 0);
    program_fd_ = fd;
    AioHandle* engine = Engine();
    ASSERT_NE(engine, nullptr);
    auto ref = engine->open_file(path, FileAccess::kReadWrite);
    ASSERT_TRUE(ref.ok()) << ref.status().ToString();
    f_ = std::make_shared<AdoptedFile>();
    f_->word = &word_;
    f_->can_read = f_->can_write = true;
    f_->file = std::move(ref).value();
  }

  struct stat Stat() {
    struct stat st {};
    EXPECT_EQ(fstat(program_fd_, &st), 0);
    return st;
  }
  int64_t Size() { return Stat().st_size; }
  int64_t Allocated() { return static_cast<int64_t>(Stat().st_blocks) * 512; }

  // A file system of its own at Path(name): "tmpfs" of `size_opt`, or "ramfs".
  bool MountOwn(const std::string& type, const std::string& opts, std::string* why) {
    mount_ = std::make_unique<dnvme::test::Mount>(type, Path(type), type, opts);
    if (!mount_->ok()) *why = mount_->what();
    return mount_->ok();
  }

  broker::LeaseWord word_{};
  std::shared_ptr<AdoptedFile> f_;
  int program_fd_ = -1;
  std::unique_ptr<dnvme::test::Mount> mount_;
};

TEST_F(ReserveTest, AWriteInsideTheFileReservesNothing) {
  Make(Path("inside"), kMiB);
  const int64_t before = Allocated();
  EXPECT_TRUE(Reserve(*f_, 0, kMiB / 2).ok());
  EXPECT_TRUE(Reserve(*f_, kMiB - 4096, kMiB).ok());
  EXPECT_EQ(Size(), kMiB);
  EXPECT_EQ(Allocated(), before);
}

TEST_F(ReserveTest, ALoneWriterReservesAheadAndTrimsAtTheEnd) {
  Make(Path("alone"));
  ASSERT_TRUE(Reserve(*f_, 0, kMiB).ok());
  EXPECT_EQ(Size(), kMiB);              // the new size, before the write-behind writes a byte
  EXPECT_GE(Allocated(), kReserveMin);  // ahead, past the end (fallocate KEEP_SIZE)
  const int64_t reserved = Allocated();
  // Later extending writes use the reservation: the size moves, no new allocation.
  ASSERT_TRUE(Reserve(*f_, kMiB, 3 * kMiB).ok());
  ASSERT_TRUE(Reserve(*f_, 3 * kMiB + 100, 5 * kMiB + 7).ok());
  EXPECT_EQ(Size(), 5 * kMiB + 7);
  EXPECT_EQ(Allocated(), reserved);
  TrimReservation(*f_);  // the lease ends
  EXPECT_EQ(Size(), 5 * kMiB + 7);
  EXPECT_LE(Allocated(), 5 * kMiB + 8192);
  EXPECT_GE(Allocated(), 5 * kMiB);  // the file's own blocks stay
}

TEST_F(ReserveTest, AFileSomeoneElseHasOpenGetsItsWritesRangeOnly) {
  Make(Path("shared"));
  word_.shared.store(1);
  ASSERT_TRUE(Reserve(*f_, 0, kMiB).ok());
  EXPECT_EQ(Size(), kMiB);
  EXPECT_GE(Allocated(), kMiB);
  EXPECT_LE(Allocated(), kMiB + 8192);  // nothing past the end another truncate would free
}

TEST_F(ReserveTest, NoTrimWhileSomeoneElseHasTheFileOpen) {
  Make(Path("trim-shared"));
  ASSERT_TRUE(Reserve(*f_, 0, kMiB).ok());
  ASSERT_GE(Allocated(), kReserveMin);
  word_.shared.store(1);  // another opener: its writes could extend the file under a trim
  TrimReservation(*f_);
  EXPECT_GE(Allocated(), kReserveMin);
  word_.shared.store(0);
  TrimReservation(*f_);
  EXPECT_LE(Allocated(), kMiB + 8192);
  EXPECT_EQ(Size(), kMiB);
}

TEST_F(ReserveTest, AShrinkBehindTheLibrarysBackIsNoticed) {
  // Another process shrinks the file: the blocks past the new end went with it, so the next
  // extending write reserves again rather than trust the old reservation.
  Make(Path("shrunk"));
  ASSERT_TRUE(Reserve(*f_, 0, 2 * kMiB).ok());
  ASSERT_EQ(ftruncate(program_fd_, 0), 0);
  ASSERT_LE(Allocated(), 8192);
  ASSERT_TRUE(Reserve(*f_, kMiB, 2 * kMiB).ok());
  EXPECT_EQ(Size(), 2 * kMiB);
  EXPECT_GE(Allocated(), kReserveMin);
}

TEST_F(ReserveTest, TruncateAdoptedForgetsTheReservation) {
  // A shrink and a grow back to the same size: only forgetting tells the blocks are gone.
  Make(Path("truncated"));
  ASSERT_TRUE(Reserve(*f_, 0, kMiB).ok());
  ASSERT_TRUE(TruncateAdopted(*f_, program_fd_, 0).ok());
  ASSERT_LE(Allocated(), 8192);
  ASSERT_TRUE(TruncateAdopted(*f_, program_fd_, kMiB).ok());
  EXPECT_EQ(Size(), kMiB);
  ASSERT_TRUE(Reserve(*f_, kMiB, 2 * kMiB).ok());
  EXPECT_EQ(Size(), 2 * kMiB);
  EXPECT_GE(Allocated(), kReserveMin);
  EXPECT_EQ(TruncateAdopted(*f_, -1, 0).ErrnoOr(), EBADF);  // ftruncate's errno
}

TEST_F(ReserveTest, FallocateBackingForgetsTheReservationAndReturnsTheErrno) {
  Make(Path("fallocated"));
  ASSERT_TRUE(Reserve(*f_, 0, kMiB).ok());  // [0, 64M) reserved
  ASSERT_GE(Allocated(), kReserveMin);
  // fallocate(2) grows the file into the reservation: Reserve looks again at the next write
  // past the end instead of trusting what it reserved before.
  ASSERT_TRUE(FallocateBacking(*f_, 0, 0, 2 * kMiB).ok());
  EXPECT_EQ(Size(), 2 * kMiB);
  ASSERT_TRUE(Reserve(*f_, 2 * kMiB, 3 * kMiB).ok());
  EXPECT_EQ(Size(), 3 * kMiB);
  EXPECT_GE(Allocated(), 2 * kMiB + kReserveMin);  // reserved ahead of the new end
  EXPECT_EQ(FallocateBacking(*f_, FALLOC_FL_PUNCH_HOLE, 0, 4096).ErrnoOr(), EOPNOTSUPP);
  EXPECT_EQ(FallocateBacking(*f_, 0, 0, -1).ErrnoOr(), EINVAL);
  EXPECT_EQ(BackingFallocate(-1, 0, 0, 4096).ErrnoOr(), EBADF);
}

TEST_F(ReserveTest, OutOfSpaceTheWriteGetsJustItsRangeOrTheError) {
  if (geteuid() != 0) GTEST_SKIP() << "mounting a small tmpfs needs root";
  std::string why;
  if (!MountOwn("tmpfs", "size=16m", &why)) GTEST_SKIP() << why;
  Make(Path("tmpfs") + "/small");
  // 64 MiB ahead do not fit: the write still gets its own 4 MiB.
  ASSERT_TRUE(Reserve(*f_, 0, 4 * kMiB).ok());
  EXPECT_EQ(Size(), 4 * kMiB);
  EXPECT_LE(Allocated(), 4 * kMiB + 8192);  // what the failed try allocated was given back
  // A write that does not fit at all: its error, with the file as it was.
  EXPECT_EQ(Reserve(*f_, 4 * kMiB, 32 * kMiB).ErrnoOr(), ENOSPC);
  EXPECT_EQ(Size(), 4 * kMiB);
  EXPECT_LE(Allocated(), 4 * kMiB + 8192);
  // Space for a smaller one is still there.
  EXPECT_TRUE(Reserve(*f_, 4 * kMiB, 8 * kMiB).ok());
  EXPECT_EQ(Size(), 8 * kMiB);
}

TEST_F(ReserveTest, WithoutFallocateTheFileIsExtendedByTruncateAlone) {
  if (geteuid() != 0) GTEST_SKIP() << "mounting a ramfs needs root";
  std::string why;
  if (!MountOwn("ramfs", "", &why)) GTEST_SKIP() << why;
  Make(Path("ramfs") + "/nofalloc");
  ASSERT_TRUE(Reserve(*f_, 0, kMiB).ok());
  EXPECT_EQ(Size(), kMiB);
  ASSERT_TRUE(Reserve(*f_, kMiB, 2 * kMiB).ok());  // not asked again, still extended
  EXPECT_EQ(Size(), 2 * kMiB);
  TrimReservation(*f_);
  EXPECT_EQ(Size(), 2 * kMiB);
}

TEST_F(ReserveTest, WritersExtendingTheFileAtOnceEachGetTheirSpace) {
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
        if (!Reserve(*f_, off, off + kPiece).ok()) ++errors;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(Size(), kThreads * kEach * kPiece);  // the furthest end, never shrunk by another
  TrimReservation(*f_);
  EXPECT_EQ(Size(), kThreads * kEach * kPiece);
}

}  // namespace
}  // namespace dnvme::preload
