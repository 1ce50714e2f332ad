// OpenHandles (fs/core/open_handles.h): a handle is deleted exactly once, at its release or, for
// files the kernel never released, when the daemon ends; with it go what it holds (the backing
// descriptor, the opener's charges).
#include "fs/core/open_handles.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "fs/limits/uid_limits.h"

namespace dnvme::fs {
namespace {

// Counts its own destruction.
struct Counted : OpenHandle {
  explicit Counted(std::atomic<int>* dead) : dead_(dead) {}
  ~Counted() override { dead_->fetch_add(1); }
  std::atomic<int>* dead_;
};

UidLimits::Maxima Many() {
  UidLimits::Maxima m;
  m.fill(1000);
  return m;
}

TEST(OpenHandles, ReleaseDeletesTheHandleAtOnceAndOnlyOnce) {
  std::atomic<int> dead{0};
  OpenHandles handles;
  auto* h = new Counted(&dead);
  handles.Track(h);
  EXPECT_EQ(dead.load(), 0);
  handles.Dispose(h);
  EXPECT_EQ(dead.load(), 1);
  handles.DeleteAll();  // released handles are not deleted again (ASan: no double free)
  EXPECT_EQ(dead.load(), 1);
}

TEST(OpenHandles, TheEndDeletesWhatTheKernelNeverReleased) {
  std::atomic<int> dead{0};
  {
    OpenHandles handles;
    Counted* a = new Counted(&dead);
    handles.Track(a);
    handles.Track(new Counted(&dead));
    handles.Track(new Counted(&dead));
    handles.Dispose(a);
    EXPECT_EQ(dead.load(), 1);
    handles.DeleteAll();
    EXPECT_EQ(dead.load(), 3);
    handles.DeleteAll();  // once is all
    EXPECT_EQ(dead.load(), 3);
    handles.Track(new Counted(&dead));  // the destructor deletes the rest too
  }
  EXPECT_EQ(dead.load(), 4);
}

TEST(OpenHandles, AHandleGivesBackItsDescriptorAndCharges) {
  UidLimits limits(Many());
  OpenHandles handles;
  const int fd = open("/proc/self/status", O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  auto* file = new FileHandle;
  file->fd = UniqueFd(fd);
  auto charge = limits.Charge(1000, UidResource::kFiles);
  ASSERT_TRUE(charge.ok());
  file->files = std::move(charge).value();
  auto* ctl = new VirtualFile;
  ctl->kind = VirtualNode::kStats;
  auto opens = limits.Charge(1000, UidResource::kControlOpens);
  ASSERT_TRUE(opens.ok());
  ctl->opens = std::move(opens).value();
  handles.Track(file);
  handles.Track(ctl);
  EXPECT_EQ(limits.Held(1000, UidResource::kFiles), 1);
  EXPECT_EQ(limits.Held(1000, UidResource::kControlOpens), 1);
  handles.Dispose(ctl);
  EXPECT_EQ(limits.Held(1000, UidResource::kControlOpens), 0);
  EXPECT_EQ(limits.Held(1000, UidResource::kFiles), 1);
  EXPECT_GE(fcntl(fd, F_GETFD), 0);
  handles.DeleteAll();  // the daemon ends with the file still open
  EXPECT_EQ(limits.Held(1000, UidResource::kFiles), 0);
  errno = 0;
  EXPECT_EQ(fcntl(fd, F_GETFD), -1);
  EXPECT_EQ(errno, EBADF);
}

TEST(OpenHandles, OpensAndReleasesFromManyThreads) {
  // FUSE threads open and release at once: every handle is deleted exactly once, released ones
  // at their release, the rest at the end.
  constexpr int kThreads = 8;
  constexpr int kPerThread = 2000;
  std::atomic<int> dead{0};
  std::atomic<int> released{0};
  OpenHandles handles;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<OpenHandle*> mine;
      for (int i = 0; i < kPerThread; ++i) {
        auto* h = new Counted(&dead);
        handles.Track(h);
        mine.push_back(h);
        if ((i + t) % 3 == 0) {  // released soon after, while others open
          handles.Dispose(mine.front());
          mine.erase(mine.begin());
          ++released;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(dead.load(), released.load());
  handles.DeleteAll();
  EXPECT_EQ(dead.load(), kThreads * kPerThread);
}

}  // namespace
}  // namespace dnvme::fs
