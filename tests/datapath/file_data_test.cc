// FileData (datapath/file_data.h) without a mount: the rules both users of the data path relied on
// their own code for. A read sees every accepted byte and stops at the end of the file; a write
// or a change inside the read-ahead window is never hidden by it (also with a writer and a reader
// racing on two threads); the first read of a read-only open starts a sequence where it is and a
// writer's does not; a file that shrank under a read is answered as read(2) would; Change runs
// after the write-behind landed and not at all when it failed; a flush error reaches a writer's
// close (peeked) and its fsync (taken, once), never a reader; copying readers refill the window at
// once, and Window::kDrop drops it.
#include "datapath/file_data.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/datapath/file_data_fixture.h"

namespace dnvme::datapath {
namespace {

using dnvme::test::MatchesPattern;
using dnvme::test::PatternByte;
using dnvme::test::WritePatternFile;
using test::kKiB;
using test::kMiB;

constexpr int64_t kFile = 24 * kMiB;
constexpr int64_t kChunk = kMiB;

class FileDataTest : public test::FileDataFixture {
 protected:
  void SetUp() override {
    DataPathTest::SetUp();
    if (HasFatalFailure()) return;
    SetUpData(kChunk, 4, 4 * kMiB);
  }
  FileRef PatternFile(const std::string& name, int64_t size = kFile, uint64_t seed = 0) {
    EXPECT_TRUE(WritePatternFile(Path(name), size, seed));
    return Open(name);
  }
  // A read into the scratch buffer, as the mount makes it (reply mode).
  Result<int64_t> ReadReplied(FileData& d, OpenFile& o, const FileRef& f, int64_t off, int64_t n,
                              ReadReply* reply, Window window = Window::kUse) {
    return ReadInto(d, o, f, off, n, scratch_.data(), reply, window);
  }
  // A read copied into `buf`, as `dnvme run` makes it.
  Result<int64_t> ReadCopied(FileData& d, OpenFile& o, const FileRef& f, int64_t off, int64_t n,
                             char* buf, Window window = Window::kUse) {
    return ReadInto(d, o, f, off, n, buf, nullptr, window);
  }
  // Writes `n` bytes of `byte` at `off` through `d`.
  Status WriteBytes(FileData& d, OpenFile& o, const FileRef& f, int64_t off, int64_t n, char byte) {
    std::vector<char> data(static_cast<size_t>(n), byte);
    MemorySource src(data.data(), data.size());
    return d.Write(o, f, /*page_cache_writes=*/false, src, data.size(), off, scratch_.data())
        .status();
  }
};

TEST_F(FileDataTest, AReadSeesEveryAcceptedByteAndStopsAtTheEnd) {
  FileRef f = PatternFile("end", 3 * kMiB);
  FileData d(&shared_);
  OpenFile o;
  d.Open(&o, /*read_only=*/false);
  // Accepted, not yet on disk: gathered into an extent the read must drain first.
  ASSERT_TRUE(WriteBytes(d, o, f, 3 * kMiB, 512 * kKiB, 'x').ok());
  ReadReply reply;
  Result<int64_t> got = ReadReplied(d, o, f, 3 * kMiB - 4096, kMiB, &reply);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, 4096 + 512 * kKiB) << "the size after the drain, not before";
  std::vector<char> all(static_cast<size_t>(*got));
  reply.CopyTo(all.data());
  EXPECT_TRUE(MatchesPattern(all.data(), 4096, 3 * kMiB - 4096));
  EXPECT_EQ(all[4096], 'x');
  EXPECT_EQ(all.back(), 'x');
  ReadReply past;
  got = ReadReplied(d, o, f, 4 * kMiB, kMiB, &past);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got, 0);
  EXPECT_TRUE(past.iov.empty());
}

