// The read policy (datapath/read_policy.h) and FileData's reads under it, without a mount.
//
// With a model of the page cache (ModelResidency: which pages it holds, as the test says) and of
// the memory (ModelMemory): a read is served from the page cache exactly where the model says it
// is cached -- whole, partly (split at the boundary, in file order, in both read modes), or not at
// all -- or, under auto, whenever the file fits; an O_DIRECT reader never is; a range the model
// calls cached that the kernel evicted meanwhile is still read right (from the device, through
// the page cache); a file that shrinks under a cached read is answered as read(2) would; a large
// cached read is cut among the engine's workers. With the real kernel (cachestat): a file's
// pages are counted exactly as they come and go (fadvise DONTNEED, a read), a partly cached range
// is split at its page boundary, and the mount's open decision follows residency.
#include "datapath/read_policy.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <functional>
#include <limits>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "datapath/file_data.h"
#include "tests/datapath/file_data_fixture.h"

namespace dnvme::datapath {
namespace {

using dnvme::test::MatchesPattern;
using dnvme::test::WritePatternFile;
using test::kKiB;
using test::kMiB;

constexpr int64_t kPage = 4096;

// The page cache as the test says it is: a set of cached page indexes (any fd).
class ModelResidency : public Residency {
 public:
  int64_t Resident(int /*fd*/, int64_t off, int64_t len) const override {
    std::lock_guard lock(mu_);
    ++probes_;
    if (on_probe_) on_probe_();
    if (unknown_) return -1;
    int64_t pages = 0;
    const int64_t first = off / kPage, last = (off + len - 1) / kPage;
    for (int64_t p = first; p <= last; ++p) pages += cached_.count(p);
    if (pages == last - first + 1) return len;
    return std::min(len, pages * kPage);
  }
  void Cache(int64_t off, int64_t len) {
    std::lock_guard lock(mu_);
    for (int64_t p = off / kPage; p < (off + len + kPage - 1) / kPage; ++p) cached_.insert(p);
  }
  void SetUnknown(bool u) { unknown_ = u; }
  void OnProbe(std::function<void()> f) { on_probe_ = std::move(f); }
  int64_t probes() const {
    std::lock_guard lock(mu_);
    return probes_;
  }

 private:
  mutable std::mutex mu_;
  std::set<int64_t> cached_;
  bool unknown_ = false;
  std::function<void()> on_probe_;
  mutable int64_t probes_ = 0;
};

class ModelMemory : public MemoryBudget {
 public:
  explicit ModelMemory(int64_t bytes) : bytes_(bytes) {}
  int64_t Available(pid_t /*pid*/) const override { return bytes_; }

 private:
  int64_t bytes_;
};

// Evicts `path`'s pages from the real page cache (they were written through it).
void Evict(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(fdatasync(fd), 0);
  ASSERT_EQ(posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), 0);
  close(fd);
}

constexpr int64_t kFile = 8 * kMiB;

bool HaveCachestat() { return !(syscall(451, -1, nullptr, nullptr, 0) != 0 && errno == ENOSYS); }

class ReadPolicyTest : public test::FileDataFixture {
 protected:
  void SetUp() override {
    DataPathTest::SetUp();
    if (HasFatalFailure()) return;
    SetUpData(kMiB, 0, kFile);
    shared_.policy.residency = &residency_;
    shared_.policy.memory = &small_memory_;  // nothing fits unless a test says so
  }
  FileRef PatternFile(const std::string& name, int64_t size = kFile) {
    EXPECT_TRUE(WritePatternFile(Path(name), size));
    Evict(Path(name));  // the device, not the page cache, unless a test caches it
    return Open(name);
  }
  uint64_t Cached() const { return counters_.bytes_read_cached.load(); }
  uint64_t FromDevice() const {
    return counters_.bytes_read_engine.load() + counters_.bytes_read_ahead_hit.load();
  }

