// Engines (fs/core/engines.h), the mount's engine swap: config.set makes a new engine that later
// submissions get, while one a submission still holds lives (and finishes its operations) until
// it lets go; the stats of every engine of the mount add up, destroyed ones included. Real
// engines (libaio) on scratch files; no mount.
#include "fs/core/engines.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "tests/engine/test_util.h"

namespace dnvme::fs {
namespace {

using dnvme::test::AlignedBuffer;
using dnvme::test::kMiB;
using dnvme::test::MatchesPattern;
using std::chrono::seconds;

constexpr int64_t kFileSize = 8 * kMiB;

// A small engine: these tests count engines, not bandwidth.
HandleConfig Small() {
  HandleConfig c;
  c.block_size = 256 << 10;
  c.queue_depth = 8;
  c.bounce_bytes_per_worker = 2 * kMiB;
  return c;
}

// An operation's completion, waited for by the test.
struct Done {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  Status status;
  void Set(const OpResult& r) {
    std::lock_guard lock(mu);
    status = r.status;
    done = true;
    cv.notify_all();
  }
  bool is_done() {
    std::lock_guard lock(mu);
    return done;
  }
  bool Wait(seconds limit) {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, limit, [&] { return done; });
  }
};

class EnginesTest : public dnvme::test::ScratchTest {
 protected:
  void SetUp() override {
    ScratchTest::SetUp();
    if (HasFatalFailure()) return;
    path_ = Path("data");
    ASSERT_TRUE(dnvme::test::WritePatternFile(path_, kFileSize));
  }
  void TearDown() override {
    engines_.Stop();
    ScratchTest::TearDown();
  }

  // The file, opened by the live engine (as the mount's OPEN does).
  FileRef OpenData(FileAccess access = FileAccess::kReadWrite) {
    auto e = engines_.Current();
    EXPECT_NE(e, nullptr);
    if (e == nullptr) return {};
    auto f = e->open_file(path_, access);
    EXPECT_TRUE(f.ok()) << f.status().ToString();
    return f.ok() ? f.value() : FileRef{};
  }

  // Reads [off, off + len) with engine `e` and checks the pattern.
  ::testing::AssertionResult ReadsBack(AioHandle& e, const FileRef& f, int64_t off, int64_t len) {
    AlignedBuffer buf(static_cast<size_t>(len));
    Status st = e.sync_pread(buf.data(), len, f, off);
    if (!st.ok()) return ::testing::AssertionFailure() << st.ToString();
    return MatchesPattern(buf.data(), buf.size(), off);
  }

