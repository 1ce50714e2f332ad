// AioHandle on real files with the real libaio backend: every size/alignment shape, every
// submission mode, async bookkeeping, errors, fd-based calls, fsync and the stats counters.
#include "dnvme/handle.h"

#include <fcntl.h>
#include <grp.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "tests/engine/test_util.h"

namespace dnvme {
namespace {

using Code = Status::Code;
using test::AlignedBuffer;
using test::kKiB;
using test::kMiB;

// Small blocks and a shallow queue so even a few MiB make many requests and several batches per
// worker; a small bounce budget keeps 8-worker handles cheap.
HandleConfig SmallConfig(int intra_op, bool single_submit, bool overlap_events) {
  HandleConfig c;
  c.block_size = 64 * kKiB;
  c.queue_depth = 4;
  c.intra_op_parallelism = intra_op;
  c.single_submit = single_submit;
  c.overlap_events = overlap_events;
  c.bounce_bytes_per_worker = 1 * kMiB;
  return c;
}

std::string Describe(const HandleConfig& c) {
  return "block_size=" + std::to_string(c.block_size) +
         " queue_depth=" + std::to_string(c.queue_depth) +
         " intra_op=" + std::to_string(c.intra_op_parallelism) +
         " single_submit=" + std::to_string(c.single_submit) +
         " overlap_events=" + std::to_string(c.overlap_events);
}

// Index of the first differing byte, or -1.
int64_t FirstDifference(const uint8_t* a, const uint8_t* b, size_t n) {
  const auto* hit = std::mismatch(a, a + n, b).first;
  return hit == a + n ? -1 : hit - a;
}

class HandleTest : public test::ScratchTest {
 protected:
  void Open(const HandleConfig& config = {}) {
    Result<std::unique_ptr<AioHandle>> h = AioHandle::Create(config);
    ASSERT_TRUE(h.ok()) << Describe(config) << ": " << h.status().ToString();
    handle_ = std::move(h).value();
    ASSERT_NE(handle_, nullptr);
  }
  void TearDown() override {
    handle_.reset();  // joins the workers before the scratch directory goes away
    test::ScratchTest::TearDown();
  }

  // Writes `size` bytes of pattern at `offset` of `path` (a fresh file), checks the file through
  // plain POSIX, reads the range back through the engine and checks that too.
  void WriteThenReadBack(const std::string& path, int64_t size, size_t misalign, int64_t offset,
                         uint64_t seed) {
    SCOPED_TRACE("size=" + std::to_string(size) + " misalign=" + std::to_string(misalign) +
                 " offset=" + std::to_string(offset) + " " + Describe(handle_->config()));
    AlignedBuffer wbuf(static_cast<size_t>(size), misalign);
    wbuf.Fill(offset, seed);
    DNVME_ASSERT_OK(handle_->sync_pwrite(wbuf.data(), size, path, offset));
    EXPECT_TRUE(wbuf.GuardsIntact());
    EXPECT_TRUE(test::MatchesPattern(wbuf.data(), wbuf.size(), offset, seed))
        << "the engine modified the caller's write buffer";

    ASSERT_EQ(test::FileSize(path), offset + size);
    const std::vector<uint8_t> file = test::ReadWholeFile(path);
    ASSERT_EQ(static_cast<int64_t>(file.size()), offset + size);
    EXPECT_TRUE(test::AllBytesAre(file.data(), static_cast<size_t>(offset), 0))
        << "bytes before the written range of a new file";
    EXPECT_TRUE(test::MatchesPattern(file.data() + offset, static_cast<size_t>(size), offset, seed))
        << "file content after sync_pwrite";

    AlignedBuffer rbuf(static_cast<size_t>(size), misalign);
    rbuf.Set(0xEE);
    DNVME_ASSERT_OK(handle_->sync_pread(rbuf.data(), size, path, offset));
    EXPECT_TRUE(test::MatchesPattern(rbuf.data(), rbuf.size(), offset, seed))
        << "data read back by sync_pread";
    EXPECT_TRUE(rbuf.GuardsIntact());
  }

