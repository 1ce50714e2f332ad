// The preload library's adoption and leases against a fake broker (fake_broker.h), no mount:
// a plain scratch directory stands for the mount through the MountProbe seam (preload/mounts.h),
// and the library's core is linked as an archive, without its interposers.
//
// The descriptor table and the broker connections are process-wide (one connection per mount
// device, kept until exit), so one fake broker serves every test of the process; each test
// clears what it saw and forgets its descriptors.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "preload/adopted_file.h"
#include "preload/adoption.h"
#include "preload/counters.h"
#include "preload/descriptor_state.h"
#include "preload/descriptor_table.h"
#include "preload/internal.h"
#include "preload/lease.h"
#include "preload/mounts.h"
#include "preload/transfer.h"
#include "tests/preload/fake_broker.h"

namespace dnvme::preload {
namespace {

using broker::Op;
using testing::FakeBroker;

std::string g_root;     // the stand-in mount (canonical path: what /proc/self/fd shows)
std::string g_outside;  // a directory beside it, on the same device, that is not the mount
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

class PreloadTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
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

  void SetUp() override { g_broker->Clear(); }

  void TearDown() override {
    for (Op op : {Op::kOpen, Op::kWrote, Op::kDrain, Op::kClose}) g_broker->FailWith(op, 0);
    g_broker->ReplySlot(FakeBroker::kAutoSlot);
    for (int fd : fds_) {
      ForgetBeforeClose(fd);
      close(fd);
    }
  }

  // A file of `size` patterned bytes at `dir`/`name`, opened with `flags`.
  int OpenFile(const std::string& dir, const std::string& name, int flags, size_t size) {
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

  // Forgets `fd` as close(2) would (the last descriptor ends the lease); returns close's error.
  int CloseFd(int fd) {
    std::erase(fds_, fd);
    const int err = ForgetBeforeClose(fd);
    close(fd);
    return err;
  }

  static ino_t InoOf(int fd) {
    struct stat st {};
    fstat(fd, &st);
    return st.st_ino;
  }

  std::vector<int> fds_;
};

TEST_F(PreloadTest, AdoptsAFileTheBrokerOpensForIt) {
  const int fd = OpenFile(g_root, "adopt.bin", O_RDWR, 1 << 20);
  auto f = Adopt(fd);
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(StateOf(fd), kOurs);
  EXPECT_EQ(LookupAdopted(fd), f);
  EXPECT_TRUE(f->can_read);
  EXPECT_TRUE(f->can_write);
  auto opens = g_broker->Requests(Op::kOpen);
  ASSERT_EQ(opens.size(), 1u);
  EXPECT_EQ(opens[0].path, "adopt.bin");  // relative to the mount
  EXPECT_EQ(opens[0].ino, InoOf(fd));     // the inode the program's descriptor shows
  EXPECT_EQ(opens[0].flags, static_cast<uint32_t>(O_RDWR));
  EXPECT_NE(f->lease, 0u);
  EXPECT_NE(g_broker->WordOf(f->lease), nullptr);
  // The engine reads the backing file the broker handed over.
  std::vector<char> got(256 << 10);
  ASSERT_EQ(DirectIo(f, false, got.data(), got.size(), 4096), static_cast<ssize_t>(got.size()));
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i], static_cast<char>((i + 4096) * 7 + 3)) << i;
  }
}

TEST_F(PreloadTest, ReadOnlyDescriptorAsksForReadAndRefusesWrites) {
  const int fd = OpenFile(g_root, "ro.bin", O_RDONLY, 4096);
  auto f = Adopt(fd);
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(g_broker->Requests(Op::kOpen).at(0).flags, static_cast<uint32_t>(O_RDONLY));
  std::vector<char> buf(4096);
  errno = 0;
  EXPECT_EQ(DirectIo(f, true, buf.data(), buf.size(), 0), -1);
  EXPECT_EQ(errno, EBADF);
}