  ModelResidency residency_;
  ModelMemory small_memory_{kMiB};  // 0.5 MiB fits at fraction 0.5
  ModelMemory large_memory_{int64_t{1} << 40};
};

TEST(ReadCacheNames, ParseAndPrintEachOther) {
  for (ReadCache c : {ReadCache::kAuto, ReadCache::kResident, ReadCache::kOff}) {
    auto parsed = ParseReadCache(ReadCacheName(c));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, c);
  }
  EXPECT_EQ(ParseReadCache("0").value(), ReadCache::kOff);
  auto bad = ParseReadCache("always");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("auto, resident or off"), std::string::npos)
      << bad.status().ToString();
}

TEST_F(ReadPolicyTest, OffReadsEverythingFromTheDeviceEvenWhenCached) {
  shared_.policy.mode = ReadCache::kOff;
  shared_.policy.memory = &large_memory_;
  residency_.Cache(0, kFile);
  FileRef f = PatternFile("off");
  FileData d(&shared_);
  OpenFile o;
  d.Open(&o, true);
  std::vector<char> buf(kMiB);
  Result<int64_t> got = ReadInto(d, o, f, 0, kMiB, buf.data(), nullptr);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_TRUE(MatchesPattern(buf.data(), kMiB, 0));
  EXPECT_EQ(Cached(), 0u);
  EXPECT_EQ(FromDevice(), static_cast<uint64_t>(kMiB));
  EXPECT_EQ(residency_.probes(), 0) << "off asks nothing";
}

TEST_F(ReadPolicyTest, AutoReadsAFileThatFitsThroughThePageCacheWhateverIsCached) {
  shared_.policy.mode = ReadCache::kAuto;
  shared_.policy.memory = &large_memory_;
  FileRef f = PatternFile("fits");
  FileData d(&shared_);
  OpenFile o;
  d.Open(&o, true);
  // Both read modes: the mount's (pieces into its scratch buffer) and dnvme run's (a copy).
  for (int64_t off = 0; off < 4 * kMiB; off += kMiB) {
    ReadReply reply;
    Result<int64_t> got = ReadInto(d, o, f, off, kMiB, scratch_.data(), &reply);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    ASSERT_EQ(reply.iov.size(), 1u);
    EXPECT_EQ(reply.iov[0].iov_base, scratch_.data()) << "read into the caller's buffer";
    EXPECT_TRUE(MatchesPattern(scratch_.data(), kMiB, off));
  }
  std::vector<char> buf(kMiB);
  Result<int64_t> got = ReadInto(d, o, f, 4 * kMiB, kMiB, buf.data(), nullptr);
  ASSERT_TRUE(got.ok());
  EXPECT_TRUE(MatchesPattern(buf.data(), kMiB, 4 * kMiB));
  EXPECT_EQ(Cached(), static_cast<uint64_t>(5 * kMiB));
  EXPECT_EQ(FromDevice(), 0u);
  EXPECT_EQ(counters_.read_ahead_fetches.load(), 0u) << "no O_DIRECT read ahead of the kernel's";
  EXPECT_EQ(residency_.probes(), 0) << "a file that fits needs no residency";
}

