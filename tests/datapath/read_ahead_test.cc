// ReadAhead (datapath/read_ahead.h) without a mount: a sequential reader is served from the
// window with no copy (the reply points into the chunks), random reads fetch nothing, a failed
// fetch ends what the window serves (the caller's own read then reports it), a small pool gives
// a partial window, Invalidate drops it, Quiesce waits for fetches, and concurrent readers of
// one file and of several share the pool without losing or mixing data. The window starts small
// and doubles as the reader consumes it; the first read of a read-only open starts a sequence
// anywhere; a seek gives the window's chunks back.
#include "datapath/read_ahead.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <thread>
#include <vector>

#include "tests/datapath/data_test_util.h"

namespace dnvme::datapath {
namespace {

using dnvme::test::PatternByte;
using dnvme::test::WritePatternFile;
using test::kKiB;
using test::kMiB;

constexpr int64_t kFile = 24 * kMiB;
constexpr int64_t kChunk = kMiB;

class ReadAheadTest : public test::DataPathTest {
 protected:
  void SetUp() override {
    DataPathTest::SetUp();
    if (HasFatalFailure()) return;
    MakePool(16);
    shared_.window = 4 * kMiB;
    shared_.engine = EngineSource();
    shared_.counters = &counters_;
  }
  void MakePool(size_t n) {
    auto pool = PinnedPool::Create(kChunk, n);
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    chunks_ = std::move(pool).value();
    shared_.chunks = chunks_.get();
  }
  FileRef PatternFile(const std::string& name, uint64_t seed = 0) {
    EXPECT_TRUE(WritePatternFile(Path(name), kFile, seed));
    return Open(name);
  }
  // The bytes of `reply` are pattern `seed` from `off` on; returns how many there are.
  static int64_t CheckReply(const ReadReply& reply, int64_t off, uint64_t seed = 0) {
    int64_t at = off;
    for (const iovec& v : reply.iov) {
      const auto* p = static_cast<const uint8_t*>(v.iov_base);
      for (size_t i = 0; i < v.iov_len; ++i, ++at) {
        if (p[i] != PatternByte(at, seed)) {
          ADD_FAILURE() << "wrong byte at " << at;
          return -1;
        }
      }
    }
    return at - off;
  }

  // The window's read of `n` bytes at `off` (ReadAhead::Read, reply mode).
  static int64_t Serve(ReadAhead& ra, const FileRef& f, int64_t off, int64_t n, int64_t size,
                       ReadReply* reply, uint64_t generation, bool starts_sequence = false) {
    WindowRead w;
    w.off = off;
    w.n = n;
    w.file_size = size;
    w.generation = generation;
    w.starts_sequence = starts_sequence;
    return ra.Read(f, w, reply);
  }