TEST_F(PreloadTest, RefusedByTheBrokerStaysOnTheMount) {
  g_broker->FailWith(Op::kOpen, EACCES);
  const int fd = OpenFile(g_root, "refused.bin", O_RDWR, 4096);
  const uint64_t refused = ProcessCounters().refused.load();
  EXPECT_EQ(Adopt(fd), nullptr);
  EXPECT_EQ(StateOf(fd), kNotOurs);
  EXPECT_EQ(LookupAdopted(fd), nullptr);
  EXPECT_EQ(g_broker->Requests(Op::kOpen).size(), 1u);
  EXPECT_EQ(ProcessCounters().refused.load(), refused + 1);
  // Classified once: a later transfer does not ask again.
  EXPECT_EQ(AdoptedForTransfer(fd), nullptr);
  EXPECT_EQ(g_broker->Requests(Op::kOpen).size(), 1u);
}

TEST_F(PreloadTest, ALeaseSlotPastThePageStaysOnTheMount) {
  // A daemon that names a slot outside its lease page: an error, never a word read or written
  // past the page; the lease it granted is given back.
  for (uint32_t slot : {broker::kMaxLeases, UINT32_MAX}) {
    g_broker->Clear();
    g_broker->ReplySlot(slot);
    const int fd = OpenFile(g_root, "badslot.bin", O_RDWR, 4096);
    const uint64_t refused = ProcessCounters().refused.load();
    EXPECT_EQ(Adopt(fd), nullptr) << "slot " << slot;
    EXPECT_EQ(StateOf(fd), kNotOurs);
    EXPECT_EQ(LookupAdopted(fd), nullptr);
    EXPECT_EQ(ProcessCounters().refused.load(), refused + 1);
    auto opens = g_broker->Requests(Op::kOpen);
    auto closes = g_broker->Requests(Op::kClose);
    ASSERT_EQ(opens.size(), 1u);
    ASSERT_EQ(closes.size(), 1u) << "the lease of slot " << slot << " was not given back";
    EXPECT_NE(closes[0].lease, 0u);
    EXPECT_LT(closes[0].length, 0);  // nothing written
  }
  // A good slot afterwards: adopted as usual.
  g_broker->ReplySlot(FakeBroker::kAutoSlot);
  const int fd = OpenFile(g_root, "goodslot.bin", O_RDWR, 4096);
  auto f = Adopt(fd);
  ASSERT_NE(f, nullptr);
  EXPECT_NE(f->word, nullptr);
  EXPECT_NE(g_broker->WordOf(f->lease), nullptr);
}

TEST_F(PreloadTest, DeletedFileIsNotAdopted) {
  // /proc/self/fd says "(deleted)": there is no path the broker could open.
  const int fd = OpenFile(g_root, "deleted.bin", O_RDWR, 4096);
  ASSERT_EQ(unlink((g_root + "/deleted.bin").c_str()), 0);
  EXPECT_EQ(Adopt(fd), nullptr);
  EXPECT_EQ(StateOf(fd), kNotOurs);
  EXPECT_TRUE(g_broker->Requests(Op::kOpen).empty());
}