  std::unique_ptr<AioHandle> handle_;
};

// ---- Shapes: size x buffer misalignment x file offset
// --------------------------------------------

enum class Cfg { kDefault, kSmall };

HandleConfig ConfigFor(Cfg c) {
  return c == Cfg::kDefault ? HandleConfig{} : SmallConfig(3, false, true);
}

using ShapeParam = std::tuple<Cfg, int64_t /*size*/, size_t /*misalign*/, int64_t /*offset*/>;

class ShapeTest : public HandleTest, public ::testing::WithParamInterface<ShapeParam> {};

std::string ShapeName(const ::testing::TestParamInfo<ShapeParam>& info) {
  return std::string(std::get<0>(info.param) == Cfg::kDefault ? "default" : "small") + "_size" +
         std::to_string(std::get<1>(info.param)) + "_mis" +
         std::to_string(std::get<2>(info.param)) + "_off" + std::to_string(std::get<3>(info.param));
}

TEST_P(ShapeTest, WriteThenReadBack) {
  const auto [cfg, size, misalign, offset] = GetParam();
  ASSERT_NO_FATAL_FAILURE(Open(ConfigFor(cfg)));
  if (size > 0) {
    ASSERT_NO_FATAL_FAILURE(WriteThenReadBack(Path("f"), size, misalign, offset, 7));
    return;
  }
  // Size 0 moves nothing: an existing file stays exactly as it was, and a 0-byte read succeeds.
  const std::string path = Path("f");
  ASSERT_TRUE(test::WritePatternFile(path, 2 * kMiB, 99));
  AlignedBuffer buf(0, misalign);
  DNVME_EXPECT_OK(handle_->sync_pwrite(buf.data(), 0, path, offset));
  DNVME_EXPECT_OK(handle_->sync_pread(buf.data(), 0, path, offset));
  EXPECT_TRUE(buf.GuardsIntact());
  EXPECT_EQ(test::FileSize(path), 2 * kMiB);
  const std::vector<uint8_t> file = test::ReadWholeFile(path);
  EXPECT_TRUE(test::MatchesPattern(file.data(), file.size(), 0, 99));
}

INSTANTIATE_TEST_SUITE_P(Matrix, ShapeTest,
                         ::testing::Combine(::testing::Values(Cfg::kDefault, Cfg::kSmall),
                                            ::testing::Values<int64_t>(0, 1, 511, 4096, kMiB + 17),
                                            ::testing::Values<size_t>(0, 1, 7, 512),
                                            ::testing::Values<int64_t>(0, 1, 4095, 4096, kMiB + 3)),
                         ShapeName);

// ---- Block sizes DeepSpeed accepts: any positive size (its tests use 1K blocks, 4K I/Os)
// ------------------------------------------------------------------------------------------------

class BlockSizeTest : public HandleTest, public ::testing::WithParamInterface<int64_t> {};

TEST_P(BlockSizeTest, SmallAndOddBlockSizesMoveTheSameBytes) {
  HandleConfig c;
  c.block_size = GetParam();
  c.queue_depth = 2;
  c.intra_op_parallelism = 2;
  ASSERT_NO_FATAL_FAILURE(Open(c));
  EXPECT_EQ(handle_->get_block_size(), GetParam()) << "the getter reports what was asked for";
  for (const int64_t size : {int64_t{4096}, int64_t{3 * 4096 + 5}, kMiB + 1}) {
    for (const int64_t offset : {int64_t{0}, int64_t{1024}, int64_t{4096}}) {
      ASSERT_NO_FATAL_FAILURE(WriteThenReadBack(Path("bs"), size, 0, offset, 3));
      ASSERT_EQ(::unlink(Path("bs").c_str()), 0);
    }
  }
  // Requests are at least one alignment unit: a 4 KiB-aligned 1 MiB write with 1K blocks is
  // 256 requests (not 1024 sub-sector ones, which O_DIRECT would refuse on 4K-sector devices).
  const HandleStats before = handle_->stats();
  AlignedBuffer buf(static_cast<size_t>(kMiB), 0);
  buf.Fill(0, 5);
  DNVME_ASSERT_OK(handle_->sync_pwrite(buf.data(), kMiB, Path("count"), 0));
  const HandleStats after = handle_->stats();
  ASSERT_GT(after.bytes_direct, before.bytes_direct) << "the scratch disk takes O_DIRECT";
  EXPECT_LE(after.requests - before.requests, static_cast<uint64_t>(kMiB / 4096))
      << "block_size " << GetParam();
}

INSTANTIATE_TEST_SUITE_P(DeepSpeedSizes, BlockSizeTest,
                         ::testing::Values<int64_t>(1, 512, 1024, 1000, 6144, 4096 + 1),
                         [](const ::testing::TestParamInfo<int64_t>& info) {
                           return "bs" + std::to_string(info.param);
                         });

// ---- Submission modes: single_submit x overlap_events x intra_op_parallelism
// ---------------------

using ModeParam = std::tuple<bool /*single_submit*/, bool /*overlap_events*/, int /*intra_op*/>;

class ModeTest : public HandleTest, public ::testing::WithParamInterface<ModeParam> {};

std::string ModeName(const ::testing::TestParamInfo<ModeParam>& info) {
  return std::string(std::get<0>(info.param) ? "single" : "batch") +
         (std::get<1>(info.param) ? "_overlap" : "_lockstep") + "_intra" +
         std::to_string(std::get<2>(info.param));
}

TEST_P(ModeTest, RoundTripsAndCountsSubmissions) {
  const auto [single_submit, overlap_events, intra_op] = GetParam();
  ASSERT_NO_FATAL_FAILURE(Open(SmallConfig(intra_op, single_submit, overlap_events)));
  // Misaligned buffer and offsets, many blocks per worker.
  ASSERT_NO_FATAL_FAILURE(WriteThenReadBack(Path("a"), 3 * kMiB + 4097, 7, 4095, 1));
  // Aligned buffer and offset, unaligned tail.
  ASSERT_NO_FATAL_FAILURE(WriteThenReadBack(Path("b"), 2 * kMiB + 100, 0, 1 * kMiB, 2));
  // Smaller than one block: with 8 workers most slices are empty or sub-alignment.
  ASSERT_NO_FATAL_FAILURE(WriteThenReadBack(Path("c"), 5000, 1, 1, 3));

  const HandleStats s = handle_->stats();
  const uint64_t moved = (3 * kMiB + 4097) + (2 * kMiB + 100) + 5000;
  EXPECT_EQ(s.ops_written, 3u);
  EXPECT_EQ(s.ops_read, 3u);
  EXPECT_EQ(s.ops_failed, 0u);
  EXPECT_EQ(s.bytes_written, moved);
  EXPECT_EQ(s.bytes_read, moved);
  EXPECT_EQ(s.bytes_direct + s.bytes_bounce + s.bytes_buffered, 2 * moved)
      << "every byte is moved exactly one way: " << s.ToJson();
  EXPECT_GT(s.bytes_direct, 0u) << s.ToJson();
  EXPECT_GT(s.bytes_bounce, 0u) << s.ToJson();
  EXPECT_GT(s.bytes_buffered, 0u) << s.ToJson();
  EXPECT_GE(s.requests, (s.bytes_direct + s.bytes_bounce) / (64 * kKiB)) << s.ToJson();
  EXPECT_EQ(s.short_transfers, 0u) << s.ToJson();
  if (single_submit) {
    EXPECT_EQ(s.submit_calls, s.requests)
        << "single_submit: one io_submit per request. " << s.ToJson();
  } else if (!overlap_events) {
    EXPECT_LT(s.submit_calls, s.requests)
        << "lock-step batches of queue_depth=4 must share io_submit calls. " << s.ToJson();
  }
  EXPECT_LE(s.submit_calls, s.requests) << s.ToJson();
  // The queue-depth gauge: nothing in flight once every operation returned; at some point more
  // than nothing and never more than queue_depth per worker.
  EXPECT_EQ(s.inflight_requests, 0u) << s.ToJson();
  EXPECT_GT(s.max_inflight_requests, 0u) << s.ToJson();
  EXPECT_LE(s.max_inflight_requests,
            static_cast<uint64_t>(handle_->get_queue_depth() * handle_->get_intra_op_parallelism()))
      << s.ToJson();
}

INSTANTIATE_TEST_SUITE_P(All, ModeTest,
                         ::testing::Combine(::testing::Bool(), ::testing::Bool(),
                                            ::testing::Range(1, 9)),
                         ModeName);

// ---- Big transfers (a few combinations only)
// ------------------------------------------------------

struct BigParam {
  const char* name;
  HandleConfig config;
  size_t misalign;
  int64_t offset;
};

void PrintTo(const BigParam& p, std::ostream* os) { *os << p.name; }

class BigTest : public HandleTest, public ::testing::WithParamInterface<BigParam> {};

TEST_P(BigTest, SixtyFourMiBPlusTail) {
  const BigParam& p = GetParam();
  ASSERT_NO_FATAL_FAILURE(Open(p.config));
  ASSERT_NO_FATAL_FAILURE(
      WriteThenReadBack(Path("big"), 64 * kMiB + 4095, p.misalign, p.offset, 5));
}

HandleConfig BigConfig(int intra, bool ss, bool oe, int64_t block, int qd) {
  HandleConfig c;
  c.intra_op_parallelism = intra;
  c.single_submit = ss;
  c.overlap_events = oe;
  c.block_size = block;
  c.queue_depth = qd;
  return c;
}

INSTANTIATE_TEST_SUITE_P(
    Few, BigTest,
    ::testing::Values(
        BigParam{"defaults_aligned", HandleConfig{}, 0, 0},
        BigParam{"intra8_single_overlap_mis1", BigConfig(8, true, true, kMiB, 32), 1, kMiB + 3},
        BigParam{"intra4_batch_mis512", BigConfig(4, false, false, 256 * kKiB, 8), 512, 4096}),
    [](const ::testing::TestParamInfo<BigParam>& info) { return std::string(info.param.name); });

// ---- Writes into existing files
// ------------------------------------------------------------------

TEST_F(HandleTest, WriteIntoMiddleNeverTruncatesAndLeavesOutsideBytes) {
  ASSERT_NO_FATAL_FAILURE(Open(SmallConfig(2, false, true)));
  const std::string path = Path("existing");
  const int64_t kSize = 8 * kMiB;
  ASSERT_TRUE(test::WritePatternFile(path, kSize, 10));
  std::vector<uint8_t> model(static_cast<size_t>(kSize));
  test::FillPattern(model.data(), model.size(), 0, 10);

  const struct {
    int64_t offset;
    int64_t length;
    size_t misalign;
  } writes[] = {
      {3 * kMiB + 5, kMiB + 17, 0},  // unaligned both ends
      {1 * kMiB, 64 * kKiB, 0},      // fully aligned: pure O_DIRECT
      {2 * kMiB, 128 * kKiB, 1},     // aligned range through bounce buffers
      {4095, 1, 1},                  // one byte
      {kSize - 4096, 4096, 0},       // the last aligned block
      {kSize - 100, 100, 7},         // the last bytes
      {5 * kMiB + 1, 4094, 512},     // inside one block, touching neither edge
  };
  uint64_t seed = 20;
  for (const auto& w : writes) {
    SCOPED_TRACE("write offset=" + std::to_string(w.offset) +
                 " length=" + std::to_string(w.length));
    AlignedBuffer buf(static_cast<size_t>(w.length), w.misalign);
    buf.Fill(w.offset, seed);
    DNVME_ASSERT_OK(handle_->sync_pwrite(buf.data(), w.length, path, w.offset));
    test::FillPattern(model.data() + w.offset, static_cast<size_t>(w.length), w.offset, seed);
    ++seed;
    ASSERT_EQ(test::FileSize(path), kSize) << "a write inside the file changed its size";
    const std::vector<uint8_t> file = test::ReadWholeFile(path);
    ASSERT_EQ(file.size(), model.size());
    EXPECT_EQ(FirstDifference(file.data(), model.data(), model.size()), -1)
        << "file differs from the expected content";
  }

  // Reads of sub-ranges of the larger file (the unaligned tail of a read is followed by more file).
  const struct {
    int64_t offset;
    int64_t length;
    size_t misalign;
  } reads[] = {{4095, kMiB + 17, 1}, {0, kSize, 0}, {3 * kMiB + 1, 70000, 512}, {kSize - 1, 1, 0}};
  for (const auto& r : reads) {
    SCOPED_TRACE("read offset=" + std::to_string(r.offset) + " length=" + std::to_string(r.length));
    AlignedBuffer buf(static_cast<size_t>(r.length), r.misalign);
    buf.Set(0xEE);
    DNVME_ASSERT_OK(handle_->sync_pread(buf.data(), r.length, path, r.offset));
    EXPECT_EQ(FirstDifference(buf.data(), model.data() + r.offset, buf.size()), -1);
    EXPECT_TRUE(buf.GuardsIntact());
  }
}

TEST_F(HandleTest, WritePastEndGrowsToOffsetPlusLength) {
  ASSERT_NO_FATAL_FAILURE(Open());
  const std::string path = Path("grow");
  ASSERT_TRUE(test::WritePatternFile(path, kMiB, 1));

  // Overlaps the end: size becomes offset + length, the head of the file is untouched.
  AlignedBuffer a(kMiB, 1);
  a.Fill(512 * kKiB + 3, 2);
  DNVME_ASSERT_OK(handle_->sync_pwrite(a.data(), kMiB, path, 512 * kKiB + 3));
  ASSERT_EQ(test::FileSize(path), 512 * kKiB + 3 + kMiB);

  // Entirely past the end: a hole of zeros in between.
  AlignedBuffer b(100, 0);
  b.Fill(10 * kMiB, 3);
  DNVME_ASSERT_OK(handle_->sync_pwrite(b.data(), 100, path, 10 * kMiB));
  ASSERT_EQ(test::FileSize(path), 10 * kMiB + 100);

  const std::vector<uint8_t> file = test::ReadWholeFile(path);
  ASSERT_EQ(static_cast<int64_t>(file.size()), 10 * kMiB + 100);
  EXPECT_TRUE(test::MatchesPattern(file.data(), 512 * kKiB + 3, 0, 1));
  EXPECT_TRUE(test::MatchesPattern(file.data() + 512 * kKiB + 3, kMiB, 512 * kKiB + 3, 2));
  const int64_t hole_start = 512 * kKiB + 3 + kMiB;
  EXPECT_TRUE(test::AllBytesAre(file.data() + hole_start, 10 * kMiB - hole_start, 0, hole_start));
  EXPECT_TRUE(test::MatchesPattern(file.data() + 10 * kMiB, 100, 10 * kMiB, 3));

  // A write that ends before the end of the file leaves the size alone.
  AlignedBuffer c(4096, 0);
  c.Fill(0, 4);
  DNVME_ASSERT_OK(handle_->sync_pwrite(c.data(), 4096, path, 0));
  EXPECT_EQ(test::FileSize(path), 10 * kMiB + 100);
}

// A long random sequence of writes and overlapping reads against an in-memory model.
class RandomOpsTest : public HandleTest, public ::testing::WithParamInterface<int> {};

TEST_P(RandomOpsTest, MatchesModel) {
  const int variant = GetParam();
  ASSERT_NO_FATAL_FAILURE(
      Open(variant == 0 ? SmallConfig(3, false, true) : SmallConfig(1, true, false)));
  const std::string path = Path("random");
  std::vector<uint8_t> model;
  std::mt19937_64 rng(1234 + variant);
  const size_t misaligns[] = {0, 1, 7, 512, 4095};
  auto pick = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  for (int step = 0; step < 60; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    if (step % 3 != 2) {
      const int64_t off = pick(0, 4 * kMiB);
      const int64_t len = pick(1, 300 * kKiB);
      AlignedBuffer buf(static_cast<size_t>(len), misaligns[pick(0, 4)]);
      buf.Fill(off, 1000 + step);
      if (step % 2 == 0) {
        DNVME_ASSERT_OK(handle_->sync_pwrite(buf.data(), len, path, off));
      } else {
        DNVME_ASSERT_OK_AND_ASSIGN(OpId id, handle_->async_pwrite(buf.data(), len, path, off));
        ASSERT_EQ(handle_->wait(), 1);
        ASSERT_EQ(handle_->completed().size(), 1u);
        EXPECT_EQ(handle_->completed()[0].id, id);
        DNVME_ASSERT_OK(handle_->completed()[0].status);
      }
      if (static_cast<int64_t>(model.size()) < off + len) model.resize(off + len, 0);
      test::FillPattern(model.data() + off, static_cast<size_t>(len), off, 1000 + step);
      ASSERT_EQ(test::FileSize(path), static_cast<int64_t>(model.size()));
    } else {
      // Up to four overlapping async reads in flight at once.
      std::vector<std::unique_ptr<AlignedBuffer>> bufs;
      std::vector<std::pair<int64_t, int64_t>> ranges;
      const int n = static_cast<int>(pick(1, 4));
      for (int i = 0; i < n; ++i) {
        const int64_t off = pick(0, static_cast<int64_t>(model.size()) - 1);
        const int64_t len = pick(1, static_cast<int64_t>(model.size()) - off);
        bufs.push_back(
            std::make_unique<AlignedBuffer>(static_cast<size_t>(len), misaligns[pick(0, 4)]));
        bufs.back()->Set(0xEE);
        ranges.emplace_back(off, len);
        DNVME_ASSERT_OK_AND_ASSIGN(OpId id,
                                   handle_->async_pread(bufs.back()->data(), len, path, off));
        (void)id;
      }
      ASSERT_EQ(handle_->wait(), n);
      for (int i = 0; i < n; ++i) {
        DNVME_EXPECT_OK(handle_->completed()[i].status);
        EXPECT_EQ(FirstDifference(bufs[i]->data(), model.data() + ranges[i].first, bufs[i]->size()),
                  -1)
            << "read " << i << " offset=" << ranges[i].first << " length=" << ranges[i].second;
        EXPECT_TRUE(bufs[i]->GuardsIntact());
      }
    }
  }
  const std::vector<uint8_t> file = test::ReadWholeFile(path);
  ASSERT_EQ(file.size(), model.size());
  EXPECT_EQ(FirstDifference(file.data(), model.data(), model.size()), -1);
}

INSTANTIATE_TEST_SUITE_P(TwoConfigs, RandomOpsTest, ::testing::Values(0, 1));

// ---- Asynchronous bookkeeping
// --------------------------------------------------------------------

TEST_F(HandleTest, AsyncOpsInFlightReportInSubmissionOrder) {
  ASSERT_NO_FATAL_FAILURE(Open(SmallConfig(2, false, false)));
  const struct {
    const char* name;
    int64_t offset;
    int64_t length;
    size_t misalign;
  } ops[] = {{"a", 0, kMiB, 0}, {"b", 4095, 300000, 1}, {"c", 8 * kMiB, 4096, 0}, {"d", 17, 1, 7}};
  constexpr int kOps = 4;

  std::vector<std::unique_ptr<AlignedBuffer>> wbufs;
  std::vector<OpId> ids;
  for (int i = 0; i < kOps; ++i) {
    wbufs.push_back(std::make_unique<AlignedBuffer>(ops[i].length, ops[i].misalign));
    wbufs.back()->Fill(ops[i].offset, 100 + i);
    DNVME_ASSERT_OK_AND_ASSIGN(OpId id, handle_->async_pwrite(wbufs.back()->data(), ops[i].length,
                                                              Path(ops[i].name), ops[i].offset));
    ids.push_back(id);
  }
  EXPECT_EQ(handle_->pending(), kOps);
  std::vector<OpId> sorted = ids;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(std::unique(sorted.begin(), sorted.end()), sorted.end()) << "op ids repeat";

  ASSERT_EQ(handle_->wait(), kOps);
  EXPECT_EQ(handle_->pending(), 0);
  ASSERT_EQ(handle_->completed().size(), static_cast<size_t>(kOps));
  for (int i = 0; i < kOps; ++i) {
    SCOPED_TRACE(ops[i].name);
    const OpResult& r = handle_->completed()[i];
    EXPECT_EQ(r.id, ids[i]);
    EXPECT_EQ(r.type, OpType::kWrite);
    EXPECT_EQ(r.path, Path(ops[i].name));
    EXPECT_EQ(r.file_offset, ops[i].offset);
    EXPECT_EQ(r.length, ops[i].length);
    EXPECT_EQ(r.bytes_done, ops[i].length);
    EXPECT_EQ(r.error_offset, -1);
    DNVME_EXPECT_OK(r.status);
    ASSERT_EQ(test::FileSize(Path(ops[i].name)), ops[i].offset + ops[i].length);
    const std::vector<uint8_t> file = test::ReadWholeFile(Path(ops[i].name));
    EXPECT_TRUE(
        test::MatchesPattern(file.data() + ops[i].offset, ops[i].length, ops[i].offset, 100 + i));
  }

  std::vector<std::unique_ptr<AlignedBuffer>> rbufs;
  ids.clear();
  for (int i = 0; i < kOps; ++i) {
    rbufs.push_back(std::make_unique<AlignedBuffer>(ops[i].length, ops[i].misalign));
    rbufs.back()->Set(0xEE);
    DNVME_ASSERT_OK_AND_ASSIGN(OpId id, handle_->async_pread(rbufs.back()->data(), ops[i].length,
                                                             Path(ops[i].name), ops[i].offset));
    ids.push_back(id);
  }
  ASSERT_EQ(handle_->wait(), kOps);
  ASSERT_EQ(handle_->completed().size(), static_cast<size_t>(kOps));
  for (int i = 0; i < kOps; ++i) {
    SCOPED_TRACE(ops[i].name);
    const OpResult& r = handle_->completed()[i];
    EXPECT_EQ(r.id, ids[i]);
    EXPECT_EQ(r.type, OpType::kRead);
    EXPECT_EQ(r.path, Path(ops[i].name));
    EXPECT_EQ(r.file_offset, ops[i].offset);
    EXPECT_EQ(r.length, ops[i].length);
    EXPECT_EQ(r.bytes_done, ops[i].length);
    EXPECT_EQ(r.error_offset, -1);
    DNVME_EXPECT_OK(r.status);
    EXPECT_TRUE(test::MatchesPattern(rbufs[i]->data(), rbufs[i]->size(), ops[i].offset, 100 + i));
    EXPECT_TRUE(rbufs[i]->GuardsIntact());
  }

  // Nothing pending: 0, and the previous outcomes are gone.
  EXPECT_EQ(handle_->wait(), 0);
  EXPECT_TRUE(handle_->completed().empty());
  EXPECT_EQ(handle_->stats().ops_written, static_cast<uint64_t>(kOps));
  EXPECT_EQ(handle_->stats().ops_read, static_cast<uint64_t>(kOps));
}

TEST_F(HandleTest, WaitWithNothingPendingReturnsZero) {
  ASSERT_NO_FATAL_FAILURE(Open());
  EXPECT_EQ(handle_->pending(), 0);
  EXPECT_EQ(handle_->wait(), 0);
  EXPECT_TRUE(handle_->completed().empty());
  EXPECT_EQ(handle_->wait(), 0);
}

TEST_F(HandleTest, SyncOpsDoNotAppearInWait) {
  ASSERT_NO_FATAL_FAILURE(Open());
  AlignedBuffer a(64 * kKiB, 0);
  a.Fill(0, 1);
  AlignedBuffer b(64 * kKiB, 0);
  b.Fill(0, 2);
  DNVME_ASSERT_OK_AND_ASSIGN(OpId id, handle_->async_pwrite(a.data(), a.ssize(), Path("a")));
  DNVME_ASSERT_OK(handle_->sync_pwrite(b.data(), b.ssize(), Path("b")));
  AlignedBuffer r(64 * kKiB, 0);
  DNVME_ASSERT_OK(handle_->sync_pread(r.data(), r.ssize(), Path("b")));
  EXPECT_TRUE(test::MatchesPattern(r.data(), r.size(), 0, 2));
  // The general form with async_op=false is synchronous too.
  DNVME_ASSERT_OK(handle_->pwrite(b.data(), b.ssize(), Path("c"), false, false));
  EXPECT_EQ(handle_->pending(), 1);
  ASSERT_EQ(handle_->wait(), 1);
  ASSERT_EQ(handle_->completed().size(), 1u);
  EXPECT_EQ(handle_->completed()[0].id, id);
  EXPECT_EQ(handle_->completed()[0].path, Path("a"));
  DNVME_EXPECT_OK(handle_->completed()[0].status);
}

TEST_F(HandleTest, GeneralFormWithAsyncOpReportsThroughWait) {
  ASSERT_NO_FATAL_FAILURE(Open());
  AlignedBuffer w(kMiB + 17, 1);
  w.Fill(4095, 3);
  DNVME_ASSERT_OK(handle_->pwrite(w.data(), w.ssize(), Path("g"), false, true, 4095));
  EXPECT_EQ(handle_->pending(), 1);
  ASSERT_EQ(handle_->wait(), 1);
  ASSERT_EQ(handle_->completed().size(), 1u);
  EXPECT_EQ(handle_->completed()[0].type, OpType::kWrite);
  EXPECT_EQ(handle_->completed()[0].bytes_done, w.ssize());
  DNVME_EXPECT_OK(handle_->completed()[0].status);

  AlignedBuffer r(kMiB + 17, 1);
  DNVME_ASSERT_OK(handle_->pread(r.data(), r.ssize(), Path("g"), false, true, 4095));
  ASSERT_EQ(handle_->wait(), 1);
  ASSERT_EQ(handle_->completed().size(), 1u);
  EXPECT_EQ(handle_->completed()[0].type, OpType::kRead);
  DNVME_EXPECT_OK(handle_->completed()[0].status);
  EXPECT_TRUE(test::MatchesPattern(r.data(), r.size(), 4095, 3));
}

TEST_F(HandleTest, DestroyingHandleWaitsForPendingOps) {
  AlignedBuffer buf(8 * kMiB + 5, 1);  // declared first: must outlive the handle
  buf.Fill(0, 6);
  const std::string path = Path("pending");
  ASSERT_NO_FATAL_FAILURE(Open(SmallConfig(2, false, true)));
  DNVME_ASSERT_OK_AND_ASSIGN(OpId id, handle_->async_pwrite(buf.data(), buf.ssize(), path));
  (void)id;
  handle_.reset();
  ASSERT_EQ(test::FileSize(path), buf.ssize());
  const std::vector<uint8_t> file = test::ReadWholeFile(path);
  EXPECT_TRUE(test::MatchesPattern(file.data(), file.size(), 0, 6));
}

TEST_F(HandleTest, ForkedChildGetsAnErrorNotAHangAndLeavesTheParentsThreads) {
  // A child inherits the handle object but none of its worker threads: an operation there must
  // fail at once (it used to queue forever), and destroying the copy must not join threads that
  // do not exist there. The parent's handle keeps working.
  ASSERT_NO_FATAL_FAILURE(Open());
  AlignedBuffer buf(64 * kKiB, 0);
  buf.Fill(0, 7);
  DNVME_ASSERT_OK(handle_->sync_pwrite(buf.data(), buf.ssize(), Path("before")));
  // One operation queued before the fork and not waited for: the child's wait() must not wait
  // for it (the parent's workers finish it, in the parent).
  AlignedBuffer big(8 * kMiB, 0);
  DNVME_ASSERT_OK_AND_ASSIGN(OpId queued,
                             handle_->async_pwrite(big.data(), big.ssize(), Path("queued")));
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::alarm(20);  // a hang becomes SIGALRM, which the parent sees
    Status st = handle_->sync_pwrite(buf.data(), buf.ssize(), Path("child"));
    const bool refused = st.code() == Code::kUnsupported && st.error_number() == ECHILD &&
                         st.message().find("forked child") != std::string::npos;
    auto async = handle_->async_pread(buf.data(), buf.ssize(), Path("before"));
    const bool async_refused = !async.ok() && handle_->pending() == 1;
    const bool waited = handle_->wait() == 1 && handle_->completed()[0].id == queued &&
                        handle_->completed()[0].status.error_number() == ECHILD;
    handle_.reset();  // must return
    ::_exit(refused && async_refused && waited ? 0 : 3);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "child killed by signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the child's operations were not refused as expected";
  EXPECT_FALSE(test::FileExists(Path("child")));
  ASSERT_EQ(handle_->wait(), 1);
  DNVME_EXPECT_OK(handle_->completed()[0].status);
  EXPECT_EQ(test::FileSize(Path("queued")), big.ssize());
  DNVME_ASSERT_OK(handle_->sync_pwrite(buf.data(), buf.ssize(), Path("after")));
  const std::vector<uint8_t> file = test::ReadWholeFile(Path("after"));
  EXPECT_TRUE(test::MatchesPattern(file.data(), file.size(), 0, 7));
}

// ---- Errors
// --------------------------------------------------------------------------------------

TEST_F(HandleTest, ReadPastEofIsEndOfFileNamingPath) {
  ASSERT_NO_FATAL_FAILURE(Open());
  const std::string small = Path("small");
  ASSERT_TRUE(test::WritePatternFile(small, 1000, 1));
  AlignedBuffer buf(4096, 0);

  Status st = handle_->sync_pread(buf.data(), 4096, small, 0);
  EXPECT_EQ(st.code(), Code::kEndOfFile) << st.ToString();
  EXPECT_NE(st.message().find(small), std::string::npos) << st.message();
  EXPECT_NE(st.error_number(), 0);

  st = handle_->sync_pread(buf.data(), 10, small, 2000);  // starts past the end
  EXPECT_EQ(st.code(), Code::kEndOfFile) << st.ToString();

  st = handle_->sync_pread(buf.data(), 1, small, 1000);  // starts exactly at the end
  EXPECT_EQ(st.code(), Code::kEndOfFile) << st.ToString();

  // Exactly up to the end is fine.
  DNVME_EXPECT_OK(handle_->sync_pread(buf.data(), 1000, small, 0));
  EXPECT_TRUE(test::MatchesPattern(buf.data(), 1000, 0, 1));

  // A multi-request read whose O_DIRECT part runs into the end.
  const std::string big = Path("big");
  ASSERT_TRUE(test::WritePatternFile(big, kMiB + 100, 2));
  AlignedBuffer large(2 * kMiB, 0);
  st = handle_->sync_pread(large.data(), large.ssize(), big, 0);
  EXPECT_EQ(st.code(), Code::kEndOfFile) << st.ToString();
  EXPECT_NE(st.message().find(big), std::string::npos) << st.message();
  EXPECT_TRUE(large.GuardsIntact());

  DNVME_ASSERT_OK_AND_ASSIGN(OpId id, handle_->async_pread(large.data(), large.ssize(), big, 0));
  ASSERT_EQ(handle_->wait(), 1);
  ASSERT_EQ(handle_->completed().size(), 1u);
  const OpResult& r = handle_->completed()[0];
  EXPECT_EQ(r.id, id);
  EXPECT_EQ(r.status.code(), Code::kEndOfFile) << r.status.ToString();
  EXPECT_NE(r.status.message().find(big), std::string::npos) << r.status.message();
  EXPECT_LE(r.bytes_done, kMiB + 100);
  EXPECT_LT(r.bytes_done, r.length);

  EXPECT_GE(handle_->stats().ops_failed, 4u);

  // The handle is still usable.
  DNVME_EXPECT_OK(handle_->sync_pread(large.data(), kMiB + 100, big, 0));
  EXPECT_TRUE(test::MatchesPattern(large.data(), kMiB + 100, 0, 2));
}

TEST_F(HandleTest, MissingFileIsNotFound) {
  ASSERT_NO_FATAL_FAILURE(Open());
  const std::string missing = Path("missing");
  AlignedBuffer buf(4096, 0);

  Status st = handle_->sync_pread(buf.data(), 4096, missing);
  EXPECT_EQ(st.code(), Code::kNotFound) << st.ToString();
  EXPECT_EQ(st.error_number(), ENOENT);
  EXPECT_NE(st.message().find(missing), std::string::npos) << st.message();

  Result<OpId> id = handle_->async_pread(buf.data(), 4096, missing);
  ASSERT_FALSE(id.ok()) << "an unopenable file must fail at submission";
  EXPECT_EQ(id.status().code(), Code::kNotFound) << id.status().ToString();
  EXPECT_EQ(handle_->pending(), 0);
  EXPECT_EQ(handle_->wait(), 0);

  // Writing creates files, but not directories.
  const std::string no_dir = Path("no-such-dir/file");
  st = handle_->sync_pwrite(buf.data(), 4096, no_dir);
  EXPECT_EQ(st.code(), Code::kNotFound) << st.ToString();
  EXPECT_NE(st.message().find(no_dir), std::string::npos) << st.message();

  st = handle_->fsync(missing);
  EXPECT_EQ(st.code(), Code::kNotFound) << st.ToString();
}

TEST_F(HandleTest, InvalidArgumentsAreRejectedBeforeAnyIo) {
  ASSERT_NO_FATAL_FAILURE(Open());
  const std::string existing = Path("existing");
  ASSERT_TRUE(test::WritePatternFile(existing, 64 * kKiB, 1));
  const std::string fresh = Path("fresh");
  AlignedBuffer buf(8192, 0);

  DNVME_EXPECT_CODE(handle_->sync_pread(buf.data(), 4096, existing, -1), kInvalidArgument);
  DNVME_EXPECT_CODE(handle_->sync_pread(buf.data(), 4096, existing, -4096), kInvalidArgument);
  DNVME_EXPECT_CODE(handle_->sync_pwrite(buf.data(), 4096, fresh, -1), kInvalidArgument);
  DNVME_EXPECT_CODE(handle_->sync_pread(nullptr, 4096, existing, 0), kInvalidArgument);
  DNVME_EXPECT_CODE(handle_->sync_pwrite(nullptr, 1, fresh, 0), kInvalidArgument);
  DNVME_EXPECT_CODE(handle_->sync_pread(buf.data(), -1, existing, 0), kInvalidArgument);
  DNVME_EXPECT_CODE(handle_->sync_pwrite(buf.data(), -4096, fresh, 0), kInvalidArgument);
  DNVME_EXPECT_CODE(handle_->pwrite(nullptr, 10, fresh, false, false), kInvalidArgument);
  DNVME_EXPECT_CODE(handle_->pread(buf.data(), 10, existing, false, false, -5), kInvalidArgument);

  Result<OpId> r1 = handle_->async_pwrite(buf.data(), 4096, fresh, -1);
  ASSERT_FALSE(r1.ok());
  EXPECT_EQ(r1.status().code(), Code::kInvalidArgument) << r1.status().ToString();
  Result<OpId> r2 = handle_->async_pread(nullptr, 4096, existing, 0);
  ASSERT_FALSE(r2.ok());
  EXPECT_EQ(r2.status().code(), Code::kInvalidArgument) << r2.status().ToString();
  DNVME_EXPECT_CODE(handle_->pread(buf.data(), 10, existing, false, true, -5), kInvalidArgument);
  EXPECT_EQ(handle_->pending(), 0) << "a rejected async op was queued";
  EXPECT_EQ(handle_->wait(), 0);

  EXPECT_FALSE(test::FileExists(fresh)) << "a rejected write created the file";
  const std::vector<uint8_t> file = test::ReadWholeFile(existing);
  EXPECT_TRUE(test::MatchesPattern(file.data(), file.size(), 0, 1));
}

TEST_F(HandleTest, BadFdIsAnError) {
  ASSERT_NO_FATAL_FAILURE(Open());
  AlignedBuffer buf(4096, 0);
  Status st = handle_->sync_pread(buf.data(), 4096, -1, 0);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.error_number(), 0);
  // A descriptor number that is not open.
  st = handle_->sync_pwrite(buf.data(), 4096, 1000001, 0);
  EXPECT_FALSE(st.ok());
  st = handle_->fsync(-1);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.error_number(), 0);
}

