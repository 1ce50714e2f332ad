// AioHandle::submit_pwrite's Submitted notice (include/dnvme/handle.h): it comes once every byte
// of the write is in the kernel -- every O_DIRECT request accepted by io_submit, the unaligned
// edges in the page cache -- and before the completion, without waiting for it. Real libaio on
// real files, through a backend (dnvme/aio_backend.h) that counts what io_submit accepted and can
// hold completions back (a "gate"), so the tests see the moment between submission and
// completion that a killed process would leave behind.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <libaio.h>
#include <unistd.h>

#include <set>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dnvme/aio_backend.h"
#include "dnvme/handle.h"
#include "engine/posix/file.h"
#include "tests/engine/test_util.h"

namespace dnvme {
namespace {

using test::AlignedBuffer;
using test::kKiB;
using test::kMiB;

constexpr unsigned kFlagResfd = 1u << 0;  // IOCB_FLAG_RESFD (linux/aio_abi.h): io_set_eventfd

// Shared by every backend of one handle (one per worker, so guarded).
struct Gate {
  std::mutex mu;
  std::condition_variable cv;
  bool open = true;              // false: GetEvents waits, so nothing completes for the engine
  int64_t submitted_bytes = 0;   // bytes of the requests io_submit accepted
  int64_t submitted_reqs = 0;    // requests io_submit accepted
  int refuse_next_submits = 0;   // answer this many io_submit calls with -EINVAL
  std::vector<std::string> log;  // "submit N", "notice", "done" in the order they happened
  std::set<int> eventfds;        // the requests' completion eventfds (io_set_eventfd)

  // Releases the held completions, and signals the eventfds the kernel signalled while they were
  // held (a worker sleeping on one would not wake otherwise).
  void Open() {
    std::set<int> fds;
    {
      std::lock_guard lock(mu);
      open = true;
      fds = eventfds;
    }
    cv.notify_all();
    for (int fd : fds) {
      const uint64_t one = 1;
      EXPECT_EQ(::write(fd, &one, sizeof(one)), static_cast<ssize_t>(sizeof(one)));
    }
  }
  void Note(std::string what) {
    std::lock_guard lock(mu);
    log.push_back(std::move(what));
  }
  int64_t Bytes() {
    std::lock_guard lock(mu);
    return submitted_bytes;
  }
};

class GateBackend : public AioBackend {
 public:
  GateBackend(std::unique_ptr<AioBackend> real, std::shared_ptr<Gate> gate)
      : real_(std::move(real)), gate_(std::move(gate)) {}

  int Submit(long nr, struct iocb** iocbs) override {
    {
      std::lock_guard lock(gate_->mu);
      if (gate_->refuse_next_submits > 0) {
        --gate_->refuse_next_submits;
        return -EINVAL;
      }
    }
    const int rc = real_->Submit(nr, iocbs);
    if (rc > 0) {
      std::lock_guard lock(gate_->mu);
      for (int i = 0; i < rc; ++i) {
        gate_->submitted_bytes += static_cast<int64_t>(iocbs[i]->u.c.nbytes);
        if (iocbs[i]->u.c.flags & kFlagResfd) gate_->eventfds.insert(iocbs[i]->u.c.resfd);
      }
      gate_->submitted_reqs += rc;
      gate_->log.push_back("submit " + std::to_string(rc));
    }
    return rc;
  }

  int GetEvents(long min_nr, long nr, struct io_event* events, struct timespec* timeout) override {
    {
      std::unique_lock lock(gate_->mu);
      const bool poll = timeout != nullptr && timeout->tv_sec == 0 && timeout->tv_nsec == 0;
      if (poll && !gate_->open) return 0;  // nothing completed, as far as the engine can tell
      gate_->cv.wait(lock, [&] { return gate_->open; });
    }
    return real_->GetEvents(min_nr, nr, events, timeout);
  }

