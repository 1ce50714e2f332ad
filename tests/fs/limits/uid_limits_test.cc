// UidLimits (fs/limits/uid_limits.h): per-uid counting, refusals that name the option and carry
// the resource's errno, one uid at its limit leaving every other untouched, charges that give
// back what they took.
#include "fs/limits/uid_limits.h"

#include <atomic>
#include <cerrno>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace dnvme::fs {
namespace {

UidLimits::Maxima Small() {
  //                  handles bytes buffers pinned pending files conns opens workers events
  return UidLimits::Maxima{2, 100, 3, 1000, 4, 5, 6, 7, 8, 256, 9};
}

TEST(UidLimits, RefusesPastTheLimitWithTheOptionAndErrno) {
  UidLimits l(Small());
  ASSERT_TRUE(l.Take(1000, UidResource::kHandles).ok());
  ASSERT_TRUE(l.Take(1000, UidResource::kHandles).ok());
  Status st = l.Take(1000, UidResource::kHandles);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), Status::Code::kResourceExhausted);
  EXPECT_EQ(st.error_number(), EMFILE);
  EXPECT_NE(st.message().find("ctl_max_handles=2"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("uid 1000"), std::string::npos) << st.message();
  EXPECT_EQ(l.Held(1000, UidResource::kHandles), 2);  // the refusal took nothing
}

TEST(UidLimits, EachResourceHasItsErrno) {
  UidLimits l(Small());
  EXPECT_EQ(l.Take(7, UidResource::kRegisteredBytes, 101).error_number(), ENOMEM);
  EXPECT_EQ(l.Take(7, UidResource::kPinnedBytes, 1001).error_number(), ENOMEM);
  EXPECT_EQ(l.Take(7, UidResource::kBuffers, 4).error_number(), EMFILE);
  EXPECT_EQ(l.Take(7, UidResource::kPending, 5).error_number(), EAGAIN);
  EXPECT_EQ(l.Take(7, UidResource::kFiles, 6).error_number(), EMFILE);
  EXPECT_EQ(l.Take(7, UidResource::kBrokerConns, 7).error_number(), EMFILE);
  EXPECT_STREQ(UidLimits::OptionName(UidResource::kPending), "ctl_max_pending");
  EXPECT_STREQ(UidLimits::OptionName(UidResource::kFiles), "max_files_per_uid");
  EXPECT_STREQ(UidLimits::OptionName(UidResource::kBrokerConns), "broker_max_conns_per_uid");
  EXPECT_EQ(l.Take(7, UidResource::kControlOpens, 8).error_number(), EMFILE);
  EXPECT_EQ(l.Take(7, UidResource::kWorkers, 9).error_number(), EAGAIN);
  EXPECT_EQ(l.Take(7, UidResource::kAioEvents, 257).error_number(), EAGAIN);
  EXPECT_STREQ(UidLimits::OptionName(UidResource::kControlOpens), "ctl_max_opens");
  EXPECT_STREQ(UidLimits::OptionName(UidResource::kWorkers), "ctl_max_workers");
  EXPECT_STREQ(UidLimits::OptionName(UidResource::kAioEvents), "ctl_max_aio_events");
  // A lookup over its share fails as in a process whose file table is full.
  EXPECT_EQ(l.Take(7, UidResource::kInodes, 10).error_number(), ENFILE);
  EXPECT_STREQ(UidLimits::OptionName(UidResource::kInodes), "max_inodes_per_uid");
}

