// OffLoop (fs/core/off_loop.h): lease waits polled together, each with its own deadline, and
// their work run on the notifier thread, never on the caller's.
#include "fs/core/off_loop.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace dnvme::fs {
namespace {

// Adds a lease that must be accepted; returns whether another connection holds one too.
bool AddLease(PreloadLeases& l, uint64_t conn, uid_t uid, broker::LeaseWord* w, bool writable) {
  bool other = false;
  Status st = l.Add(conn, uid, w, writable, &other);
  EXPECT_TRUE(st.ok()) << st.ToString();
  return other;
}

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

// Counts finished work and waits for a number of them.
struct Done {
  std::mutex mu;
  std::condition_variable cv;
  int n = 0;
  std::vector<bool> landed;
  void Add(bool l) {
    std::lock_guard lock(mu);
    ++n;
    landed.push_back(l);
    cv.notify_all();
  }
  bool WaitFor(int want, milliseconds limit) {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, limit, [&] { return n >= want; });
  }
};

TEST(OffLoop, WorkRunsOnTheNotifierThreadNotTheCallers) {
  OffLoop off;
  PreloadLeases idle;  // no holder: the wait ends at the gate's first look
  Done done;
  std::atomic<bool> other_thread{false};
  const auto caller = std::this_thread::get_id();
  off.AfterLeaseWrites(&idle, false, [&](bool landed) {
    other_thread = std::this_thread::get_id() != caller;
    done.Add(landed);
  });
  ASSERT_TRUE(done.WaitFor(1, milliseconds(5000)));
  EXPECT_TRUE(other_thread.load());
  EXPECT_TRUE(done.landed[0]);
}

TEST(OffLoop, ManyWaitsOfOneHolderEndTogetherNotOneAfterAnother) {
  // 50 waits whose holder never lands its writes, each 200 ms: polled together they all end
  // about 200 ms from now; queued one behind another (as on the holder's lane) 10 s.
  OffLoop off;
  std::vector<PreloadLeases> leases(50);
  std::vector<broker::LeaseWord> words(50);
  for (size_t i = 0; i < leases.size(); ++i) {
    AddLease(leases[i], 1, 1500, &words[i], /*writable=*/true);  // a uid of its own (HolderTrust)
    words[i].writes_inflight.store(1);
  }
  Done done;
  const auto t0 = Clock::now();
  for (auto& l : leases) {
    off.AfterLeaseWrites(
        &l, false, [&](bool landed) { done.Add(landed); }, milliseconds(200));
  }
  ASSERT_TRUE(done.WaitFor(50, milliseconds(8000))) << "the waits queued behind each other";
  EXPECT_LT(Clock::now() - t0, milliseconds(5000));
  // The first to reach its limit distrusts the holder (HolderTrust): the rest stop waiting for
  // it then, as for any holder that stalled once. Every one ran to its limit or past it.
  EXPECT_GE(off.gave_up(), 1u);
  EXPECT_GE(Clock::now() - t0, milliseconds(200));
}

TEST(OffLoop, AWaitEndsWhenTheWritesLand) {
  OffLoop off;
  PreloadLeases l;
  broker::LeaseWord w{};
  AddLease(l, 1, 1000, &w, true);
  w.writes_inflight.store(1);
  Done done;
  off.AfterLeaseWrites(
      &l, /*share_if_busy=*/true, [&](bool landed) { done.Add(landed); }, milliseconds(10000));
  std::this_thread::sleep_for(milliseconds(20));
  EXPECT_EQ(done.n, 0);
  EXPECT_EQ(w.shared.load(), 1u) << "share_if_busy did not mark the busy holder";
  w.writes_inflight.store(0);
  ASSERT_TRUE(done.WaitFor(1, milliseconds(5000)));
  EXPECT_TRUE(done.landed[0]);
}

TEST(OffLoop, ShutdownRunsEverythingQueuedAndLaterWorkInPlace) {
  Done done;
  PreloadLeases l;
  broker::LeaseWord w{};
  AddLease(l, 1, 1000, &w, true);
  w.writes_inflight.store(1);
  {
    OffLoop off;
    off.AfterLeaseWrites(
        &l, false, [&](bool landed) { done.Add(landed); }, milliseconds(60000));
    off.Shutdown();  // does not wait a minute: the wait ends as given up
    EXPECT_EQ(done.n, 1);
    off.AfterLeaseWrites(
        &l, false, [&](bool landed) { done.Add(landed); },
        milliseconds(60000));  // after Shutdown: here, now
    EXPECT_EQ(done.n, 2);
  }
}

}  // namespace
}  // namespace dnvme::fs
