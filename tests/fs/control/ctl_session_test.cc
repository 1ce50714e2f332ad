// CtlSession's queue (fs/control/control.h): a write is queued and answered at once, one job runs
// a session's requests in the order written, a read waits (parked: no thread blocks) while
// requests are queued or running and then gets the last one's answer, the queue is bounded, and
// a job that could not be handed over leaves nothing queued. The requests are `hello` (it needs
// nothing of the core) and text that is not JSON (an error answer), so the order shows.
#include "fs/control/control.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "fs/limits/uid_lanes.h"

namespace dnvme::fs {
namespace {

using nlohmann::json;

class FakeCore : public ControlCore {
 public:
  explicit FakeCore(const UidLimits::Maxima& m = Generous()) : limits_(m) {}
  static UidLimits::Maxima Generous() {
    UidLimits::Maxima m;
    m.fill(int64_t{1} << 20);
    return m;
  }
  Inode* PinInode(dev_t, ino_t) override { return nullptr; }
  void Unpin(Inode*) override {}
  Status DrainForExternal(Inode&) override { return Status::Ok(); }
  void AfterExternalWrite(Inode&) override {}
  void AfterExternalCreate(const std::string&, const std::string&) override {}
  UidLimits& uid_limits() override { return limits_; }
  CtlCounters& ctl_counters() override { return counters_; }
  HandleConfig EngineConfig() override { return HandleConfig{}; }
  Result<HandleConfig> SetEngineConfig(const std::string&) override {
    return Status::Unsupported(EPERM, "not in this test");
  }
  bool MayReconfigure(uid_t) const override { return false; }
  std::string StatsJson() override { return "{}"; }
  void AddCtlEngine(AioHandle*) override {}
  void RemoveCtlEngine(AioHandle*) override {}
  int root_fd() const override { return -1; }
  const std::string& mountpoint() const override { return mountpoint_; }
  bool Stopping() const override { return stopping_; }
  void set_stopping(bool s) { stopping_ = s; }

 private:
  bool stopping_ = false;
  UidLimits limits_;
  CtlCounters counters_;
  std::string mountpoint_ = "/mnt/test";
};

std::string Hello(int id) { return json{{"op", "hello"}, {"id", id}}.dump(); }

// Jobs handed over by Enqueue, run when the test says (RunAll), on the test's thread.
class ManualJobs {
 public:
  CtlSession::Starter For(const std::shared_ptr<CtlSession>& s) {
    return [this, s] {
      if (refuse_) return Status::ResourceExhausted(EAGAIN, "lane full");
      jobs_.push_back([s] { s->RunQueued(); });
      ++handed_;
      return Status::Ok();
    };
  }
  void RunAll() {
    std::vector<std::function<void()>> jobs;
    jobs.swap(jobs_);
    for (auto& j : jobs) j();
  }
  int handed() const { return handed_; }
  void set_refuse(bool r) { refuse_ = r; }

 private:
  std::vector<std::function<void()>> jobs_;
  int handed_ = 0;
  bool refuse_ = false;
};

// Answers of reads, in the order they were given.
struct Answers {
  std::vector<std::string> got;
  CtlSession::ReadReply Reply() {
    return [this](const Result<std::string>& r) {
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      got.push_back(r.value());
    };
  }
};

class CtlSessionTest : public ::testing::Test {
 protected:
  FakeCore core_;
  Caller caller_{1000, 1000, 1, {}};
  std::shared_ptr<CtlSession> session_ = std::make_shared<CtlSession>(core_, caller_);
  ManualJobs jobs_;

