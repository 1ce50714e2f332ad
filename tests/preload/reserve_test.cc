// `dnvme run`'s writes and their space (datapath/space.h, as preload/staging.cc sets it up:
// reserved and the file extended before each write; preload/reserve.h: trimmed at the lease's
// end, forgotten around truncates) on real files: ext4 (the scratch directory), and a small tmpfs
// and a ramfs for ENOSPC and a file system without fallocate (those need root, and skip with the
// reason without it). The adopted file is made by hand (its backing file opened by the process's
// engine, a lease word of its own): no broker is involved.
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

#include "preload/counters.h"
#include "preload/staging.h"
#include "tests/engine/test_util.h"

namespace dnvme::preload {
namespace {

using dnvme::test::kMiB;

constexpr int64_t kReserveMin = 8 * kMiB;  // SpaceOptions::step_min: a lone writer's step

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
  // The program writes `n` bytes at `off` (of a pattern): the bytes the write returned.
  Result<int64_t> Write(int64_t off, int64_t n) {
    if (WritePool() == nullptr) ADD_FAILURE() << "no write-behind buffers";
    data_.assign(static_cast<size_t>(n), static_cast<char>('a' + off % 23));
    return SubmitWrite(*f_, data_.data(), data_.size(), off);
  }
  // Write(), the bytes it returned, -1 on an error.
  int64_t Wrote(int64_t off, int64_t n) {
    Result<int64_t> got = Write(off, n);
    return got.ok() ? *got : -1;
  }
  void Land() { ASSERT_TRUE(f_->data.Drain().ok()); }

  // A file system of its own at Path(name): "tmpfs" of `size_opt`, or "ramfs".
  bool MountOwn(const std::string& type, const std::string& opts, std::string* why) {
    mount_ = std::make_unique<dnvme::test::Mount>(type, Path(type), type, opts);
    if (!mount_->ok()) *why = mount_->what();
    return mount_->ok();
  }

