// An adopted file's lease (preload/lease.h) against the fake broker (scratch_mount.h): what is
// written around the mount is noted as one range and announced once, from any thread without
// losing a range; broker errors come back as errno; the end of the lease closes the witness,
// tells the broker what is still pending, and refuses later writes.
#include "preload/lease.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "preload/adoption.h"
#include "preload/descriptor_table.h"
#include "preload/transfer.h"
#include "tests/preload/scratch_mount.h"

namespace dnvme::preload {
namespace {

using broker::Op;

class LeaseTest : public testing::PreloadTest {
 protected:
  std::shared_ptr<AdoptedFile> Adopted(const std::string& name, int* fd, size_t size = 1 << 20) {
    *fd = OpenFile(root(), name, O_RDWR, size);
    auto f = Adopt(*fd);
    EXPECT_NE(f, nullptr) << name;
    return f;
  }
};

TEST_F(LeaseTest, WrittenRangesAreAnnouncedAsTheirHull) {
  int fd = -1;
  auto f = Adopted("hull.bin", &fd);
  ASSERT_NE(f, nullptr);
  EXPECT_FALSE(HasPending(*f));
  NoteWritten(*f, 5000, 100);
  NoteWritten(*f, 100, 10);    // before, with a gap
  NoteWritten(*f, 2000, 50);   // inside
  NoteWritten(*f, 5050, 200);  // overlapping the end
  EXPECT_TRUE(HasPending(*f));
  const Status st = Announce(*f);
  ASSERT_TRUE(st.ok()) << st.ToString();
  auto wrote = broker().Requests(Op::kWrote);
  ASSERT_EQ(wrote.size(), 1u);
  EXPECT_EQ(wrote[0].lease, f->lease);
  EXPECT_EQ(wrote[0].offset, 100);
  EXPECT_EQ(wrote[0].length, 5250 - 100);  // one range: the gap is announced too
  EXPECT_FALSE(HasPending(*f));
  // A new range after the announcement starts a new hull.
  NoteWritten(*f, 9000, 1);
  ASSERT_TRUE(Announce(*f).ok());
  wrote = broker().Requests(Op::kWrote);
  ASSERT_EQ(wrote.size(), 2u);
  EXPECT_EQ(wrote[1].offset, 9000);
  EXPECT_EQ(wrote[1].length, 1);
}

TEST_F(LeaseTest, ALeaseCallCarriesTheLeaseAndTheBrokersErrno) {
  int fd = -1;
  auto f = Adopted("call.bin", &fd);
  ASSERT_NE(f, nullptr);
  Status st = LeaseCall(*f, Op::kDrain, 4096, 8192);
  ASSERT_TRUE(st.ok()) << st.ToString();
  auto drains = broker().Requests(Op::kDrain);
  ASSERT_EQ(drains.size(), 1u);
  EXPECT_EQ(drains[0].lease, f->lease);
  EXPECT_EQ(drains[0].offset, 4096);
  EXPECT_EQ(drains[0].length, 8192);
  broker().FailWith(Op::kDrain, ENOLCK);
  st = LeaseCall(*f, Op::kDrain, 0, 0);
  EXPECT_FALSE(st.ok());
  EXPECT_EQ(st.ErrnoOr(), ENOLCK) << st.ToString();
  broker().FailWith(Op::kWrote, EROFS);
  NoteWritten(*f, 0, 10);
  st = Announce(*f);
  EXPECT_EQ(st.ErrnoOr(), EROFS) << st.ToString();
  // Not announced: the range stays pending and goes with the next announcement.
  EXPECT_TRUE(HasPending(*f));
  broker().FailWith(Op::kWrote, 0);
  NoteWritten(*f, 100, 10);
  ASSERT_TRUE(Announce(*f).ok());
  auto wrote = broker().Requests(Op::kWrote);
  ASSERT_FALSE(wrote.empty());
  EXPECT_EQ(wrote.back().offset, 0);
  EXPECT_EQ(wrote.back().length, 110);
  EXPECT_FALSE(HasPending(*f));
}

TEST_F(LeaseTest, MappedIsRememberedForTheLifeOfTheFile) {
  int fd = -1;
  auto f = Adopted("mapped.bin", &fd);
  ASSERT_NE(f, nullptr);
  EXPECT_FALSE(IsMapped(*f));
  NoteMapped(*f);
  EXPECT_TRUE(IsMapped(*f));
  NoteMapped(*f);
  EXPECT_TRUE(IsMapped(*f));
  ASSERT_TRUE(Announce(*f).ok());  // nothing pending: nothing sent, still mapped
  EXPECT_TRUE(IsMapped(*f));
  EXPECT_TRUE(broker().Requests(Op::kWrote).empty());
}

TEST_F(LeaseTest, NoRangeIsLostBetweenThreadsThatNoteAndAnnounce) {
  // Writers note ranges while other calls announce (a small write through the mount, fsync):
  // every range noted is in some announcement, however the calls interleave.
  int fd = -1;
  auto f = Adopted("threads.bin", &fd);
  ASSERT_NE(f, nullptr);
  constexpr int kThreads = 4;
  constexpr int kRanges = 150;
  std::atomic<int> failed{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kRanges; ++i) {
        NoteWritten(*f, (int64_t{t} * kRanges + i) * 4096, 4096);
        if (i % 10 == t && !Announce(*f).ok()) ++failed;
      }
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_TRUE(Announce(*f).ok());
  EXPECT_EQ(failed.load(), 0);
  EXPECT_FALSE(HasPending(*f));
  const auto wrote = broker().Requests(Op::kWrote);
  for (int64_t r = 0; r < kThreads * kRanges; ++r) {
    const int64_t lo = r * 4096, hi = lo + 4096;
    bool covered = false;
    for (const auto& w : wrote) covered = covered || (w.offset <= lo && hi <= w.offset + w.length);
    ASSERT_TRUE(covered) << "range " << lo << ".." << hi << " never announced";
  }
}

TEST_F(LeaseTest, TheEndOfTheLeaseClosesTheWitnessAndRefusesLaterWrites) {
  int fd = -1;
  auto f = Adopted("end.bin", &fd);
  ASSERT_NE(f, nullptr);
  const int witness = f->witness;
  ASSERT_GE(witness, 0);
  NoteWritten(*f, 100, 900);
  // Another thread is still inside a transfer of the file when the program closes it.
  EXPECT_EQ(CloseFd(fd), 0);
  auto closes = broker().Requests(Op::kClose);
  ASSERT_EQ(closes.size(), 1u);
  EXPECT_EQ(closes[0].lease, f->lease);
  EXPECT_EQ(closes[0].offset, 100);  // the pending range: the daemon announces it
  EXPECT_EQ(closes[0].length, 900);
  EXPECT_EQ(f->witness, -1);
  EXPECT_EQ(fcntl(witness, F_GETFD), -1);
  std::vector<char> data(256 << 10, 'e');
  // The lease word may be another file's by now.
  EXPECT_EQ(DirectIo(f, true, data.data(), data.size(), 0).status().ErrnoOr(), EBADF);
  EXPECT_EQ(broker().Requests(Op::kWrote).size(), 0u);
}

TEST_F(LeaseTest, ABrokerThatFailsTheCloseStillEndsTheLeaseHere) {
  int fd = -1;
  auto f = Adopted("close-fails.bin", &fd);
  ASSERT_NE(f, nullptr);
  const int witness = f->witness;
  broker().FailWith(Op::kClose, EIO);
  EXPECT_EQ(CloseFd(fd), 0);  // logged only: close(2) has nothing the program could do
  EXPECT_EQ(broker().Requests(Op::kClose).size(), 1u);
  EXPECT_EQ(f->witness, -1);
  EXPECT_EQ(fcntl(witness, F_GETFD), -1);
  EXPECT_EQ(LookupAdopted(fd), nullptr);
}

}  // namespace
}  // namespace dnvme::preload
