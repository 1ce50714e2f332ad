// WriteBehind (datapath/write_behind.h) with the FUSE transport's sources (WriteSource), without a
// mount: extents of each kind (pinned chunk, spliced pipe, adopted request buffer) land exactly;
// ordering (a synchronous write waits for earlier data, an overlapping extent for the flight before
// it); short completions are continued; EIO and ENOSPC injected through the engine's backend seam
// become the sticky error, reported once; drain and write under concurrency; destruction waits for
// flushes.
#include "fs/transport/write_source.h"
#include "datapath/write_behind.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <thread>
#include <vector>

#include "fs/transport/request_buffer.h"
#include "tests/datapath/data_test_util.h"

namespace dnvme::fs {
namespace {

using datapath::test::kKiB;
using datapath::test::kMiB;
using dnvme::test::FillPattern;
using dnvme::test::PatternByte;
using dnvme::test::ReadWholeFile;

// A WriteSource over plain memory, as libfuse hands a request the loop read(2) into a buffer
// that is not a request buffer (so it cannot be adopted).
struct MemoryPayload {
  explicit MemoryPayload(const void* data, size_t n) : bv(FUSE_BUFVEC_INIT(n)) {
    bv.buf[0].mem = const_cast<void*>(data);
  }
  fuse_bufvec bv;
};

class WriteBehindTest : public datapath::test::DataPathTest {
 protected:
  void SetUp() override {
    DataPathTest::SetUp();
    if (HasFatalFailure()) return;
    auto pool = PinnedPool::Create(kChunk, 4);
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    chunks_ = std::move(pool).value();
    shared_.chunks = chunks_.get();
    shared_.write_chunk = kChunk;
    shared_.engine = EngineSource();
    shared_.counters = &counters_;
    scratch_ = std::make_unique<PinnedBuffer>(std::move(PinnedBuffer::Allocate(4 * kMiB).value()));
  }
  void TearDown() override {
    splicers_.reset();
    DataPathTest::TearDown();
  }

  // Writes `n` pattern bytes at `off` from plain memory.
  // `errors`: the writing description's place in the file's errors (the fixture's by default).
  Status WritePattern(datapath::WriteBehind& wb, const FileRef& f, int64_t off, size_t n,
                      uint64_t seed = 0, datapath::ErrorCursor* errors = nullptr) {
    std::vector<char> data(n);
    FillPattern(data.data(), n, off, seed);
    MemoryPayload p(data.data(), n);
    WriteSource src(&p.bv, nullptr);
    return wb.Write(f, /*page_cache_writes=*/false, src, n, off, scratch_->bytes(),
                    errors != nullptr ? errors : &writer_);
  }

  // Acts as a transport's loop thread: receives `n` pattern bytes for `off` into a buffer lent
  // from `pool` (the payload page-aligned after the headers) and hands them to `wb`. `spare`, when
  // given, gets the room the buffer has after the payload.
  Status WriteReceived(datapath::WriteBehind& wb, const FileRef& f, RequestBufferPool& pool,
                       int64_t off, size_t n, size_t* spare = nullptr) {
    Receiver r;
    if (!pool.Lend(&r)) return Status::ResourceExhausted(ENOMEM, "no request buffer to lend");
    char* payload = r.buffer.data() + kRequestReadOffset + kWriteHeaderBytes;
    FillPattern(payload, n, off);
    MemoryPayload p(payload, n);
    WriteSource src(&p.bv, &pool);
    if (spare != nullptr) *spare = src.adoptable_spare();
    return wb.Write(f, /*page_cache_writes=*/false, src, n, off, scratch_->bytes(), &writer_);
  }

  // The file holds pattern `seed` over [from, to).
  void ExpectPattern(const std::string& name, int64_t from, int64_t to, uint64_t seed = 0) {
    std::vector<uint8_t> got = ReadWholeFile(Path(name));
    ASSERT_GE(static_cast<int64_t>(got.size()), to) << name;
    for (int64_t i = from; i < to; ++i) {
      ASSERT_EQ(got[static_cast<size_t>(i)], PatternByte(i, seed)) << name << " at " << i;
    }
  }