  broker::LeaseWord word_{};
  std::shared_ptr<AdoptedFile> f_;
  int program_fd_ = -1;
  std::vector<char> data_;
  std::unique_ptr<dnvme::test::Mount> mount_;
};

TEST_F(ReserveTest, AWriteInsideTheFileReservesNothing) {
  Make(Path("inside"), kMiB);
  ASSERT_EQ(ftruncate(program_fd_, 0), 0);
  std::vector<char> full(kMiB, 'i');
  ASSERT_EQ(pwrite(program_fd_, full.data(), full.size(), 0), kMiB);
  ASSERT_EQ(fsync(program_fd_), 0);
  const int64_t before = Allocated();
  EXPECT_EQ(Wrote(0, kMiB / 2), kMiB / 2);
  EXPECT_EQ(Wrote(kMiB - 4096, 4096), 4096);
  Land();
  EXPECT_EQ(Size(), kMiB);
  EXPECT_EQ(Allocated(), before);
}

TEST_F(ReserveTest, ALoneWriterReservesAheadAndTrimsAtTheEnd) {
  Make(Path("alone"));
  ASSERT_EQ(Wrote(0, kMiB), kMiB);
  EXPECT_EQ(Size(), kMiB);              // the new size, as the write returns
  EXPECT_GE(Allocated(), kReserveMin);  // ahead, past the end (fallocate KEEP_SIZE)
  const int64_t reserved = Allocated();
  // Later extending writes use the reservation: the size moves, no new allocation.
  ASSERT_EQ(Wrote(kMiB, 2 * kMiB), 2 * kMiB);
  ASSERT_EQ(Wrote(3 * kMiB + 100, 2 * kMiB - 93), 2 * kMiB - 93);
  EXPECT_EQ(Size(), 5 * kMiB + 7);
  EXPECT_LE(Allocated(), reserved + 8192);  // (an extent tree block as the flushes split it)
  Land();
  TrimReservation(*f_);  // the lease ends
  EXPECT_EQ(Size(), 5 * kMiB + 7);
  EXPECT_LE(Allocated(), 5 * kMiB + 8192);
  EXPECT_GE(Allocated(), 5 * kMiB - 4096);  // the file's own blocks stay (100 bytes are a hole)
}

TEST_F(ReserveTest, AFileSomeoneElseHasOpenGetsItsWritesRangeOnly) {
  Make(Path("shared"));
  word_.shared.store(1);
  ASSERT_EQ(Wrote(0, kMiB), kMiB);
  EXPECT_EQ(Size(), kMiB);
  EXPECT_GE(Allocated(), kMiB);
  EXPECT_LE(Allocated(), kMiB + 8192);  // nothing past the end another truncate would free
}

TEST_F(ReserveTest, NoTrimWhileSomeoneElseHasTheFileOpen) {
  Make(Path("trim-shared"));
  ASSERT_EQ(Wrote(0, kMiB), kMiB);
  Land();
  ASSERT_GE(Allocated(), kReserveMin);
  word_.shared.store(1);  // another opener: its writes could extend the file under a trim
  TrimReservation(*f_);
  EXPECT_GE(Allocated(), kReserveMin);
  word_.shared.store(0);
  TrimReservation(*f_);
  EXPECT_LE(Allocated(), kMiB + 8192);
  EXPECT_EQ(Size(), kMiB);
}

TEST_F(ReserveTest, TruncateInChangeForgetsTheReservation) {
  // A shrink and a grow back to the same size: only the change tells the blocks are gone.
  Make(Path("truncated"));
  ASSERT_EQ(Wrote(0, kMiB), kMiB);
  ASSERT_TRUE(f_->data.Change([&] { return TruncateAdopted(program_fd_, 0); }).ok());
  ASSERT_LE(Allocated(), 8192);
  ASSERT_TRUE(f_->data.Change([&] { return TruncateAdopted(program_fd_, kMiB); }).ok());
  EXPECT_EQ(Size(), kMiB);
  ASSERT_EQ(Wrote(kMiB, kMiB), kMiB);
  EXPECT_EQ(Size(), 2 * kMiB);
  EXPECT_GE(Allocated(), kReserveMin);
  EXPECT_EQ(TruncateAdopted(-1, 0).ErrnoOr(), EBADF);  // ftruncate's errno
}

TEST_F(ReserveTest, FallocateInChangeForgetsTheReservationAndReturnsTheErrno) {
  Make(Path("fallocated"));
  ASSERT_EQ(Wrote(0, kMiB), kMiB);  // [0, 64M) reserved
  ASSERT_GE(Allocated(), kReserveMin);
  ASSERT_TRUE(f_->data.Change([&] { return FallocateBacking(*f_, 0, 0, 2 * kMiB); }).ok());
  EXPECT_EQ(Size(), 2 * kMiB);
  ASSERT_EQ(Wrote(2 * kMiB, kMiB), kMiB);
  EXPECT_EQ(Size(), 3 * kMiB);
  EXPECT_EQ(FallocateBacking(*f_, FALLOC_FL_PUNCH_HOLE, 0, 4096).ErrnoOr(), EOPNOTSUPP);
  EXPECT_EQ(FallocateBacking(*f_, 0, 0, -1).ErrnoOr(), EINVAL);
  EXPECT_EQ(BackingFallocate(-1, 0, 0, 4096).ErrnoOr(), EBADF);
}

TEST_F(ReserveTest, OutOfSpaceAWriteReturnsWhatFitsThenTheError) {
  if (geteuid() != 0) GTEST_SKIP() << "mounting a small tmpfs needs root";
  std::string why;
  if (!MountOwn("tmpfs", "size=16m", &why)) GTEST_SKIP() << why;
  Make(Path("tmpfs") + "/small");
  // 64 MiB ahead do not fit: the write still gets its own 4 MiB.
  ASSERT_EQ(Wrote(0, 4 * kMiB), 4 * kMiB);
  EXPECT_EQ(Size(), 4 * kMiB);
  // 28 MiB into 12 free: the write returns what fit, as ext4's does; the next one the error.
  Result<int64_t> got = Write(4 * kMiB, 28 * kMiB);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_GT(*got, 11 * kMiB);
  EXPECT_LE(*got, 12 * kMiB);
  const int64_t end = 4 * kMiB + *got;
  EXPECT_EQ(Size(), end);
  EXPECT_EQ(Write(end, kMiB).status().ErrnoOr(), ENOSPC);
  Land();
  EXPECT_EQ(Size(), end);  // no zero-filled tail, every byte returned is there
  std::vector<char> back(static_cast<size_t>(*got));
  ASSERT_EQ(pread(program_fd_, back.data(), back.size(), 4 * kMiB),
            static_cast<ssize_t>(back.size()));
  EXPECT_EQ(back, std::vector<char>(back.size(), static_cast<char>('a' + (4 * kMiB) % 23)));
}

TEST_F(ReserveTest, WithoutFallocateTheWritesGoThroughAndExtend) {
  if (geteuid() != 0) GTEST_SKIP() << "mounting a ramfs needs root";
  std::string why;
  if (!MountOwn("ramfs", "", &why)) GTEST_SKIP() << why;
  Make(Path("ramfs") + "/nofalloc");
  ASSERT_EQ(Wrote(0, kMiB), kMiB);
  EXPECT_EQ(Size(), kMiB);
  ASSERT_EQ(Wrote(kMiB, kMiB), kMiB);
  EXPECT_EQ(Size(), 2 * kMiB);
  EXPECT_GE(ProcessCounters().data.space_write_through.load(), 2u);
  TrimReservation(*f_);
  EXPECT_EQ(Size(), 2 * kMiB);
}

}  // namespace
}  // namespace dnvme::preload
