// Shared by the data path's unit tests (WriteBehind, ReadAhead; tests/datapath/, and
// tests/fs/transport/write_source_test.cc with the FUSE transport's sources): an engine whose
// libaio backend can fail completions on demand (the engine's backend seam, dnvme/aio_backend.h),
// scratch files, and counters. No mount, no FUSE session.
//
// Thread safety: Faults is atomics (read by engine workers); the rest is used by the test thread.
#pragma once

#include <gtest/gtest.h>
#include <libaio.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "datapath/counters.h"
#include "dnvme/aio_backend.h"
#include "dnvme/handle.h"
#include "dnvme/pinned.h"
#include "tests/engine/test_util.h"

namespace dnvme::datapath::test {

using dnvme::test::kKiB;
using dnvme::test::kMiB;

// What the backend injects: completions of requests of the chosen kind that cover
// `fail_offset` get -fail_errno; every `short_every`-th completion is cut to half (the engine
// must continue it); the first write request covering `delay_offset` reaches the kernel only
// `delay_ms` later (from another thread), so a later request for the same bytes can overtake it,
// as two O_DIRECT writes in flight may on a real device.
struct Faults {
  std::atomic<int64_t> delay_offset{-1};
  std::atomic<int> delay_ms{100};
  std::atomic<uint64_t> delayed{0};
  std::atomic<int> fail_errno{0};
  std::atomic<bool> fail_writes{true};
  std::atomic<int64_t> fail_offset{-1};
  std::atomic<int> short_every{0};
  std::atomic<uint64_t> completions{0};
  std::atomic<uint64_t> injected{0};
};

class FaultyBackend : public AioBackend {
 public:
  FaultyBackend(std::unique_ptr<AioBackend> real, Faults* f) : real_(std::move(real)), f_(f) {}
  ~FaultyBackend() override {
    for (auto& t : late_) t.join();  // before the real context goes (it waits for its requests)
  }
  int Submit(long nr, struct iocb** iocbs) override {
    const int64_t at = f_->delay_offset.load();
    for (long i = 0; at >= 0 && i < nr; ++i) {
      const iocb* cb = iocbs[i];
      const auto off = static_cast<int64_t>(cb->u.c.offset);
      if (cb->aio_lio_opcode != IO_CMD_PWRITE || at < off ||
          at >= off + static_cast<int64_t>(cb->u.c.nbytes)) {
        continue;
      }
      if (i > 0) return real_->Submit(i, iocbs);  // the prefix first; it comes back as iocbs[0]
      if (f_->delay_offset.exchange(-1) != at) break;  // once
      f_->delayed.fetch_add(1);
      struct iocb* late = iocbs[0];
      late_.emplace_back([this, late] {
        std::this_thread::sleep_for(std::chrono::milliseconds(f_->delay_ms.load()));
        struct iocb* one[1] = {late};
        while (real_->Submit(1, one) == -EAGAIN) std::this_thread::yield();
      });
      if (nr == 1) return 1;
      const int rest = real_->Submit(nr - 1, iocbs + 1);
      return rest < 0 ? 1 : 1 + rest;
    }
    return real_->Submit(nr, iocbs);
  }
  int GetEvents(long min_nr, long nr, struct io_event* events, struct timespec* t) override {
    const int n = real_->GetEvents(min_nr, nr, events, t);
    for (int i = 0; i < n; ++i) {
      io_event& e = events[i];
      const iocb* cb = e.obj;
      const bool write = cb->aio_lio_opcode == IO_CMD_PWRITE;
      const auto off = static_cast<int64_t>(cb->u.c.offset);
      const auto len = static_cast<int64_t>(cb->u.c.nbytes);
      const int64_t at = f_->fail_offset.load();
      if (f_->fail_errno.load() != 0 && write == f_->fail_writes.load() && at >= off &&
          at < off + len) {
        e.res = static_cast<unsigned long>(-static_cast<long>(f_->fail_errno.load()));
        f_->injected.fetch_add(1);
        continue;
      }
      const int every = f_->short_every.load();
      const auto res = static_cast<long>(e.res);
      if (every > 0 && res > 8192 && f_->completions.fetch_add(1) % every == 0) {
        // Half of what was done, page-rounded: the engine continues from there.
        e.res = static_cast<unsigned long>(res / 2 / 4096 * 4096);
        f_->injected.fetch_add(1);
      }
    }
    return n;
  }

 private:
  std::unique_ptr<AioBackend> real_;
  Faults* f_;
  std::vector<std::thread> late_;  // delayed submissions (touched by the worker thread only)
};

class FaultyFactory : public AioBackendFactory {
 public:
  explicit FaultyFactory(Faults* f) : real_(LibaioBackendFactory()), f_(f) {}
  Result<std::unique_ptr<AioBackend>> Create(unsigned depth) override {
    auto real = real_->Create(depth);
    if (!real.ok()) return real.status();
    return std::unique_ptr<AioBackend>(new FaultyBackend(std::move(real).value(), f_));
  }

 private:
  std::shared_ptr<AioBackendFactory> real_;
  Faults* f_;
};

// A fixture with a scratch directory and a fault-injecting engine (256 KiB blocks, so a 1 MiB
// extent is several requests; overlap_events).
class DataPathTest : public dnvme::test::ScratchTest {
 protected:
  void SetUp() override {
    ScratchTest::SetUp();
    HandleConfig c;
    c.block_size = 256 * kKiB;
    c.queue_depth = 8;
    // A sliding window: a worker takes new operations while requests of earlier ones are still
    // in flight (lock-step batches would order overlapping writes by themselves).
    c.overlap_events = true;
    HandleOptions o;
    o.backend = std::make_shared<FaultyFactory>(&faults_);
    auto h = AioHandle::Create(c, o);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    engine_ = std::shared_ptr<AioHandle>(std::move(h).value());
  }
  void TearDown() override {
    engine_.reset();
    ScratchTest::TearDown();
  }
  std::function<std::shared_ptr<AioHandle>()> EngineSource() {
    return [this] { return engine_; };
  }
  FileRef Open(const std::string& name) {
    auto f = engine_->open_file(Path(name), FileAccess::kReadWrite);
    EXPECT_TRUE(f.ok()) << f.status().ToString();
    return f.ok() ? f.value() : FileRef();
  }

  Faults faults_;
  std::shared_ptr<AioHandle> engine_;
  Counters counters_;
};

}  // namespace dnvme::datapath::test
