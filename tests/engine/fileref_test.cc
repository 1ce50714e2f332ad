// FileRef and the thread-safe operations a FUSE daemon uses: files opened once, many threads
// submitting at once, completion callbacks, and several small operations sharing one worker's
// ring (the multi-slice scheduler).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "dnvme/handle.h"
#include "tests/engine/test_util.h"

namespace dnvme {
namespace {

using test::kKiB;
using test::kMiB;

class FileRefTest : public test::ScratchTest {};

TEST_F(FileRefTest, OpenFileReadWriteRoundTrip) {
  auto h = AioHandle::Create();
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  auto f = (*h)->open_file(Path("rw.dat"), FileAccess::kReadWrite);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_TRUE(f->valid());
  EXPECT_TRUE(f->direct());
  EXPECT_GE(f->buffered_fd(), 0);
  test::AlignedBuffer w(3 * kMiB + 5, 0), r(3 * kMiB + 5, 0);
  w.Fill(100);
  DNVME_ASSERT_OK((*h)->sync_pwrite(w.data(), w.size(), *f, 100));
  DNVME_ASSERT_OK((*h)->sync_pread(r.data(), r.size(), *f, 100));
  EXPECT_TRUE(test::MatchesPattern(r.data(), r.size(), 100));
}

TEST_F(FileRefTest, AccessModeIsEnforced) {
  auto h = AioHandle::Create();
  ASSERT_TRUE(h.ok());
  ASSERT_TRUE(test::WritePatternFile(Path("ro.dat"), 8192));
  auto ro = (*h)->open_file(Path("ro.dat"), FileAccess::kRead);
  ASSERT_TRUE(ro.ok()) << ro.status().ToString();
  test::AlignedBuffer b(4096, 0);
  Status st = (*h)->sync_pwrite(b.data(), 4096, *ro, 0);
  EXPECT_EQ(st.code(), Status::Code::kInvalidArgument) << st.ToString();
  FileRef empty;
  EXPECT_EQ((*h)->sync_pread(b.data(), 4096, empty, 0).code(), Status::Code::kInvalidArgument);
  auto missing = (*h)->open_file(Path("missing.dat"), FileAccess::kRead);
  EXPECT_EQ(missing.status().code(), Status::Code::kNotFound);
}

TEST_F(FileRefTest, AdoptFdSurvivesClosingTheCallersFd) {
  auto h = AioHandle::Create();
  ASSERT_TRUE(h.ok());
  int fd = open(Path("adopt.dat").c_str(), O_RDWR | O_CREAT | O_APPEND, 0644);
  ASSERT_GE(fd, 0);
  auto f = (*h)->adopt_fd(fd, FileAccess::kReadWrite);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  ASSERT_EQ(close(fd), 0);
  test::AlignedBuffer w(kMiB, 0);
  w.Fill(4096);
  // O_APPEND on the caller's fd must not turn a positional write into an append.
  DNVME_ASSERT_OK((*h)->sync_pwrite(w.data(), w.size(), *f, 4096));
  EXPECT_EQ(test::FileSize(Path("adopt.dat")), 4096 + kMiB);
}

// Many threads, many small async operations with callbacks, on one handle with one worker: every
// callback runs once, with the right result, and the data lands where it should.
TEST_F(FileRefTest, ConcurrentSubmitFromManyThreads) {
  HandleConfig c;
  c.queue_depth = 32;
  c.block_size = 256 * kKiB;
  auto h = AioHandle::Create(c);
  ASSERT_TRUE(h.ok());
  auto f = (*h)->open_file(Path("many.dat"), FileAccess::kReadWrite);
  ASSERT_TRUE(f.ok());
  constexpr int kThreads = 6, kOpsPerThread = 40;
  constexpr int64_t kOpSize = 512 * kKiB + 300;  // unaligned tails too
  const int64_t total = kThreads * kOpsPerThread * kOpSize;
  test::AlignedBuffer w(static_cast<size_t>(total), 0);
  w.Fill(0);
  std::mutex mu;
  std::condition_variable cv;
  int done = 0, failures = 0;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kOpsPerThread; ++i) {
        const int64_t off = (static_cast<int64_t>(t) * kOpsPerThread + i) * kOpSize;
        Status st =
            (*h)->submit_pwrite(w.data() + off, kOpSize, *f, off, [&, off](const OpResult& r) {
              std::lock_guard lock(mu);
              if (!r.status.ok() || r.bytes_done != kOpSize || r.file_offset != off) ++failures;
              ++done;
              cv.notify_all();
            });
        if (!st.ok()) {
          std::lock_guard lock(mu);
          ++failures;
          ++done;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  {
    std::unique_lock lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(120),
                            [&] { return done == kThreads * kOpsPerThread; }))
        << "only " << done << " callbacks ran";
    EXPECT_EQ(failures, 0);
  }
  test::AlignedBuffer r(static_cast<size_t>(total), 0);
  DNVME_ASSERT_OK((*h)->sync_pread(r.data(), total, *f, 0));
  EXPECT_TRUE(test::MatchesPattern(r.data(), r.size(), 0));
  const HandleStats s = (*h)->stats();
  EXPECT_EQ(s.ops_written, static_cast<uint64_t>(kThreads * kOpsPerThread));
}

// Several small async operations on one worker are in flight together: with a backend that
// records the deepest in-flight count, two 64 KiB ops of one request each must overlap.
TEST_F(FileRefTest, SmallOperationsShareTheRing) {
  HandleConfig c;
  c.queue_depth = 16;
  c.overlap_events = true;
  auto h = AioHandle::Create(c);
  ASSERT_TRUE(h.ok());
  auto f = (*h)->open_file(Path("ring.dat"), FileAccess::kReadWrite);
  ASSERT_TRUE(f.ok());
  constexpr int kOps = 64;
  test::AlignedBuffer w(kOps * 64 * kKiB, 0);
  w.Fill(0);
  for (int i = 0; i < kOps; ++i) {
    auto id =
        (*h)->async_pwrite(w.data() + i * 64 * kKiB, 64 * kKiB, Path("ring.dat"), i * 64 * kKiB);
    ASSERT_TRUE(id.ok()) << id.status().ToString();
  }
  EXPECT_EQ((*h)->wait(), kOps);
  for (const auto& r : (*h)->completed()) EXPECT_TRUE(r.status.ok()) << r.status.ToString();
  // Fewer io_submit calls than operations shows requests of different operations were batched
  // together in one call (one op = one request here).
  const HandleStats s = (*h)->stats();
  EXPECT_EQ(s.requests, static_cast<uint64_t>(kOps));
  EXPECT_LT(s.submit_calls, static_cast<uint64_t>(kOps));
  test::AlignedBuffer r(kOps * 64 * kKiB, 0);
  DNVME_ASSERT_OK((*h)->sync_pread(r.data(), r.size(), *f, 0));
  EXPECT_TRUE(test::MatchesPattern(r.data(), r.size(), 0));
}

}  // namespace
}  // namespace dnvme