 private:
  std::unique_ptr<AioBackend> real_;
  std::shared_ptr<Gate> gate_;
};

class GateFactory : public AioBackendFactory {
 public:
  explicit GateFactory(std::shared_ptr<Gate> gate)
      : real_(LibaioBackendFactory()), gate_(std::move(gate)) {}
  Result<std::unique_ptr<AioBackend>> Create(unsigned depth) override {
    DNVME_ASSIGN_OR_RETURN(std::unique_ptr<AioBackend> real, real_->Create(depth));
    return std::unique_ptr<AioBackend>(std::make_unique<GateBackend>(std::move(real), gate_));
  }

 private:
  std::shared_ptr<AioBackendFactory> real_;
  std::shared_ptr<Gate> gate_;
};

// What one write's two callbacks saw.
struct Seen {
  std::mutex mu;
  std::condition_variable cv;
  int notices = 0;
  int dones = 0;
  bool notice_before_done = false;
  Status status;

  Submitted Notice(const std::shared_ptr<Gate>& gate) {
    return [this, gate] {
      gate->Note("notice");
      std::lock_guard lock(mu);
      ++notices;
      notice_before_done = dones == 0;
      cv.notify_all();
    };
  }
  Completion Done(const std::shared_ptr<Gate>& gate) {
    return [this, gate](const OpResult& r) {
      gate->Note("done");
      std::lock_guard lock(mu);
      ++dones;
      status = r.status;
      cv.notify_all();
    };
  }
  bool WaitNotice() {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(30), [&] { return notices > 0; });
  }
  bool WaitDone() {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(30), [&] { return dones > 0; });
  }
  int Dones() {
    std::lock_guard lock(mu);
    return dones;
  }
};

int64_t RoundUp(int64_t v, int64_t a) { return (v + a - 1) / a * a; }
int64_t RoundDown(int64_t v, int64_t a) { return v / a * a; }

class SubmittedTest : public test::ScratchTest {
 protected:
  void Open(HandleConfig config) {
    gate_ = std::make_shared<Gate>();
    HandleOptions options;
    options.backend = std::make_shared<GateFactory>(gate_);
    auto h = AioHandle::Create(config, options);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    handle_ = std::move(h).value();
  }
  void TearDown() override {
    if (gate_) gate_->Open();  // a failed assertion must not leave a worker waiting
    handle_.reset();
    test::ScratchTest::TearDown();
  }

  // The file's edge alignment, as the engine computes it (the direct part of a write is what lies
  // between its first and last boundary).
  int64_t EdgeAlign(const std::string& path) {
    auto f = OpenIoFile(path, FileAccess::kWrite, DirectPolicy::kAuto, false);
    EXPECT_TRUE(f.ok()) << f.status().ToString();
    return f.ok() ? f.value()->edge_align : 4096;
  }

  // Bytes of [off, off + len) of `path` read through the page cache.
  std::vector<uint8_t> ReadRange(const std::string& path, int64_t off, int64_t len) {
    std::vector<uint8_t> out(static_cast<size_t>(len));
    int64_t got = 0;
    UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    EXPECT_TRUE(fd.valid());
    EXPECT_TRUE(
        PreadFull(fd.get(), reinterpret_cast<char*>(out.data()), len, off, path, &got).ok());
    out.resize(static_cast<size_t>(got));
    return out;
  }

  std::shared_ptr<Gate> gate_;
  std::unique_ptr<AioHandle> handle_;
};

HandleConfig Config(int workers, int queue_depth) {
  HandleConfig c;
  c.block_size = 64 * kKiB;
  c.queue_depth = queue_depth;
  c.intra_op_parallelism = workers;
  c.bounce_bytes_per_worker = 1 * kMiB;
  return c;
}

// The notice comes while every request is still held from completing: all direct bytes were
// accepted by io_submit and both unaligned edges are already in the file. Then the completion.
class HeldCompletionsTest : public SubmittedTest, public ::testing::WithParamInterface<int> {};

