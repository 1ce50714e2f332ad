// WriteBehind (datapath/write_behind.h) with plain memory (MemorySource), as `dnvme run` uses it:
// no mount, no FUSE. Acknowledged-when-submitted writes (Ack::kSubmitted) survive the writer's
// _exit right after they returned (and gathered ones, the control, do not); extents that start
// anywhere in a page stay asynchronous and exact; overlapping rewrites land in order; the flush
// hooks see every flush start and finish once; Close refuses later writes; errors injected through
// the engine's backend seam (EIO, EROFS) reach the writer once, and a direct request refused for
// space (ENOSPC, EDQUOT) is written again through the page cache; concurrent writers and drains
// lose nothing. The mount's sources (adopted request buffers, spliced pipes) are tested with the
// transport in tests/fs/transport/write_source_test.cc.
#include "datapath/write_behind.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "datapath/extent_source.h"
#include "tests/datapath/data_test_util.h"

namespace dnvme::datapath {
namespace {

using dnvme::test::FillPattern;
using dnvme::test::MatchesPattern;
using dnvme::test::ReadWholeFile;
using test::kKiB;
using test::kMiB;

constexpr int64_t kChunk = 2 * kMiB;

class MemoryWriteBehindTest : public test::DataPathTest {
 protected:
  void SetUp() override {
    DataPathTest::SetUp();
    if (HasFatalFailure()) return;
    // As `dnvme run` sizes them: one page more than an extent, for an unaligned start.
    auto pool = PinnedPool::Create(kChunk + 4096, 4);
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    chunks_ = std::move(pool).value();
    shared_.chunks = chunks_.get();
    shared_.write_chunk = kChunk;
    shared_.ack = Ack::kSubmitted;
    shared_.unaligned_extents = true;
    shared_.engine = EngineSource();
    shared_.counters = &counters_;
  }

  // Writes `n` pattern bytes (seeded) at `off` from plain memory.
  Status Write(WriteBehind& wb, const FileRef& f, int64_t off, size_t n, uint64_t seed = 0,
               ErrorCursor* errors = nullptr) {
    std::vector<char> data(n);
    FillPattern(data.data(), n, off, seed);
    MemorySource src(data.data(), n);
    return wb.Write(f, /*page_cache_writes=*/false, src, n, off, /*scratch=*/nullptr,
                    errors != nullptr ? errors : &errors_);
  }
  // Checks [off, off + n) of the file against the pattern written with `seed`.
  void ExpectPattern(const std::string& name, int64_t off, int64_t n, uint64_t seed = 0) {
    std::vector<uint8_t> got = ReadWholeFile(Path(name));
    ASSERT_GE(static_cast<int64_t>(got.size()), off + n) << name;
    EXPECT_TRUE(MatchesPattern(got.data() + off, static_cast<size_t>(n), off, seed)) << name;
  }