// ---- validate=true
// ----------------------------------------------------------------------------------

TEST_F(HandleTest, ValidatePassesOnGoodData) {
  ASSERT_NO_FATAL_FAILURE(Open(SmallConfig(2, false, true)));
  const std::string path = Path("v");
  AlignedBuffer w(2 * kMiB + 33, 7);
  w.Fill(4095, 9);
  DNVME_ASSERT_OK(handle_->pwrite(w.data(), w.ssize(), path, true, false, 4095));
  EXPECT_EQ(handle_->stats().validate_checks, 1u);
  const std::vector<uint8_t> file = test::ReadWholeFile(path);
  ASSERT_EQ(static_cast<int64_t>(file.size()), 4095 + w.ssize());
  EXPECT_TRUE(test::MatchesPattern(file.data() + 4095, w.size(), 4095, 9));

  AlignedBuffer r(2 * kMiB + 33, 0);
  DNVME_ASSERT_OK(handle_->pread(r.data(), r.ssize(), path, true, false, 4095));
  EXPECT_TRUE(test::MatchesPattern(r.data(), r.size(), 4095, 9));
  EXPECT_EQ(handle_->stats().validate_checks, 2u);

  // Asynchronous with validation.
  DNVME_ASSERT_OK(handle_->pwrite(w.data(), w.ssize(), Path("v2"), true, true, 4095));
  ASSERT_EQ(handle_->wait(), 1);
  DNVME_EXPECT_OK(handle_->completed()[0].status);
  EXPECT_EQ(handle_->stats().validate_checks, 3u);
}