TEST_F(ReadPolicyTest, AutoReadsWhatIsCachedFromTheCacheAndTheRestFromTheDevice) {
  shared_.policy.mode = ReadCache::kAuto;  // the file does not fit small_memory_
  FileRef f = PatternFile("part");
  // Cached: [1 MiB, 1.5 MiB + 3 pages).
  const int64_t lo = kMiB, hi = kMiB + kMiB / 2 + 3 * kPage;
  residency_.Cache(lo, hi - lo);
  FileData d(&shared_);
  OpenFile o;
  d.Open(&o, true);
  // A small read across the end of the cached run: split at the page.
  ReadReply small;
  Result<int64_t> got = ReadInto(d, o, f, hi - 2 * kPage, 64 * kKiB, scratch_.data(), &small);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  std::vector<char> bytes(static_cast<size_t>(small.bytes()));
  small.CopyTo(bytes.data());
  EXPECT_TRUE(MatchesPattern(bytes.data(), bytes.size(), hi - 2 * kPage));
  EXPECT_EQ(Cached(), static_cast<uint64_t>(2 * kPage)) << "exactly the cached pages";
  EXPECT_EQ(FromDevice(), static_cast<uint64_t>(64 * kKiB - 2 * kPage));
  // A large one (2 MiB): split in granules of 1/64 of it (32 KiB); a granule only partly cached
  // is read from the device whole.
  const uint64_t cached0 = Cached(), device0 = FromDevice();
  ReadReply reply;
  got = ReadInto(d, o, f, 0, 2 * kMiB, scratch_.data(), &reply);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, 2 * kMiB);
  std::vector<char> all(static_cast<size_t>(reply.bytes()));
  reply.CopyTo(all.data());
  EXPECT_TRUE(MatchesPattern(all.data(), all.size(), 0)) << "the pieces in file order";
  const uint64_t cached = Cached() - cached0;
  EXPECT_LE(cached, static_cast<uint64_t>(hi - lo));
  EXPECT_GE(cached, static_cast<uint64_t>(hi - lo - 64 * kKiB)) << "all but a granule or two";
  EXPECT_EQ(cached + FromDevice() - device0, static_cast<uint64_t>(2 * kMiB));
  // Copy mode, from inside the cached run to beyond it.
  const uint64_t cached1 = Cached();
  std::vector<char> buf(kMiB);
  got = ReadInto(d, o, f, lo + kPage, kMiB, buf.data(), nullptr);
  ASSERT_TRUE(got.ok());
  EXPECT_TRUE(MatchesPattern(buf.data(), kMiB, lo + kPage));
  EXPECT_GT(Cached() - cached1, static_cast<uint64_t>(kMiB / 4));
  EXPECT_LE(Cached() - cached1, static_cast<uint64_t>(hi - lo - kPage));
}

TEST_F(ReadPolicyTest, ResidentNeverFillsTheCacheEvenForAFileThatFits) {
  shared_.policy.mode = ReadCache::kResident;
  shared_.policy.memory = &large_memory_;
  FileRef f = PatternFile("resident");
  residency_.Cache(0, kMiB);
  FileData d(&shared_);
  OpenFile o;
  d.Open(&o, true);
  std::vector<char> buf(2 * kMiB);
  Result<int64_t> got = ReadInto(d, o, f, 0, 2 * kMiB, buf.data(), nullptr);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_TRUE(MatchesPattern(buf.data(), 2 * kMiB, 0));
  EXPECT_EQ(Cached(), static_cast<uint64_t>(kMiB));
  EXPECT_EQ(FromDevice(), static_cast<uint64_t>(kMiB));
}

TEST_F(ReadPolicyTest, AnOpenTheMountSentToTheEngineReadsOnlyWhatIsCachedFromTheCache) {
  shared_.policy.mode = ReadCache::kAuto;
  shared_.policy.memory = &large_memory_;  // fits, but the open says not to fill
  FileRef f = PatternFile("engine-open");
  FileData d(&shared_);
  OpenFile o;
  d.Open(&o, true);
  std::vector<char> buf(kMiB);
  FileRead r;
  r.size = kMiB;
  r.buf = buf.data();
  r.shrunk_fd = f.buffered_fd();
  r.may_fill = false;
  Result<int64_t> got = d.Read(o, f, r);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_TRUE(MatchesPattern(buf.data(), kMiB, 0));
  EXPECT_EQ(Cached(), 0u);
  EXPECT_EQ(FromDevice(), static_cast<uint64_t>(kMiB));
}

TEST_F(ReadPolicyTest, AnODirectReaderIsNeverServedFromTheCache) {
  shared_.policy.mode = ReadCache::kAuto;
  shared_.policy.memory = &large_memory_;
  residency_.Cache(0, kFile);
  FileRef f = PatternFile("odirect");
  FileData d(&shared_);
  OpenFile o;
  d.Open(&o, true);
  ReadReply reply;
  Result<int64_t> got = ReadInto(d, o, f, 0, kMiB, scratch_.data(), &reply, Window::kSkip);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_TRUE(MatchesPattern(scratch_.data(), kMiB, 0));
  EXPECT_EQ(Cached(), 0u);
  EXPECT_EQ(counters_.bytes_read_engine.load(), static_cast<uint64_t>(kMiB));
}