  std::string path_;
  Engines engines_;
};

TEST_F(EnginesTest, NoEngineBeforeStartNorAfterResetOrStop) {
  EXPECT_EQ(engines_.Current(), nullptr);
  DNVME_ASSERT_OK(engines_.Start(Small()));
  ASSERT_NE(engines_.Current(), nullptr);
  EXPECT_EQ(engines_.Current()->config(), Small());
  EXPECT_EQ(engines_.config(), Small());
  engines_.Reset();  // a preflight's engine goes
  EXPECT_EQ(engines_.Current(), nullptr);
  DNVME_ASSERT_OK(engines_.Start(Small()));
  EXPECT_NE(engines_.Current(), nullptr);
  engines_.Stop();
  EXPECT_EQ(engines_.Current(), nullptr);
}

TEST_F(EnginesTest, AnEngineThatCannotBeMadeIsAnError) {
  HandleConfig bad = Small();
  bad.queue_depth = 0;
  EXPECT_FALSE(engines_.Start(bad).ok());
  EXPECT_EQ(engines_.Current(), nullptr);
}

TEST_F(EnginesTest, AnEqualConfigurationKeepsTheEngine) {
  DNVME_ASSERT_OK(engines_.Start(Small()));
  const auto before = engines_.Current();
  bool changed = true;
  auto c = engines_.Reconfigure("{}", &changed);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_FALSE(changed);
  EXPECT_EQ(c.value(), Small());
  changed = true;
  ASSERT_TRUE(engines_.Reconfigure(R"({"queue_depth": 8, "block_size": "256K"})", &changed).ok());
  EXPECT_FALSE(changed);  // the values it has already
  EXPECT_EQ(engines_.Current(), before);
}

TEST_F(EnginesTest, ANewConfigurationServesTheNextSubmissions) {
  DNVME_ASSERT_OK(engines_.Start(Small()));
  const auto before = engines_.Current();
  const FileRef file = OpenData();  // opened under the first engine
  bool changed = false;
  auto c = engines_.Reconfigure(R"({"queue_depth": 16})", &changed);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_TRUE(changed);
  HandleConfig want = Small();
  want.queue_depth = 16;  // applied on top of the live configuration: the rest stays
  EXPECT_EQ(c.value(), want);
  EXPECT_EQ(engines_.config(), want);
  const auto after = engines_.Current();
  ASSERT_NE(after, nullptr);
  EXPECT_NE(after, before);
  EXPECT_EQ(after->config(), want);
  // A file the mount opened before the swap is served by the new engine.
  EXPECT_TRUE(ReadsBack(*after, file, kMiB, 2 * kMiB));
}

TEST_F(EnginesTest, AFailedReconfigurationKeepsTheOldEngine) {
  DNVME_ASSERT_OK(engines_.Start(Small()));
  const auto before = engines_.Current();
  for (const char* patch : {R"({"queue_depth": 0})", R"({"no_such_key": 1})", "not json",
                            R"({"single_submit": "yes"})"}) {
    bool changed = true;
    auto c = engines_.Reconfigure(patch, &changed);
    EXPECT_FALSE(c.ok()) << patch;
    EXPECT_FALSE(changed) << patch;
    EXPECT_EQ(engines_.Current(), before) << patch;
    EXPECT_EQ(engines_.config(), Small()) << patch;
  }
}

TEST_F(EnginesTest, AnEngineTheKernelCannotMakeKeepsTheOldOne) {
  // 256 workers of 4096 events each: more than aio-max-nr lets one process set up.
  int64_t max_nr = 0;
  std::ifstream("/proc/sys/fs/aio-max-nr") >> max_nr;
  if (max_nr <= 0 || max_nr >= 256 * 4096) {
    GTEST_SKIP() << "aio-max-nr is " << max_nr << ": the kernel would make such an engine";
  }
  DNVME_ASSERT_OK(engines_.Start(Small()));
  const auto before = engines_.Current();
  bool changed = true;
  auto c = engines_.Reconfigure(R"({"intra_op_parallelism": 256, "queue_depth": 4096})", &changed);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().ToString().find("new engine"), std::string::npos) << c.status().ToString();
  EXPECT_FALSE(changed);
  EXPECT_EQ(engines_.Current(), before);
  EXPECT_EQ(engines_.config(), Small());
}

TEST_F(EnginesTest, ARetiredEngineLivesUntilItsLastUserLetsGo) {
  DNVME_ASSERT_OK(engines_.Start(Small()));
  const FileRef file = OpenData();
  std::shared_ptr<AioHandle> held = engines_.Current();  // a submission in progress
  bool changed = false;
  ASSERT_TRUE(engines_.Reconfigure(R"({"queue_depth": 16})", &changed).ok());
  ASSERT_TRUE(changed);
  EXPECT_NE(engines_.Current(), held);
  // Still whole for the submission that holds it, however often the stats are read.
  engines_.MountStats();
  ASSERT_EQ(engines_.retired(), 1u);
  EXPECT_TRUE(ReadsBack(*held, file, 0, kMiB));
  held.reset();
  EXPECT_EQ(engines_.retired(), 1u);  // destroyed by the next reconfiguration or stats, not here
  const HandleStats total = engines_.MountStats();
  EXPECT_EQ(engines_.retired(), 0u);
  EXPECT_EQ(total.bytes_read, static_cast<uint64_t>(kMiB));  // its numbers outlive it
}

TEST_F(EnginesTest, AnEngineNobodyHoldsGoesAtTheSwap) {
  DNVME_ASSERT_OK(engines_.Start(Small()));
  bool changed = false;
  ASSERT_TRUE(engines_.Reconfigure(R"({"queue_depth": 16})", &changed).ok());
  EXPECT_EQ(engines_.retired(), 0u);
  ASSERT_TRUE(engines_.Reconfigure(R"({"queue_depth": 32})", &changed).ok());
  EXPECT_EQ(engines_.retired(), 0u);
  EXPECT_EQ(engines_.Current()->config().queue_depth, 32);
}