TEST_F(FileDataTest, AWriteInsideTheWindowIsNeverHiddenByIt) {
  FileRef f = PatternFile("inside");
  FileData d(&shared_);
  OpenFile o;
  d.Open(&o, false);
  for (int64_t off = 0; off < 8 * kMiB; off += 256 * kKiB) {
    // Ahead of the reader, inside the window it has fetched: the next reads must see it.
    const int64_t ahead = off + kMiB;
    ASSERT_TRUE(WriteBytes(d, o, f, ahead, 4096, static_cast<char>('a' + off / (256 * kKiB))).ok());
    ReadReply reply;
    Result<int64_t> got = ReadReplied(d, o, f, off, 256 * kKiB, &reply);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    ASSERT_EQ(*got, 256 * kKiB);
    std::vector<char> buf(static_cast<size_t>(*got));
    reply.CopyTo(buf.data());
    // Each block read was written over (4 KiB at its start) by the write 4 blocks earlier.
    if (off >= kMiB) {
      EXPECT_EQ(buf[0], static_cast<char>('a' + (off - kMiB) / (256 * kKiB))) << "at " << off;
      EXPECT_TRUE(MatchesPattern(buf.data() + 4096, buf.size() - 4096, off + 4096));
    } else {
      EXPECT_TRUE(MatchesPattern(buf.data(), buf.size(), off));
    }
  }
  EXPECT_GT(counters_.read_ahead_fetches.load(), 0u) << "the reader was read ahead of";
}

TEST_F(FileDataTest, ARacingWriterIsSeenByEveryReadThatStartsAfterItsWrite) {
  // The race both callers guarded by hand: a reader that drained just before a write must not
  // serve (or fetch) the old bytes after the write returned.
  FileRef f = PatternFile("race");
  FileData d(&shared_);
  OpenFile writer, reader;
  d.Open(&writer, false);
  d.Open(&reader, true);
  constexpr int kBlocks = 16;
  constexpr int64_t kBlock = kMiB;
  std::atomic<int> written[kBlocks];  // the version last written to block b (0: the pattern)
  for (auto& w : written) w = 0;
  std::atomic<bool> stop{false};
  std::thread w([&] {
    for (int v = 1; v <= 40 && !stop; ++v) {
      const int b = (v * 7) % kBlocks;
      ASSERT_TRUE(WriteBytes(d, writer, f, b * kBlock, 4096, static_cast<char>(v)).ok());
      written[b].store(v);
    }
  });
  std::vector<char> buf(static_cast<size_t>(kBlock));
  for (int pass = 0; pass < 3; ++pass) {
    for (int b = 0; b < kBlocks; ++b) {
      const int before = written[b].load();  // a write that returned before this read
      Result<int64_t> got = ReadCopied(d, reader, f, b * kBlock, kBlock, buf.data());
      ASSERT_TRUE(got.ok()) << got.status().ToString();
      ASSERT_EQ(*got, kBlock);
      const int seen = static_cast<unsigned char>(buf[0]);
      if (before > 0) {
        // This block was overwritten: the byte is a version at least as new as `before`.
        EXPECT_GE(seen, before) << "block " << b << " pass " << pass;
        EXPECT_LE(seen, 40);
      }
    }
  }
  stop = true;
  w.join();
}

TEST_F(FileDataTest, TheFirstReadOfAReadOnlyOpenStartsASequenceAnywhere) {
  FileRef f = PatternFile("first");
  FileData d(&shared_);
  OpenFile writer, reader;
  d.Open(&writer, /*read_only=*/false);
  ReadReply r0;
  ASSERT_TRUE(ReadReplied(d, writer, f, 5 * kMiB, 64 * kKiB, &r0).ok());
  EXPECT_EQ(d.window(), 0) << "a writable open's first read elsewhere is not a sequence yet";
  d.Open(&reader, /*read_only=*/true);
  ReadReply r1;
  ASSERT_TRUE(ReadReplied(d, reader, f, 9 * kMiB, 64 * kKiB, &r1).ok());
  EXPECT_GT(d.window(), 0) << "a read-only open's first read starts one where it is";
  ReadReply r2;
  Result<int64_t> got = ReadReplied(d, reader, f, 9 * kMiB + 64 * kKiB, 64 * kKiB, &r2);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got, 64 * kKiB);
  EXPECT_FALSE(r2.pins.empty()) << "served from the window";
}