// ---- fd-based variants
// -------------------------------------------------------------------------------

class FdTest : public HandleTest, public ::testing::WithParamInterface<bool /*O_DIRECT*/> {};

TEST_P(FdTest, SyncAndAsyncOnCallersFd) {
  const bool direct = GetParam();
  ASSERT_NO_FATAL_FAILURE(Open(SmallConfig(2, false, false)));
  const std::string path = Path("fdfile");
  const int flags = O_RDWR | O_CREAT | O_CLOEXEC | (direct ? O_DIRECT : 0);
  const int fd = ::open(path.c_str(), flags, 0644);
  ASSERT_GE(fd, 0) << "open(" << path << "): " << std::strerror(errno);
  const int fl_before = ::fcntl(fd, F_GETFL);

  // Aligned everything.
  AlignedBuffer a(kMiB, 0);
  a.Fill(0, 1);
  DNVME_EXPECT_OK(handle_->sync_pwrite(a.data(), a.ssize(), fd, 0));
  AlignedBuffer ra(kMiB, 0);
  DNVME_EXPECT_OK(handle_->sync_pread(ra.data(), ra.ssize(), fd, 0));
  EXPECT_TRUE(test::MatchesPattern(ra.data(), ra.size(), 0, 1));

  // Misaligned buffer, unaligned offset and tail.
  AlignedBuffer b(kMiB + 17, 1);
  b.Fill(4095, 2);
  DNVME_EXPECT_OK(handle_->sync_pwrite(b.data(), b.ssize(), fd, 4095));
  AlignedBuffer rb(kMiB + 17, 7);
  DNVME_EXPECT_OK(handle_->sync_pread(rb.data(), rb.ssize(), fd, 4095));
  EXPECT_TRUE(test::MatchesPattern(rb.data(), rb.size(), 4095, 2));
  EXPECT_TRUE(rb.GuardsIntact());

  // Asynchronous: the result names the descriptor.
  AlignedBuffer c(300000, 512);
  c.Fill(3 * kMiB + 1, 3);
  DNVME_ASSERT_OK_AND_ASSIGN(OpId id, handle_->async_pwrite(c.data(), c.ssize(), fd, 3 * kMiB + 1));
  ASSERT_EQ(handle_->wait(), 1);
  ASSERT_EQ(handle_->completed().size(), 1u);
  EXPECT_EQ(handle_->completed()[0].id, id);
  EXPECT_EQ(handle_->completed()[0].path, "fd:" + std::to_string(fd));
  DNVME_EXPECT_OK(handle_->completed()[0].status);
  AlignedBuffer rc(300000, 0);
  DNVME_ASSERT_OK(handle_->pread(rc.data(), rc.ssize(), fd, true, true, 3 * kMiB + 1));
  ASSERT_EQ(handle_->wait(), 1);
  EXPECT_EQ(handle_->completed()[0].path, "fd:" + std::to_string(fd));
  DNVME_EXPECT_OK(handle_->completed()[0].status);
  EXPECT_TRUE(test::MatchesPattern(rc.data(), rc.size(), 3 * kMiB + 1, 3));

  DNVME_EXPECT_OK(handle_->fsync(fd));

  // The caller's descriptor is still open and its flags unchanged.
  EXPECT_NE(::fcntl(fd, F_GETFD), -1) << "the engine closed the caller's fd";
  EXPECT_EQ(::fcntl(fd, F_GETFL), fl_before) << "the engine changed the caller's fd flags";
  ::close(fd);

  const std::vector<uint8_t> file = test::ReadWholeFile(path);
  ASSERT_EQ(static_cast<int64_t>(file.size()), 3 * kMiB + 1 + 300000);
  EXPECT_TRUE(test::MatchesPattern(file.data(), 4095, 0, 1));
  EXPECT_TRUE(test::MatchesPattern(file.data() + 4095, kMiB + 17, 4095, 2));
  EXPECT_TRUE(test::MatchesPattern(file.data() + 3 * kMiB + 1, 300000, 3 * kMiB + 1, 3));
}

