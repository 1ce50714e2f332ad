// The mount's READ path (fs/core/read_path.h) on a started Mount, an Inode and a FileHandle over a
// scratch file, without a FUSE session: a buffered reader is read ahead and answered without a
// copy, an O_DIRECT reader is not read ahead, a read stops at the end of the file and sees the
// bytes the write-behind still holds; ReadAsync answers from the engine's completion (the bytes,
// the end of the file, a file that shrank meanwhile) and declines without a reply buffer.
#include "fs/core/read_path.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "datapath/extent_source.h"
#include "fs/core/inode.h"
#include "fs/core/mount.h"
#include "tests/engine/test_util.h"

namespace dnvme::fs {
namespace {

using dnvme::test::kMiB;
using dnvme::test::MatchesPattern;
using dnvme::test::WritePatternFile;

constexpr int64_t kFile = 8 * kMiB;

class ReadPathTest : public dnvme::test::ScratchTest {
 protected:
  void StartMount(bool async_reply, datapath::ReadCache read_cache = datapath::ReadCache::kOff) {
    MountOptions o;
    o.read_cache = read_cache;
    o.engine.block_size = 256 << 10;
    o.engine.queue_depth = 8;
    o.write_behind = 8 * kMiB;
    o.write_chunk = kMiB;
    o.read_ahead = 4 * kMiB;
    o.async_reply = async_reply;
    mount_ = std::make_unique<Mount>(o);
    Status st = mount_->Start();
    ASSERT_TRUE(st.ok()) << st.ToString();
    inode_ = std::make_unique<Inode>(mount_->data_shared());
    inode_->type = S_IFREG;
    auto pool = PinnedPool::Create(kMiB, 1);
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    scratch_pool_ = std::move(pool).value();
    scratch_ = scratch_pool_->TryAcquire();
    ASSERT_TRUE(scratch_);
  }
  void TearDown() override {
    handles_.clear();
    inode_.reset();
    scratch_ = PinnedPool::Lease();
    if (mount_) mount_->Stop();
    mount_.reset();
    ScratchTest::TearDown();
  }
  // An open of `name` as the FUSE ops make one (fs/fuse/ops_file.cc MakeHandle).
  FileHandle& OpenHandle(const std::string& name, bool writable, bool client_direct) {
    auto fh = std::make_unique<FileHandle>();
    fh->fd.Reset(open(Path(name).c_str(), writable ? O_RDWR : O_RDONLY));
    EXPECT_TRUE(fh->fd.valid()) << name;
    auto ref = mount_->engine()->adopt_fd(fh->fd.get(),
                                          writable ? FileAccess::kReadWrite : FileAccess::kRead);
    EXPECT_TRUE(ref.ok()) << ref.status().ToString();
    if (ref.ok()) fh->file = std::move(ref).value();
    fh->inode = inode_.get();
    fh->writable = writable;
    fh->client_direct = client_direct;
    inode_->data.Open(&fh->open, !writable);
    handles_.push_back(std::move(fh));
    return *handles_.back();
  }
  // The bytes `reply` holds, in order.
  static std::vector<char> Bytes(const datapath::ReadReply& reply) {
    std::vector<char> out(static_cast<size_t>(reply.bytes()));
    reply.CopyTo(out.data());
    return out;
  }