  static constexpr int64_t kChunk = 1 << 20;
  std::unique_ptr<PinnedPool> chunks_;
  std::unique_ptr<datapath::PipePool> pipes_;
  std::unique_ptr<datapath::SpliceWorkers> splicers_;
  std::unique_ptr<PinnedBuffer> scratch_;
  datapath::WriteBehindShared shared_;
  datapath::ErrorCursor writer_;  // the one writing description of most tests
};

TEST_F(WriteBehindTest, ChunkExtentsLandExactlyAndSizeShowsBeforeTheyDo) {
  FileRef f = Open("a");
  datapath::WriteBehind wb(&shared_);
  for (int64_t off = 0; off < 5 * kMiB; off += 256 * kKiB) {
    DNVME_ASSERT_OK(WritePattern(wb, f, off, 256 * kKiB));
  }
  struct stat st {};
  st.st_size = 0;
  wb.ApplyPending(&st);
  EXPECT_EQ(st.st_size, 5 * kMiB) << "accepted bytes count in the size before they land";
  DNVME_ASSERT_OK(wb.Drain(&writer_));
  EXPECT_EQ(wb.inflight(), 0);
  ExpectPattern("a", 0, 5 * kMiB);
  EXPECT_EQ(counters_.bytes_written_behind.load(), static_cast<uint64_t>(5 * kMiB));
  EXPECT_GE(counters_.write_behind_flushes.load(), 5u);
  EXPECT_EQ(counters_.bytes_written_sync.load(), 0u);
  st.st_size = 7;
  wb.ApplyPending(&st);
  EXPECT_EQ(st.st_size, 7) << "after a drain the backing file is the truth";
}

TEST_F(WriteBehindTest, UnalignedWriteGoesSynchronouslyAfterEarlierData) {
  FileRef f = Open("b");
  datapath::WriteBehind wb(&shared_);
  DNVME_ASSERT_OK(WritePattern(wb, f, 0, kMiB, /*seed=*/1));
  // Unaligned: written at once, but only after the gathered megabyte landed (else the older
  // data would overwrite it).
  DNVME_ASSERT_OK(WritePattern(wb, f, 512 * kKiB + 100, 1000, /*seed=*/2));
  EXPECT_EQ(counters_.bytes_written_sync.load(), 1000u);
  DNVME_ASSERT_OK(wb.Drain(&writer_));
  ExpectPattern("b", 0, 512 * kKiB + 100, 1);
  ExpectPattern("b", 512 * kKiB + 100, 512 * kKiB + 1100, 2);
  ExpectPattern("b", 512 * kKiB + 1100, kMiB, 1);
}

TEST_F(WriteBehindTest, OverlappingExtentWaitsForTheFlightBeforeIt) {
  FileRef f = Open("c");
  datapath::WriteBehind wb(&shared_);
  for (int round = 0; round < 4; ++round) {
    // Two full chunks in flight, then a rewrite of the first that must land last. One request of
    // the first flush reaches the disk late: were the rewrite submitted before that flush
    // completed, its bytes would be overwritten by the older ones.
    faults_.delay_offset = 4096 + round * 8192;
    DNVME_ASSERT_OK(WritePattern(wb, f, 0, 2 * kChunk, /*seed=*/10 + round));
    DNVME_ASSERT_OK(WritePattern(wb, f, 0, kChunk, /*seed=*/100 + round));
    DNVME_ASSERT_OK(wb.Drain(&writer_));
    ExpectPattern("c", 0, kChunk, 100 + round);
    ExpectPattern("c", kChunk, 2 * kChunk, 10 + round);
  }
  EXPECT_EQ(faults_.delayed.load(), 4u);
}

TEST_F(WriteBehindTest, ShortCompletionsAreContinued) {
  faults_.short_every = 2;
  FileRef f = Open("d");
  datapath::WriteBehind wb(&shared_);
  for (int64_t off = 0; off < 4 * kMiB; off += kMiB)
    DNVME_ASSERT_OK(WritePattern(wb, f, off, kMiB));
  DNVME_ASSERT_OK(wb.Drain(&writer_));
  EXPECT_GT(faults_.injected.load(), 0u);
  ExpectPattern("d", 0, 4 * kMiB);
}

class WriteBehindErrorTest : public WriteBehindTest, public ::testing::WithParamInterface<int> {};

TEST_P(WriteBehindErrorTest, FailedFlushIsStickyAndReportedOnce) {
  const int err = GetParam();
  faults_.fail_errno = err;
  faults_.fail_offset = kChunk + 4096;  // in the second extent
  FileRef f = Open("e");
  datapath::WriteBehind wb(&shared_);
  // Accepted: the second extent is flushed by the last of these writes, so its failure can
  // only surface afterwards.
  for (int64_t off = 0; off < 2 * kChunk; off += 256 * kKiB) {
    DNVME_ASSERT_OK(WritePattern(wb, f, off, 256 * kKiB));
  }
  // A reader's drain sees the error but leaves it for the writer.
  Status seen = wb.Drain(nullptr);
  EXPECT_EQ(seen.error_number(), err) << seen.ToString();
  EXPECT_EQ(wb.Drain(nullptr).error_number(), err);
  // The next write hears of it (and is not accepted)...
  Status next = WritePattern(wb, f, 2 * kChunk, 4096);
  EXPECT_EQ(next.error_number(), err) << next.ToString();
  // ...once: after that writes and drains succeed again.
  faults_.fail_errno = 0;
  DNVME_EXPECT_OK(wb.Drain(&writer_));
  DNVME_ASSERT_OK(WritePattern(wb, f, 2 * kChunk, 4096));
  DNVME_EXPECT_OK(wb.Drain(&writer_));
  EXPECT_GE(counters_.errors.load(), 1u);
  EXPECT_GE(faults_.injected.load(), 1u);
  ExpectPattern("e", 0, kChunk);  // the other extents landed
  ExpectPattern("e", 2 * kChunk, 2 * kChunk + 4096);
  // A close (take_error) reports a new failure once, and a second close finds none.
  faults_.fail_errno = err;
  faults_.fail_offset = 3 * kChunk;
  DNVME_ASSERT_OK(WritePattern(wb, f, 3 * kChunk, 256 * kKiB));
  EXPECT_EQ(wb.Drain(&writer_).error_number(), err);
  DNVME_EXPECT_OK(wb.Drain(&writer_));
}

// Linux's errseq rules (docs/security.md): each writing description hears of a flush error once,
// at its next write, close or fsync; one hearing of it does not hide it from another; a reader's
// look never takes it; a description opened after a heard error does not hear of it.
TEST_P(WriteBehindErrorTest, EachDescriptionHearsOfAnErrorOnceAndAReaderTakesNothing) {
  const int err = GetParam();
  FileRef f = Open("q");
  datapath::WriteBehind wb(&shared_);
  datapath::ErrorCursor a = wb.Sample(), b = wb.Sample();
  faults_.fail_errno = err;
  faults_.fail_offset = 0;
  DNVME_ASSERT_OK(WritePattern(wb, f, 0, 256 * kKiB, 0, &a));  // accepted; its flush will fail
  // A reader's close and a truncate look (and drain) but take nothing, however often.
  EXPECT_EQ(wb.Drain(nullptr).error_number(), err);
  EXPECT_EQ(wb.Drain(nullptr).error_number(), err);
  faults_.fail_errno = 0;
  // The writer's fsync hears of it, once...
  EXPECT_EQ(wb.Drain(&a).error_number(), err);
  DNVME_EXPECT_OK(wb.Drain(&a));
  // (A close only looks: a forked child's close-on-exec of the writer's copy must not take the
  // error from the writer's own fsync.)
  faults_.fail_errno = err;
  DNVME_ASSERT_OK(WritePattern(wb, f, 0, 256 * kKiB, 0, &a));
  EXPECT_EQ(wb.DrainAndPeek(a).error_number(), err);
  faults_.fail_errno = 0;
  EXPECT_EQ(wb.DrainAndPeek(a).error_number(), err);
  EXPECT_EQ(wb.Drain(&a).error_number(), err);
  DNVME_EXPECT_OK(wb.DrainAndPeek(a));
  // ...and another description opened before the errors, which never wrote, hears of the latest
  // at its fsync, once.
  EXPECT_EQ(wb.Drain(&b).error_number(), err);
  DNVME_EXPECT_OK(wb.Drain(&b));
  // Heard of: a reader's look is clean now, and a description opened now starts after it.
  DNVME_EXPECT_OK(wb.Drain(nullptr));
  datapath::ErrorCursor c = wb.Sample();
  DNVME_EXPECT_OK(wb.Drain(&c));
  // A new error: each of them hears of it, once, whichever asks first.
  faults_.fail_errno = err;
  DNVME_ASSERT_OK(WritePattern(wb, f, 0, 256 * kKiB, 0, &c));
  datapath::ErrorCursor d = wb.Sample();  // opened before the flush failed: hears of it too
  EXPECT_EQ(wb.Drain(&c).error_number(), err);
  EXPECT_EQ(wb.Drain(&d).error_number(), err);
  EXPECT_EQ(WritePattern(wb, f, 512 * kKiB, 4096, 0, &a).error_number(), err);
  faults_.fail_errno = 0;
  DNVME_EXPECT_OK(WritePattern(wb, f, 512 * kKiB, 4096, 0, &a));
  DNVME_EXPECT_OK(wb.Drain(&a));
  DNVME_EXPECT_OK(wb.Drain(&c));
  EXPECT_EQ(wb.Drain(&b).error_number(), err);
}

// Not ENOSPC: a flush refused for space is written again through the page cache, which keeps
// what fits (datapath/write_behind.cc, KeepWhatFits; tests/datapath/write_behind_test.cc).
INSTANTIATE_TEST_SUITE_P(Errnos, WriteBehindErrorTest, ::testing::Values(EIO, EROFS),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return std::string(i.param == EIO ? "EIO" : "EROFS");
                         });

TEST_F(WriteBehindTest, AdoptedRequestBuffersAreWrittenWithoutACopy) {
  FileRef f = Open("g");
  datapath::WriteBehind wb(&shared_);
  auto pool = RequestBufferPool::Create(kMiB + 8192, 32);
  // Act as a transport's loop thread: each request is received into the Receiver's buffer, with
  // the payload page-aligned after the headers.
  for (int64_t off = 0; off < 4 * kMiB; off += 512 * kKiB) {
    Receiver r;
    ASSERT_TRUE(pool->Lend(&r));
    const char* received = r.buffer.data();
    char* payload = r.buffer.data() + kRequestReadOffset + kWriteHeaderBytes;
    FillPattern(payload, 512 * kKiB, off);
    MemoryPayload p(payload, 512 * kKiB);
    WriteSource src(&p.bv, pool.get());
    ASSERT_TRUE(src.adoptable());
    DNVME_ASSERT_OK(wb.Write(f, false, src, 512 * kKiB, off, scratch_->bytes(), &writer_));
    // Adopted: the loop's next request lands in a replacement, the payload stays where it was.
    EXPECT_NE(r.buffer.data(), received);
  }
  DNVME_ASSERT_OK(wb.Drain(&writer_));
  EXPECT_EQ(counters_.bytes_written_adopted.load(), static_cast<uint64_t>(4 * kMiB));
  ExpectPattern("g", 0, 4 * kMiB);
}

// A writer's buffer that is not page-aligned: the kernel cuts each 1 MiB write at max_pages
// into 1 MiB - 16 bytes and 16. The long piece is adopted although it ends inside a page, and the
// short one completes that page in the adopted buffer's spare bytes: nothing is written
// synchronously and every byte goes out from the request buffers.
TEST_F(WriteBehindTest, APayloadCutInsideAPageIsCompletedByTheNextRequest) {
  FileRef f = Open("cut");
  datapath::WriteBehind wb(&shared_);
  auto pool = RequestBufferPool::Create(kMiB + 4096, 32);  // room for exactly 1 MiB of payload
  constexpr size_t kCut = kMiB - 16;
  for (int64_t off = 0; off < 4 * kMiB; off += kMiB) {
    size_t spare = 0;
    DNVME_ASSERT_OK(WriteReceived(wb, f, *pool, off, kCut, &spare));
    EXPECT_EQ(spare, 16u);
    DNVME_ASSERT_OK(WritePattern(wb, f, off + static_cast<int64_t>(kCut), 16));
  }
  DNVME_ASSERT_OK(wb.Drain(&writer_));
  EXPECT_EQ(counters_.bytes_written_adopted.load(), static_cast<uint64_t>(4 * kMiB));
  EXPECT_EQ(counters_.bytes_written_sync.load(), 0u);
  ExpectPattern("cut", 0, 4 * kMiB);
}

// The write after the cut may be longer than the rest of the page: the page is completed in the
// spare bytes, the rest goes on in a new extent (copied into a chunk), and a write that leaves
// the extent's end inside a page again still lands.
TEST_F(WriteBehindTest, AWriteLongerThanTheCutPageGoesOnInAChunk) {
  FileRef f = Open("longer");
  datapath::WriteBehind wb(&shared_);
  auto pool = RequestBufferPool::Create(kMiB + 4096, 4);
  DNVME_ASSERT_OK(WriteReceived(wb, f, *pool, 0, 300 * kKiB + 100));
  DNVME_ASSERT_OK(WritePattern(wb, f, 300 * kKiB + 100, 8192 + 7));
  DNVME_ASSERT_OK(WritePattern(wb, f, 300 * kKiB + 100 + 8192 + 7, 5000));
  DNVME_ASSERT_OK(wb.Drain(&writer_));
  EXPECT_EQ(counters_.bytes_written_adopted.load(), static_cast<uint64_t>(300 * kKiB + 4096))
      << "the adopted payload, completed to its page";
  ExpectPattern("longer", 0, 300 * kKiB + 100 + 8192 + 7 + 5000);
}

// The extent is flushed before the write that would complete its page arrives (a drain: fsync,
// a reader): the cut payload goes out with its unaligned length, and the rest, starting inside
// that page, is written synchronously after it.
TEST_F(WriteBehindTest, ACutPayloadFlushedBeforeItsPageIsCompletedStillLands) {
  FileRef f = Open("drained");
  datapath::WriteBehind wb(&shared_);
  auto pool = RequestBufferPool::Create(kMiB + 4096, 4);
  DNVME_ASSERT_OK(WriteReceived(wb, f, *pool, 0, kMiB - 16));
  DNVME_ASSERT_OK(wb.Drain(nullptr));
  DNVME_ASSERT_OK(WritePattern(wb, f, kMiB - 16, 16 + 4096));
  DNVME_ASSERT_OK(wb.Drain(&writer_));
  EXPECT_EQ(counters_.bytes_written_adopted.load(), static_cast<uint64_t>(kMiB - 16));
  EXPECT_EQ(counters_.bytes_written_sync.load(), 16u + 4096u);
  ExpectPattern("drained", 0, kMiB + 4096);
}

// As a mount runs it: 8 MiB extents of several adopted payloads, each completed in its spare
// bytes, so one extent holds buffers whose payloads were grown.
TEST_F(WriteBehindTest, CompletedPayloadsShareLargeExtents) {
  auto big = PinnedPool::Create(8 * kMiB, 2);
  ASSERT_TRUE(big.ok()) << big.status().ToString();
  std::unique_ptr<PinnedPool> chunks = std::move(big).value();
  shared_.chunks = chunks.get();
  shared_.write_chunk = 8 * kMiB;
  FileRef f = Open("large");
  datapath::WriteBehind wb(&shared_);
  auto pool = RequestBufferPool::Create(kMiB + 4096, 32);
  constexpr size_t kCut = kMiB - 64;  // torch's tensors sit 64 bytes into a page
  for (int64_t off = 0; off < 16 * kMiB; off += kMiB) {
    DNVME_ASSERT_OK(WriteReceived(wb, f, *pool, off, kCut));
    DNVME_ASSERT_OK(WritePattern(wb, f, off + static_cast<int64_t>(kCut), 64));
  }
  DNVME_ASSERT_OK(wb.Drain(&writer_));
  EXPECT_EQ(counters_.bytes_written_adopted.load(), static_cast<uint64_t>(16 * kMiB));
  EXPECT_EQ(counters_.write_behind_flushes.load(), 2u) << "two 8 MiB extents";
  ExpectPattern("large", 0, 16 * kMiB);
  shared_.chunks = chunks_.get();
}

TEST_F(WriteBehindTest, SplicedPipeExtentsLandExactly) {
  auto pipes = datapath::PipePool::Create(4 * kChunk, kChunk, 64 * kKiB);
  if (!pipes.ok()) GTEST_SKIP() << "no pipes: " << pipes.status().ToString();
  pipes_ = std::move(pipes).value();
  splicers_ = std::make_unique<datapath::SpliceWorkers>(2);
  shared_.pipes = pipes_.get();
  shared_.splicers = splicers_.get();
  FileRef f = Open("h");
  ASSERT_GE(f.direct_fd(), 0) << "the scratch filesystem must take O_DIRECT";
  datapath::WriteBehind wb(&shared_);
  // Each request arrives in a pipe, as the session loop's spliced receive leaves it.
  for (int64_t off = 0; off < 3 * kMiB; off += 256 * kKiB) {
    int fds[2];
    ASSERT_EQ(pipe2(fds, O_CLOEXEC), 0);
    ASSERT_GE(fcntl(fds[1], F_SETPIPE_SZ, 512 * 1024), 256 * 1024);
    std::vector<char> data(256 * kKiB);
    FillPattern(data.data(), data.size(), off);
    ASSERT_EQ(write(fds[1], data.data(), data.size()), static_cast<ssize_t>(data.size()));
    fuse_bufvec bv = FUSE_BUFVEC_INIT(data.size());
    bv.buf[0].flags = static_cast<fuse_buf_flags>(FUSE_BUF_IS_FD);
    bv.buf[0].fd = fds[0];
    WriteSource src(&bv, nullptr);
    ASSERT_TRUE(src.in_pipe());
    Status st =
        wb.Write(f, /*page_cache_writes=*/true, src, data.size(), off, scratch_->bytes(), &writer_);
    close(fds[0]);
    close(fds[1]);
    DNVME_ASSERT_OK(st);
  }
  DNVME_ASSERT_OK(wb.Drain(&writer_));
  EXPECT_EQ(counters_.bytes_written_spliced.load() + counters_.bytes_splice_fallback.load(),
            static_cast<uint64_t>(3 * kMiB));
  EXPECT_EQ(counters_.bytes_written_behind.load(), static_cast<uint64_t>(3 * kMiB));
  ExpectPattern("h", 0, 3 * kMiB);
}

TEST_F(WriteBehindTest, ConcurrentWritersAndDrainersLoseNothing) {
  FileRef f = Open("i");
  datapath::WriteBehind wb(&shared_);
  constexpr int kWriters = 4;
  constexpr int64_t kEach = 3 * kMiB;
  std::atomic<bool> stop{false};
  std::atomic<int> failures{0};
  std::thread drainer([&] {
    while (!stop) {
      if (!wb.Drain(nullptr).ok()) ++failures;
      struct stat st {};
      wb.ApplyPending(&st);
    }
  });
  std::vector<std::thread> writers;
  for (int w = 0; w < kWriters; ++w) {
    writers.emplace_back([&, w] {
      for (int64_t off = w * kEach; off < (w + 1) * kEach; off += 128 * kKiB) {
        if (!WritePattern(wb, f, off, 128 * kKiB).ok()) ++failures;
      }
      if (!wb.Drain(&writer_).ok()) ++failures;  // close
    });
  }
  for (auto& t : writers) t.join();
  stop = true;
  drainer.join();
  EXPECT_EQ(failures.load(), 0);
  DNVME_ASSERT_OK(wb.Drain(&writer_));
  ExpectPattern("i", 0, kWriters * kEach);
}

TEST_F(WriteBehindTest, DestructionWaitsForFlushesInFlight) {
  FileRef f = Open("j");
  {
    datapath::WriteBehind wb(&shared_);
    for (int64_t off = 0; off < 4 * kChunk; off += kChunk) {
      DNVME_ASSERT_OK(WritePattern(wb, f, off, kChunk));
    }
  }  // flushes complete into a live object (ASan would catch the opposite)
  ExpectPattern("j", 0, 4 * kChunk);
}

TEST_F(WriteBehindTest, WithoutChunksEveryWriteIsSynchronous) {
  shared_.chunks = nullptr;  // write_behind=0
  FileRef f = Open("k");
  datapath::WriteBehind wb(&shared_);
  DNVME_ASSERT_OK(WritePattern(wb, f, 0, kMiB));
  EXPECT_EQ(counters_.bytes_written_sync.load(), static_cast<uint64_t>(kMiB));
  EXPECT_EQ(wb.inflight(), 0);
  ExpectPattern("k", 0, kMiB);
}

}  // namespace
}  // namespace dnvme::fs