TEST_F(EnginesTest, AnOperationInFlightAcrossTheSwapFinishesOnItsEngine) {
  DNVME_ASSERT_OK(engines_.Start(Small()));
  const FileRef file = OpenData();
  AlignedBuffer buf(static_cast<size_t>(kFileSize));
  Done done;
  {
    std::shared_ptr<AioHandle> e = engines_.Current();  // as a READ handler does
    DNVME_ASSERT_OK(e->submit_pread(buf.data(), kFileSize, file, 0,
                                    [&done](const OpResult& r) { done.Set(r); }));
  }  // the handler returns; its operation is still in flight
  bool changed = false;
  ASSERT_TRUE(engines_.Reconfigure(R"({"queue_depth": 16})", &changed).ok());
  ASSERT_TRUE(changed);
  // The old engine, held by nobody now, is destroyed by the swap or the next stats: either way
  // only after its operation and its callback ended.
  engines_.MountStats();
  EXPECT_EQ(engines_.retired(), 0u);
  ASSERT_TRUE(done.is_done());
  DNVME_EXPECT_OK(done.status);
  EXPECT_TRUE(MatchesPattern(buf.data(), buf.size(), 0));
}

// What an operation still in flight on a retired engine moves is counted: the engine is retired
// (AioHandle::Retire: its operations waited for) before its stats join the destroyed engines'
// total. (It was not when the stats were read before the destruction that waited.)
TEST_F(EnginesTest, OperationsInFlightAtTheSwapCountInTheStats) {
  DNVME_ASSERT_OK(engines_.Start(Small()));
  const FileRef file = OpenData();
  AlignedBuffer buf(static_cast<size_t>(kFileSize));
  Done done;
  DNVME_ASSERT_OK(engines_.Current()->submit_pread(buf.data(), kFileSize, file, 0,
                                                   [&done](const OpResult& r) { done.Set(r); }));
  bool changed = false;
  ASSERT_TRUE(engines_.Reconfigure(R"({"queue_depth": 16})", &changed).ok());
  ASSERT_TRUE(done.Wait(seconds(60)));
  DNVME_EXPECT_OK(done.status);
  const HandleStats s = engines_.MountStats();
  EXPECT_EQ(s.ops_read, 1u);
  EXPECT_EQ(s.bytes_read, static_cast<uint64_t>(kFileSize));
}

TEST_F(EnginesTest, StopWaitsForTheOperationsOfEveryEngine) {
  DNVME_ASSERT_OK(engines_.Start(Small()));
  const FileRef file = OpenData();
  AlignedBuffer a(static_cast<size_t>(kFileSize / 2)), b(static_cast<size_t>(kFileSize / 2));
  Done done_a, done_b;
  std::shared_ptr<AioHandle> first = engines_.Current();
  bool changed = false;
  ASSERT_TRUE(engines_.Reconfigure(R"({"queue_depth": 16})", &changed).ok());
  // One operation on the retired engine (still held while it submits), one on the live one.
  DNVME_ASSERT_OK(
      first->submit_pread(a.data(), a.ssize(), file, 0, [&](const OpResult& r) { done_a.Set(r); }));
  first.reset();
  DNVME_ASSERT_OK(engines_.Current()->submit_pread(b.data(), b.ssize(), file, a.ssize(),
                                                   [&](const OpResult& r) { done_b.Set(r); }));
  engines_.Stop();
  EXPECT_TRUE(done_a.is_done());
  EXPECT_TRUE(done_b.is_done());
  EXPECT_EQ(engines_.retired(), 0u);
  EXPECT_EQ(engines_.Current(), nullptr);
  DNVME_EXPECT_OK(done_a.status);
  DNVME_EXPECT_OK(done_b.status);
  EXPECT_TRUE(MatchesPattern(a.data(), a.size(), 0));
  EXPECT_TRUE(MatchesPattern(b.data(), b.size(), a.ssize()));
}

