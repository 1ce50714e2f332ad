// The descriptor table (preload/descriptor_table.h) against the fake broker (scratch_mount.h):
// which descriptors map to which adopted file as the program dups, reuses, disowns and closes
// them, one lease per open file ended with its last descriptor, the broker connection kept per
// mount, and a forked child that forgets what the parent adopted.
#include "preload/descriptor_table.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "preload/adoption.h"
#include "preload/descriptor_state.h"
#include "preload/internal.h"
#include "preload/lease.h"
#include "preload/transfer.h"
#include "tests/preload/scratch_mount.h"

namespace dnvme::preload {
namespace {

using broker::Op;

class DescriptorTableTest : public testing::PreloadTest {
 protected:
  // An adopted file at root()/name opened O_RDWR, and its descriptor.
  std::shared_ptr<AdoptedFile> Adopted(const std::string& name, int* fd, size_t size = 1 << 20) {
    *fd = OpenFile(root(), name, O_RDWR, size);
    auto f = Adopt(*fd);
    EXPECT_NE(f, nullptr) << name;
    return f;
  }
  // A duplicate of `fd` made as the interposed dup does.
  int Dup(int fd) {
    const int n = Duplicated(fd, fcntl(fd, F_DUPFD_CLOEXEC, 0));
    Track(n);
    return n;
  }
  size_t Closes() { return broker().Requests(Op::kClose).size(); }
};

TEST_F(DescriptorTableTest, SameOpenFileTellsDuplicatesFromSecondOpens) {
  const int fd = OpenFile(root(), "same.bin", O_RDWR, 4096);
  const int dup_fd = dup(fd);
  Track(dup_fd);
  const int again = open((root() + "/same.bin").c_str(), O_RDWR | O_CLOEXEC);
  Track(again);
  EXPECT_TRUE(SameOpenFile(fd, dup_fd));
  EXPECT_FALSE(SameOpenFile(fd, again));   // the same file, another open file
  EXPECT_FALSE(SameOpenFile(fd, 100000));  // no such descriptor
}

TEST_F(DescriptorTableTest, UnknownDescriptorsMapToNothing) {
  const int fd = OpenFile(root(), "unknown.bin", O_RDWR, 4096);
  EXPECT_EQ(LookupAdopted(fd), nullptr);
  EXPECT_EQ(LookupAdopted(-1), nullptr);
  EXPECT_TRUE(DropDescriptor(fd).ok());
  EXPECT_TRUE(LandWrites(fd).ok());
  EXPECT_TRUE(Disown(fd).ok());
  BeforeMap(fd);
  BeforeMap(-1);
  EXPECT_EQ(StateOf(fd), kUnknown);
  EXPECT_EQ(Closes(), 0u);
}

TEST_F(DescriptorTableTest, ASecondOpenOfTheFileIsAnotherAdoptedFile) {
  int fd = -1;
  auto f = Adopted("second.bin", &fd);
  ASSERT_NE(f, nullptr);
  const int again = OpenFile(root(), "second.bin", O_RDWR, 1 << 20);  // truncates and rewrites
  auto g = Adopt(again);
  ASSERT_NE(g, nullptr);
  EXPECT_NE(g, f);  // its own offset, write-behind and lease
  EXPECT_NE(g->lease, f->lease);
  EXPECT_EQ(broker().Requests(Op::kOpen).size(), 2u);
  const auto all = AllAdopted();
  EXPECT_NE(std::find(all.begin(), all.end(), f), all.end());
  EXPECT_NE(std::find(all.begin(), all.end(), g), all.end());
  EXPECT_EQ(CloseFd(again), 0);
  ASSERT_EQ(Closes(), 1u);
  EXPECT_EQ(broker().Requests(Op::kClose)[0].lease, g->lease);
  EXPECT_EQ(LookupAdopted(fd), f);  // the first open keeps its lease
}

TEST_F(DescriptorTableTest, TheLeaseEndsWithTheLastDescriptorOnly) {
  int fd = -1;
  auto f = Adopted("last.bin", &fd);
  ASSERT_NE(f, nullptr);
  const int a = Dup(fd);
  const int b = Dup(a);  // a duplicate of a duplicate: the same file
  EXPECT_EQ(LookupAdopted(b), f);
  EXPECT_EQ(f->fds, 3);
  EXPECT_EQ(StateOf(b), kOurs);
  EXPECT_TRUE(DropDescriptor(fd).ok());
  EXPECT_EQ(StateOf(fd), kUnknown);
  EXPECT_EQ(LookupAdopted(fd), nullptr);
  EXPECT_TRUE(DropDescriptor(b).ok());
  EXPECT_EQ(Closes(), 0u);
  EXPECT_GE(f->witness, 0);  // the lease holds its witness
  EXPECT_TRUE(DropDescriptor(a).ok());
  ASSERT_EQ(Closes(), 1u);
  EXPECT_EQ(broker().Requests(Op::kClose)[0].lease, f->lease);
  EXPECT_EQ(f->witness, -1);
  EXPECT_EQ(f->fds, 0);
  EXPECT_TRUE(DropDescriptor(a).ok());  // forgotten already: nothing more
  EXPECT_EQ(Closes(), 1u);
}

TEST_F(DescriptorTableTest, ADuplicateOfAnotherKindKeepsItsKind) {
  const int plain = OpenFile(root(), "plain.bin", O_RDWR, 4096);
  EXPECT_EQ(Duplicated(plain, -1), -1);  // a failed dup changes nothing
  const int a = Dup(plain);
  EXPECT_EQ(StateOf(a), kUnknown);  // looked at by its own first large transfer
  EXPECT_EQ(LookupAdopted(a), nullptr);
  const int refused = OpenFile(root(), "append.bin", O_WRONLY | O_APPEND, 4096);
  EXPECT_EQ(Adopt(refused), nullptr);
  ASSERT_EQ(StateOf(refused), kNotOurs);
  const int b = Dup(refused);
  EXPECT_EQ(StateOf(b), kNotOurs);  // not asked again
}

TEST_F(DescriptorTableTest, Dup2OverAnAdoptedDescriptorMovesItToTheOtherFile) {
  int fd1 = -1, fd2 = -1;
  auto f1 = Adopted("over1.bin", &fd1);
  auto f2 = Adopted("over2.bin", &fd2);
  ASSERT_NE(f1, nullptr);
  ASSERT_NE(f2, nullptr);
  const int target = Dup(fd2);
  ASSERT_EQ(LookupAdopted(target), f2);
  // dup2(fd1, target): the kernel closed target's open file behind the table's back.
  ASSERT_EQ(Duplicated(fd1, dup2(fd1, target)), target);
  EXPECT_EQ(LookupAdopted(target), f1);
  EXPECT_EQ(f1->fds, 2);
  EXPECT_EQ(f2->fds, 1);  // fd2 still maps to it: its lease goes on
  EXPECT_EQ(Closes(), 0u);
  // dup2 over the last descriptor of a file ends its lease.
  ASSERT_EQ(Duplicated(fd1, dup2(fd1, fd2)), fd2);
  EXPECT_EQ(LookupAdopted(fd2), f1);
  ASSERT_EQ(Closes(), 1u);
  EXPECT_EQ(broker().Requests(Op::kClose)[0].lease, f2->lease);
}

TEST_F(DescriptorTableTest, AReusedNumberIsANewFile) {
  int fd = -1;
  auto f = Adopted("reused.bin", &fd);
  ASSERT_NE(f, nullptr);
  // fclose closed it behind the table; open(2) returned the number again.
  ASSERT_EQ(OpenedDescriptor(fd), fd);
  EXPECT_EQ(LookupAdopted(fd), nullptr);
  EXPECT_EQ(StateOf(fd), kUnknown);
  EXPECT_EQ(Closes(), 1u);  // its only descriptor: the lease ended
  EXPECT_EQ(OpenedDescriptor(-1), -1);
  // A number the library had given back to libc is looked at again too.
  const int refused = OpenFile(root(), "reused-append.bin", O_WRONLY | O_APPEND, 4096);
  EXPECT_EQ(Adopt(refused), nullptr);
  ASSERT_EQ(StateOf(refused), kNotOurs);
  EXPECT_EQ(OpenedDescriptor(refused), refused);
  EXPECT_EQ(StateOf(refused), kUnknown);
}

TEST_F(DescriptorTableTest, DisownSendsEveryDescriptorOfTheFileBackToTheMount) {
  int fd = -1;
  auto f = Adopted("disown.bin", &fd);
  ASSERT_NE(f, nullptr);
  const int a = Dup(fd);
  int other_fd = -1;
  auto other = Adopted("disown-other.bin", &other_fd);
  ASSERT_NE(other, nullptr);
  std::vector<char> data(256 << 10, 'd');
  ASSERT_EQ(DirectIo(f, true, data.data(), data.size(), 0).value(),
            static_cast<int64_t>(data.size()));
  EXPECT_TRUE(Disown(a).ok());  // fcntl(F_SETFL, O_APPEND) on one of them
  for (int n : {fd, a}) {
    EXPECT_EQ(StateOf(n), kNotOurs) << n;
    EXPECT_EQ(LookupAdopted(n), nullptr) << n;
  }
  auto closes = broker().Requests(Op::kClose);
  ASSERT_EQ(closes.size(), 1u);
  EXPECT_EQ(closes[0].lease, f->lease);
  EXPECT_EQ(closes[0].offset, 0);  // what it wrote, for the mount to announce
  EXPECT_EQ(closes[0].length, static_cast<int64_t>(data.size()));
  EXPECT_EQ(LookupAdopted(other_fd), other);  // another file is untouched
  std::vector<char> back(data.size());
  ASSERT_EQ(pread(fd, back.data(), back.size(), 0), static_cast<ssize_t>(back.size()));
  EXPECT_EQ(back, data);  // landed before the mount took the file back
}

TEST_F(DescriptorTableTest, LandWritesWaitsForTheWriteBehind) {
  int fd = -1;
  auto f = Adopted("land.bin", &fd);
  ASSERT_NE(f, nullptr);
  std::vector<char> data(2 << 20, 'l');
  ASSERT_EQ(DirectIo(f, true, data.data(), data.size(), 4096).value(),
            static_cast<int64_t>(data.size()));
  EXPECT_TRUE(LandWrites(fd).ok());  // fsync
  EXPECT_EQ(broker().WordOf(f->lease)->writes_inflight.load(), 0u);
  std::vector<char> back(data.size());
  ASSERT_EQ(pread(fd, back.data(), back.size(), 4096), static_cast<ssize_t>(back.size()));
  EXPECT_EQ(back, data);
  EXPECT_TRUE(broker().Requests(Op::kWrote).empty());  // landing is not announcing
}

TEST_F(DescriptorTableTest, BeforeMapAnnouncesAndThenEveryWriteAtOnce) {
  int fd = -1;
  auto f = Adopted("map.bin", &fd);
  ASSERT_NE(f, nullptr);
  std::vector<char> data(256 << 10, 'm');
  ASSERT_EQ(DirectIo(f, true, data.data(), data.size(), 0).value(),
            static_cast<int64_t>(data.size()));
  EXPECT_TRUE(broker().Requests(Op::kWrote).empty());
  EXPECT_FALSE(IsMapped(*f));
  BeforeMap(fd);
  EXPECT_TRUE(IsMapped(*f));
  auto wrote = broker().Requests(Op::kWrote);
  ASSERT_EQ(wrote.size(), 1u);  // what was written around the mount, before the mapping
  EXPECT_EQ(wrote[0].offset, 0);
  EXPECT_EQ(wrote[0].length, static_cast<int64_t>(data.size()));
  ASSERT_EQ(DirectIo(f, true, data.data(), data.size(), 1 << 20).value(),
            static_cast<int64_t>(data.size()));
  wrote = broker().Requests(Op::kWrote);
  ASSERT_EQ(wrote.size(), 2u);  // the mapping's pages are the kernel's: told before it returns
  EXPECT_EQ(wrote[1].offset, 1 << 20);
}

TEST_F(DescriptorTableTest, TheFirstConnectionOfAMountIsKept) {
  const dev_t dev = makedev(4095, 4242);  // a mount no test adopts files of
  EXPECT_EQ(ConnectionOf(dev), nullptr);
  std::vector<std::shared_ptr<BrokerConnection>> mine(8), kept(8);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < mine.size(); ++i) {
    mine[i] = std::make_shared<BrokerConnection>();
    threads.emplace_back([&, i] { kept[i] = KeepConnection(dev, mine[i]); });
  }
  for (auto& t : threads) t.join();
  ASSERT_NE(ConnectionOf(dev), nullptr);
  int winners = 0;
  for (size_t i = 0; i < mine.size(); ++i) {
    EXPECT_EQ(kept[i], ConnectionOf(dev)) << i;  // the losers close theirs and use this one
    if (mine[i] == kept[i]) ++winners;
  }
  EXPECT_EQ(winners, 1);
  EXPECT_EQ(KeepConnection(dev, std::make_shared<BrokerConnection>()), ConnectionOf(dev));
}

TEST_F(DescriptorTableTest, DupsAndClosesFromManyThreadsKeepTheCount) {
  int fd = -1;
  auto f = Adopted("threads.bin", &fd);
  ASSERT_NE(f, nullptr);
  constexpr int kThreads = 4;
  constexpr int kRounds = 200;
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int r = 0; r < kRounds; ++r) {
        const int n = Duplicated(fd, fcntl(fd, F_DUPFD_CLOEXEC, 0));
        if (LookupAdopted(n) != f) ++wrong;
        if (!ForgetBeforeClose(n).ok()) ++wrong;
        close(n);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(f->fds, 1);
  EXPECT_EQ(Closes(), 0u);  // never the last descriptor
  EXPECT_EQ(LookupAdopted(fd), f);
  EXPECT_EQ(CloseFd(fd), 0);
  EXPECT_EQ(Closes(), 1u);
}

TEST_F(DescriptorTableTest, AForkedChildForgetsWhatTheParentAdopted) {
  int fd = -1;
  auto f = Adopted("fork.bin", &fd);
  ASSERT_NE(f, nullptr);
  const int witness = f->witness;
  ASSERT_GE(witness, 0);
  LockTableForFork();
  const pid_t pid = fork();
  if (pid == 0) {
    ForgetTableInChild();
    // Bits of what the child got wrong; the exit status says which.
    int bad = 0;
    if (LookupAdopted(fd) != nullptr) bad |= 1;
    if (StateOf(fd) != kUnknown) bad |= 2;
    if (fcntl(witness, F_GETFD) != -1) bad |= 4;  // the parent's witness is closed here
    if (!AllAdopted().empty()) bad |= 8;
    if (ConnectionOf(dev()) != nullptr) bad |= 16;  // connects again on demand
    _exit(bad);
  }
  UnlockTableAfterFork();
  ASSERT_GT(pid, 0);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "what the child got wrong (bits)";
  // The parent's leases stay the parent's: nothing was closed, the file is still adopted.
  EXPECT_EQ(Closes(), 0u);
  EXPECT_EQ(LookupAdopted(fd), f);
  EXPECT_EQ(f->witness, witness);
  EXPECT_GE(fcntl(witness, F_GETFD), 0);
  NoteWritten(*f, 0, 10);
  const Status st = Announce(*f);  // the connection still serves the parent
  EXPECT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(broker().Requests(Op::kWrote).size(), 1u);
}

}  // namespace
}  // namespace dnvme::preload
