// The preload library's adoption and leases against a fake broker (fake_broker.h), no mount:
// a plain scratch directory stands for the mount through the MountProbe seam (scratch_mount.h),
// and the library's core is linked as an archive, without its interposers.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
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
#include "preload/transfer.h"
#include "tests/preload/fake_broker.h"
#include "tests/preload/scratch_mount.h"

namespace dnvme::preload {
namespace {

using broker::Op;
using testing::FakeBroker;
using testing::PreloadTest;

TEST_F(PreloadTest, AdoptsAFileTheBrokerOpensForIt) {
  const int fd = OpenFile(root(), "adopt.bin", O_RDWR, 1 << 20);
  auto f = Adopt(fd);
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(StateOf(fd), kOurs);
  EXPECT_EQ(LookupAdopted(fd), f);
  EXPECT_TRUE(f->can_read);
  EXPECT_TRUE(f->can_write);
  auto opens = broker().Requests(Op::kOpen);
  ASSERT_EQ(opens.size(), 1u);
  EXPECT_EQ(opens[0].path, "adopt.bin");  // relative to the mount
  EXPECT_EQ(opens[0].ino, InoOf(fd));     // the inode the program's descriptor shows
  EXPECT_EQ(opens[0].flags, static_cast<uint32_t>(O_RDWR));
  EXPECT_NE(f->lease, 0u);
  EXPECT_NE(broker().WordOf(f->lease), nullptr);
  // The engine reads the backing file the broker handed over.
  std::vector<char> got(256 << 10);
  ASSERT_EQ(DirectIo(f, false, got.data(), got.size(), 4096).value(),
            static_cast<int64_t>(got.size()));
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i], static_cast<char>((i + 4096) * 7 + 3)) << i;
  }
}

TEST_F(PreloadTest, ReadOnlyDescriptorAsksForReadAndRefusesWrites) {
  const int fd = OpenFile(root(), "ro.bin", O_RDONLY, 4096);
  auto f = Adopt(fd);
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(broker().Requests(Op::kOpen).at(0).flags, static_cast<uint32_t>(O_RDONLY));
  std::vector<char> buf(4096);
  EXPECT_EQ(DirectIo(f, true, buf.data(), buf.size(), 0).status().ErrnoOr(), EBADF);
}

TEST_F(PreloadTest, WriteOnlyDescriptorAsksForWriteAndRefusesReads) {
  const int fd = OpenFile(root(), "wo.bin", O_WRONLY, 4096);
  auto f = Adopt(fd);
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(broker().Requests(Op::kOpen).at(0).flags, static_cast<uint32_t>(O_WRONLY));
  EXPECT_FALSE(f->can_read);
  EXPECT_TRUE(f->can_write);
  std::vector<char> buf(4096);
  EXPECT_EQ(DirectIo(f, false, buf.data(), buf.size(), 0).status().ErrnoOr(), EBADF);
}

TEST_F(PreloadTest, ANumberThatNamesAnotherFileNowIsAdoptedAgain) {
  // fclose or close_range closed the descriptor behind the library's back, and the number came
  // back for another file: the old file's lease ends, the new file is adopted in its place.
  const int fd = OpenFile(root(), "stale-old.bin", O_RDWR, 4096);
  auto old = AdoptedForTransfer(fd);
  ASSERT_NE(old, nullptr);
  EXPECT_EQ(AdoptedForTransfer(fd), old);  // the same open file: no new question
  const int other = OpenFile(root(), "stale-new.bin", O_RDWR, 4096);
  ASSERT_EQ(dup2(other, fd), fd);  // as a close and a reopen that got the same number
  const uint64_t stale = ProcessCounters().stale.load();
  broker().Clear();
  auto now = AdoptedForTransfer(fd);
  ASSERT_NE(now, nullptr);
  EXPECT_NE(now, old);
  EXPECT_EQ(LookupAdopted(fd), now);
  EXPECT_EQ(ProcessCounters().stale.load(), stale + 1);
  auto closes = broker().Requests(Op::kClose);
  ASSERT_EQ(closes.size(), 1u);
  EXPECT_EQ(closes[0].lease, old->lease);
  auto opens = broker().Requests(Op::kOpen);
  ASSERT_EQ(opens.size(), 1u);
  EXPECT_EQ(opens[0].path, "stale-new.bin");
}