INSTANTIATE_TEST_SUITE_P(Flags, FdTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return std::string(info.param ? "O_DIRECT" : "buffered");
                         });

TEST_F(HandleTest, FsyncByPath) {
  ASSERT_NO_FATAL_FAILURE(Open());
  const std::string path = Path("durable");
  AlignedBuffer buf(kMiB, 0);
  buf.Fill(0, 1);
  DNVME_ASSERT_OK(handle_->sync_pwrite(buf.data(), buf.ssize(), path));
  DNVME_EXPECT_OK(handle_->fsync(path));
  EXPECT_EQ(test::FileSize(path), kMiB);
}

TEST_F(HandleTest, FdatasyncOnWriteStillWritesCorrectly) {
  HandleConfig c = SmallConfig(2, false, true);
  c.fdatasync_on_write = true;
  ASSERT_NO_FATAL_FAILURE(Open(c));
  ASSERT_NO_FATAL_FAILURE(WriteThenReadBack(Path("fdatasync"), kMiB + 3, 1, 17, 4));
}

// ---- Stats
// ------------------------------------------------------------------------------------------

class StatsTest : public HandleTest {
 protected:
  // Write then read `length` bytes at `offset` from a buffer misaligned by `misalign`, and return
  // the stats deltas for the write and for the read.
  void Measure(int64_t length, size_t misalign, int64_t offset, HandleStats* w, HandleStats* r) {
    const std::string path = Path("stats" + std::to_string(counter_++));
    AlignedBuffer buf(static_cast<size_t>(length), misalign);
    buf.Fill(offset, 1);
    const HandleStats s0 = handle_->stats();
    DNVME_ASSERT_OK(handle_->sync_pwrite(buf.data(), length, path, offset));
    const HandleStats s1 = handle_->stats();
    buf.Set(0);
    DNVME_ASSERT_OK(handle_->sync_pread(buf.data(), length, path, offset));
    const HandleStats s2 = handle_->stats();
    EXPECT_TRUE(test::MatchesPattern(buf.data(), buf.size(), offset, 1));
    *w = Delta(s1, s0);
    *r = Delta(s2, s1);
  }
  static HandleStats Delta(const HandleStats& b, const HandleStats& a) {
    HandleStats d;
    d.ops_read = b.ops_read - a.ops_read;
    d.ops_written = b.ops_written - a.ops_written;
    d.ops_failed = b.ops_failed - a.ops_failed;
    d.bytes_read = b.bytes_read - a.bytes_read;
    d.bytes_written = b.bytes_written - a.bytes_written;
    d.bytes_direct = b.bytes_direct - a.bytes_direct;
    d.bytes_bounce = b.bytes_bounce - a.bytes_bounce;
    d.bytes_buffered = b.bytes_buffered - a.bytes_buffered;
    d.direct_fallbacks = b.direct_fallbacks - a.direct_fallbacks;
    d.requests = b.requests - a.requests;
    d.submit_calls = b.submit_calls - a.submit_calls;
    d.submit_retries = b.submit_retries - a.submit_retries;
    d.short_transfers = b.short_transfers - a.short_transfers;
    d.validate_checks = b.validate_checks - a.validate_checks;
    return d;
  }
  int counter_ = 0;
};