// The model says cached; the kernel no longer has the pages (evicted between the probe and the
// read): the buffered read fetches them again, and the bytes are right.
TEST_F(ReadPolicyTest, ARangeEvictedMeanwhileIsStillReadRight) {
  shared_.policy.mode = ReadCache::kResident;
  FileRef f = PatternFile("evicted");
  residency_.Cache(0, kFile);
  residency_.OnProbe([&] { Evict(Path("evicted")); });
  FileData d(&shared_);
  OpenFile o;
  d.Open(&o, true);
  std::vector<char> buf(3 * kMiB);
  Result<int64_t> got = ReadInto(d, o, f, kMiB, 3 * kMiB, buf.data(), nullptr);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, 3 * kMiB);
  EXPECT_TRUE(MatchesPattern(buf.data(), 3 * kMiB, kMiB));
  EXPECT_EQ(Cached(), static_cast<uint64_t>(3 * kMiB));
}

// Truncated after the size was read (the probe runs between the two): what is there now.
TEST_F(ReadPolicyTest, AFileThatShrinksUnderACachedReadIsAnsweredAsReadWould) {
  shared_.policy.mode = ReadCache::kResident;
  FileRef f = PatternFile("shrinks");
  residency_.Cache(0, kFile);
  residency_.OnProbe([&] { ASSERT_EQ(truncate(Path("shrinks").c_str(), kMiB + 100), 0); });
  FileData d(&shared_);
  OpenFile o;
  d.Open(&o, true);
  std::vector<char> buf(2 * kMiB);
  Result<int64_t> got = ReadInto(d, o, f, 0, 2 * kMiB, buf.data(), nullptr);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, kMiB + 100);
  EXPECT_TRUE(MatchesPattern(buf.data(), kMiB + 100, 0));
}

TEST_F(ReadPolicyTest, UnknownResidencyCountsAsNothingCached) {
  shared_.policy.mode = ReadCache::kResident;
  residency_.Cache(0, kFile);
  residency_.SetUnknown(true);
  FileRef f = PatternFile("unknown");
  FileData d(&shared_);
  OpenFile o;
  d.Open(&o, true);
  std::vector<char> buf(kMiB);
  ASSERT_TRUE(ReadInto(d, o, f, 0, kMiB, buf.data(), nullptr).ok());
  EXPECT_TRUE(MatchesPattern(buf.data(), kMiB, 0));
  EXPECT_EQ(Cached(), 0u);
}

TEST_F(ReadPolicyTest, ALargeCachedReadIsCutAmongTheEngineWorkers) {
  shared_.policy.mode = ReadCache::kAuto;
  shared_.policy.memory = &large_memory_;
  shared_.policy.parallel_from = 2 * kMiB;
  FileRef f = PatternFile("large");
  FileData d(&shared_);
  OpenFile o;
  d.Open(&o, true);
  std::vector<char> buf(kFile);
  const HandleStats before = engine_->stats();
  Result<int64_t> got = ReadInto(d, o, f, 100, kFile - 100, buf.data() + 1, nullptr);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, kFile - 100);
  EXPECT_TRUE(MatchesPattern(buf.data() + 1, kFile - 100, 100));
  const HandleStats after = engine_->stats();
  EXPECT_EQ(after.bytes_buffered - before.bytes_buffered, static_cast<uint64_t>(kFile - 100))
      << "through the engine's page-cache read";
  EXPECT_EQ(after.requests, before.requests) << "no O_DIRECT request";
  // Below the threshold: one pread on this thread, the engine untouched.
  ASSERT_TRUE(ReadInto(d, o, f, 0, kMiB, buf.data(), nullptr).ok());
  EXPECT_EQ(engine_->stats().bytes_buffered, after.bytes_buffered);
}