TEST_P(HeldCompletionsTest, NoticeWhileEveryRequestIsInFlight) {
  const int workers = GetParam();
  // Each worker's slice fits its queue (16 requests of 64 KiB): no request has to wait for a
  // completion to be submitted.
  Open(Config(workers, 32));
  const std::string path = Path("f.bin");
  ASSERT_TRUE(test::WritePatternFile(path, 0));
  const int64_t align = EdgeAlign(path);
  const int64_t off = 1000;
  const int64_t len = workers * kMiB + 3000;
  AlignedBuffer buf(static_cast<size_t>(len), 1000 % 4096);
  buf.Fill(off, 7);
  {
    std::lock_guard lock(gate_->mu);
    gate_->open = false;
  }
  FileRef file;
  DNVME_ASSERT_OK_AND_ASSIGN(file, handle_->open_file(path, FileAccess::kReadWrite));
  ASSERT_TRUE(file.direct()) << "the scratch file system refused O_DIRECT";
  Seen seen;
  DNVME_ASSERT_OK(
      handle_->submit_pwrite(buf.data(), len, file, off, seen.Done(gate_), seen.Notice(gate_)));
  ASSERT_TRUE(seen.WaitNotice()) << "no notice while completions were held";
  EXPECT_EQ(seen.Dones(), 0) << "completed although every completion was held";
  const int64_t a = RoundUp(off, align), b = RoundDown(off + len, align);
  EXPECT_EQ(gate_->Bytes(), b - a) << "the notice came before every direct byte was submitted";
  // Both edges are in the page cache already, so the file has its final size.
  EXPECT_EQ(test::FileSize(path), off + len);
  const auto head = ReadRange(path, off, a - off);
  EXPECT_TRUE(test::MatchesPattern(head.data(), head.size(), off, 7)) << "head edge";
  const auto tail = ReadRange(path, b, off + len - b);
  EXPECT_TRUE(test::MatchesPattern(tail.data(), tail.size(), b, 7)) << "tail edge";

  gate_->Open();
  ASSERT_TRUE(seen.WaitDone());
  DNVME_EXPECT_OK(seen.status);
  std::lock_guard lock(seen.mu);
  EXPECT_EQ(seen.notices, 1);
  EXPECT_TRUE(seen.notice_before_done);
  const auto all = test::ReadWholeFile(path);
  ASSERT_EQ(static_cast<int64_t>(all.size()), off + len);
  EXPECT_TRUE(test::MatchesPattern(all.data() + off, static_cast<size_t>(len), off, 7));
}

INSTANTIATE_TEST_SUITE_P(Workers, HeldCompletionsTest, ::testing::Values(1, 3),
                         [](const auto& info) { return "w" + std::to_string(info.param); });

// A write that needs more requests than the queue holds: the notice waits for the last io_submit
// (so for completions that free slots) and still comes once, before the completion.
TEST_F(SubmittedTest, MoreRequestsThanTheQueueNoticeAfterTheLastSubmit) {
  Open(Config(3, 4));
  const std::string path = Path("g.bin");
  ASSERT_TRUE(test::WritePatternFile(path, 0));
  const int64_t align = EdgeAlign(path);
  const int64_t off = 4096 + 5, len = 6 * kMiB + 11;
  AlignedBuffer buf(static_cast<size_t>(len), 3);  // misaligned: through bounce buffers
  buf.Fill(off, 9);
  FileRef file;
  DNVME_ASSERT_OK_AND_ASSIGN(file, handle_->open_file(path, FileAccess::kWrite));
  Seen seen;
  int64_t bytes_at_notice = -1;
  Submitted notice = seen.Notice(gate_);
  DNVME_ASSERT_OK(handle_->submit_pwrite(buf.data(), len, file, off, seen.Done(gate_), [&] {
    bytes_at_notice = gate_->Bytes();
    notice();
  }));
  ASSERT_TRUE(seen.WaitDone());
  DNVME_EXPECT_OK(seen.status);
  std::lock_guard lock(seen.mu);
  EXPECT_EQ(seen.notices, 1);
  EXPECT_TRUE(seen.notice_before_done);
  EXPECT_EQ(bytes_at_notice, RoundDown(off + len, align) - RoundUp(off, align));
  // The notice came right after a submission, none came after it, and the completion last.
  std::lock_guard glock(gate_->mu);
  const auto& log = gate_->log;
  size_t at = 0;
  while (at < log.size() && log[at] != "notice") ++at;
  ASSERT_LT(at, log.size());
  ASSERT_GT(at, 0u);
  EXPECT_EQ(log[at - 1].rfind("submit ", 0), 0u) << log[at - 1];
  for (size_t i = at + 1; i < log.size(); ++i) EXPECT_NE(log[i].rfind("submit ", 0), 0u);
  EXPECT_EQ(log.back(), "done");
  const auto all = test::ReadWholeFile(path);
  ASSERT_EQ(static_cast<int64_t>(all.size()), off + len);
  EXPECT_TRUE(test::MatchesPattern(all.data() + off, static_cast<size_t>(len), off, 9));
}