TEST_F(StatsTest, AlignedBufferGoesStraightToDisk) {
  ASSERT_NO_FATAL_FAILURE(Open());
  HandleStats w, r;
  ASSERT_NO_FATAL_FAILURE(Measure(kMiB, 0, 0, &w, &r));
  for (const HandleStats* d : {&w, &r}) {
    EXPECT_EQ(d->bytes_direct, static_cast<uint64_t>(kMiB)) << d->ToJson();
    EXPECT_EQ(d->bytes_bounce, 0u) << d->ToJson();
    EXPECT_EQ(d->bytes_buffered, 0u) << d->ToJson();
    EXPECT_EQ(d->direct_fallbacks, 0u) << d->ToJson();
    EXPECT_GE(d->requests, 1u) << d->ToJson();
  }
  EXPECT_EQ(w.ops_written, 1u);
  EXPECT_EQ(w.ops_read, 0u);
  EXPECT_EQ(w.bytes_written, static_cast<uint64_t>(kMiB));
  EXPECT_EQ(r.ops_read, 1u);
  EXPECT_EQ(r.ops_written, 0u);
  EXPECT_EQ(r.bytes_read, static_cast<uint64_t>(kMiB));
}

TEST_F(StatsTest, MisalignedBufferGoesThroughBounceBuffers) {
  ASSERT_NO_FATAL_FAILURE(Open());
  HandleStats w, r;
  ASSERT_NO_FATAL_FAILURE(Measure(kMiB, 1, 0, &w, &r));
  for (const HandleStats* d : {&w, &r}) {
    EXPECT_EQ(d->bytes_bounce, static_cast<uint64_t>(kMiB)) << d->ToJson();
    EXPECT_EQ(d->bytes_direct, 0u) << d->ToJson();
    EXPECT_EQ(d->bytes_buffered, 0u) << d->ToJson();
  }
}