// cache_writes: the write-behind's flushes of a file that fits go through the page cache (the
// kernel then holds every written page), and without it O_DIRECT (it holds none of them).
TEST_F(ReadPolicyTest, CacheWritesFlushesAFileThatFitsThroughThePageCache) {
  if (!HaveCachestat()) GTEST_SKIP() << "no cachestat(2) in this kernel (Linux 6.5+)";
  std::unique_ptr<PinnedPool> wb_pool = Pool(kMiB, 4);
  ASSERT_TRUE(wb_pool);
  shared_.writes.chunks = wb_pool.get();
  shared_.writes.write_chunk = kMiB;
  shared_.writes.policy = &shared_.policy;
  shared_.policy.mode = ReadCache::kAuto;
  shared_.policy.memory = &large_memory_;
  for (bool cache : {true, false}) {
    SCOPED_TRACE(cache ? "cache_writes" : "O_DIRECT");
    shared_.policy.cache_writes = cache;
    const std::string name = cache ? "cached-writes" : "direct-writes";
    FileRef f = PatternFile(name, 0);
    const uint64_t before = counters_.bytes_written_cached.load();
    {
      FileData d(&shared_);
      OpenFile o;
      d.Open(&o, false);
      std::vector<char> data(4 * kMiB);
      dnvme::test::FillPattern(data.data(), data.size(), 0);
      MemorySource src(data.data(), data.size());
      ASSERT_TRUE(d.Write(o, f, false, src, data.size(), 0, nullptr).ok());
      ASSERT_TRUE(d.Sync(o).ok());
      ASSERT_TRUE(d.Release().ok());
    }
    const int64_t cached = KernelResidency().Resident(f.buffered_fd(), 0, 4 * kMiB);
    EXPECT_EQ(cached, cache ? 4 * kMiB : 0);
    EXPECT_EQ(counters_.bytes_written_cached.load() - before,
              cache ? static_cast<uint64_t>(4 * kMiB) : 0u);
    std::vector<char> back(4 * kMiB);
    ASSERT_EQ(pread(f.buffered_fd(), back.data(), back.size(), 0), 4 * kMiB);
    EXPECT_TRUE(MatchesPattern(back.data(), back.size(), 0));
  }
  shared_.writes.chunks = nullptr;
}

TEST(ReadPolicyPlan, FitsFollowsTheFractionOfTheMemory) {
  ModelMemory mem(100 * kMiB);
  ReadPolicy p;
  p.memory = &mem;
  p.fraction = 0.5;
  EXPECT_TRUE(p.Fits(50 * kMiB));
  EXPECT_FALSE(p.Fits(50 * kMiB + 1));
  p.fraction = 0;
  EXPECT_FALSE(p.Fits(1));
}

TEST(ReadPolicyPlan, APartlyCachedLargeReadNeedsBoundedProbes) {
  // Every other page cached over 64 MiB: the worst case for halving.
  ModelResidency model;
  for (int64_t p = 0; p < 64 * kMiB / kPage; p += 2) model.Cache(p * kPage, kPage);
  ReadPolicy policy;
  policy.mode = ReadCache::kResident;
  policy.residency = &model;
  std::vector<ResidentRun> plan = policy.Plan(-1, 0, 64 * kMiB, 64 * kMiB);
  int64_t covered = 0, at = 0;
  for (const ResidentRun& r : plan) {
    EXPECT_EQ(r.off, at) << "runs in order, without gaps";
    at += r.len;
    covered += r.len;
  }
  EXPECT_EQ(covered, 64 * kMiB);
  EXPECT_LT(model.probes(), 400) << "granules of len/64 bound the halving";
}