TEST_F(PreloadTest, NotAdoptedWithoutAskingTheBroker) {
  const int append = OpenFile(g_root, "append.bin", O_WRONLY | O_APPEND, 4096);
  EXPECT_EQ(Adopt(append), nullptr);  // appends stay atomic on the mount
  EXPECT_EQ(StateOf(append), kNotOurs);
  const int outside = OpenFile(g_outside, "outside.bin", O_RDWR, 4096);
  EXPECT_EQ(Adopt(outside), nullptr);  // same device, not under the mountpoint
  EXPECT_EQ(StateOf(outside), kNotOurs);
  const int dir = open(g_root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  ASSERT_GE(dir, 0);
  fds_.push_back(dir);
  EXPECT_EQ(Adopt(dir), nullptr);  // not a regular file
  EXPECT_TRUE(g_broker->Requests(Op::kOpen).empty());
}

TEST_F(PreloadTest, DuplicatesShareOneFileAndOneLease) {
  const int fd = OpenFile(g_root, "dup.bin", O_RDWR, 4096);
  const int early = dup(fd);  // made before adoption: found by kcmp
  fds_.push_back(early);
  auto f = Adopt(fd);
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(Adopt(early), f);
  const int late = Duplicated(fd, fcntl(fd, F_DUPFD_CLOEXEC, 0));  // as the interposed dup does
  fds_.push_back(late);
  EXPECT_EQ(LookupAdopted(late), f);
  EXPECT_EQ(f->fds, 3);
  EXPECT_EQ(g_broker->Requests(Op::kOpen).size(), 1u);
  EXPECT_EQ(CloseFd(early), 0);
  EXPECT_EQ(CloseFd(fd), 0);
  EXPECT_TRUE(g_broker->Requests(Op::kClose).empty());  // one descriptor left
  EXPECT_EQ(CloseFd(late), 0);
  ASSERT_EQ(g_broker->Requests(Op::kClose).size(), 1u);
  EXPECT_EQ(g_broker->Requests(Op::kClose)[0].lease, f->lease);
}

TEST_F(PreloadTest, AnnounceSendsTheWrittenRangeOnce) {
  const int fd = OpenFile(g_root, "announce.bin", O_RDWR, 4096);
  auto f = Adopt(fd);
  ASSERT_NE(f, nullptr);
  NoteWritten(*f, 1000, 100);
  NoteWritten(*f, 300, 10);
  EXPECT_TRUE(HasPending(*f));
  ASSERT_TRUE(Announce(*f).ok());
  auto wrote = g_broker->Requests(Op::kWrote);
  ASSERT_EQ(wrote.size(), 1u);
  EXPECT_EQ(wrote[0].lease, f->lease);
  EXPECT_EQ(wrote[0].offset, 300);
  EXPECT_EQ(wrote[0].length, 800);  // [300, 1100): the ranges merged
  EXPECT_FALSE(HasPending(*f));
  ASSERT_TRUE(Announce(*f).ok());
  EXPECT_EQ(g_broker->Requests(Op::kWrote).size(), 1u);  // nothing new: nothing sent
}

TEST_F(PreloadTest, WriteToASharedLeaseIsAnnouncedBeforeItReturns) {
  const int fd = OpenFile(g_root, "shared.bin", O_RDWR, 1 << 20);
  auto f = Adopt(fd);
  ASSERT_NE(f, nullptr);
  g_broker->WordOf(f->lease)->shared.store(1);  // as the daemon does when another opens it
  std::vector<char> data(256 << 10, 'x');
  ASSERT_EQ(DirectIo(f, true, data.data(), data.size(), 8192), static_cast<ssize_t>(data.size()));
  auto wrote = g_broker->Requests(Op::kWrote);
  ASSERT_EQ(wrote.size(), 1u);
  EXPECT_EQ(wrote[0].offset, 8192);
  EXPECT_EQ(wrote[0].length, static_cast<int64_t>(data.size()));
  EXPECT_EQ(g_broker->WordOf(f->lease)->writes_inflight.load(), 0u);  // landed when announced
  std::vector<char> back(data.size());
  ASSERT_EQ(pread(fd, back.data(), back.size(), 8192), static_cast<ssize_t>(back.size()));
  EXPECT_EQ(back, data);
}

TEST_F(PreloadTest, EndOfTheLeaseDrainsAndSendsClose) {
  const int fd = OpenFile(g_root, "end.bin", O_RDWR, 0);
  auto f = Adopt(fd);
  ASSERT_NE(f, nullptr);
  const uint64_t lease = f->lease;
  std::vector<char> data(3 << 20, 'y');  // extends the file: space reserved, write-behind
  ASSERT_EQ(DirectIo(f, true, data.data(), data.size(), 0), static_cast<ssize_t>(data.size()));
  EXPECT_TRUE(g_broker->Requests(Op::kWrote).empty());  // not shared: announced later
  f.reset();
  EXPECT_EQ(CloseFd(fd), 0);
  EXPECT_EQ(StateOf(fd), kUnknown);
  auto closes = g_broker->Requests(Op::kClose);
  ASSERT_EQ(closes.size(), 1u);
  EXPECT_EQ(closes[0].lease, lease);
  EXPECT_EQ(closes[0].offset, 0);
  EXPECT_EQ(closes[0].length, static_cast<int64_t>(data.size()));  // the pending range
  EXPECT_EQ(g_broker->WordOf(lease)->writes_inflight.load(), 0u);
  struct stat st {};
  ASSERT_EQ(stat((g_root + "/end.bin").c_str(), &st), 0);
  EXPECT_EQ(st.st_size, static_cast<off_t>(data.size()));  // the reservation trimmed
  EXPECT_LE(st.st_blocks * 512, static_cast<blkcnt_t>(data.size()) + (1 << 20));
}

TEST_F(PreloadTest, LeaseWithoutWritesClosesWithNothingWritten) {
  const int fd = OpenFile(g_root, "clean.bin", O_RDONLY, 4096);
  ASSERT_NE(Adopt(fd), nullptr);
  EXPECT_EQ(CloseFd(fd), 0);
  auto closes = g_broker->Requests(Op::kClose);
  ASSERT_EQ(closes.size(), 1u);
  EXPECT_EQ(closes[0].length, -1);  // include/dnvme/broker.h: nothing written
}

TEST_F(PreloadTest, MountDirtyIsDrainedBeforeADirectRead) {
  const int fd = OpenFile(g_root, "dirty.bin", O_RDWR, 1 << 20);
  auto f = Adopt(fd);
  ASSERT_NE(f, nullptr);
  g_broker->WordOf(f->lease)->mount_dirty.store(1);
  std::vector<char> buf(128 << 10);
  ASSERT_EQ(DirectIo(f, false, buf.data(), buf.size(), 0), static_cast<ssize_t>(buf.size()));
  auto drains = g_broker->Requests(Op::kDrain);
  ASSERT_EQ(drains.size(), 1u);
  EXPECT_EQ(drains[0].lease, f->lease);
  ASSERT_EQ(DirectIo(f, false, buf.data(), buf.size(), 0), static_cast<ssize_t>(buf.size()));
  EXPECT_EQ(g_broker->Requests(Op::kDrain).size(), 1u);  // the broker cleared the flag
}

TEST_F(PreloadTest, BrokerErrorsBecomeTheCallsErrno) {
  const int fd = OpenFile(g_root, "errors.bin", O_RDWR, 1 << 20);
  auto f = Adopt(fd);
  ASSERT_NE(f, nullptr);
  std::vector<char> buf(128 << 10, 'z');
  g_broker->FailWith(Op::kDrain, ENOLCK);
  g_broker->WordOf(f->lease)->mount_dirty.store(1);
  errno = 0;
  EXPECT_EQ(DirectIo(f, false, buf.data(), buf.size(), 0), -1);
  EXPECT_EQ(errno, ENOLCK);
  g_broker->FailWith(Op::kDrain, 0);
  g_broker->WordOf(f->lease)->mount_dirty.store(0);
  g_broker->FailWith(Op::kWrote, EROFS);
  g_broker->WordOf(f->lease)->shared.store(1);
  errno = 0;
  EXPECT_EQ(DirectIo(f, true, buf.data(), buf.size(), 0), -1);  // the announcement failed
  EXPECT_EQ(errno, EROFS);
  EXPECT_EQ(FallocateAdopted(f, 0, 0, 4096), -1);
  EXPECT_EQ(errno, EROFS);
}

}  // namespace
}  // namespace dnvme::preload