// Without a notice the order stays as it was: the tail edge is written after the direct part
// (a failing direct part then never leaves the file extended past what was written).
TEST_F(SubmittedTest, WithoutANoticeTheTailComesLast) {
  Open(Config(1, 32));
  const std::string path = Path("h.bin");
  ASSERT_TRUE(test::WritePatternFile(path, 0));
  const int64_t align = EdgeAlign(path);
  const int64_t len = kMiB + 100;
  AlignedBuffer buf(static_cast<size_t>(len));
  buf.Fill(0, 3);
  {
    std::lock_guard lock(gate_->mu);
    gate_->open = false;
  }
  FileRef file;
  DNVME_ASSERT_OK_AND_ASSIGN(file, handle_->open_file(path, FileAccess::kWrite));
  Seen seen;
  DNVME_ASSERT_OK(handle_->submit_pwrite(buf.data(), len, file, 0, seen.Done(gate_)));
  const int64_t b = RoundDown(len, align);
  for (int i = 0; i < 3000 && gate_->Bytes() < b; ++i) usleep(1000);
  ASSERT_EQ(gate_->Bytes(), b);
  EXPECT_LE(test::FileSize(path), b) << "the tail edge was written before the direct part";
  gate_->Open();
  ASSERT_TRUE(seen.WaitDone());
  DNVME_EXPECT_OK(seen.status);
  EXPECT_EQ(test::FileSize(path), len);
}

// With overlap_events, a write posted while another's requests are in flight is submitted at once,
// not after a completion: its notice comes while every completion is held. (A caller that waits
// for the notice of each write -- `dnvme run` -- would otherwise keep one write in flight.)
TEST_F(SubmittedTest, SlidingWindowSubmitsAPostedWriteWhileOthersAreInFlight) {
  HandleConfig c = Config(1, 128);  // room for all four writes' requests (16 each)
  c.overlap_events = true;
  Open(c);
  const std::string path = Path("s.bin");
  ASSERT_TRUE(test::WritePatternFile(path, 8 * kMiB));  // inside the file: no extending writes
  {
    std::lock_guard lock(gate_->mu);
    gate_->open = false;
  }
  FileRef file;
  DNVME_ASSERT_OK_AND_ASSIGN(file, handle_->open_file(path, FileAccess::kWrite));
  AlignedBuffer buf(static_cast<size_t>(4 * kMiB));
  buf.Fill(0, 5);
  Seen seen[4];
  for (int i = 0; i < 4; ++i) {
    const int64_t off = i * kMiB;
    DNVME_ASSERT_OK(handle_->submit_pwrite(buf.data() + off, kMiB, file, off, seen[i].Done(gate_),
                                           seen[i].Notice(gate_)));
    ASSERT_TRUE(seen[i].WaitNotice()) << "write " << i << " waited for an earlier completion";
  }
  EXPECT_EQ(gate_->Bytes(), 4 * kMiB);
  for (auto& s : seen) EXPECT_EQ(s.Dones(), 0);
  gate_->Open();
  for (auto& s : seen) {
    ASSERT_TRUE(s.WaitDone());
    DNVME_EXPECT_OK(s.status);
  }
  const auto all = test::ReadWholeFile(path);
  ASSERT_EQ(static_cast<int64_t>(all.size()), 8 * kMiB);
  EXPECT_TRUE(test::MatchesPattern(all.data(), static_cast<size_t>(4 * kMiB), 0, 5));
}