TEST(ReadPolicyPlan, ColdReadsToEngineFollowsTheModeTheSizeAndTheResidency) {
  ModelResidency model;
  ModelMemory small(kMiB), large(int64_t{1} << 40);
  ReadPolicy p;
  p.residency = &model;
  p.memory = &small;
  const int64_t from = 64 * kMiB, size = 256 * kMiB;
  p.mode = ReadCache::kOff;
  EXPECT_TRUE(p.ColdReadsToEngine(-1, size, 0, from));
  EXPECT_FALSE(p.ColdReadsToEngine(-1, from - 1, 0, from)) << "small files stay passthrough";
  p.mode = ReadCache::kAuto;
  EXPECT_TRUE(p.ColdReadsToEngine(-1, size, 0, from)) << "cold and larger than the memory";
  p.memory = &large;
  EXPECT_FALSE(p.ColdReadsToEngine(-1, size, 0, from)) << "fits: the page cache";
  p.memory = &small;
  model.Cache(0, size);
  EXPECT_FALSE(p.ColdReadsToEngine(-1, size, 0, from)) << "cached: the page cache serves it";
  p.mode = ReadCache::kResident;
  EXPECT_FALSE(p.ColdReadsToEngine(-1, size, 0, from));
}

// Issue 54: a reader who could not write the file learns nothing of its residency from the
// decisions (the kernel refuses it cachestat), and the reader's memory, not the daemon's, decides.
TEST(ReadPolicyPlan, WithoutTheRightToProbeResidencyCountsAsUnknown) {
  ModelResidency model;
  ModelMemory small(kMiB);
  ReadPolicy p;
  p.residency = &model;
  p.memory = &small;
  p.mode = ReadCache::kAuto;
  const int64_t from = 64 * kMiB, size = 256 * kMiB;
  model.Cache(0, size);
  EXPECT_FALSE(p.ColdReadsToEngine(-1, size, 0, from, /*may_probe=*/true));
  const int64_t asked = model.probes();
  EXPECT_TRUE(p.ColdReadsToEngine(-1, size, 0, from, /*may_probe=*/false))
      << "decided as if cold, whatever is cached";
  EXPECT_EQ(model.probes(), asked) << "the kernel was asked all the same";
  p.residency = &UnknownResidency();
  std::vector<ResidentRun> plan = p.Plan(-1, 0, 4 * kMiB, size);
  ASSERT_EQ(plan.size(), 1u);
  EXPECT_FALSE(plan[0].resident) << "unknown residency reads the device";
}

class PerPidMemory : public MemoryBudget {
 public:
  int64_t Available(pid_t pid) const override { return pid == 4242 ? 16 * kMiB : 1 << 30; }
};

TEST(ReadPolicyPlan, TheReadersMemoryDecidesWhetherARunMayFillThePageCache) {
  ModelResidency model;  // nothing cached
  PerPidMemory mem;
  ReadPolicy p;
  p.residency = &model;
  p.memory = &mem;
  p.mode = ReadCache::kAuto;
  const int64_t size = 200 * kMiB;
  std::vector<ResidentRun> daemon = p.Plan(-1, 0, kMiB, size, /*pid=*/0);
  ASSERT_EQ(daemon.size(), 1u);
  EXPECT_TRUE(daemon[0].resident) << "fits the (model) daemon's memory: through the page cache";
  std::vector<ResidentRun> reader = p.Plan(-1, 0, kMiB, size, /*pid=*/4242);
  ASSERT_EQ(reader.size(), 1u);
  EXPECT_FALSE(reader[0].resident) << "a reader with 16 MiB: the cold run goes to the device";
}

// ---- the real kernel ----

TEST_F(ReadPolicyTest, KernelResidencyCountsPagesAsTheyComeAndGo) {
  if (!HaveCachestat()) GTEST_SKIP() << "no cachestat(2) in this kernel (Linux 6.5+)";
  const std::string path = Path("kernel");
  ASSERT_TRUE(WritePatternFile(path, 4 * kMiB));
  Evict(path);
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  const Residency& k = KernelResidency();
  EXPECT_EQ(k.Resident(fd, 0, 4 * kMiB), 0);
  std::vector<char> buf(kMiB);
  ASSERT_EQ(pread(fd, buf.data(), kMiB / 2, kMiB), kMiB / 2);  // may read a little ahead
  EXPECT_EQ(k.Resident(fd, kMiB, kMiB / 2), kMiB / 2);
  EXPECT_EQ(k.Resident(fd, kMiB + 100, 1000), 1000) << "a piece of a cached page";
  // The kernel's read-ahead may have brought pages after the read, never before it.
  EXPECT_EQ(k.Resident(fd, 0, kMiB), 0);
  ReadPolicy p;
  p.mode = ReadCache::kResident;
  std::vector<ResidentRun> plan = p.Plan(fd, kMiB - 3 * kPage, 6 * kPage, 4 * kMiB);
  ASSERT_GE(plan.size(), 2u);
  EXPECT_FALSE(plan[0].resident);
  EXPECT_EQ(plan[0].len, 3 * kPage) << "split at the first cached page";
  EXPECT_TRUE(plan[1].resident);
  ASSERT_EQ(posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), 0);
  EXPECT_EQ(k.Resident(fd, 0, 4 * kMiB), 0);
  EXPECT_EQ(k.Resident(-1, 0, kMiB), -1) << "a bad descriptor: unknown";
  close(fd);
}