TEST_F(EnginesTest, SubmissionsWhileConfigSetSwapsTheEngineAllLand) {
  // FUSE threads take the live engine once per submission while config.set swaps it again and
  // again and the stats are read: every operation succeeds with the right bytes, and the mount's
  // stats count each one once, on whichever engine it ran.
  DNVME_ASSERT_OK(engines_.Start(Small()));
  const FileRef file = OpenData();
  constexpr int kThreads = 3;
  constexpr int kOps = 60;
  constexpr int64_t kLen = 256 << 10;
  std::atomic<bool> stop{false};
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      AlignedBuffer buf(static_cast<size_t>(kLen));
      for (int i = 0; i < kOps; ++i) {
        const int64_t off = ((t * kOps + i) * kLen) % kFileSize;
        std::shared_ptr<AioHandle> e = engines_.Current();
        Status st;
        if (i % 2 == 0) {
          st = e->sync_pread(buf.data(), kLen, file, off);
          if (st.ok() && !MatchesPattern(buf.data(), buf.size(), off)) ++failures;
        } else {
          buf.Fill(off);  // the pattern again: the file stays as it was
          st = e->sync_pwrite(buf.data(), kLen, file, off);
        }
        if (!st.ok()) {
          ADD_FAILURE() << st.ToString();
          ++failures;
        }
      }
    });
  }
  std::thread swapper([&] {
    int n = 0;
    while (!stop.load()) {
      bool changed = false;
      const std::string patch = n++ % 2 ? R"({"queue_depth": 8})" : R"({"queue_depth": 4})";
      auto c = engines_.Reconfigure(patch, &changed);
      if (!c.ok() || !changed) ++failures;
      engines_.MountStats();
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  });
  for (auto& t : threads) t.join();
  stop = true;
  swapper.join();
  EXPECT_EQ(failures.load(), 0);
  const HandleStats s = engines_.MountStats();
  EXPECT_EQ(s.ops_read, static_cast<uint64_t>(kThreads * kOps / 2));
  EXPECT_EQ(s.ops_written, static_cast<uint64_t>(kThreads * kOps / 2));
  EXPECT_EQ(s.bytes_read, static_cast<uint64_t>(kThreads * kOps / 2 * kLen));
  EXPECT_EQ(s.bytes_written, static_cast<uint64_t>(kThreads * kOps / 2 * kLen));
  std::vector<uint8_t> all = dnvme::test::ReadWholeFile(path_);
  EXPECT_TRUE(MatchesPattern(all.data(), all.size(), 0));
}

TEST_F(EnginesTest, ReconfigureWithoutALiveEngineLeavesTheStatsReadable) {
  // After Reset (a preflight's engine dropped) there is no engine to retire.
  DNVME_ASSERT_OK(engines_.Start(Small()));
  engines_.Reset();
  bool changed = false;
  ASSERT_TRUE(engines_.Reconfigure(R"({"queue_depth": 16})", &changed).ok());
  EXPECT_TRUE(changed);
  ASSERT_NE(engines_.Current(), nullptr);
  const HandleStats s = engines_.MountStats();  // must not touch a retired engine that is none
  EXPECT_EQ(s.ops_read, 0u);
}

TEST_F(EnginesTest, ControlSessionEnginesCountWhileTheyLiveAndAfter) {
  DNVME_ASSERT_OK(engines_.Start(Small()));
  auto session = AioHandle::Create(Small());
  ASSERT_TRUE(session.ok()) << session.status().ToString();
  std::unique_ptr<AioHandle> h = std::move(session).value();
  engines_.AddSessionEngine(h.get());
  AlignedBuffer buf(static_cast<size_t>(kMiB));
  DNVME_ASSERT_OK(h->sync_pread(buf.data(), buf.ssize(), path_, 0));
  EXPECT_EQ(engines_.SessionStats().bytes_read, static_cast<uint64_t>(kMiB));
  EXPECT_EQ(engines_.MountStats().bytes_read, 0u);  // the mount's engines only
  engines_.RemoveSessionEngine(h.get());
  engines_.RemoveSessionEngine(h.get());  // a second close counts nothing again
  h.reset();
  EXPECT_EQ(engines_.SessionStats().bytes_read, static_cast<uint64_t>(kMiB));
}

}  // namespace
}  // namespace dnvme::fs