TEST_F(FileDataTest, AFileThatShrankUnderAReadIsAnsweredAsReadWould) {
  FileRef f = PatternFile("shrunk", 4 * kMiB);
  // The engine is asked for once the size was taken: the file shrinks right then, behind the
  // data path (a passthrough writer, another process), so the engine's read meets its end.
  std::atomic<int> asked{0};
  shared_.reads.engine = [&] {
    if (asked.fetch_add(1) == 0) {
      EXPECT_EQ(ftruncate(f.buffered_fd(), 3 * kMiB + 100), 0);
    }
    return engine_;
  };
  FileData d(&shared_);
  OpenFile o;
  d.Open(&o, false);
  ReadReply reply;
  Result<int64_t> got = ReadReplied(d, o, f, 3 * kMiB, kMiB, &reply, Window::kSkip);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, 100) << "what the file holds there now";
  ASSERT_EQ(reply.bytes(), 100);
  EXPECT_TRUE(MatchesPattern(reply.iov[0].iov_base, 100, 3 * kMiB));
}

TEST_F(FileDataTest, ChangeRunsOnceTheWritesLandedAndInvalidatesTheWindow) {
  FileRef f = PatternFile("change");
  FileData d(&shared_);
  OpenFile o;
  d.Open(&o, false);
  ReadReply r0;
  ASSERT_TRUE(ReadReplied(d, o, f, 0, 256 * kKiB, &r0).ok());
  ASSERT_GT(d.window(), 0);
  ASSERT_TRUE(d.Change([] { return Status::Ok(); }).ok());
  EXPECT_EQ(d.window(), 0) << "the window goes with a change";
  ASSERT_TRUE(WriteBytes(d, o, f, 2 * kMiB, 64 * kKiB, 'w').ok());
  int64_t size_seen = -1;
  Status st = d.Change([&] {
    struct stat sb {};
    EXPECT_EQ(fstat(f.buffered_fd(), &sb), 0);
    size_seen = sb.st_size;
    char c = 0;
    EXPECT_EQ(pread(f.buffered_fd(), &c, 1, 2 * kMiB), 1);
    EXPECT_EQ(c, 'w') << "the write landed before the change";
    return ftruncate(f.buffered_fd(), kMiB) == 0 ? Status::Ok() : Status::FromErrno(errno, "t");
  });
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(size_seen, kFile);
  ReadReply r1;
  Result<int64_t> got = ReadReplied(d, o, f, 256 * kKiB, 2 * kMiB, &r1);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got, kMiB - 256 * kKiB) << "nothing of the old window survives the truncate";
}

TEST_F(FileDataTest, AFailedFlushStopsTheChangeAndReachesWritersOnly) {
  FileRef f = PatternFile("fail", 4 * kMiB);
  FileData d(&shared_);
  OpenFile writer, reader;
  d.Open(&writer, false);
  d.Open(&reader, true);
  faults_.fail_errno = EIO;
  faults_.fail_offset = kMiB + 4096;
  ASSERT_TRUE(WriteBytes(d, writer, f, kMiB, kChunk, 'e').ok()) << "gathered: not yet flushed";
  bool ran = false;
  Status st = d.Change([&] {
    ran = true;
    return Status::Ok();
  });
  EXPECT_EQ(st.ErrnoOr(), EIO);
  EXPECT_FALSE(ran) << "a change must not run over data that did not land";
  EXPECT_TRUE(d.Flush(reader).ok()) << "a reader's close hears nothing";
  EXPECT_EQ(d.Flush(writer).ErrnoOr(), EIO) << "a writer's close peeks";
  EXPECT_EQ(d.Sync(writer).ErrnoOr(), EIO) << "its fsync still reports it";
  EXPECT_TRUE(d.Sync(writer).ok()) << "once";
  EXPECT_EQ(d.Sync(reader).ErrnoOr(), EIO) << "every description opened before hears at fsync";
  faults_.fail_errno = 0;
}