  std::unique_ptr<PinnedPool> chunks_;
  ReadAheadShared shared_;
};

TEST_F(ReadAheadTest, SequentialReaderIsServedFromTheWindowWithoutCopies) {
  FileRef f = PatternFile("seq");
  ReadAhead ra(&shared_);
  int64_t served = 0;
  for (int64_t off = 0; off < 8 * kMiB; off += 512 * kKiB) {
    ReadReply r;
    const int64_t n = Serve(ra, f, off, 512 * kKiB, kFile, &r, ra.Generation());
    EXPECT_EQ(CheckReply(r, off), n);
    EXPECT_EQ(r.pins.size(), r.iov.size()) << "every piece keeps its chunk alive";
    served += n;
  }
  EXPECT_EQ(served, 8 * kMiB) << "a read at offset 0 starts a sequence: every read hits";
  EXPECT_GT(counters_.read_ahead_fetches.load(), 0u);
  EXPECT_EQ(counters_.bytes_read_ahead_hit.load(), static_cast<uint64_t>(served));
  ra.Quiesce();
  EXPECT_EQ(ra.inflight(), 0);
}

TEST_F(ReadAheadTest, RandomReadsFetchNothing) {
  FileRef f = PatternFile("rand");
  ReadAhead ra(&shared_);
  for (int64_t off : {5 * kMiB, kMiB, 9 * kMiB + 4096, 3 * kMiB}) {
    ReadReply r;
    EXPECT_EQ(Serve(ra, f, off, 64 * kKiB, kFile, &r, ra.Generation()), 0);
  }
  EXPECT_EQ(counters_.read_ahead_fetches.load(), 0u);
}

TEST_F(ReadAheadTest, AFirstReadElsewhereIsNotYetASequence) {
  FileRef f = PatternFile("later");
  ReadAhead ra(&shared_);
  ReadReply r0, r1;
  EXPECT_EQ(Serve(ra, f, kMiB, 256 * kKiB, kFile, &r0, ra.Generation()), 0);
  EXPECT_EQ(counters_.read_ahead_fetches.load(), 0u);
  const int64_t n = Serve(ra, f, kMiB + 256 * kKiB, 256 * kKiB, kFile, &r1, ra.Generation());
  EXPECT_EQ(n, 256 * kKiB) << "the second read in order is";
  EXPECT_EQ(CheckReply(r1, kMiB + 256 * kKiB), n);
  ra.Quiesce();
}

TEST_F(ReadAheadTest, ASmallSkipContinuesTheSequenceALargerOneEndsIt) {
  shared_.max_skip = 64 * kKiB;  // as `dnvme run` allows a zip reader's header skips
  FileRef f = PatternFile("skip");
  ReadAhead ra(&shared_);
  ReadReply r0, r1, r2, r3;
  EXPECT_EQ(Serve(ra, f, 0, 256 * kKiB, kFile, &r0, ra.Generation()), 256 * kKiB);
  // 30 bytes skipped (a zip local header read some other way): still in sequence.
  const int64_t at = 256 * kKiB + 30;
  EXPECT_EQ(Serve(ra, f, at, 100 * kKiB, kFile, &r1, ra.Generation()), 100 * kKiB);
  EXPECT_EQ(CheckReply(r1, at), 100 * kKiB);
  // A skip past max_skip is a seek: not served, the window is not extended.
  const uint64_t fetched = counters_.read_ahead_fetches.load();
  const int64_t far = at + 100 * kKiB + 64 * kKiB + 4096;
  EXPECT_EQ(Serve(ra, f, far + 5 * kMiB, 4096, kFile, &r2, ra.Generation()), 0);
  EXPECT_EQ(counters_.read_ahead_fetches.load(), fetched);
  // The next read continues from there: a sequence again.
  EXPECT_GT(Serve(ra, f, far + 5 * kMiB + 4096, 4096, kFile, &r3, ra.Generation()), 0);
  ra.Quiesce();
}

TEST_F(ReadAheadTest, ReadsOfMaxReadOrMoreAreNotReadAhead) {
  shared_.max_read = 2 * kMiB;
  FileRef f = PatternFile("big");
  ReadAhead ra(&shared_);
  ReadReply r0, r1, r2;
  EXPECT_GT(Serve(ra, f, 0, kMiB, kFile, &r0, ra.Generation()), 0);
  const uint64_t fetched = counters_.read_ahead_fetches.load();
  EXPECT_EQ(Serve(ra, f, kMiB, 2 * kMiB, kFile, &r1, ra.Generation()), 0)
      << "one large read is its own request";
  EXPECT_EQ(counters_.read_ahead_fetches.load(), fetched);
  EXPECT_EQ(Serve(ra, f, 3 * kMiB, kMiB, kFile, &r2, ra.Generation()), 0)
      << "and it ended the sequence";
  ra.Quiesce();
}

TEST_F(ReadAheadTest, AReaderThatDrainedBeforeAChangeFetchesNothing) {
  // A reader samples the generation, drains the write-behind; then a write is gathered (or a
  // truncate, a fallocate made) and the window invalidated after it. What the reader would fetch
  // now could predate the change, and a later reader would be served it from the window.
  FileRef f = PatternFile("gen");
  ReadAhead ra(&shared_);
  const uint64_t before = ra.Generation();
  ra.Invalidate();  // the change, made after the reader drained
  ReadReply r0;
  EXPECT_EQ(Serve(ra, f, 0, 256 * kKiB, kFile, &r0, before), 0);
  EXPECT_EQ(counters_.read_ahead_fetches.load(), 0u) << "nothing fetched for a stale reader";
  // A reader that sampled after the change reads ahead as usual.
  ReadReply r1;
  EXPECT_EQ(Serve(ra, f, 0, 256 * kKiB, kFile, &r1, ra.Generation()), 256 * kKiB);
  EXPECT_EQ(CheckReply(r1, 0), 256 * kKiB);
  ra.Quiesce();
}

TEST_F(ReadAheadTest, ReadsAtTheEndOfTheFileStopThere) {
  FileRef f = PatternFile("end");
  ReadAhead ra(&shared_);
  ReadReply r0, r1;
  Serve(ra, f, kFile - 3 * kMiB, kMiB, kFile, &r0, ra.Generation());
  const int64_t n = Serve(ra, f, kFile - 2 * kMiB, 2 * kMiB, kFile, &r1, ra.Generation());
  EXPECT_EQ(CheckReply(r1, kFile - 2 * kMiB), n);
  EXPECT_EQ(n, 2 * kMiB);
  ra.Quiesce();
}

TEST_F(ReadAheadTest, FailedFetchEndsWhatTheWindowServes) {
  FileRef f = PatternFile("fail");
  faults_.fail_errno = EIO;
  faults_.fail_writes = false;
  // The sequence is found at 1.5M (the second read in order): chunks from there, of which the
  // second, [2.5M, 3.5M), fails.
  faults_.fail_offset = 2 * kMiB + 512 * kKiB + 100;
  ReadAhead ra(&shared_);
  ReadReply r0;
  Serve(ra, f, kMiB, 512 * kKiB, kFile, &r0, ra.Generation());
  ReadReply r1;
  const int64_t n = Serve(ra, f, kMiB + 512 * kKiB, 2 * kMiB, kFile, &r1, ra.Generation());
  EXPECT_EQ(n, kMiB) << "served up to the failed chunk, not past it";
  EXPECT_EQ(CheckReply(r1, kMiB + 512 * kKiB), n);
  EXPECT_GT(faults_.injected.load(), 0u);
  ra.Quiesce();
}

TEST_F(ReadAheadTest, ASmallPoolGivesAPartialWindowAndInvalidateDropsIt) {
  MakePool(2);  // two chunks for a four-chunk window
  FileRef f = PatternFile("small");
  ReadAhead ra(&shared_);
  ReadReply r0, r1;
  Serve(ra, f, 0, 256 * kKiB, kFile, &r0, ra.Generation());
  const int64_t n = Serve(ra, f, 256 * kKiB, 4 * kMiB, kFile, &r1, ra.Generation());
  EXPECT_EQ(n, 2 * kMiB - 256 * kKiB) << "the two chunks the pool had";
  EXPECT_EQ(CheckReply(r1, 256 * kKiB), n);
  // The replies were sent: their chunks go back once the window lets them go.
  r0 = ReadReply();
  r1 = ReadReply();
  ra.Invalidate();
  ReadReply r2;
  EXPECT_EQ(Serve(ra, f, 2 * kMiB, kMiB, kFile, &r2, ra.Generation()), 0)
      << "a dropped window is not a sequence";
  ra.Quiesce();
  // A fetch's callback returns its chunk as it finishes, on the engine's thread: wait (bounded).
  for (int i = 0; i < 500 && chunks_->available() != 2; ++i) usleep(10000);
  EXPECT_EQ(chunks_->available(), 2u) << "every chunk back in the pool";
}

TEST_F(ReadAheadTest, ConcurrentReadersShareThePool) {
  constexpr int kReaders = 4;
  std::vector<FileRef> files;
  for (int i = 0; i < kReaders; ++i) files.push_back(PatternFile("c" + std::to_string(i), i));
  std::vector<std::unique_ptr<ReadAhead>> windows;
  for (int i = 0; i < kReaders; ++i) windows.push_back(std::make_unique<ReadAhead>(&shared_));
  std::atomic<int> bad{0};
  std::vector<std::thread> readers;
  for (int i = 0; i < kReaders; ++i) {
    readers.emplace_back([&, i] {
      for (int64_t off = 0; off < kFile; off += 256 * kKiB) {
        ReadReply r;
        const int64_t n =
            Serve(*windows[i], files[i], off, 256 * kKiB, kFile, &r, windows[i]->Generation());
        if (CheckReply(r, off, i) != n) ++bad;
        if (off % (4 * kMiB) == 0) windows[i]->Invalidate();  // a write came by
      }
    });
  }
  for (auto& t : readers) t.join();
  EXPECT_EQ(bad.load(), 0);
  for (auto& w : windows) w->Quiesce();
  for (int i = 0; i < 500 && chunks_->available() != chunks_->count(); ++i) usleep(10000);
  EXPECT_EQ(chunks_->available(), chunks_->count());
}

TEST_F(ReadAheadTest, AWindowStartsSmallAndGrowsWithTheReader) {
  shared_.initial_window = kChunk;
  shared_.window = 8 * kMiB;
  FileRef f = PatternFile("grow");
  ReadAhead ra(&shared_);
  ReadReply r0;
  EXPECT_EQ(Serve(ra, f, 0, 4 * kKiB, kFile, &r0, ra.Generation()), 4 * kKiB);
  EXPECT_EQ(ra.window(), kChunk) << "a sequence starts with initial_window";
  EXPECT_EQ(counters_.read_ahead_fetches.load(), 1u) << "a header read fetches one chunk";
  // Read on in 256 KiB pieces: the window doubles each time the reader consumed a whole window.
  std::vector<int64_t> seen{ra.window()};
  int64_t served = 4 * kKiB, asked = 4 * kKiB;
  for (int64_t off = 4 * kKiB; off < 20 * kMiB; off += 256 * kKiB) {
    ReadReply r;
    const int64_t n = Serve(ra, f, off, 256 * kKiB, kFile, &r, ra.Generation());
    EXPECT_EQ(CheckReply(r, off), n);
    served += n;
    asked += 256 * kKiB;
    if (ra.window() != seen.back()) seen.push_back(ra.window());
  }
  EXPECT_EQ(seen, (std::vector<int64_t>{kChunk, 2 * kMiB, 4 * kMiB, 8 * kMiB}))
      << "1, 2, 4 then the 8 MiB most, never more";
  EXPECT_EQ(served, asked) << "every read served from the window";
  ra.Quiesce();
  EXPECT_EQ(ra.window(), 0);
}

TEST_F(ReadAheadTest, TheFirstReadOfAReadOnlyOpenStartsASequenceAnywhere) {
  shared_.initial_window = kChunk;
  FileRef f = PatternFile("ro");
  ReadAhead ra(&shared_);
  ReadReply r0, r1;
  // A loader that seeks past a header first: its first read, 5 MiB + 100 in.
  const int64_t at = 5 * kMiB + 100;
  EXPECT_EQ(Serve(ra, f, at, 64 * kKiB, kFile, &r0, ra.Generation(), /*starts_sequence=*/true),
            64 * kKiB);
  EXPECT_EQ(CheckReply(r0, at), 64 * kKiB);
  EXPECT_EQ(ra.window(), kChunk);
  EXPECT_EQ(Serve(ra, f, at + 64 * kKiB, 64 * kKiB, kFile, &r1, ra.Generation()), 64 * kKiB)
      << "and the next read continues it";
  ra.Quiesce();
}

TEST_F(ReadAheadTest, ASeekDropsTheWindowAndANewSequenceFetchesAgain) {
  MakePool(4);  // exactly one 4 MiB window
  FileRef f = PatternFile("seek");
  ReadAhead ra(&shared_);
  {
    ReadReply r;
    EXPECT_EQ(Serve(ra, f, 0, 64 * kKiB, kFile, &r, ra.Generation()), 64 * kKiB);
  }
  EXPECT_EQ(counters_.read_ahead_fetches.load(), 4u);
  {
    ReadReply r;
    EXPECT_EQ(Serve(ra, f, 20 * kMiB, 64 * kKiB, kFile, &r, ra.Generation()), 0) << "a seek";
  }
  EXPECT_EQ(ra.window(), 0);
  // The dropped chunks go back to the pool as their fetches complete.
  for (int i = 0; i < 500 && chunks_->available() != 4; ++i) usleep(10000);
  ASSERT_EQ(chunks_->available(), 4u) << "a seek holds no chunks";
  ReadReply r;
  EXPECT_EQ(Serve(ra, f, 0, kMiB, kFile, &r, ra.Generation()), kMiB) << "offset 0 starts again";
  EXPECT_EQ(CheckReply(r, 0), kMiB);
  ra.Quiesce();
}

TEST_F(ReadAheadTest, TwoInterleavedReadersOfOneFileKeepTheWindow) {
  // The mount's window is the inode's: two readers of one file (or FUSE requests handed over
  // out of order) interleave. A read inside the fetched window continues the sequence.
  FileRef f = PatternFile("two");
  ReadAhead ra(&shared_);
  int64_t served = 0, asked = 0;
  for (int64_t off = 0; off < 3 * kMiB; off += 256 * kKiB) {
    for (int64_t at : {off, off + 128 * kKiB}) {  // reader B trails reader A by half a read
      ReadReply r;
      const int64_t n = Serve(ra, f, at, 128 * kKiB, kFile, &r, ra.Generation());
      EXPECT_EQ(CheckReply(r, at), n);
      served += n;
      asked += 128 * kKiB;
    }
    ReadReply back;  // and a read behind both, still inside the window
    const int64_t n = Serve(ra, f, off, 64 * kKiB, kFile, &back, ra.Generation());
    EXPECT_EQ(CheckReply(back, off), n);
    served += n;
    asked += 64 * kKiB;
  }
  EXPECT_EQ(served, asked) << "every read served from the window";
  ra.Quiesce();
}

TEST_F(ReadAheadTest, OffWithoutAPool) {
  shared_.chunks = nullptr;  // read_ahead=0
  FileRef f = PatternFile("off");
  ReadAhead ra(&shared_);
  ReadReply r0, r1;
  Serve(ra, f, 0, kMiB, kFile, &r0, ra.Generation());
  EXPECT_EQ(Serve(ra, f, kMiB, kMiB, kFile, &r1, ra.Generation()), 0);
}

}  // namespace
}  // namespace dnvme::datapath