  Status Write(const std::string& text) {
    return session_->Enqueue(text, caller_, jobs_.For(session_));
  }
};

TEST_F(CtlSessionTest, ReadWithNothingQueuedIsAnsweredAtOnce) {
  Answers a;
  session_->Read(4096, a.Reply());
  ASSERT_EQ(a.got.size(), 1u);
  EXPECT_EQ(a.got[0], "");
}

TEST_F(CtlSessionTest, WritesQueueBehindOneJobAndTheReadWaitsForTheLast) {
  ASSERT_TRUE(Write(Hello(1)).ok());
  ASSERT_TRUE(Write(Hello(2)).ok());
  EXPECT_EQ(jobs_.handed(), 1) << "one job per busy session";
  Answers a;
  session_->Read(1 << 20, a.Reply());
  EXPECT_TRUE(a.got.empty()) << "answered before the requests ran";
  jobs_.RunAll();
  ASSERT_EQ(a.got.size(), 1u);
  json j = json::parse(a.got[0]);
  EXPECT_EQ(j["id"], 2);
  EXPECT_EQ(j["ok"], true);
  session_->Read(1 << 20, a.Reply());  // consumed: the next read is empty, at once
  ASSERT_EQ(a.got.size(), 2u);
  EXPECT_EQ(a.got[1], "");
  ASSERT_TRUE(Write(Hello(3)).ok());
  EXPECT_EQ(jobs_.handed(), 2) << "an idle session starts a job again";
  jobs_.RunAll();
}

TEST_F(CtlSessionTest, RequestsRunInTheOrderWritten) {
  ASSERT_TRUE(Write(Hello(1)).ok());
  ASSERT_TRUE(Write("not json").ok());
  jobs_.RunAll();
  Answers a;
  session_->Read(1 << 20, a.Reply());
  ASSERT_EQ(a.got.size(), 1u);
  json j = json::parse(a.got[0]);
  EXPECT_EQ(j["ok"], false) << a.got[0];
  EXPECT_EQ(j["error"]["code"], "EBADMSG");
  EXPECT_EQ(core_.ctl_counters().requests.load(), 2u);
}

// Fs::Stop: a user's queued requests must not hold the unmount; those not yet run are answered
// ECANCELED and run nothing.
TEST_F(CtlSessionTest, RequestsQueuedWhenTheDaemonStopsAreCancelledNotRun) {
  ASSERT_TRUE(Write(Hello(1)).ok());
  ASSERT_TRUE(Write(Hello(2)).ok());
  core_.set_stopping(true);
  jobs_.RunAll();
  Answers a;
  session_->Read(1 << 20, a.Reply());
  ASSERT_EQ(a.got.size(), 1u);
  json j = json::parse(a.got[0]);
  EXPECT_EQ(j["id"], 2);
  EXPECT_EQ(j["ok"], false) << a.got[0];
  EXPECT_EQ(j["error"]["code"], "ECANCELED") << a.got[0];
  EXPECT_EQ(core_.ctl_counters().request_errors.load(), 2u) << "both answered, neither run";
}

TEST_F(CtlSessionTest, ParkedReadsTakeTheirPartsInOrder) {
  ASSERT_TRUE(Write(Hello(7)).ok());
  Answers a;
  session_->Read(10, a.Reply());
  session_->Read(10, a.Reply());
  EXPECT_TRUE(a.got.empty());
  jobs_.RunAll();
  ASSERT_EQ(a.got.size(), 2u);
  Answers rest;
  session_->Read(1 << 20, rest.Reply());
  ASSERT_EQ(rest.got.size(), 1u);
  EXPECT_EQ(json::parse(a.got[0] + a.got[1] + rest.got[0])["id"], 7);
}

TEST_F(CtlSessionTest, TheQueueIsBounded) {
  for (size_t i = 0; i < CtlSession::kMaxQueued; ++i) ASSERT_TRUE(Write(Hello(1)).ok()) << i;
  Status full = Write(Hello(2));
  EXPECT_EQ(full.error_number(), EAGAIN) << full.ToString();
  EXPECT_NE(full.message().find("read the answer"), std::string::npos) << full.ToString();
  jobs_.RunAll();
  EXPECT_TRUE(Write(Hello(3)).ok()) << "room again once the queue ran";
  jobs_.RunAll();
  // Bytes: requests of kMaxRequestBytes fill kMaxQueuedBytes first.
  const std::string longest(kMaxRequestBytes, ' ');
  size_t taken = 0;
  while (Write(longest).ok()) ++taken;
  EXPECT_EQ(taken, CtlSession::kMaxQueuedBytes / kMaxRequestBytes);
  jobs_.RunAll();
  // Longer ones (a write over max_write arrives as several) are refused by their size alone and
  // take no room: their text is not kept.
  for (int i = 0; i < 20; ++i) ASSERT_TRUE(Write(std::string(size_t{3} << 20, 'x')).ok()) << i;
  jobs_.RunAll();
  Answers a;
  session_->Read(1 << 20, a.Reply());
  ASSERT_EQ(a.got.size(), 1u);
  json j = json::parse(a.got[0]);
  EXPECT_EQ(j["error"]["code"], "E2BIG") << a.got[0];
  EXPECT_NE(a.got[0].find("request of 3145728 bytes"), std::string::npos) << a.got[0];
}

TEST_F(CtlSessionTest, AJobThatCannotBeHandedOverLeavesNothingQueued) {
  jobs_.set_refuse(true);
  Status st = Write(Hello(1));
  EXPECT_EQ(st.error_number(), EAGAIN);
  Answers a;
  session_->Read(1 << 20, a.Reply());
  ASSERT_EQ(a.got.size(), 1u) << "a read must not wait for a request that was refused";
  EXPECT_EQ(a.got[0], "");
  jobs_.set_refuse(false);
  ASSERT_TRUE(Write(Hello(2)).ok());
  jobs_.RunAll();
  session_->Read(1 << 20, a.Reply());
  ASSERT_EQ(a.got.size(), 2u);
  EXPECT_EQ(json::parse(a.got[1])["id"], 2);
  EXPECT_EQ(core_.ctl_counters().requests.load(), 1u);
}

// A ctl descriptor is its opener's: a write by another uid (a set-user-ID program that inherited
// it, or a process that dropped privileges after opening) is refused, nothing is queued and the
// opener's answer is untouched (issue 45: root's write ran as root in a uid-65534 session).
TEST_F(CtlSessionTest, AWriteByAnotherUidIsRefusedAndRunsNothing) {
  ASSERT_TRUE(Write(Hello(1)).ok());
  jobs_.RunAll();
  const Caller root{0, 0, 2, {}};
  Status st = session_->Enqueue(Hello(2), root, jobs_.For(session_));
  EXPECT_EQ(st.error_number(), EPERM) << st.ToString();
  EXPECT_NE(st.message().find("opened by uid 1000"), std::string::npos) << st.ToString();
  EXPECT_EQ(session_->Request(Hello(3), root).error_number(), EPERM);
  EXPECT_EQ(jobs_.handed(), 1) << "a refused write handed a job over";
  Answers a;
  session_->Read(1 << 20, a.Reply());
  ASSERT_EQ(a.got.size(), 1u);
  EXPECT_EQ(json::parse(a.got[0])["id"], 1) << "the refused writes replaced the opener's answer";
  EXPECT_EQ(core_.ctl_counters().requests.load(), 1u);
  // The opener's own uid with other groups (a set-group-ID program) is served, as the opener.
  const Caller setgid{1000, 0, 3, {0}};
  EXPECT_TRUE(session_->Request(Hello(4), setgid).ok());
  EXPECT_EQ(session_->opener().gid, 1000u);
  EXPECT_TRUE(session_->opener().groups.empty());
}

// A handle's engine threads and libaio events are charged to the opener's uid at handle.open
// and given back at handle.close (issue 45: 8 handles x 256 workers, 2048 threads for one user).
TEST(CtlSessionWorkersTest, HandleWorkersAndAioEventsAreChargedPerUid) {
  UidLimits::Maxima m = FakeCore::Generous();
  m[static_cast<size_t>(UidResource::kWorkers)] = 4;
  m[static_cast<size_t>(UidResource::kAioEvents)] = 40;
  FakeCore core(m);
  const Caller user{65534, 65534, 1, {}};
  auto s1 = std::make_shared<CtlSession>(core, user);
  auto s2 = std::make_shared<CtlSession>(core, user);  // the limit is the uid's, not the session's
  auto call = [](CtlSession& s, const Caller& c, const json& req) {
    EXPECT_TRUE(s.Request(req.dump(), c).ok());
    std::string answer;
    s.Read(1 << 20, [&](const Result<std::string>& r) { answer = r.value(); });
    return json::parse(answer);
  };
  auto open_handle = [&](CtlSession& s, int workers, int depth) {
    return call(s, user,
                {{"op", "handle.open"},
                 {"block_size", 4096},
                 {"queue_depth", depth},
                 {"intra_op_parallelism", workers},
                 {"bounce_bytes_per_worker", 8192}});
  };
  json h1 = open_handle(*s1, 3, 8);
  ASSERT_EQ(h1["ok"], true) << h1.dump();
  UidLimits& l = core.uid_limits();
  EXPECT_EQ(l.Held(65534, UidResource::kWorkers), 3);
  EXPECT_EQ(l.Held(65534, UidResource::kAioEvents), 24);
  json refused = open_handle(*s2, 2, 4);  // 5 threads > ctl_max_workers=4
  ASSERT_EQ(refused["ok"], false) << refused.dump();
  EXPECT_EQ(refused["error"]["code"], "EAGAIN") << refused.dump();
  EXPECT_NE(refused["error"]["message"].get<std::string>().find("ctl_max_workers=4"),
            std::string::npos)
      << refused.dump();
  json events = open_handle(*s2, 1, 32);  // 24 + 32 events > ctl_max_aio_events=40
  ASSERT_EQ(events["ok"], false) << events.dump();
  EXPECT_EQ(events["error"]["code"], "EAGAIN") << events.dump();
  EXPECT_NE(events["error"]["message"].get<std::string>().find("ctl_max_aio_events=40"),
            std::string::npos)
      << events.dump();
  EXPECT_EQ(l.Held(65534, UidResource::kWorkers), 3) << "a refused handle.open kept a charge";
  EXPECT_EQ(l.Held(65534, UidResource::kHandles), 1);
  // Root has its own share.
  const Caller root{0, 0, 2, {}};
  auto rs = std::make_shared<CtlSession>(core, root);
  json r = call(*rs, root,
                {{"op", "handle.open"},
                 {"block_size", 4096},
                 {"queue_depth", 8},
                 {"intra_op_parallelism", 4},
                 {"bounce_bytes_per_worker", 8192}});
  EXPECT_EQ(r["ok"], true) << r.dump();
  // Closing gives the units back.
  json closed = call(*s1, user, {{"op", "handle.close"}, {"handle", h1["handle"]}});
  ASSERT_EQ(closed["ok"], true) << closed.dump();
  EXPECT_EQ(l.Held(65534, UidResource::kWorkers), 0);
  EXPECT_EQ(l.Held(65534, UidResource::kAioEvents), 0);
  EXPECT_EQ(open_handle(*s2, 2, 4)["ok"], true);
  s2.reset();  // a session's end closes its handles
  EXPECT_EQ(l.Held(65534, UidResource::kWorkers), 0);
}

// On real lane threads: every round writes a few requests and reads; the read, answered from a
// lane thread, always carries the round's last id. Races the job's end against the next write
// and read.
TEST(CtlSessionLanesTest, EachReadGetsItsRoundsLastAnswer) {
  FakeCore core;
  UidLanes lanes(UidLanes::Options{});
  const Caller caller{1000, 1000, 1, {}};
  auto session = std::make_shared<CtlSession>(core, caller);
  auto start = [&] { return lanes.Submit(1000, [s = session] { s->RunQueued(); }); };
  for (int round = 0; round < 300; ++round) {
    const int writes = 1 + round % 4;
    for (int i = 0; i < writes; ++i) {
      ASSERT_TRUE(session->Enqueue(Hello(round * 10 + i), caller, start).ok());
    }
    std::promise<std::string> answer;
    session->Read(1 << 20, [&](const Result<std::string>& r) { answer.set_value(r.value()); });
    auto f = answer.get_future();
    ASSERT_EQ(f.wait_for(std::chrono::seconds(30)), std::future_status::ready) << round;
    EXPECT_EQ(json::parse(f.get())["id"], round * 10 + writes - 1) << round;
  }
  lanes.Shutdown();
  EXPECT_EQ(session.use_count(), 1) << "a job still holds the session";
}

}  // namespace
}  // namespace dnvme::fs