TEST_F(FileDataTest, CopyingReadersRefillTheWindowAtOnce) {
  // `dnvme run`'s reader: bytes land in its buffer, and the chunk a read emptied is fetched again
  // for the bytes after the window before the call returns (a reply would still hold it).
  shared_.reads.window = 4 * kMiB;
  FileRef f = PatternFile("into");
  FileData d(&shared_);
  OpenFile o;
  d.Open(&o, true);
  std::vector<char> buf(static_cast<size_t>(kChunk));
  Result<int64_t> got = ReadCopied(d, o, f, 0, kChunk, buf.data());
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, kChunk);
  EXPECT_TRUE(MatchesPattern(buf.data(), buf.size(), 0));
  EXPECT_EQ(counters_.read_ahead_fetches.load(), 5u)
      << "four chunks for the window, and the one this read emptied fetched again";
  // kSkip: read straight into the buffer, nothing fetched.
  const uint64_t before = counters_.read_ahead_fetches.load();
  got = ReadCopied(d, o, f, 10 * kChunk, kChunk, buf.data(), Window::kSkip);
  ASSERT_TRUE(got.ok());
  EXPECT_TRUE(MatchesPattern(buf.data(), buf.size(), 10 * kChunk));
  EXPECT_EQ(counters_.read_ahead_fetches.load(), before);
  // kDrop: the window goes too (the file may change behind it).
  EXPECT_GT(d.window(), 0);
  got = ReadCopied(d, o, f, kChunk, kChunk, buf.data(), Window::kDrop);
  ASSERT_TRUE(got.ok());
  EXPECT_TRUE(MatchesPattern(buf.data(), buf.size(), kChunk));
  EXPECT_EQ(d.window(), 0);
  EXPECT_TRUE(d.Release().ok());
  EXPECT_EQ(d.fetches_inflight(), 0);
}

TEST_F(FileDataTest, RandomCopyingReadsFetchNothing) {
  // A large read that starts no sequence must not refill a window either.
  FileRef f = PatternFile("randinto");
  FileData d(&shared_);
  OpenFile o;
  d.Open(&o, false);
  std::vector<char> buf(static_cast<size_t>(300 * kKiB));
  for (int64_t off : {5 * kMiB + 100, kMiB + 7, 9 * kMiB + 4096, 3 * kMiB + 1}) {
    Result<int64_t> got = ReadCopied(d, o, f, off, static_cast<int64_t>(buf.size()), buf.data());
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_TRUE(MatchesPattern(buf.data(), buf.size(), off));
  }
  EXPECT_EQ(counters_.read_ahead_fetches.load(), 0u);
}

TEST_F(FileDataTest, AfterCloseEveryWriteIsRefused) {
  FileRef f = PatternFile("closed", kMiB);
  FileData d(&shared_);
  OpenFile o;
  d.Open(&o, false);
  ASSERT_TRUE(WriteBytes(d, o, f, 0, 4096, 'c').ok());
  d.Close();
  EXPECT_EQ(WriteBytes(d, o, f, 4096, 4096, 'd').ErrnoOr(), EBADF);
  char c = 0;
  ASSERT_EQ(pread(f.buffered_fd(), &c, 1, 0), 1);
  EXPECT_EQ(c, 'c') << "Close landed what was accepted";
}

// ---- space before acknowledgement (datapath/space.h), as the mount sets it up -------------------

