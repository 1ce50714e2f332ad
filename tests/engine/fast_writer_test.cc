// FastWriter (include/dnvme/fast_writer.h): a stream written in random-sized pieces lands byte for
// byte with the exact length; truncate on/off; striped writers (data-parallel saves) together
// write the whole file, one after the other and concurrently; ENOSPC on a full tmpfs reaches
// Write/Close and sticks; bad options and misuse are refused.
#include "dnvme/fast_writer.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "dnvme/handle.h"
#include "tests/engine/test_util.h"

namespace dnvme {
namespace {

using test::kKiB;
using test::kMiB;

class FastWriterTest : public test::ScratchTest {
 protected:
  void SetUp() override {
    test::ScratchTest::SetUp();
    HandleConfig c;
    c.block_size = 64 * kKiB;
    c.queue_depth = 8;
    c.intra_op_parallelism = 2;
    Result<std::unique_ptr<AioHandle>> h = AioHandle::Create(c);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    handle_ = std::move(h).value();
  }
  void TearDown() override {
    handle_.reset();
    mount_.reset();
    test::ScratchTest::TearDown();
  }

  static FastWriterOptions SmallOptions() {
    FastWriterOptions o;
    o.buffer_bytes = 256 * kKiB;  // small, so a few MiB cross many buffer boundaries
    o.num_buffers = 3;
    return o;
  }

  // Feeds `total` bytes of the pattern (seed) to `w` in pieces of random size (1 byte .. 3 MiB,
  // mostly small, like a serializer's headers between tensors).
  static void Feed(FastWriter* w, int64_t total, uint64_t seed, uint32_t rng_seed) {
    std::mt19937 rng(rng_seed);
    std::vector<char> piece;
    int64_t pos = 0;
    while (pos < total) {
      int64_t n;
      switch (rng() % 4) {
        case 0:
          n = 1 + rng() % 64;
          break;
        case 1:
          n = 1 + rng() % (64 * kKiB);
          break;
        case 2:
          n = 3 * kMiB - static_cast<int64_t>(rng() % 4096);
          break;
        default:
          n = 4096 * (1 + rng() % 64);
          break;
      }
      n = std::min(n, total - pos);
      piece.resize(static_cast<size_t>(n));
      test::FillPattern(piece.data(), piece.size(), pos, seed);
      Status st = w->Write(piece.data(), piece.size());
      ASSERT_TRUE(st.ok()) << "at stream offset " << pos << ": " << st.ToString();
      pos += n;
      ASSERT_EQ(w->position(), pos);
    }
  }

