// Real filesystem behaviour: a full tmpfs (ENOSPC), ramfs refusing O_DIRECT (the direct policy),
// and direct=never on the normal scratch disk. The mount tests need root and skip, with the reason,
// without it or when the mount itself is refused.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "dnvme/handle.h"
#include "tests/engine/test_util.h"

namespace dnvme {
namespace {

using Code = Status::Code;
using test::AlignedBuffer;
using test::kKiB;
using test::kMiB;

class FilesystemTest : public test::ScratchTest {
 protected:
  void TearDown() override {
    handle_.reset();
    mount_.reset();  // unmount before the scratch directory is removed
    test::ScratchTest::TearDown();
  }

  // Mounts `fstype` at <scratch>/mnt; sets *skip_reason instead when that is not possible here.
  void MountScratch(const std::string& fstype, const std::string& options,
                    std::string* skip_reason) {
    if (::geteuid() != 0) {
      *skip_reason =
          "needs root to mount " + fstype + " (euid " + std::to_string(::geteuid()) + ")";
      return;
    }
    mount_ = std::make_unique<test::Mount>(fstype, Path("mnt"), fstype, options);
    if (!mount_->ok()) {
      *skip_reason = "cannot mount " + fstype + " here: " + mount_->what();
      mount_.reset();
    }
  }

  void Open(const HandleConfig& config) {
    Result<std::unique_ptr<AioHandle>> h = AioHandle::Create(config);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    handle_ = std::move(h).value();
  }

  std::string MountPath(const std::string& name) const { return mount_->path() + "/" + name; }

