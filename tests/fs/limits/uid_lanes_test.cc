// UidLanes (fs/limits/uid_lanes.h): at most threads_per_key jobs of a uid at once, a bounded
// queue (EAGAIN beyond it, naming the option), another uid never waiting for a full lane,
// threads made on demand and ended when idle, shutdown running what was queued.
#include "fs/limits/uid_lanes.h"

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace dnvme::fs {
namespace {

using namespace std::chrono_literals;

// Jobs that block until opened; counts how many run at once.
class Gate {
 public:
  UidLanes::Job Job() {
    return [this] {
      const int now = running_.fetch_add(1) + 1;
      int seen = max_.load();
      while (now > seen && !max_.compare_exchange_weak(seen, now)) {
      }
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return open_; });
      }
      running_.fetch_sub(1);
      done_.fetch_add(1);
    };
  }
  void Open() {
    std::lock_guard lock(mu_);
    open_ = true;
    cv_.notify_all();
  }
  int max() const { return max_.load(); }
  int running() const { return running_.load(); }
  int done() const { return done_.load(); }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
  std::atomic<int> running_{0}, max_{0}, done_{0};
};

// Opens the gate when a test leaves early, so the lanes' shutdown does not wait for ever.
struct OpenOnExit {
  Gate& gate;
  ~OpenOnExit() { gate.Open(); }
};

template <typename F>
bool WaitFor(F pred, std::chrono::milliseconds limit = 5000ms) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

UidLanes::Options Opts(int threads, size_t queued) {
  UidLanes::Options o;
  o.threads_per_key = threads;
  o.max_queued = queued;
  o.idle = 100ms;
  o.option = "ctl_threads_per_uid";
  return o;
}

TEST(UidLanes, AtMostThreadsPerKeyRunAndTheQueueIsBounded) {
  Gate gate;
  UidLanes lanes(Opts(2, 3));
  OpenOnExit guard{gate};
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(lanes.Submit(65534, gate.Job()).ok()) << i;
  ASSERT_TRUE(WaitFor([&] { return gate.running() == 2; }));
  EXPECT_EQ(lanes.Running(65534), 2u);
  EXPECT_EQ(lanes.Queued(65534), 3u);
  Status full = lanes.Submit(65534, gate.Job());
  EXPECT_EQ(full.code(), Status::Code::kResourceExhausted);
  EXPECT_EQ(full.error_number(), EAGAIN);
  EXPECT_NE(full.message().find("ctl_threads_per_uid=2"), std::string::npos) << full.message();
  // Work that must run is queued anyway.
  EXPECT_TRUE(lanes.Submit(65534, gate.Job(), UidLanes::IfFull::kQueue).ok());
  gate.Open();
  ASSERT_TRUE(WaitFor([&] { return gate.done() == 6; }));
  EXPECT_EQ(gate.max(), 2);
}

TEST(UidLanes, AnotherUidRunsWhileOnesLaneIsFull) {
  Gate gate;
  UidLanes lanes(Opts(1, 1));
  OpenOnExit guard{gate};
  ASSERT_TRUE(lanes.Submit(65534, gate.Job()).ok());
  ASSERT_TRUE(lanes.Submit(65534, gate.Job()).ok());
  ASSERT_FALSE(lanes.Submit(65534, gate.Job()).ok());
  std::atomic<bool> root_ran{false};
  ASSERT_TRUE(lanes.Submit(0, [&] { root_ran = true; }).ok());
  EXPECT_TRUE(WaitFor([&] { return root_ran.load(); })) << "root waited for uid 65534's lane";
  gate.Open();
  ASSERT_TRUE(WaitFor([&] { return gate.done() == 2; }));
}

TEST(UidLanes, JobsOfOneThreadLaneStartInOrder) {
  UidLanes lanes(Opts(1, 100));
  std::mutex mu;
  std::vector<int> order;
  for (int i = 0; i < 50; ++i) {
    ASSERT_TRUE(lanes
                    .Submit(7,
                            [&, i] {
                              std::lock_guard lock(mu);
                              order.push_back(i);
                            })
                    .ok());
  }
  ASSERT_TRUE(WaitFor([&] {
    std::lock_guard lock(mu);
    return order.size() == 50;
  }));
  for (int i = 0; i < 50; ++i) EXPECT_EQ(order[static_cast<size_t>(i)], i);
}

TEST(UidLanes, ThreadsAreMadeOnDemandAndEndWhenIdle) {
  Gate gate;
  UidLanes lanes(Opts(4, 16));
  OpenOnExit guard{gate};
  EXPECT_EQ(lanes.Threads(), 0u);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(lanes.Submit(1, gate.Job()).ok());
  ASSERT_TRUE(WaitFor([&] { return gate.running() == 3; }));
  EXPECT_EQ(lanes.Threads(), 3u);  // one per job, not the lane's maximum
  gate.Open();
  ASSERT_TRUE(WaitFor([&] { return lanes.Threads() == 0; })) << "idle threads did not end";
  EXPECT_EQ(lanes.Running(1), 0u);
  // The lane comes back for new work.
  std::atomic<bool> ran{false};
  ASSERT_TRUE(lanes.Submit(1, [&] { ran = true; }).ok());
  EXPECT_TRUE(WaitFor([&] { return ran.load(); }));
}

TEST(UidLanes, ShutdownRunsWhatWasQueuedAndRefusesTheRest) {
  std::atomic<int> ran{0};
  {
    UidLanes lanes(Opts(1, 100));
    for (int i = 0; i < 20; ++i) {
      ASSERT_TRUE(lanes
                      .Submit(static_cast<uid_t>(i % 3),
                              [&] {
                                std::this_thread::sleep_for(1ms);
                                ran.fetch_add(1);
                              })
                      .ok());
    }
    lanes.Shutdown();
    EXPECT_EQ(ran.load(), 20);
    EXPECT_EQ(lanes.Threads(), 0u);
    Status late = lanes.Submit(0, [&] { ran.fetch_add(1); });
    EXPECT_EQ(late.error_number(), ESHUTDOWN);
    lanes.Shutdown();  // idempotent
  }
  EXPECT_EQ(ran.load(), 20);
}

TEST(UidLanes, AJobMaySubmitAnother) {
  UidLanes lanes(Opts(1, 4));
  std::atomic<bool> second{false};
  ASSERT_TRUE(
      lanes.Submit(3, [&] { EXPECT_TRUE(lanes.Submit(3, [&] { second = true; }).ok()); }).ok());
  EXPECT_TRUE(WaitFor([&] { return second.load(); }));
}

}  // namespace
}  // namespace dnvme::fs