  std::unique_ptr<AioHandle> handle_;
  std::unique_ptr<test::Mount> mount_;
};

TEST_F(FastWriterTest, RandomPiecesLandExactly) {
  test::Watchdog wd(std::chrono::seconds(300), "FastWriter stream");
  const std::string path = Path("ckpt.bin");
  for (int64_t total : {int64_t{0}, int64_t{1}, int64_t{4095}, 256 * kKiB, 9 * kMiB + 777}) {
    SCOPED_TRACE("total " + std::to_string(total));
    auto w = FastWriter::Open(handle_.get(), path, SmallOptions());
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    ASSERT_NO_FATAL_FAILURE(Feed(w->get(), total, 7, static_cast<uint32_t>(total)));
    DNVME_ASSERT_OK((*w)->Close());
    EXPECT_EQ((*w)->bytes_stored(), total);
    EXPECT_TRUE((*w)->closed());
    ASSERT_EQ(test::FileSize(path), total);
    const std::vector<uint8_t> file = test::ReadWholeFile(path);
    EXPECT_TRUE(test::MatchesPattern(file.data(), file.size(), 0, 7));
  }
  EXPECT_GT(handle_->stats().bytes_direct, 0u) << "full buffers should go O_DIRECT";
}

// DeepSpeed's FastFileWriter writes through the caller's pinned tensor, halved for double
// buffering (a 4 KiB tensor: two 2 KiB buffers) or whole (one buffer). Both land exactly, and the
// caller's memory is what the stream went through.
TEST_F(FastWriterTest, ExternalBuffersOfAnySizeLandExactly) {
  test::Watchdog wd(std::chrono::seconds(300), "FastWriter external buffers");
  const std::string path = Path("external.bin");
  struct Case {
    size_t buffer_bytes;
    int num_buffers;
  };
  for (const Case c : {Case{2048, 2}, Case{4096, 1}, Case{1000, 3}, Case{256 * kKiB, 2}}) {
    SCOPED_TRACE(std::to_string(c.num_buffers) + " x " + std::to_string(c.buffer_bytes));
    std::vector<char> memory(c.buffer_bytes * static_cast<size_t>(c.num_buffers), 0);
    FastWriterOptions o;
    o.buffer_bytes = c.buffer_bytes;
    o.num_buffers = c.num_buffers;
    o.external = memory.data();
    const int64_t total = 3 * kMiB + 333;
    auto w = FastWriter::Open(handle_.get(), path, o);
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    ASSERT_NO_FATAL_FAILURE(Feed(w->get(), total, 11, 3));
    DNVME_ASSERT_OK((*w)->Close());
    ASSERT_EQ(test::FileSize(path), total);
    const std::vector<uint8_t> file = test::ReadWholeFile(path);
    EXPECT_TRUE(test::MatchesPattern(file.data(), file.size(), 0, 11));
    EXPECT_NE(std::count(memory.begin(), memory.end(), 0), static_cast<long>(memory.size()))
        << "the stream did not pass through the caller's buffers";
  }
  FastWriterOptions bad;
  std::vector<char> memory(4096);
  bad.external = memory.data();
  bad.buffer_bytes = 0;
  EXPECT_EQ(FastWriter::Open(handle_.get(), path, bad).status().error_number(), EINVAL);
  bad.buffer_bytes = 4096;
  bad.num_buffers = 0;
  EXPECT_EQ(FastWriter::Open(handle_.get(), path, bad).status().error_number(), EINVAL);
}

TEST_F(FastWriterTest, TruncateOrKeep) {
  const std::string path = Path("old.bin");
  {
    std::vector<char> old(3 * kMiB, 'x');
    FILE* f = std::fopen(path.c_str(), "wb");
    ASSERT_NE(f, nullptr);
    ASSERT_EQ(std::fwrite(old.data(), 1, old.size(), f), old.size());
    ASSERT_EQ(std::fclose(f), 0);
  }

  FastWriterOptions keep = SmallOptions();
  keep.truncate = false;
  auto w = FastWriter::Open(handle_.get(), path, keep);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  ASSERT_NO_FATAL_FAILURE(Feed(w->get(), kMiB + 3, 1, 1));
  DNVME_ASSERT_OK((*w)->Close());
  std::vector<uint8_t> file = test::ReadWholeFile(path);
  ASSERT_EQ(static_cast<int64_t>(file.size()), 3 * kMiB) << "truncate=false keeps the old size";
  EXPECT_TRUE(test::MatchesPattern(file.data(), kMiB + 3, 0, 1));
  EXPECT_TRUE(test::AllBytesAre(file.data() + kMiB + 3, file.size() - kMiB - 3, 'x'));

  auto t = FastWriter::Open(handle_.get(), path, SmallOptions());
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ASSERT_NO_FATAL_FAILURE(Feed(t->get(), kMiB + 3, 2, 2));
  DNVME_ASSERT_OK((*t)->Close());
  EXPECT_EQ(test::FileSize(path), kMiB + 3) << "truncate=true starts a fresh file";
  file = test::ReadWholeFile(path);
  EXPECT_TRUE(test::MatchesPattern(file.data(), file.size(), 0, 2));
}

// Three writers serialize the same stream; each stores its stripes (192 KiB: not a multiple of
// the buffer size, so stripe ends submit partial buffers). One after the other, then at once with
// a handle each (a handle is driven by one thread at a time).
TEST_F(FastWriterTest, StripedWritersTogetherWriteTheFile) {
  test::Watchdog wd(std::chrono::seconds(300), "striped FastWriters");
  const int64_t total = 5 * kMiB + 12345;
  for (bool concurrent : {false, true}) {
    SCOPED_TRACE(concurrent ? "concurrent" : "sequential");
    const std::string path = Path(concurrent ? "dp_concurrent.bin" : "dp_sequential.bin");
    std::vector<std::unique_ptr<AioHandle>> handles;
    std::vector<std::unique_ptr<FastWriter>> writers;
    for (int i = 0; i < 3; ++i) {
      AioHandle* h = handle_.get();
      if (concurrent) {
        auto created = AioHandle::Create(handle_->config());
        ASSERT_TRUE(created.ok()) << created.status().ToString();
        handles.push_back(std::move(created).value());
        h = handles.back().get();
      }
      FastWriterOptions o = SmallOptions();
      o.stripe_bytes = 192 * kKiB;
      o.stripe_count = 3;
      o.stripe_index = i;
      o.truncate = (i == 0);  // opened (and truncated) before the others write
      auto w = FastWriter::Open(h, path, o);
      ASSERT_TRUE(w.ok()) << w.status().ToString();
      writers.push_back(std::move(w).value());
    }
    std::vector<Status> results(3);
    auto run = [&](size_t i) {
      Feed(writers[i].get(), total, 3, static_cast<uint32_t>(10 + i));
      results[i] = writers[i]->Close();
    };
    if (concurrent) {
      std::vector<std::thread> threads;
      for (size_t i = 0; i < 3; ++i) threads.emplace_back(run, i);
      for (auto& t : threads) t.join();
    } else {
      for (size_t i = 0; i < 3; ++i) run(i);
    }
    int64_t stored = 0;
    for (size_t i = 0; i < 3; ++i) {
      DNVME_EXPECT_OK(results[i]);
      EXPECT_EQ(writers[i]->position(), total);
      EXPECT_GT(writers[i]->bytes_stored(), total / 4);
      EXPECT_LT(writers[i]->bytes_stored(), total / 2);
      stored += writers[i]->bytes_stored();
    }
    EXPECT_EQ(stored, total) << "every byte is stored by exactly one writer";
    writers.clear();
    ASSERT_EQ(test::FileSize(path), total);
    const std::vector<uint8_t> file = test::ReadWholeFile(path);
    EXPECT_TRUE(test::MatchesPattern(file.data(), file.size(), 0, 3));
  }
}

TEST_F(FastWriterTest, NoSpaceReachesTheWriterAndSticks) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to mount a 1 MiB tmpfs";
  mount_ = std::make_unique<test::Mount>("tmpfs", Path("mnt"), "tmpfs", "size=1m");
  if (!mount_->ok()) GTEST_SKIP() << "cannot mount tmpfs here: " << mount_->what();
  test::Watchdog wd(std::chrono::seconds(300), "FastWriter ENOSPC");
  const std::string path = mount_->path() + "/full.bin";
  auto w = FastWriter::Open(handle_.get(), path, SmallOptions());
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  std::vector<char> piece(512 * kKiB, 'a');
  Status st;
  int writes = 0;
  while (st.ok() && writes < 64) {  // 32 MiB into 1 MiB: an error must come long before
    st = (*w)->Write(piece.data(), piece.size());
    ++writes;
  }
  if (st.ok()) st = (*w)->Close();
  EXPECT_EQ(st.error_number(), ENOSPC) << st.ToString();
  EXPECT_NE(st.message().find("full.bin"), std::string::npos) << st.message();
  // Sticky: a later write and Close report it too.
  Status again = (*w)->Write(piece.data(), 1);
  if (!(*w)->closed()) {
    EXPECT_EQ(again.error_number(), ENOSPC) << again.ToString();
    again = (*w)->Close();
  }
  EXPECT_EQ(again.error_number(), ENOSPC) << again.ToString();
  EXPECT_EQ((*w)->Close().error_number(), ENOSPC);
}

// Writers borrow a pool's buffers when it has enough free, else pin their own; Close returns them.
TEST_F(FastWriterTest, BorrowsPoolBuffers) {
  auto pool = PinnedPool::Create(256 * kKiB, 3);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  FastWriterOptions o = SmallOptions();
  o.num_buffers = 2;
  o.pool = pool->get();
  auto a = FastWriter::Open(handle_.get(), Path("a.bin"), o);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ((*pool)->available(), 1u);
  auto b = FastWriter::Open(handle_.get(), Path("b.bin"), o);  // only 1 free: pins its own
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ((*pool)->available(), 1u);
  ASSERT_NO_FATAL_FAILURE(Feed(a->get(), 3 * kMiB + 1, 5, 1));
  ASSERT_NO_FATAL_FAILURE(Feed(b->get(), 2 * kMiB + 7, 6, 2));
  DNVME_ASSERT_OK((*a)->Close());
  EXPECT_EQ((*pool)->available(), 3u) << "Close returns the leases";
  DNVME_ASSERT_OK((*b)->Close());
  std::vector<uint8_t> file = test::ReadWholeFile(Path("a.bin"));
  ASSERT_EQ(static_cast<int64_t>(file.size()), 3 * kMiB + 1);
  EXPECT_TRUE(test::MatchesPattern(file.data(), file.size(), 0, 5));
  file = test::ReadWholeFile(Path("b.bin"));
  ASSERT_EQ(static_cast<int64_t>(file.size()), 2 * kMiB + 7);
  EXPECT_TRUE(test::MatchesPattern(file.data(), file.size(), 0, 6));

  o.buffer_bytes = 512 * kKiB;  // a pool of another size is a caller bug
  EXPECT_EQ(FastWriter::Open(handle_.get(), Path("c.bin"), o).status().error_number(), EINVAL);
}

TEST_F(FastWriterTest, BadOptionsAndMisuse) {
  struct Bad {
    const char* what;
    FastWriterOptions o;
  };
  std::vector<Bad> bad;
  bad.push_back({"buffer_bytes 1000", SmallOptions()});
  bad.back().o.buffer_bytes = 1000;
  bad.push_back({"num_buffers 1", SmallOptions()});
  bad.back().o.num_buffers = 1;
  bad.push_back({"stripe_bytes 5000", SmallOptions()});
  bad.back().o.stripe_bytes = 5000;
  bad.push_back({"stripe_index 2 of 2", SmallOptions()});
  bad.back().o.stripe_bytes = 4096;
  bad.back().o.stripe_count = 2;
  bad.back().o.stripe_index = 2;
  bad.push_back({"stripe_count without stripe_bytes", SmallOptions()});
  bad.back().o.stripe_count = 2;
  for (const Bad& b : bad) {
    auto w = FastWriter::Open(handle_.get(), Path("bad.bin"), b.o);
    EXPECT_FALSE(w.ok()) << b.what;
    if (!w.ok()) {
      EXPECT_EQ(w.status().error_number(), EINVAL) << b.what;
    }
  }
  EXPECT_FALSE(FastWriter::Open(nullptr, Path("x"), SmallOptions()).ok());
  auto missing = FastWriter::Open(handle_.get(), Path("no/such/dir/x"), SmallOptions());
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().error_number(), ENOENT) << missing.status().ToString();

  auto w = FastWriter::Open(handle_.get(), Path("closed.bin"), SmallOptions());
  ASSERT_TRUE(w.ok());
  DNVME_ASSERT_OK((*w)->Write("abc", 3));
  DNVME_ASSERT_OK((*w)->Close());
  DNVME_EXPECT_OK((*w)->Close());  // idempotent
  EXPECT_EQ((*w)->Write("d", 1).error_number(), EINVAL);
  EXPECT_EQ(test::FileSize(Path("closed.bin")), 3);

  // Abandoned without Close: the destructor waits for in-flight writes (no crash, no leak).
  {
    auto a = FastWriter::Open(handle_.get(), Path("abandoned.bin"), SmallOptions());
    ASSERT_TRUE(a.ok());
    std::vector<char> piece(kMiB, 'z');
    DNVME_ASSERT_OK((*a)->Write(piece.data(), piece.size()));
  }
}

}  // namespace
}  // namespace dnvme