TEST_F(StatsTest, UnalignedTailGoesThroughPageCache) {
  ASSERT_NO_FATAL_FAILURE(Open());
  HandleStats w, r;
  ASSERT_NO_FATAL_FAILURE(Measure(4096 + 100, 0, 0, &w, &r));
  for (const HandleStats* d : {&w, &r}) {
    EXPECT_EQ(d->bytes_direct, 4096u) << d->ToJson();
    EXPECT_EQ(d->bytes_buffered, 100u) << d->ToJson();
    EXPECT_EQ(d->bytes_bounce, 0u) << d->ToJson();
  }
}

TEST_F(StatsTest, UnalignedHeadAndTailAroundAlignedMiddle) {
  ASSERT_NO_FATAL_FAILURE(Open());
  HandleStats w, r;
  // File range [100, 8292): head [100, 4096), middle [4096, 8192), tail [8192, 8292). The buffer
  // is misaligned by the same 100 bytes, so the middle lands on an aligned address.
  ASSERT_NO_FATAL_FAILURE(Measure(8192, 100, 100, &w, &r));
  for (const HandleStats* d : {&w, &r}) {
    EXPECT_EQ(d->bytes_direct, 4096u) << d->ToJson();
    EXPECT_EQ(d->bytes_buffered, 4096u) << d->ToJson();
    EXPECT_EQ(d->bytes_bounce, 0u) << d->ToJson();
  }
}

TEST_F(StatsTest, RangeInsideOneBlockIsAllBuffered) {
  ASSERT_NO_FATAL_FAILURE(Open());
  HandleStats w, r;
  ASSERT_NO_FATAL_FAILURE(Measure(10, 0, 1, &w, &r));
  for (const HandleStats* d : {&w, &r}) {
    EXPECT_EQ(d->bytes_buffered, 10u) << d->ToJson();
    EXPECT_EQ(d->bytes_direct + d->bytes_bounce, 0u) << d->ToJson();
  }
}

// sync_pread_cached: the page cache serves and keeps the read (mincore of a mapping of the file
// shows its pages resident afterwards, none before), every slice through the buffered descriptor
// even on a file open O_DIRECT, the bytes exact at any offset and length, and end of file reported
// as by sync_pread.
TEST_F(HandleTest, CachedReadGoesThroughThePageCacheOnEveryWorkerAndKeepsThePages) {
  constexpr int64_t kSize = 8 * kMiB + 300;
  const std::string path = Path("cached");
  ASSERT_TRUE(test::WritePatternFile(path, kSize, 7));
  {
    // Written through the page cache: land it and drop it, so the read must fetch it again.
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::fdatasync(fd), 0);
    ASSERT_EQ(::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), 0);
    ::close(fd);
  }
  auto resident_pages = [&] {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    void* m = ::mmap(nullptr, kSize, PROT_READ, MAP_SHARED, fd, 0);
    ::close(fd);
    if (m == MAP_FAILED) return -1;
    std::vector<unsigned char> vec(static_cast<size_t>((kSize + 4095) / 4096));
    int n = ::mincore(m, kSize, vec.data()) == 0 ? 0 : -1;
    for (unsigned char v : vec) n += (n >= 0 && (v & 1)) ? 1 : 0;
    ::munmap(m, kSize);
    return n;
  };
  ASSERT_EQ(resident_pages(), 0) << "the file should have left the page cache";
  HandleConfig c = SmallConfig(4, false, true);
  auto h = AioHandle::Create(c);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  auto f = (*h)->open_file(path, FileAccess::kRead);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  ASSERT_TRUE(f->direct()) << "the scratch file system takes O_DIRECT";
  AlignedBuffer buf(kSize + 4096);
  // An unaligned offset and length into an unaligned buffer: nothing here could go O_DIRECT.
  const int64_t off = 4096 + 17, n = kSize - off - 5;
  const HandleStats before = (*h)->stats();
  Status st = (*h)->sync_pread_cached(buf.data() + 3, n, *f, off);
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_TRUE(test::MatchesPattern(buf.data() + 3, static_cast<size_t>(n), off, 7));
  const HandleStats after = (*h)->stats();
  EXPECT_EQ(after.bytes_buffered - before.bytes_buffered, static_cast<uint64_t>(n));
  EXPECT_EQ(after.bytes_direct + after.bytes_bounce, before.bytes_direct + before.bytes_bounce);
  EXPECT_EQ(after.requests, before.requests) << "no libaio request";
  EXPECT_EQ(after.ops_read - before.ops_read, 1u);
  // The pages the read touched stay: every page of [off, off + n).
  EXPECT_GE(resident_pages(), static_cast<int>((off + n) / 4096 - off / 4096));
  st = (*h)->sync_pread_cached(buf.data(), 2 * kMiB, *f, kSize - kMiB);
  EXPECT_EQ(st.code(), Code::kEndOfFile) << st.ToString();
  EXPECT_TRUE(test::MatchesPattern(buf.data(), kMiB, kSize - kMiB, 7)) << "what exists is read";
}

TEST_F(StatsTest, SingleSubmitIsOneCallPerRequest) {
  HandleConfig c;
  c.block_size = 64 * kKiB;
  c.queue_depth = 8;
  c.single_submit = true;
  ASSERT_NO_FATAL_FAILURE(Open(c));
  HandleStats w, r;
  ASSERT_NO_FATAL_FAILURE(Measure(kMiB, 0, 0, &w, &r));
  for (const HandleStats* d : {&w, &r}) {
    EXPECT_EQ(d->short_transfers, 0u) << d->ToJson();
    EXPECT_EQ(d->requests, 16u) << "1 MiB in 64 KiB requests: " << d->ToJson();
    EXPECT_EQ(d->submit_calls, d->requests) << d->ToJson();
  }
}

TEST_F(StatsTest, BatchSubmitSharesCalls) {
  HandleConfig c;
  c.block_size = 64 * kKiB;
  c.queue_depth = 8;
  ASSERT_NO_FATAL_FAILURE(Open(c));
  HandleStats w, r;
  ASSERT_NO_FATAL_FAILURE(Measure(kMiB, 0, 0, &w, &r));
  for (const HandleStats* d : {&w, &r}) {
    EXPECT_EQ(d->requests, 16u) << d->ToJson();
    EXPECT_GE(d->submit_calls, 2u)
        << "16 requests cannot fit in one queue_depth=8 batch " << d->ToJson();
    EXPECT_LT(d->submit_calls, d->requests) << d->ToJson();
  }
}

TEST_F(StatsTest, ToJsonNamesCounters) {
  ASSERT_NO_FATAL_FAILURE(Open());
  const std::string json = handle_->stats().ToJson();
  for (const char* key : {"ops_read", "ops_written", "bytes_direct", "bytes_bounce",
                          "bytes_buffered", "direct_fallbacks", "requests", "submit_calls",
                          "submit_retries", "short_transfers", "validate_checks"}) {
    EXPECT_NE(json.find(key), std::string::npos) << key << " missing from " << json;
  }
}

TEST_F(StatsTest, NewCpuLockedBufferIsPinnedAlignedZeroedAndDirect) {
  ASSERT_NO_FATAL_FAILURE(Open());
  DNVME_ASSERT_OK_AND_ASSIGN(PinnedBuffer buf, AioHandle::new_cpu_locked_buffer(kMiB));
  ASSERT_EQ(buf.size(), static_cast<size_t>(kMiB));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(buf.data()) % ::sysconf(_SC_PAGESIZE), 0u);
  EXPECT_TRUE(test::AllBytesAre(buf.data(), buf.size(), 0));

  test::FillPattern(buf.data(), buf.size(), 0, 8);
  const HandleStats s0 = handle_->stats();
  DNVME_ASSERT_OK(handle_->sync_pwrite(buf.data(), kMiB, Path("locked")));
  EXPECT_EQ(handle_->stats().bytes_direct - s0.bytes_direct, static_cast<uint64_t>(kMiB));
  std::memset(buf.data(), 0, buf.size());
  DNVME_ASSERT_OK(handle_->sync_pread(buf.data(), kMiB, Path("locked")));
  EXPECT_TRUE(test::MatchesPattern(buf.data(), buf.size(), 0, 8));

  // Freeing it (free_cpu_locked_tensor) unpins exactly its bytes. Measured around the free only:
  // the handle may pin its own bounce buffers during I/O.
  const int64_t with_buf = PinnedBytesInUse();
  EXPECT_GE(with_buf, kMiB);
  buf = PinnedBuffer();
  EXPECT_EQ(PinnedBytesInUse(), with_buf - kMiB) << "freeing the locked buffer did not unpin it";
}