class FileDataSpaceTest : public FileDataTest {
 protected:
  void SetUp() override {
    FileDataTest::SetUp();
    if (HasFatalFailure()) return;
    shared_.space.reserve = true;
    shared_.space.unlanded_max = 4 * kChunk;
    shared_.budget = &budget_;
  }
  void TearDown() override {
    own_.reset();
    FileDataTest::TearDown();
  }
  // A tmpfs of `size_opt` of the test's own at Path("small"): false (with the reason) without.
  bool SmallTmpfs(const std::string& size_opt, std::string* why) {
    if (geteuid() != 0) {
      *why = "mounting a small tmpfs needs root";
      return false;
    }
    own_ = std::make_unique<dnvme::test::Mount>("tmpfs", Path("small"), "tmpfs", size_opt);
    if (!own_->ok()) *why = own_->what();
    return own_->ok();
  }
  static int64_t Allocated(const FileRef& f) {
    struct stat st {};
    EXPECT_EQ(fstat(f.buffered_fd(), &st), 0);
    return static_cast<int64_t>(st.st_blocks) * 512;
  }
  static int64_t Size(const FileRef& f) {
    struct stat st {};
    EXPECT_EQ(fstat(f.buffered_fd(), &st), 0);
    return st.st_size;
  }
  // Writes `n` bytes of `byte` at `off` through `d`: the bytes accepted, or the error.
  Result<size_t> Put(FileData& d, OpenFile& o, const FileRef& f, int64_t off, int64_t n,
                     char byte) {
    std::vector<char> data(static_cast<size_t>(n), byte);
    MemorySource src(data.data(), data.size());
    return d.Write(o, f, /*page_cache_writes=*/false, src, data.size(), off, scratch_.data());
  }

  SpaceBudget budget_;
  std::unique_ptr<dnvme::test::Mount> own_;
};

TEST_F(FileDataSpaceTest, AFullFileSystemRefusesTheWriteThatDoesNotFitAndKeepsEveryAcceptedByte) {
  // Issue 54: through the mount a full backing file system acknowledged ~30 MiB more than fit.
  // Here: 1 MiB writes into 16 MiB; the write that does not fit is short or refused (ENOSPC),
  // and after the flushes the file holds exactly every byte a write accepted.
  std::string why;
  if (!SmallTmpfs("size=16m", &why)) GTEST_SKIP() << why;
  auto opened = engine_->open_file(Path("small") + "/f", FileAccess::kReadWrite);
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  FileRef f = std::move(opened).value();
  FileData d(&shared_);
  OpenFile o;
  d.Open(&o, false);
  int64_t accepted = 0;
  Status refused;
  for (int i = 0; i < 32 && refused.ok(); ++i) {
    Result<size_t> got = Put(d, o, f, accepted, kMiB, static_cast<char>('a' + i));
    if (!got.ok()) {
      refused = got.status();
    } else {
      accepted += static_cast<int64_t>(*got);
    }
  }
  EXPECT_EQ(refused.ErrnoOr(), ENOSPC) << refused.ToString();
  EXPECT_GT(accepted, 15 * kMiB);
  EXPECT_LE(accepted, 16 * kMiB);
  EXPECT_TRUE(d.Sync(o).ok()) << "nothing accepted was lost, so fsync has nothing to report";
  EXPECT_EQ(Size(f), accepted);
  std::vector<char> back(static_cast<size_t>(accepted));
  ASSERT_EQ(pread(f.buffered_fd(), back.data(), back.size(), 0), accepted);
  for (int64_t at = 0; at < accepted; at += 4096) {
    ASSERT_EQ(back[static_cast<size_t>(at)], static_cast<char>('a' + at / kMiB)) << "at " << at;
  }
  EXPECT_GE(counters_.space_refusals.load(), 1u);
}