  std::unique_ptr<PinnedPool> chunks_;
  WriteBehindShared shared_;
  ErrorCursor errors_;
};

// In a child process: a fresh engine and pool (the fixture's threads do not survive fork), a
// WriteBehind acknowledging with `ack`, writes of `total` bytes in odd pieces, then _exit without
// a drain -- the program that returns from write() and exits at once. Returns the child's status.
int WriteAndExit(const std::string& path, Ack ack, int64_t total) {
  const pid_t pid = fork();
  if (pid < 0) return -1;
  if (pid > 0) {
    int status = 0;
    while (waitpid(pid, &status, 0) < 0) {
      if (errno != EINTR) return -1;
    }
    return status;
  }
  HandleConfig c;
  c.overlap_events = true;
  auto engine = AioHandle::Create(c);
  auto pool = PinnedPool::Create(kChunk + 4096, 4);
  if (!engine.ok() || !pool.ok()) _exit(2);
  std::shared_ptr<AioHandle> h(std::move(engine).value());
  auto file = h->open_file(path, FileAccess::kReadWrite);
  if (!file.ok()) _exit(3);
  Counters counters;
  WriteBehindShared shared;
  shared.chunks = pool.value().get();
  shared.write_chunk = kChunk;
  shared.ack = ack;
  shared.unaligned_extents = true;
  shared.engine = [h] { return h; };
  shared.counters = &counters;
  auto* wb = new WriteBehind(&shared);  // never destroyed: the process ends under it
  ErrorCursor errors;
  std::vector<char> data(static_cast<size_t>(total));
  FillPattern(data.data(), data.size(), 0);
  for (int64_t off = 0; off < total;) {
    const int64_t n = std::min<int64_t>(total - off, 700 * kKiB + 3);
    MemorySource src(data.data() + off, static_cast<size_t>(n));
    if (!wb->Write(file.value(), false, src, static_cast<size_t>(n), off, nullptr, &errors).ok()) {
      _exit(4);
    }
    off += n;
  }
  _exit(0);
}

TEST_F(MemoryWriteBehindTest, ASubmittedWriteSurvivesTheWritersExit) {
  // Writes that returned are in the kernel (the engine's Submitted notice): the kernel finishes
  // them after the process is gone, as it does a write(2) that returned on ext4.
  ASSERT_TRUE(Open("survives").valid());
  const int64_t total = 5 * kMiB + 1234;
  const int status = WriteAndExit(Path("survives"), Ack::kSubmitted, total);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  ExpectPattern("survives", 0, total);
}

TEST_F(MemoryWriteBehindTest, AGatheredWriteDiesWithTheWriter) {
  // The control for the test above: acknowledged when gathered (right for the daemon, which
  // outlives its writers), the last extent is still in the dead process's memory.
  ASSERT_TRUE(Open("lost").valid());
  const int64_t total = 5 * kMiB + 1234;
  const int status = WriteAndExit(Path("lost"), Ack::kGathered, total);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  std::vector<uint8_t> got = ReadWholeFile(Path("lost"));
  const bool all_there =
      static_cast<int64_t>(got.size()) == total && MatchesPattern(got.data(), got.size(), 0);
  EXPECT_FALSE(all_there) << "the pending extent should have died with the process";
}

TEST_F(MemoryWriteBehindTest, UnalignedWritesGoBehindAndLandExactly) {
  FileRef f = Open("unaligned");
  WriteBehind wb(&shared_);
  // A zip writer's pattern: small headers, then data, at offsets that are not page-aligned, and
  // writes larger than an extent.
  int64_t off = 0;
  const size_t sizes[] = {30, 4096, 100, 3 * kMiB + 17, 1, 65536, 5000, 2 * kMiB};
  for (size_t n : sizes) {
    ASSERT_TRUE(Write(wb, f, off, n).ok()) << "at " << off;
    off += static_cast<int64_t>(n);
  }
  ASSERT_TRUE(wb.Drain(&errors_).ok());
  EXPECT_EQ(counters_.bytes_written_sync.load(), 0u) << "an unaligned start is not synchronous";
  EXPECT_EQ(counters_.bytes_written_behind.load(), static_cast<uint64_t>(off));
  ExpectPattern("unaligned", 0, off);
}

TEST_F(MemoryWriteBehindTest, AnOverlappingRewriteLandsAfterTheWriteItOverlaps) {
  FileRef f = Open("overlap");
  WriteBehind wb(&shared_);
  // The first write's request reaches the kernel late; a rewrite of part of it (not continuing
  // it) must not overtake it.
  faults_.delay_offset = 64 * kKiB;
  faults_.delay_ms = 200;
  ASSERT_TRUE(Write(wb, f, 0, kMiB, /*seed=*/0).ok());
  ASSERT_TRUE(Write(wb, f, 64 * kKiB + 10, 100 * kKiB, /*seed=*/7).ok());
  ASSERT_TRUE(wb.Drain(&errors_).ok());
  ExpectPattern("overlap", 0, 64 * kKiB + 10, 0);
  ExpectPattern("overlap", 64 * kKiB + 10, 100 * kKiB, 7);
  ExpectPattern("overlap", 164 * kKiB + 10, kMiB - 164 * kKiB - 10, 0);
}

TEST_F(MemoryWriteBehindTest, ARewriteOfAPendingExtentWaitsForItsFlush) {
  // The mount's acknowledgement: the first write stays pending in its extent; the rewrite does
  // not continue it, so it flushes that extent -- which is in flight only from then on -- and
  // must wait for it before its own bytes may fly (found by the randomized model test).
  shared_.ack = Ack::kGathered;
  shared_.unaligned_extents = false;
  FileRef f = Open("pending");
  WriteBehind wb(&shared_);
  faults_.delay_offset = 512 * kKiB;
  faults_.delay_ms = 200;
  ASSERT_TRUE(Write(wb, f, 0, kMiB, /*seed=*/0).ok());
  EXPECT_EQ(wb.inflight(), 0) << "a part-filled extent waits for more";
  ASSERT_TRUE(Write(wb, f, 512 * kKiB, 64 * kKiB, /*seed=*/7).ok());
  ASSERT_TRUE(wb.Drain(&errors_).ok());
  EXPECT_EQ(faults_.delayed.load(), 1u);
  ExpectPattern("pending", 0, 512 * kKiB, 0);
  ExpectPattern("pending", 512 * kKiB, 64 * kKiB, 7);
  ExpectPattern("pending", 576 * kKiB, kMiB - 576 * kKiB, 0);
}

TEST_F(MemoryWriteBehindTest, AWriteAcceptedDuringADrainStillCountsInTheSize) {
  // The mount: one handle's release drains the file while another handle's WRITE, on another
  // loop thread, is accepted into a new extent. The drain, woken by the last flush, must not
  // forget that extent's end: a GETATTR in between answered the disk's smaller size, the kernel
  // believed it, and the file looked shorter than the write that returned (found by the
  // randomized model test, DNVME_SEED=1610646617; the extent itself still landed at close).
  shared_.ack = Ack::kGathered;
  FileRef f = Open("drain-race");
  WriteBehind wb(&shared_);
  faults_.delay_offset = 0;
  faults_.delay_ms = 400;
  ASSERT_TRUE(Write(wb, f, 0, kChunk).ok());  // a whole extent: flushed at once, held in flight
  ASSERT_EQ(wb.inflight(), 1);
  std::thread drain([&] { EXPECT_TRUE(wb.Drain(nullptr).ok()); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the drain waits for the flight
  const int64_t tail = 2 * kChunk;
  ASSERT_TRUE(Write(wb, f, tail, 64 * kKiB, /*seed=*/3).ok());  // pending, past the disk's end
  drain.join();
  EXPECT_EQ(faults_.delayed.load(), 1u);
  struct stat st {};
  ASSERT_EQ(fstat(f.buffered_fd(), &st), 0);
  EXPECT_EQ(st.st_size, kChunk) << "the tail is still pending: not on disk yet";
  wb.ApplyPending(&st);
  EXPECT_EQ(st.st_size, tail + 64 * kKiB) << "the pending tail counts in the size";
  ASSERT_TRUE(wb.Drain(&errors_).ok());
  ExpectPattern("drain-race", tail, 64 * kKiB, 3);
}

TEST_F(MemoryWriteBehindTest, HooksSeeEveryFlushStartAndFinishOnce) {
  FileRef f = Open("hooks");
  std::atomic<int> started{0}, finished{0}, most{0};
  FlushHooks hooks;
  hooks.started = [&] {
    const int now = started.fetch_add(1) + 1 - finished.load();
    if (now > most.load()) most = now;
  };
  hooks.finished = [&] { finished.fetch_add(1); };
  WriteBehind wb(&shared_, hooks);
  for (int i = 0; i < 8; ++i) ASSERT_TRUE(Write(wb, f, i * 768 * kKiB, 768 * kKiB).ok());
  ASSERT_TRUE(wb.Drain(&errors_).ok());
  EXPECT_GE(started.load(), 8) << "each acknowledged write is flushed by itself";
  EXPECT_EQ(started.load(), finished.load());
  EXPECT_GE(most.load(), 1);
  EXPECT_EQ(wb.inflight(), 0);
}

TEST_F(MemoryWriteBehindTest, CloseDrainsAndRefusesLaterWrites) {
  FileRef f = Open("closed");
  int finished = 0;
  FlushHooks hooks;
  hooks.finished = [&] { ++finished; };  // under the WriteBehind's mutex
  WriteBehind wb(&shared_, hooks);
  ASSERT_TRUE(Write(wb, f, 0, kMiB).ok());
  wb.Close();
  EXPECT_EQ(wb.inflight(), 0);
  EXPECT_GE(finished, 1);
  Status st = Write(wb, f, kMiB, 4096);
  EXPECT_EQ(st.error_number(), EBADF) << st.ToString();
  ExpectPattern("closed", 0, kMiB);
}

class MemoryWriteBehindErrorTest : public MemoryWriteBehindTest,
                                   public ::testing::WithParamInterface<int> {};

TEST_P(MemoryWriteBehindErrorTest, AFailedFlushReachesTheWriterOnce) {
  FileRef f = Open("failing");
  faults_.fail_errno = GetParam();
  faults_.fail_offset = kMiB + 4096;
  WriteBehind wb(&shared_);
  ASSERT_TRUE(Write(wb, f, 0, kMiB).ok());
  // The failing write may hear of its own error at once (a completion before the latch) or at
  // the next call; either way exactly once.
  int heard = 0;
  for (Status st : {Write(wb, f, kMiB, kMiB), wb.Drain(&errors_), wb.Drain(&errors_)}) {
    if (!st.ok()) {
      EXPECT_EQ(st.error_number(), GetParam()) << st.ToString();
      ++heard;
    }
  }
  EXPECT_EQ(heard, 1);
  // Another description opened before the failure hears of it too, once.
  EXPECT_GT(faults_.injected.load(), 0u);
  EXPECT_GE(counters_.errors.load(), 1u);
}

// ENOSPC and EDQUOT are written again through the page cache first (below); EROFS stands for the
// errors that are not.
INSTANTIATE_TEST_SUITE_P(Errnos, MemoryWriteBehindErrorTest, ::testing::Values(EIO, EROFS),
                         [](const auto& info) { return info.param == EIO ? "EIO" : "EROFS"; });

class MemoryWriteBehindNoSpaceTest : public MemoryWriteBehindTest,
                                     public ::testing::WithParamInterface<int> {};

TEST_P(MemoryWriteBehindNoSpaceTest, ADirectRequestRefusedForSpaceIsWrittenThroughThePageCache) {
  // An O_DIRECT request fits whole or not at all; the page cache keeps what fits. Here the
  // injected refusal is the direct request's alone (the scratch file system has room), so every
  // byte lands and nobody hears an error. Main reported ENOSPC and left the range from the failed
  // request on unwritten (a 1 MiB request into 680 KiB free left the file empty: issue 45).
  FileRef f = Open("nospace");
  faults_.fail_errno = GetParam();
  faults_.fail_offset = kMiB + 4096;
  WriteBehind wb(&shared_);
  ErrorCursor reader = wb.Sample();
  const int64_t total = 2 * kMiB + 777;
  ASSERT_TRUE(Write(wb, f, 0, static_cast<size_t>(total)).ok());
  Status st = wb.Drain(&errors_);
  EXPECT_TRUE(st.ok()) << st.ToString();
  st = wb.Drain(&reader);
  EXPECT_TRUE(st.ok()) << st.ToString();
  EXPECT_GT(faults_.injected.load(), 0u);
  std::vector<uint8_t> got = ReadWholeFile(Path("nospace"));
  EXPECT_EQ(static_cast<int64_t>(got.size()), total);
  ExpectPattern("nospace", 0, total);
}

INSTANTIATE_TEST_SUITE_P(Errnos, MemoryWriteBehindNoSpaceTest, ::testing::Values(ENOSPC, EDQUOT),
                         [](const auto& info) {
                           return info.param == ENOSPC ? "ENOSPC" : "EDQUOT";
                         });

TEST_F(MemoryWriteBehindTest, ConcurrentWritersAndDrainsLoseNothing) {
  FileRef f = Open("concurrent");
  WriteBehind wb(&shared_);
  constexpr int kThreads = 4;
  constexpr int64_t kEach = 6 * kMiB;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      ErrorCursor mine;
      // Each thread its own region, in odd-sized pieces starting off the page.
      int64_t off = t * kEach + 123;
      const int64_t end = (t + 1) * kEach;
      while (off < end) {
        const auto n = static_cast<size_t>(std::min<int64_t>(end - off, 300 * kKiB + 7));
        if (!Write(wb, f, off, n, 0, &mine).ok()) failures.fetch_add(1);
        off += static_cast<int64_t>(n);
        if (off % 3 == 0 && !wb.Drain(&mine).ok()) failures.fetch_add(1);
      }
    });
  }
  for (auto& th : threads) th.join();
  ASSERT_TRUE(wb.Drain(&errors_).ok());
  EXPECT_EQ(failures.load(), 0);
  for (int t = 0; t < kThreads; ++t) ExpectPattern("concurrent", t * kEach + 123, kEach - 123);
}

}  // namespace
}  // namespace dnvme::datapath