  std::unique_ptr<Mount> mount_;
  std::unique_ptr<Inode> inode_;
  std::vector<std::unique_ptr<FileHandle>> handles_;
  std::unique_ptr<PinnedPool> scratch_pool_;
  PinnedPool::Lease scratch_;
};

TEST_F(ReadPathTest, ABufferedReaderIsReadAheadAndAnsweredWithoutACopy) {
  StartMount(false);
  ASSERT_TRUE(WritePatternFile(Path("seq"), kFile));
  FileHandle& fh = OpenHandle("seq", /*writable=*/false, /*client_direct=*/false);
  int64_t pinned_pieces = 0;
  for (int64_t off = 0; off < 4 * kMiB; off += 256 << 10) {
    datapath::ReadReply reply;
    Result<int64_t> n = Read(*mount_, fh, scratch_.data(), 256 << 10, off, &reply, 0);
    ASSERT_TRUE(n.ok()) << n.status().ToString();
    ASSERT_EQ(*n, 256 << 10);
    std::vector<char> got = Bytes(reply);
    ASSERT_TRUE(MatchesPattern(got.data(), got.size(), off));
    pinned_pieces += static_cast<int64_t>(reply.pins.size());
  }
  EXPECT_GT(mount_->counters().read_ahead_fetches.load(), 0u);
  EXPECT_GT(pinned_pieces, 0) << "replies point into the read-ahead chunks";
  EXPECT_EQ(mount_->counters().read_ops.load(), 16u);
  EXPECT_TRUE(inode_->data.Release().ok());
}

// The mount's default read policy on a file the page cache holds (it was just written through
// it): every READ is read from the page cache into the scratch buffer, nothing from the device;
// an engine open (fs/fuse/passthrough.h) of the same file, evicted, reads from the device and
// leaves the cache alone.
TEST_F(ReadPathTest, TheDefaultPolicyServesACachedFileFromThePageCache) {
  StartMount(false, MountOptions().read_cache);
  ASSERT_TRUE(WritePatternFile(Path("warm"), kFile));
  FileHandle& fh = OpenHandle("warm", /*writable=*/false, /*client_direct=*/false);
  for (int64_t off = 0; off < 2 * kMiB; off += kMiB) {
    datapath::ReadReply reply;
    Result<int64_t> n = Read(*mount_, fh, scratch_.data(), kMiB, off, &reply, 0);
    ASSERT_TRUE(n.ok()) << n.status().ToString();
    ASSERT_EQ(reply.iov.size(), 1u);
    EXPECT_EQ(reply.iov[0].iov_base, scratch_.data());
    EXPECT_TRUE(MatchesPattern(scratch_.data(), kMiB, off));
  }
  EXPECT_EQ(mount_->counters().bytes_read_cached.load(), static_cast<uint64_t>(2 * kMiB));
  EXPECT_EQ(mount_->counters().bytes_read_engine.load(), 0u);
  EXPECT_EQ(mount_->counters().read_ahead_fetches.load(), 0u);
  ASSERT_EQ(fdatasync(fh.fd.get()), 0);
  ASSERT_EQ(posix_fadvise(fh.fd.get(), 0, 0, POSIX_FADV_DONTNEED), 0);
  FileHandle& engine_open = OpenHandle("warm", false, false);
  engine_open.engine_reads = true;
  datapath::ReadReply reply;
  Result<int64_t> n = Read(*mount_, engine_open, scratch_.data(), kMiB, 4 * kMiB, &reply, 0);
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  std::vector<char> got = Bytes(reply);
  EXPECT_TRUE(MatchesPattern(got.data(), got.size(), 4 * kMiB));
  EXPECT_EQ(mount_->counters().bytes_read_cached.load(), static_cast<uint64_t>(2 * kMiB));
  EXPECT_GT(
      mount_->counters().bytes_read_engine.load() + mount_->counters().bytes_read_ahead_hit.load(),
      0u);
  EXPECT_TRUE(inode_->data.Release().ok());
}

TEST_F(ReadPathTest, AnODirectReaderIsNotReadAhead) {
  StartMount(false);
  ASSERT_TRUE(WritePatternFile(Path("direct"), kFile));
  FileHandle& fh = OpenHandle("direct", false, /*client_direct=*/true);
  for (int64_t off = 0; off < 2 * kMiB; off += kMiB) {
    datapath::ReadReply reply;
    Result<int64_t> n = Read(*mount_, fh, scratch_.data(), kMiB, off, &reply, 0);
    ASSERT_TRUE(n.ok()) << n.status().ToString();
    ASSERT_EQ(reply.iov.size(), 1u);
    EXPECT_EQ(reply.iov[0].iov_base, scratch_.data()) << "read on demand into the scratch buffer";
    EXPECT_TRUE(MatchesPattern(scratch_.data(), kMiB, off));
  }
  EXPECT_EQ(mount_->counters().read_ahead_fetches.load(), 0u);
  EXPECT_EQ(mount_->counters().bytes_read_engine.load(), static_cast<uint64_t>(2 * kMiB));
}

TEST_F(ReadPathTest, AReadStopsAtTheEndAndSeesWritesStillPending) {
  StartMount(false);
  ASSERT_TRUE(WritePatternFile(Path("tail"), kMiB));
  FileHandle& writer = OpenHandle("tail", /*writable=*/true, false);
  std::vector<char> data(4096, 'p');
  datapath::MemorySource src(data.data(), data.size());
  ASSERT_TRUE(
      inode_->data.Write(writer.open, writer.file, false, src, data.size(), kMiB, scratch_.data())
          .ok());
  FileHandle& reader = OpenHandle("tail", false, false);
  datapath::ReadReply reply;
  Result<int64_t> n = Read(*mount_, reader, scratch_.data(), kMiB, kMiB - 4096, &reply, 0);
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  EXPECT_EQ(*n, 8192) << "the pending write extended the file";
  std::vector<char> got = Bytes(reply);
  EXPECT_TRUE(MatchesPattern(got.data(), 4096, kMiB - 4096));
  EXPECT_EQ(got[4096], 'p');
  datapath::ReadReply past;
  n = Read(*mount_, reader, scratch_.data(), kMiB, 2 * kMiB, &past, 0);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 0);
}

// What ReadAsync answered, waited for by the test.
struct Answer {
  std::mutex mu;
  std::condition_variable cv;
  std::optional<Result<std::vector<char>>> got;
  ReadDone Done() {
    return [this](Result<std::span<const char>> r) {
      std::lock_guard lock(mu);
      if (r.ok()) {
        got = std::vector<char>(r.value().begin(), r.value().end());
      } else {
        got = Result<std::vector<char>>(r.status());
      }
      cv.notify_all();
    };
  }
  Result<std::vector<char>> Wait() {
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return got.has_value(); });
    return *got;
  }
};