TEST_F(PreloadTest, APathLongerThanTheKernelNamesStaysOnTheMount) {
  // /proc/self/fd cannot name it (ENAMETOOLONG): there is no path to send the broker.
  int dir = open(root().c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
  ASSERT_GE(dir, 0);
  const std::string part(200, 'd');
  for (int i = 0; i < 22; ++i) {  // 22 * 201 bytes: past PATH_MAX
    ASSERT_EQ(mkdirat(dir, part.c_str(), 0755), 0);
    const int next = openat(dir, part.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
    close(dir);
    ASSERT_GE(next, 0);
    dir = next;
  }
  const int fd = openat(dir, "deep.bin", O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  close(dir);
  ASSERT_GE(fd, 0);
  Track(fd);
  ASSERT_EQ(ftruncate(fd, 1 << 20), 0);
  EXPECT_EQ(Adopt(fd), nullptr);
  EXPECT_EQ(StateOf(fd), kNotOurs);
  EXPECT_TRUE(broker().Requests(Op::kOpen).empty());
}

TEST_F(PreloadTest, RefusedByTheBrokerStaysOnTheMount) {
  broker().FailWith(Op::kOpen, EACCES);
  const int fd = OpenFile(root(), "refused.bin", O_RDWR, 4096);
  const uint64_t refused = ProcessCounters().refused.load();
  EXPECT_EQ(Adopt(fd), nullptr);
  EXPECT_EQ(StateOf(fd), kNotOurs);
  EXPECT_EQ(LookupAdopted(fd), nullptr);
  EXPECT_EQ(broker().Requests(Op::kOpen).size(), 1u);
  EXPECT_EQ(ProcessCounters().refused.load(), refused + 1);
  // Classified once: a later transfer does not ask again.
  EXPECT_EQ(AdoptedForTransfer(fd), nullptr);
  EXPECT_EQ(broker().Requests(Op::kOpen).size(), 1u);
}

TEST_F(PreloadTest, ALeaseSlotPastThePageStaysOnTheMount) {
  // A daemon that names a slot outside its lease page: an error, never a word read or written
  // past the page; the lease it granted is given back.
  for (uint32_t slot : {broker::kMaxLeases, UINT32_MAX}) {
    broker().Clear();
    broker().ReplySlot(slot);
    const int fd = OpenFile(root(), "badslot.bin", O_RDWR, 4096);
    const uint64_t refused = ProcessCounters().refused.load();
    EXPECT_EQ(Adopt(fd), nullptr) << "slot " << slot;
    EXPECT_EQ(StateOf(fd), kNotOurs);
    EXPECT_EQ(LookupAdopted(fd), nullptr);
    EXPECT_EQ(ProcessCounters().refused.load(), refused + 1);
    auto opens = broker().Requests(Op::kOpen);
    auto closes = broker().Requests(Op::kClose);
    ASSERT_EQ(opens.size(), 1u);
    ASSERT_EQ(closes.size(), 1u) << "the lease of slot " << slot << " was not given back";
    EXPECT_NE(closes[0].lease, 0u);
    EXPECT_LT(closes[0].length, 0);  // nothing written
  }
  // A good slot afterwards: adopted as usual.
  broker().ReplySlot(FakeBroker::kAutoSlot);
  const int fd = OpenFile(root(), "goodslot.bin", O_RDWR, 4096);
  auto f = Adopt(fd);
  ASSERT_NE(f, nullptr);
  EXPECT_NE(f->word, nullptr);
  EXPECT_NE(broker().WordOf(f->lease), nullptr);
}

TEST_F(PreloadTest, DeletedFileIsNotAdopted) {
  // /proc/self/fd says "(deleted)": there is no path the broker could open.
  const int fd = OpenFile(root(), "deleted.bin", O_RDWR, 4096);
  ASSERT_EQ(unlink((root() + "/deleted.bin").c_str()), 0);
  EXPECT_EQ(Adopt(fd), nullptr);
  EXPECT_EQ(StateOf(fd), kNotOurs);
  EXPECT_TRUE(broker().Requests(Op::kOpen).empty());
}

TEST_F(PreloadTest, NotAdoptedWithoutAskingTheBroker) {
  const int append = OpenFile(root(), "append.bin", O_WRONLY | O_APPEND, 4096);
  EXPECT_EQ(Adopt(append), nullptr);  // appends stay atomic on the mount
  EXPECT_EQ(StateOf(append), kNotOurs);
  const int elsewhere = OpenFile(outside(), "outside.bin", O_RDWR, 4096);
  EXPECT_EQ(Adopt(elsewhere), nullptr);  // same device, not under the mountpoint
  EXPECT_EQ(StateOf(elsewhere), kNotOurs);
  const int dir = open(root().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  ASSERT_GE(dir, 0);
  Track(dir);
  EXPECT_EQ(Adopt(dir), nullptr);  // not a regular file
  const int path_only = open((root() + "/append.bin").c_str(), O_PATH | O_CLOEXEC);
  ASSERT_GE(path_only, 0);
  Track(path_only);
  EXPECT_EQ(Adopt(path_only), nullptr);  // no I/O on an O_PATH descriptor
  EXPECT_EQ(StateOf(path_only), kNotOurs);
  EXPECT_TRUE(broker().Requests(Op::kOpen).empty());
}

TEST_F(PreloadTest, DuplicatesShareOneFileAndOneLease) {
  const int fd = OpenFile(root(), "dup.bin", O_RDWR, 4096);
  const int early = dup(fd);  // made before adoption: found by kcmp
  Track(early);
  auto f = Adopt(fd);
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(Adopt(early), f);
  const int late = Duplicated(fd, fcntl(fd, F_DUPFD_CLOEXEC, 0));  // as the interposed dup does
  Track(late);
  EXPECT_EQ(LookupAdopted(late), f);
  EXPECT_EQ(f->fds, 3);
  EXPECT_EQ(broker().Requests(Op::kOpen).size(), 1u);
  EXPECT_EQ(CloseFd(early), 0);
  EXPECT_EQ(CloseFd(fd), 0);
  EXPECT_TRUE(broker().Requests(Op::kClose).empty());  // one descriptor left
  EXPECT_EQ(CloseFd(late), 0);
  ASSERT_EQ(broker().Requests(Op::kClose).size(), 1u);
  EXPECT_EQ(broker().Requests(Op::kClose)[0].lease, f->lease);
}

TEST_F(PreloadTest, AnnounceSendsTheWrittenRangeOnce) {
  const int fd = OpenFile(root(), "announce.bin", O_RDWR, 4096);
  auto f = Adopt(fd);
  ASSERT_NE(f, nullptr);
  NoteWritten(*f, 1000, 100);
  NoteWritten(*f, 300, 10);
  EXPECT_TRUE(HasPending(*f));
  ASSERT_TRUE(Announce(*f).ok());
  auto wrote = broker().Requests(Op::kWrote);
  ASSERT_EQ(wrote.size(), 1u);
  EXPECT_EQ(wrote[0].lease, f->lease);
  EXPECT_EQ(wrote[0].offset, 300);
  EXPECT_EQ(wrote[0].length, 800);  // [300, 1100): the ranges merged
  EXPECT_FALSE(HasPending(*f));
  ASSERT_TRUE(Announce(*f).ok());
  EXPECT_EQ(broker().Requests(Op::kWrote).size(), 1u);  // nothing new: nothing sent
}

TEST_F(PreloadTest, WriteToASharedLeaseIsAnnouncedBeforeItReturns) {
  const int fd = OpenFile(root(), "shared.bin", O_RDWR, 1 << 20);
  auto f = Adopt(fd);
  ASSERT_NE(f, nullptr);
  broker().WordOf(f->lease)->shared.store(1);  // as the daemon does when another opens it
  std::vector<char> data(256 << 10, 'x');
  ASSERT_EQ(DirectIo(f, true, data.data(), data.size(), 8192).value(),
            static_cast<int64_t>(data.size()));
  auto wrote = broker().Requests(Op::kWrote);
  ASSERT_EQ(wrote.size(), 1u);
  EXPECT_EQ(wrote[0].offset, 8192);
  EXPECT_EQ(wrote[0].length, static_cast<int64_t>(data.size()));
  EXPECT_EQ(broker().WordOf(f->lease)->writes_inflight.load(), 0u);  // landed when announced
  std::vector<char> back(data.size());
  ASSERT_EQ(pread(fd, back.data(), back.size(), 8192), static_cast<ssize_t>(back.size()));
  EXPECT_EQ(back, data);
}

TEST_F(PreloadTest, EndOfTheLeaseDrainsAndSendsClose) {
  const int fd = OpenFile(root(), "end.bin", O_RDWR, 0);
  auto f = Adopt(fd);
  ASSERT_NE(f, nullptr);
  const uint64_t lease = f->lease;
  std::vector<char> data(3 << 20, 'y');  // extends the file: space reserved, write-behind
  ASSERT_EQ(DirectIo(f, true, data.data(), data.size(), 0).value(),
            static_cast<int64_t>(data.size()));
  EXPECT_TRUE(broker().Requests(Op::kWrote).empty());  // not shared: announced later
  f.reset();
  EXPECT_EQ(CloseFd(fd), 0);
  EXPECT_EQ(StateOf(fd), kUnknown);
  auto closes = broker().Requests(Op::kClose);
  ASSERT_EQ(closes.size(), 1u);
  EXPECT_EQ(closes[0].lease, lease);
  EXPECT_EQ(closes[0].offset, 0);
  EXPECT_EQ(closes[0].length, static_cast<int64_t>(data.size()));  // the pending range
  EXPECT_EQ(broker().WordOf(lease)->writes_inflight.load(), 0u);
  struct stat st {};
  ASSERT_EQ(stat((root() + "/end.bin").c_str(), &st), 0);
  EXPECT_EQ(st.st_size, static_cast<off_t>(data.size()));  // the reservation trimmed
  EXPECT_LE(st.st_blocks * 512, static_cast<blkcnt_t>(data.size()) + (1 << 20));
}

TEST_F(PreloadTest, LeaseWithoutWritesClosesWithNothingWritten) {
  const int fd = OpenFile(root(), "clean.bin", O_RDONLY, 4096);
  ASSERT_NE(Adopt(fd), nullptr);
  EXPECT_EQ(CloseFd(fd), 0);
  auto closes = broker().Requests(Op::kClose);
  ASSERT_EQ(closes.size(), 1u);
  EXPECT_EQ(closes[0].length, -1);  // include/dnvme/broker.h: nothing written
}

TEST_F(PreloadTest, MountDirtyIsDrainedBeforeADirectRead) {
  const int fd = OpenFile(root(), "dirty.bin", O_RDWR, 1 << 20);
  auto f = Adopt(fd);
  ASSERT_NE(f, nullptr);
  broker().WordOf(f->lease)->mount_dirty.store(1);
  std::vector<char> buf(128 << 10);
  ASSERT_EQ(DirectIo(f, false, buf.data(), buf.size(), 0).value(),
            static_cast<int64_t>(buf.size()));
  auto drains = broker().Requests(Op::kDrain);
  ASSERT_EQ(drains.size(), 1u);
  EXPECT_EQ(drains[0].lease, f->lease);
  ASSERT_EQ(DirectIo(f, false, buf.data(), buf.size(), 0).value(),
            static_cast<int64_t>(buf.size()));
  EXPECT_EQ(broker().Requests(Op::kDrain).size(), 1u);  // the broker cleared the flag
}

TEST_F(PreloadTest, BrokerErrorsBecomeTheCallsErrno) {
  const int fd = OpenFile(root(), "errors.bin", O_RDWR, 1 << 20);
  auto f = Adopt(fd);
  ASSERT_NE(f, nullptr);
  std::vector<char> buf(128 << 10, 'z');
  broker().FailWith(Op::kDrain, ENOLCK);
  broker().WordOf(f->lease)->mount_dirty.store(1);
  EXPECT_EQ(DirectIo(f, false, buf.data(), buf.size(), 0).status().ErrnoOr(), ENOLCK);
  broker().FailWith(Op::kDrain, 0);
  broker().WordOf(f->lease)->mount_dirty.store(0);
  broker().FailWith(Op::kWrote, EROFS);
  broker().WordOf(f->lease)->shared.store(1);
  EXPECT_EQ(DirectIo(f, true, buf.data(), buf.size(), 0).status().ErrnoOr(),
            EROFS);  // the announcement failed
  EXPECT_EQ(FallocateAdopted(f, 0, 0, 4096).ErrnoOr(), EROFS);
}

}  // namespace
}  // namespace dnvme::preload