// A control handle takes its workers and their libaio events at once (fs/control/control.cc,
// OpenHandle): the refusal says how many it asked for, and takes nothing.
TEST(UidLimits, WorkersAndAioEventsAreTakenManyAtOnce) {
  UidLimits l(Small());
  auto workers = l.Charge(65534, UidResource::kWorkers, 6);
  ASSERT_TRUE(workers.ok());
  Status st = l.Take(65534, UidResource::kWorkers, 3);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.error_number(), EAGAIN);
  EXPECT_NE(st.message().find("has 6 engine threads"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("3 more"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("ctl_max_workers=8"), std::string::npos) << st.message();
  EXPECT_EQ(l.Held(65534, UidResource::kWorkers), 6);
  EXPECT_TRUE(l.Take(0, UidResource::kWorkers, 8).ok());  // root's own share
  Status ev = l.Take(65534, UidResource::kAioEvents, 6 * 128);
  EXPECT_EQ(ev.error_number(), EAGAIN);
  EXPECT_NE(ev.message().find("ctl_max_aio_events=256"), std::string::npos) << ev.message();
  workers->Reset();  // the handle closed
  EXPECT_EQ(l.Held(65534, UidResource::kWorkers), 0);
  EXPECT_TRUE(l.Take(65534, UidResource::kWorkers, 8).ok());
}

TEST(UidLimits, OneUidAtItsLimitLeavesOthersAlone) {
  UidLimits l(Small());
  ASSERT_TRUE(l.Take(65534, UidResource::kRegisteredBytes, 100).ok());
  EXPECT_FALSE(l.Take(65534, UidResource::kRegisteredBytes, 1).ok());
  EXPECT_TRUE(l.Take(0, UidResource::kRegisteredBytes, 100).ok());  // root has its own share
  EXPECT_TRUE(l.Take(1000, UidResource::kRegisteredBytes, 60).ok());
  EXPECT_EQ(l.Held(65534, UidResource::kRegisteredBytes), 100);
  EXPECT_EQ(l.Held(1000, UidResource::kRegisteredBytes), 60);
}

TEST(UidLimits, ReleaseGivesBackAndNeverGoesNegative) {
  UidLimits l(Small());
  ASSERT_TRUE(l.Take(5, UidResource::kFiles, 5).ok());
  l.Release(5, UidResource::kFiles, 2);
  EXPECT_EQ(l.Held(5, UidResource::kFiles), 3);
  EXPECT_TRUE(l.Take(5, UidResource::kFiles, 2).ok());
  l.Release(5, UidResource::kFiles, 100);
  EXPECT_EQ(l.Held(5, UidResource::kFiles), 0);
  l.Release(6, UidResource::kFiles);  // a uid that holds nothing
  EXPECT_EQ(l.Held(6, UidResource::kFiles), 0);
  EXPECT_TRUE(l.Take(5, UidResource::kFiles, 0).ok());  // nothing to take
}

TEST(UidLimits, ChargeReleasesWhenDestroyedOrMoved) {
  UidLimits l(Small());
  {
    auto c = l.Charge(9, UidResource::kBuffers, 3);
    ASSERT_TRUE(c.ok());
    EXPECT_EQ(l.Held(9, UidResource::kBuffers), 3);
    EXPECT_FALSE(l.Charge(9, UidResource::kBuffers).ok());
    UidCharge moved = std::move(c).value();
    EXPECT_TRUE(moved.held());
    EXPECT_EQ(moved.units(), 3);
    UidCharge other;
    other = std::move(moved);
    EXPECT_FALSE(moved.held());  // NOLINT(bugprone-use-after-move): moved-from is empty
    EXPECT_EQ(l.Held(9, UidResource::kBuffers), 3);
  }
  EXPECT_EQ(l.Held(9, UidResource::kBuffers), 0);
  auto again = l.Charge(9, UidResource::kBuffers);
  ASSERT_TRUE(again.ok());
  UidCharge c = std::move(again).value();
  c.Reset();
  EXPECT_EQ(l.Held(9, UidResource::kBuffers), 0);
}

TEST(UidLimits, ConcurrentTakersNeverPassTheLimit) {
  UidLimits::Maxima m = Small();
  m[static_cast<size_t>(UidResource::kPending)] = 1000;
  UidLimits l(m);
  std::vector<std::thread> threads;
  std::atomic<int> taken{0};
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 500; ++i) {
        if (l.Take(3, UidResource::kPending).ok()) taken.fetch_add(1);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(taken.load(), 1000);
  EXPECT_EQ(l.Held(3, UidResource::kPending), 1000);
}

}  // namespace
}  // namespace dnvme::fs