  std::unique_ptr<test::Mount> mount_;
  std::unique_ptr<AioHandle> handle_;
};

TEST_F(FilesystemTest, FullTmpfsReportsNoSpace) {
  std::string skip;
  ASSERT_NO_FATAL_FAILURE(MountScratch("tmpfs", "size=1m", &skip));
  if (!skip.empty()) GTEST_SKIP() << skip;
  HandleConfig c;
  c.block_size = 256 * kKiB;
  ASSERT_NO_FATAL_FAILURE(Open(c));
  test::Watchdog wd(std::chrono::seconds(300), "ENOSPC on tmpfs");

  const std::string path = MountPath("big");
  AlignedBuffer buf(4 * kMiB, 0);
  buf.Fill(0, 1);
  Status st = handle_->sync_pwrite(buf.data(), buf.ssize(), path, 0);
  EXPECT_EQ(st.code(), Code::kNoSpace) << st.ToString();
  EXPECT_EQ(st.error_number(), ENOSPC) << st.ToString();
  EXPECT_NE(st.message().find(path), std::string::npos) << st.message();

  // Misaligned buffer and offsets: the buffered and bounce paths report it the same way.
  AlignedBuffer odd(4 * kMiB + 17, 1);
  odd.Fill(4095, 2);
  const std::string path2 = MountPath("big2");
  st = handle_->sync_pwrite(odd.data(), odd.ssize(), path2, 4095);
  EXPECT_EQ(st.code(), Code::kNoSpace) << st.ToString();
  EXPECT_NE(st.message().find(path2), std::string::npos) << st.message();

  // Asynchronously: the outcome is in completed().
  DNVME_ASSERT_OK_AND_ASSIGN(OpId id,
                             handle_->async_pwrite(buf.data(), buf.ssize(), MountPath("big3"), 0));
  ASSERT_EQ(handle_->wait(), 1);
  const OpResult& r = handle_->completed()[0];
  EXPECT_EQ(r.id, id);
  EXPECT_EQ(r.status.code(), Code::kNoSpace) << r.status.ToString();
  EXPECT_LT(r.bytes_done, r.length);
  EXPECT_GE(r.error_offset, 0);
  EXPECT_GE(handle_->stats().ops_failed, 3u);

  // The handle still works on the normal disk.
  DNVME_EXPECT_OK(handle_->sync_pwrite(buf.data(), kMiB, Path("ok"), 0));
  EXPECT_EQ(test::FileSize(Path("ok")), kMiB);
}

TEST_F(FilesystemTest, RamfsWithDirectAutoFallsBackToBuffered) {
  std::string skip;
  ASSERT_NO_FATAL_FAILURE(MountScratch("ramfs", "", &skip));
  if (!skip.empty()) GTEST_SKIP() << skip;
  HandleConfig c;
  c.direct = DirectPolicy::kAuto;
  c.block_size = 256 * kKiB;
  ASSERT_NO_FATAL_FAILURE(Open(c));

  const std::string path = MountPath("f");
  const int64_t size = kMiB + 17;
  AlignedBuffer w(static_cast<size_t>(size), 0);
  w.Fill(4096, 3);
  DNVME_ASSERT_OK(handle_->sync_pwrite(w.data(), size, path, 4096));
  ASSERT_EQ(test::FileSize(path), 4096 + size);
  const std::vector<uint8_t> file = test::ReadWholeFile(path);
  EXPECT_TRUE(test::AllBytesAre(file.data(), 4096, 0));
  EXPECT_TRUE(test::MatchesPattern(file.data() + 4096, static_cast<size_t>(size), 4096, 3));

  AlignedBuffer r(static_cast<size_t>(size), 1);
  DNVME_ASSERT_OK(handle_->sync_pread(r.data(), size, path, 4096));
  EXPECT_TRUE(test::MatchesPattern(r.data(), r.size(), 4096, 3));
  EXPECT_TRUE(r.GuardsIntact());

  const HandleStats s = handle_->stats();
  EXPECT_GE(s.direct_fallbacks, 1u) << s.ToJson();
  EXPECT_EQ(s.bytes_direct, 0u) << "ramfs cannot do O_DIRECT: " << s.ToJson();
  EXPECT_EQ(s.bytes_bounce, 0u) << s.ToJson();
  EXPECT_EQ(s.bytes_buffered, static_cast<uint64_t>(2 * size)) << s.ToJson();
}

TEST_F(FilesystemTest, RamfsWithDirectRequiredIsUnsupported) {
  std::string skip;
  ASSERT_NO_FATAL_FAILURE(MountScratch("ramfs", "", &skip));
  if (!skip.empty()) GTEST_SKIP() << skip;
  HandleConfig c;
  c.direct = DirectPolicy::kRequired;
  ASSERT_NO_FATAL_FAILURE(Open(c));

  const std::string path = MountPath("f");
  AlignedBuffer buf(kMiB, 0);
  buf.Fill(0, 4);
  Status st = handle_->sync_pwrite(buf.data(), buf.ssize(), path, 0);
  EXPECT_EQ(st.code(), Code::kUnsupported) << st.ToString();
  EXPECT_NE(st.message().find(path), std::string::npos) << st.message();

  // Reading an existing file on ramfs is refused the same way.
  const std::string existing = MountPath("existing");
  ASSERT_TRUE(test::WritePatternFile(existing, kMiB, 5));
  st = handle_->sync_pread(buf.data(), buf.ssize(), existing, 0);
  EXPECT_EQ(st.code(), Code::kUnsupported) << st.ToString();

  Result<OpId> id = handle_->async_pread(buf.data(), buf.ssize(), existing, 0);
  if (id.ok()) {  // refused at open (nothing queued) or reported through wait(): both are allowed
    ASSERT_EQ(handle_->wait(), 1);
    EXPECT_EQ(handle_->completed()[0].status.code(), Code::kUnsupported)
        << handle_->completed()[0].status.ToString();
  } else {
    EXPECT_EQ(id.status().code(), Code::kUnsupported) << id.status().ToString();
    EXPECT_EQ(handle_->pending(), 0);
  }
  EXPECT_EQ(handle_->stats().bytes_buffered, 0u) << "direct=required must not fall back";
}

TEST_F(FilesystemTest, DirectNeverIsAllBuffered) {
  HandleConfig c;
  c.direct = DirectPolicy::kNever;
  ASSERT_NO_FATAL_FAILURE(Open(c));
  const std::string path = Path("never");
  AlignedBuffer w(kMiB, 0);
  w.Fill(0, 6);
  DNVME_ASSERT_OK(handle_->sync_pwrite(w.data(), kMiB, path, 0));
  AlignedBuffer r(kMiB, 0);
  DNVME_ASSERT_OK(handle_->sync_pread(r.data(), kMiB, path, 0));
  EXPECT_TRUE(test::MatchesPattern(r.data(), r.size(), 0, 6));
  const std::vector<uint8_t> file = test::ReadWholeFile(path);
  EXPECT_TRUE(test::MatchesPattern(file.data(), file.size(), 0, 6));

  const HandleStats s = handle_->stats();
  EXPECT_EQ(s.bytes_buffered, static_cast<uint64_t>(2 * kMiB)) << s.ToJson();
  EXPECT_EQ(s.bytes_direct, 0u) << s.ToJson();
  EXPECT_EQ(s.bytes_bounce, 0u) << s.ToJson();
  EXPECT_EQ(s.direct_fallbacks, 0u) << "never is a choice, not a fallback: " << s.ToJson();
}

TEST_F(FilesystemTest, DirectRequiredWorksOnTheScratchDisk) {
  HandleConfig c;
  c.direct = DirectPolicy::kRequired;
  ASSERT_NO_FATAL_FAILURE(Open(c));
  const std::string path = Path("required");
  AlignedBuffer w(kMiB + 17, 1);
  w.Fill(4095, 7);
  DNVME_ASSERT_OK(handle_->sync_pwrite(w.data(), w.ssize(), path, 4095));
  AlignedBuffer r(kMiB + 17, 0);
  DNVME_ASSERT_OK(handle_->sync_pread(r.data(), r.ssize(), path, 4095));
  EXPECT_TRUE(test::MatchesPattern(r.data(), r.size(), 4095, 7));
  EXPECT_EQ(handle_->stats().direct_fallbacks, 0u);
}

}  // namespace
}  // namespace dnvme