TEST(SystemMemoryTest, AvailableIsPositiveAndAtMostTheMachine) {
  const int64_t avail = SystemMemory().Available(0);
  EXPECT_GT(avail, 0);
  EXPECT_LE(avail, static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE));
  EXPECT_LE(SystemMemory().Available(getpid()), avail + (64 << 20)) << "another pid's view";
}

TEST(HeadroomCacheTest, WorksAKeyOutOncePerTtl) {
  HeadroomCache cache(/*ttl_ns=*/1000, /*capacity=*/8);
  int computed = 0;
  auto value = [&](int64_t v) {
    return [&computed, v] {
      ++computed;
      return v;
    };
  };
  EXPECT_EQ(cache.Get("0::/a", 0, value(10)), 10);
  EXPECT_EQ(cache.Get("0::/a", 999, value(11)), 10) << "within the ttl: the cached value";
  EXPECT_EQ(computed, 1);
  EXPECT_EQ(cache.Get("0::/b", 999, value(20)), 20) << "another membership: its own value";
  EXPECT_EQ(cache.Get("0::/a", 1000, value(12)), 12) << "expired: worked out again";
  EXPECT_EQ(computed, 3);
  EXPECT_EQ(cache.size(), 2u);
}

TEST(HeadroomCacheTest, ManyMembershipsStayBounded) {
  // A local user making cgroups (or processes) by the thousand cannot grow the daemon.
  HeadroomCache cache(/*ttl_ns=*/1'000'000, /*capacity=*/16);
  for (int i = 0; i < 1000; ++i) {
    const std::string key = "0::/user/" + std::to_string(i);
    EXPECT_EQ(cache.Get(key, i, [i] { return int64_t{i}; }), i);
    ASSERT_LE(cache.size(), 16u) << "after " << key;
  }
  // Expired entries go first: the fresh ones stay.
  HeadroomCache aging(/*ttl_ns=*/10, /*capacity=*/4);
  for (int i = 0; i < 3; ++i) aging.Get("old" + std::to_string(i), 0, [] { return int64_t{1}; });
  aging.Get("fresh", 15, [] { return int64_t{2}; });
  aging.Get("new", 16, [] { return int64_t{3}; });  // full: the three expired ones go
  EXPECT_EQ(aging.size(), 2u);
  int again = 0;
  EXPECT_EQ(aging.Get("fresh", 20, [&] { return int64_t{++again}; }), 2) << "kept";
  EXPECT_EQ(again, 0);
}

TEST(SystemMemoryTest, AGoneOpenerIsToldTheMachinesMemory) {
  // The mount asks for its opener's budget after the open; the opener may have exited (nothing
  // to read in /proc): the machine's memory decides, never 0 (every file would go to the
  // engine) or an error.
  const int64_t machine = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
  const int64_t gone = SystemMemory().Available(std::numeric_limits<pid_t>::max());
  EXPECT_GT(gone, 0);
  EXPECT_LE(gone, machine);
  const int64_t parent = SystemMemory().Available(getppid());
  EXPECT_GT(parent, 0);
  EXPECT_LE(parent, machine);
}

}  // namespace
}  // namespace dnvme::datapath