TEST_F(ReadPathTest, ReadAsyncAnswersFromTheCompletion) {
  StartMount(/*async_reply=*/true);
  ASSERT_TRUE(WritePatternFile(Path("async"), 3 * kMiB / 2));
  FileHandle& fh = OpenHandle("async", false, /*client_direct=*/true);
  Answer whole;
  ASSERT_TRUE(ReadAsync(*mount_, fh, kMiB, 0, whole.Done()));
  Result<std::vector<char>> got = whole.Wait();
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  ASSERT_EQ(got->size(), static_cast<size_t>(kMiB));
  EXPECT_TRUE(MatchesPattern(got->data(), got->size(), 0));
  Answer tail;
  ASSERT_TRUE(ReadAsync(*mount_, fh, kMiB, kMiB, tail.Done()));
  got = tail.Wait();
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->size(), static_cast<size_t>(kMiB / 2)) << "clamped to the end of the file";
  Answer past;
  ASSERT_TRUE(ReadAsync(*mount_, fh, kMiB, 2 * kMiB, past.Done()));
  got = past.Wait();
  ASSERT_TRUE(got.ok());
  EXPECT_TRUE(got->empty());
  EXPECT_FALSE(ReadAsync(*mount_, fh, 2 * kMiB, 0, Answer().Done()))
      << "larger than a reply buffer: the caller reads synchronously";
}

TEST_F(ReadPathTest, ReadAsyncDeclinesWithoutReplyBuffers) {
  StartMount(/*async_reply=*/false);
  ASSERT_TRUE(WritePatternFile(Path("noasync"), kMiB));
  FileHandle& fh = OpenHandle("noasync", false, true);
  EXPECT_FALSE(ReadAsync(*mount_, fh, 4096, 0, Answer().Done()));
  EXPECT_EQ(mount_->counters().read_ops.load(), 0u) << "declined before anything was counted";
}

}  // namespace
}  // namespace dnvme::fs
