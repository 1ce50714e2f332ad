// A FileData fixture (tests/datapath/): the fault-injecting engine of DataPathTest, the data
// path's shared state wired to it -- read-ahead chunks (a 4 MiB window), write-behind chunks
// when a test wants them -- and a pinned scratch buffer, as the mount reads into.
//
// Thread safety: the test thread only.
#pragma once

#include <memory>

#include "datapath/file_data.h"
#include "tests/datapath/data_test_util.h"

namespace dnvme::datapath::test {

class FileDataFixture : public DataPathTest {
 protected:
  // Read-ahead chunks of `chunk` bytes (8 of them), `wb_chunks` write-behind chunks of `chunk`
  // (0: none, so writes are synchronous), a scratch buffer of `scratch` bytes.
  void SetUpData(int64_t chunk, size_t wb_chunks, int64_t scratch) {
    ra_pool_ = Pool(chunk, 8);
    shared_.reads.chunks = ra_pool_.get();
    shared_.reads.window = 4 * kMiB;
    shared_.reads.engine = EngineSource();
    shared_.reads.counters = &counters_;
    if (wb_chunks > 0) {
      wb_pool_ = Pool(chunk, wb_chunks);
      shared_.writes.chunks = wb_pool_.get();
      shared_.writes.write_chunk = chunk;
    }
    shared_.writes.engine = EngineSource();
    shared_.writes.counters = &counters_;
    scratch_pool_ = Pool(scratch, 1);
    if (scratch_pool_) scratch_ = scratch_pool_->TryAcquire();
    ASSERT_TRUE(scratch_) << "no pinned scratch buffer";
  }
  void TearDown() override {
    scratch_ = PinnedPool::Lease();
    DataPathTest::TearDown();
  }
  // A read of `n` bytes at `off` through `d`: into `buf` (copied there, as `dnvme run` reads, with
  // `reply` null; else pieces appended to `reply`, as the mount reads into its scratch buffer).
  static Result<int64_t> ReadInto(FileData& d, OpenFile& o, const FileRef& f, int64_t off,
                                  int64_t n, char* buf, ReadReply* reply, Window w = Window::kUse) {
    FileRead r;
    r.off = off;
    r.size = n;
    r.window = w;
    r.buf = buf;
    r.reply = reply;
    r.shrunk_fd = f.buffered_fd();
    return d.Read(o, f, r);
  }
  static std::unique_ptr<PinnedPool> Pool(int64_t size, size_t count) {
    auto p = PinnedPool::Create(static_cast<size_t>(size), count);
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    return p.ok() ? std::move(p).value() : nullptr;
  }

  std::unique_ptr<PinnedPool> ra_pool_, wb_pool_, scratch_pool_;
  PinnedPool::Lease scratch_;
  FileDataShared shared_;
};

}  // namespace dnvme::datapath::test