// A zero-byte write notices inline, before submit_pwrite returns, and before its completion.
TEST_F(SubmittedTest, ZeroBytesNoticeInline) {
  Open(Config(2, 4));
  const std::string path = Path("z.bin");
  ASSERT_TRUE(test::WritePatternFile(path, 0));
  FileRef file;
  DNVME_ASSERT_OK_AND_ASSIGN(file, handle_->open_file(path, FileAccess::kWrite));
  Seen seen;
  char byte = 0;
  DNVME_ASSERT_OK(handle_->submit_pwrite(&byte, 0, file, 0, seen.Done(gate_), seen.Notice(gate_)));
  std::lock_guard lock(seen.mu);
  EXPECT_EQ(seen.notices, 1);
  EXPECT_EQ(seen.dones, 1);
  EXPECT_TRUE(seen.notice_before_done);
}

// io_submit refusing outright: nothing more will reach the kernel, so the notice still comes,
// once, before the completion that reports the error.
TEST_F(SubmittedTest, RefusedSubmitStillNoticesOnceThenFails) {
  Open(Config(1, 8));
  const std::string path = Path("r.bin");
  ASSERT_TRUE(test::WritePatternFile(path, 0));
  FileRef file;
  DNVME_ASSERT_OK_AND_ASSIGN(file, handle_->open_file(path, FileAccess::kWrite));
  {
    std::lock_guard lock(gate_->mu);
    gate_->refuse_next_submits = 1;
  }
  const int64_t len = 2 * kMiB;
  AlignedBuffer buf(static_cast<size_t>(len));
  buf.Fill(0, 1);
  Seen seen;
  DNVME_ASSERT_OK(
      handle_->submit_pwrite(buf.data(), len, file, 0, seen.Done(gate_), seen.Notice(gate_)));
  ASSERT_TRUE(seen.WaitDone());
  std::lock_guard lock(seen.mu);
  EXPECT_EQ(seen.status.error_number(), EINVAL) << seen.status.ToString();
  EXPECT_EQ(seen.notices, 1);
  EXPECT_TRUE(seen.notice_before_done);
}

// Buffered I/O (O_DIRECT refused or turned off): the notice comes when every byte is in the page
// cache.
TEST_F(SubmittedTest, BufferedWriteNoticesWithEveryByteInThePageCache) {
  HandleConfig c = Config(2, 8);
  c.direct = DirectPolicy::kNever;
  Open(c);
  const std::string path = Path("b.bin");
  ASSERT_TRUE(test::WritePatternFile(path, 0));
  FileRef file;
  DNVME_ASSERT_OK_AND_ASSIGN(file, handle_->open_file(path, FileAccess::kWrite));
  const int64_t off = 77, len = 3 * kMiB + 5;
  AlignedBuffer buf(static_cast<size_t>(len));
  buf.Fill(off, 4);
  Seen seen;
  std::vector<uint8_t> at_notice;
  Submitted notice = seen.Notice(gate_);
  DNVME_ASSERT_OK(handle_->submit_pwrite(buf.data(), len, file, off, seen.Done(gate_), [&] {
    at_notice = test::ReadWholeFile(path);
    notice();
  }));
  ASSERT_TRUE(seen.WaitDone());
  DNVME_EXPECT_OK(seen.status);
  std::lock_guard lock(seen.mu);
  EXPECT_EQ(seen.notices, 1);
  EXPECT_TRUE(seen.notice_before_done);
  ASSERT_EQ(static_cast<int64_t>(at_notice.size()), off + len);
  EXPECT_TRUE(test::MatchesPattern(at_notice.data() + off, static_cast<size_t>(len), off, 4));
}

}  // namespace
}  // namespace dnvme