TEST_F(FileDataSpaceTest, TrimLandsThePendingBytesThenFreesWhatLiesPastTheEnd) {
  FileRef f = Open("trim");
  FileData d(&shared_);
  OpenFile o;
  d.Open(&o, false);
  ASSERT_TRUE(Put(d, o, f, 0, 3 * kMiB, 't').ok());
  EXPECT_TRUE(d.holds_reservation());
  EXPECT_GE(Allocated(f), shared_.space.step_min);
  ASSERT_TRUE(d.Trim(f.buffered_fd()).ok());
  EXPECT_FALSE(d.holds_reservation());
  EXPECT_EQ(Size(f), 3 * kMiB);  // the pending bytes landed first
  EXPECT_LE(Allocated(f), 3 * kMiB + 8192);
  // The writer goes on: it reserves again.
  ASSERT_TRUE(Put(d, o, f, 3 * kMiB, kMiB, 'u').ok());
  EXPECT_TRUE(d.holds_reservation());
  ASSERT_TRUE(d.Drain().ok());
  EXPECT_EQ(Size(f), 4 * kMiB);
}

TEST_F(FileDataSpaceTest, NoTrimWhileAnOutsideWriterRuns) {
  FileRef f = Open("outside");
  FileData d(&shared_);
  OpenFile o;
  d.Open(&o, false);
  ASSERT_TRUE(Put(d, o, f, 0, kMiB, 'o').ok());
  d.BeginOutsideWrite();  // a control-file pwrite may be extending the file
  ASSERT_TRUE(d.Trim(f.buffered_fd()).ok());
  EXPECT_TRUE(d.holds_reservation()) << "trimmed under an outside writer";
  d.EndOutsideWrite();
  ASSERT_TRUE(d.Trim(f.buffered_fd()).ok());
  EXPECT_FALSE(d.holds_reservation());
}

TEST_F(FileDataSpaceTest, AStaleGrantIsNeverTakenIn) {
  // The write-behind refuses a grant whose epoch moved (a Trim or a change came between it and
  // the write), taking nothing: FileData then asks the reservation again.
  FileRef f = Open("stale");
  WriteBehind wb(&shared_.writes);
  SpaceReservation resv;
  ErrorCursor cursor;
  std::vector<char> data(kMiB, 's');
  WriteAdmission admit;
  admit.resv = &resv;
  admit.epoch = resv.epoch();
  resv.Forget();
  MemorySource src(data.data(), data.size());
  bool stale = false;
  ASSERT_TRUE(
      wb.Write(f, false, src, data.size(), 0, scratch_.data(), &cursor, admit, &stale).ok());
  EXPECT_TRUE(stale);
  ASSERT_TRUE(wb.Drain(nullptr).ok());
  EXPECT_EQ(Size(f), 0) << "a stale grant's bytes were taken in";
  admit.epoch = resv.epoch();
  stale = false;
  MemorySource again(data.data(), data.size());
  ASSERT_TRUE(
      wb.Write(f, false, again, data.size(), 0, scratch_.data(), &cursor, admit, &stale).ok());
  EXPECT_FALSE(stale);
  ASSERT_TRUE(wb.Drain(nullptr).ok());
  EXPECT_EQ(Size(f), kMiB);
}

TEST_F(FileDataSpaceTest, AChangeMakesTheReservationLookAgain) {
  FileRef f = Open("changed");
  FileData d(&shared_);
  OpenFile o;
  d.Open(&o, false);
  ASSERT_TRUE(Put(d, o, f, 0, kMiB, 'c').ok());
  ASSERT_TRUE(d.Change([&] {
                 return ftruncate(f.buffered_fd(), 0) == 0 ? Status::Ok()
                                                           : Status::FromErrno(errno, "ftruncate");
               }).ok());
  ASSERT_LE(Allocated(f), 8192);  // the truncate freed the reservation with the file
  ASSERT_TRUE(Put(d, o, f, 0, kMiB, 'd').ok());
  EXPECT_GE(Allocated(f), shared_.space.step_min) << "the write after the change reserved again";
}

}  // namespace
}  // namespace dnvme::datapath