// ---- Unprivileged use under a small RLIMIT_MEMLOCK
// -------------------------------------------------

struct MemlockChildReport {
  int setup_errno = 0;
  char setup_step[32] = {};
  int create_code = -1;      // Status::Code of AioHandle::Create
  int aligned_code = -1;     // of a 1 MiB write from aligned memory
  int misaligned_code = -1;  // of a 1 MiB write from misaligned memory
  int64_t pinned_after_aligned = -1;
  char create_message[512] = {};
  char aligned_message[512] = {};
  char misaligned_message[512] = {};
};

void CopyMessage(char* dst, size_t n, const Status& st) {
  std::strncpy(dst, st.message().c_str(), n - 1);
}

// A process without CAP_IPC_LOCK and with the common default RLIMIT_MEMLOCK of 8 MiB (what a
// DeepSpeed user typically has) uses a default-config handle through an fd opened beforehand.
[[noreturn]] void RunUnprivilegedChild(int out_fd, int file_fd) {
  MemlockChildReport rep;
  auto send = [&](int code) {
    const char* p = reinterpret_cast<const char*>(&rep);
    size_t left = sizeof(rep);
    while (left > 0) {
      const ssize_t w = ::write(out_fd, p, left);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) break;
      p += w;
      left -= static_cast<size_t>(w);
    }
    ::_exit(code);
  };
  auto fail = [&](const char* step) {
    rep.setup_errno = errno == 0 ? -1 : errno;
    std::strncpy(rep.setup_step, step, sizeof(rep.setup_step) - 1);
    send(3);
  };
  const struct rlimit rl = {8 * 1024 * 1024, 8 * 1024 * 1024};
  if (::setrlimit(RLIMIT_MEMLOCK, &rl) != 0) fail("setrlimit");
  if (::geteuid() == 0) {
    if (::setgroups(0, nullptr) != 0) fail("setgroups");
    if (::setresgid(65534, 65534, 65534) != 0) fail("setresgid");
    if (::setresuid(65534, 65534, 65534) != 0) fail("setresuid");
    // Changing uid makes the process non-dumpable, which hides /proc/self/fd from it; the engine
    // may reopen a caller's fd through /proc/self/fd.
    if (::prctl(PR_SET_DUMPABLE, 1) != 0) fail("prctl");
  }
  Result<std::unique_ptr<AioHandle>> h = AioHandle::Create(HandleConfig{});
  rep.create_code = static_cast<int>(h.ok() ? Code::kOk : h.status().code());
  if (!h.ok()) {
    CopyMessage(rep.create_message, sizeof(rep.create_message), h.status());
    send(0);
  }
  AioHandle& handle = *h.value();
  {
    AlignedBuffer buf(kMiB, 0);
    buf.Fill(0, 1);
    const Status st = handle.sync_pwrite(buf.data(), kMiB, file_fd, 0);
    rep.aligned_code = static_cast<int>(st.code());
    CopyMessage(rep.aligned_message, sizeof(rep.aligned_message), st);
    rep.pinned_after_aligned = PinnedBytesInUse();
  }
  {
    AlignedBuffer buf(kMiB, 1);
    buf.Fill(kMiB, 2);
    const Status st = handle.sync_pwrite(buf.data(), kMiB, file_fd, kMiB);
    rep.misaligned_code = static_cast<int>(st.code());
    CopyMessage(rep.misaligned_message, sizeof(rep.misaligned_message), st);
  }
  send(0);
  ::_exit(0);  // not reached: send() exits
}

TEST_F(HandleTest, UnprivilegedDefaultHandleUnderEightMiBMemlock) {
  if (!test::kMlockIsReal) GTEST_SKIP() << test::kMlockSkipReason;
  const std::string path = Path("unpriv");
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_DIRECT, 0666);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  ASSERT_EQ(::fchmod(fd, 0666), 0) << std::strerror(errno);  // the child may reopen it as nobody
  int pipefd[2];
  ASSERT_EQ(::pipe(pipefd), 0);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0) << std::strerror(errno);
  if (pid == 0) {
    ::close(pipefd[0]);
    RunUnprivilegedChild(pipefd[1], fd);
  }
  ::close(pipefd[1]);
  MemlockChildReport rep;
  size_t got = 0;
  while (got < sizeof(rep)) {
    const ssize_t n = ::read(pipefd[0], reinterpret_cast<char*>(&rep) + got, sizeof(rep) - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  ::close(pipefd[0]);
  int wstatus = 0;
  ASSERT_EQ(::waitpid(pid, &wstatus, 0), pid);
  ::close(fd);
  ASSERT_TRUE(WIFEXITED(wstatus)) << "child died (signal "
                                  << (WIFSIGNALED(wstatus) ? WTERMSIG(wstatus) : 0) << ")";
  ASSERT_EQ(got, sizeof(rep)) << "no report from the child";
  ASSERT_EQ(rep.setup_errno, 0) << rep.setup_step << ": " << std::strerror(rep.setup_errno);

  ASSERT_EQ(rep.create_code, static_cast<int>(Code::kOk)) << rep.create_message;
  // Aligned memory goes straight to disk: it needs no pinned bounce memory at all, so the limit
  // must not get in its way.
  EXPECT_EQ(rep.aligned_code, static_cast<int>(Code::kOk))
      << "an aligned 1 MiB write failed under RLIMIT_MEMLOCK=8 MiB: " << rep.aligned_message;
  EXPECT_LE(rep.pinned_after_aligned, 8 * kMiB);
  // Misaligned memory needs bounce buffers: it may work within the limit, or fail saying so.
  if (rep.misaligned_code != static_cast<int>(Code::kOk)) {
    EXPECT_EQ(rep.misaligned_code, static_cast<int>(Code::kResourceExhausted))
        << rep.misaligned_message;
    EXPECT_NE(std::string(rep.misaligned_message).find("RLIMIT_MEMLOCK"), std::string::npos)
        << rep.misaligned_message;
  }
}

// ---- Creation
// ------------------------------------------------------------------------------------

TEST_F(HandleTest, GettersReturnConfig) {
  HandleConfig c;
  c.block_size = 256 * kKiB;
  c.queue_depth = 16;
  c.single_submit = true;
  c.overlap_events = true;
  c.intra_op_parallelism = 3;
  c.direct = DirectPolicy::kNever;
  ASSERT_NO_FATAL_FAILURE(Open(c));
  EXPECT_EQ(handle_->get_block_size(), 256 * kKiB);
  EXPECT_EQ(handle_->get_queue_depth(), 16);
  EXPECT_TRUE(handle_->get_single_submit());
  EXPECT_TRUE(handle_->get_overlap_events());
  EXPECT_EQ(handle_->get_intra_op_parallelism(), 3);
  EXPECT_EQ(handle_->config(), c);
}

TEST_F(HandleTest, CreateRejectsInvalidConfig) {
  const struct {
    const char* key;
    void (*mutate)(HandleConfig*);
  } cases[] = {
      {"block_size", [](HandleConfig* c) { c->block_size = int64_t{2} << 30; }},
      {"queue_depth", [](HandleConfig* c) { c->queue_depth = 0; }},
      {"intra_op_parallelism", [](HandleConfig* c) { c->intra_op_parallelism = 0; }},
  };
  for (const auto& k : cases) {
    HandleConfig c;
    k.mutate(&c);
    Result<std::unique_ptr<AioHandle>> h = AioHandle::Create(c);
    ASSERT_FALSE(h.ok()) << k.key;
    EXPECT_EQ(h.status().code(), Code::kInvalidArgument) << h.status().ToString();
    EXPECT_NE(h.status().message().find(k.key), std::string::npos) << h.status().message();
  }
}

TEST_F(HandleTest, OpTypeNames) {
  EXPECT_STRNE(OpTypeName(OpType::kRead), OpTypeName(OpType::kWrite));
  EXPECT_STRNE(OpTypeName(OpType::kRead), "");
}

}  // namespace
}  // namespace dnvme
