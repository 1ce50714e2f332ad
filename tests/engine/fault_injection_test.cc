// Fault injection through the libaio seam (dnvme/aio_backend.h): a backend that wraps the real
// libaio one and makes io_submit answer EAGAIN/EINTR or accept part of a batch, shortens
// completions, turns a completion into -EIO/-ENOSPC, and corrupts data in flight. Each test checks
// that the engine still moves exactly the right bytes, or reports the failure with path, offset
// and errno, and stays usable.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <libaio.h>
#include <sys/uio.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <ostream>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "dnvme/aio_backend.h"
#include "dnvme/handle.h"
#include "tests/engine/test_util.h"

namespace dnvme {
namespace {

using Code = Status::Code;
using test::AlignedBuffer;
using test::kKiB;
using test::kMiB;

// ---- The fault plan and the wrapping backend ---------------------------------------------------

// What to inject, shared by every backend of one handle (workers run concurrently, so atomics).
struct FaultPlan {
  // (a) io_submit: every 4th call -EAGAIN (only while requests are in flight, as the kernel would),
  // every 4th -EINTR, every 4th accepts only the first request of a batch.
  std::atomic<bool> submit_faults{false};
  std::atomic<uint64_t> submit_calls{0};
  std::atomic<uint64_t> injected_eagain{0};
  std::atomic<uint64_t> injected_eintr{0};
  std::atomic<uint64_t> injected_partial{0};

  // (b) every 3rd successful completion is shortened, alternately to a multiple of 4096 and to an
  // odd byte count.
  std::atomic<bool> short_completions{false};
  std::atomic<uint64_t> completions_seen{0};
  std::atomic<uint64_t> injected_short_aligned{0};
  std::atomic<uint64_t> injected_short_unaligned{0};

  // (c)/(d) the completion of every request of kind `fail_write` covering `fail_offset` gets
  // res = -fail_errno. The first such request's offset and length are recorded.
  std::atomic<int> fail_errno{0};
  std::atomic<bool> fail_write{true};
  std::atomic<int64_t> fail_offset{-1};
  std::atomic<int64_t> failed_request_offset{-1};
  std::atomic<int64_t> failed_request_length{-1};
  std::atomic<uint64_t> injected_errors{0};

  // (e) flip the byte at this file offset in every read completion that covers it.
  std::atomic<int64_t> corrupt_read_offset{-1};
  std::atomic<uint64_t> injected_read_corruptions{0};

  // (f) once: the write request covering this offset is submitted from a copy with that byte
  // flipped (the caller's memory is untouched), so the disk gets a wrong byte.
  std::atomic<int64_t> corrupt_write_offset{-1};
  std::atomic<uint64_t> injected_write_corruptions{0};

  // Sanity: the engine asked GetEvents to wait (no timeout) for more completions than it had in
  // flight, which on a real context blocks forever. Answered with a timeout instead, and counted.
  std::atomic<uint64_t> getevents_overreach{0};
  std::atomic<uint64_t> backends_created{0};
};

bool IsRead(const iocb* cb) {
  return cb->aio_lio_opcode == IO_CMD_PREAD || cb->aio_lio_opcode == IO_CMD_PREADV;
}
bool IsWrite(const iocb* cb) {
  return cb->aio_lio_opcode == IO_CMD_PWRITE || cb->aio_lio_opcode == IO_CMD_PWRITEV;
}
bool IsVector(const iocb* cb) {
  return cb->aio_lio_opcode == IO_CMD_PREADV || cb->aio_lio_opcode == IO_CMD_PWRITEV;
}
int64_t IocbOffset(const iocb* cb) { return IsVector(cb) ? cb->u.v.offset : cb->u.c.offset; }
int64_t IocbLength(const iocb* cb) {
  if (!IsVector(cb)) return static_cast<int64_t>(cb->u.c.nbytes);
  int64_t n = 0;
  for (unsigned long i = 0; i < cb->u.v.nr; ++i) n += static_cast<int64_t>(cb->u.v.vec[i].iov_len);
  return n;
}
// The memory byte that holds request byte `index`.
uint8_t* IocbByte(const iocb* cb, int64_t index) {
  if (!IsVector(cb)) return static_cast<uint8_t*>(cb->u.c.buf) + index;
  for (unsigned long i = 0; i < cb->u.v.nr; ++i) {
    const auto len = static_cast<int64_t>(cb->u.v.vec[i].iov_len);
    if (index < len) return static_cast<uint8_t*>(cb->u.v.vec[i].iov_base) + index;
    index -= len;
  }
  return nullptr;
}

class FaultBackend : public AioBackend {
 public:
  FaultBackend(std::unique_ptr<AioBackend> real, std::shared_ptr<FaultPlan> plan)
      : real_(std::move(real)), plan_(std::move(plan)) {}
  ~FaultBackend() override {
    for (auto& [cb, swap] : swapped_) std::free(swap.copy);
  }

  int Submit(long nr, struct iocb** iocbs) override {
    if (plan_->submit_faults && nr > 0) {
      const uint64_t k = plan_->submit_calls.fetch_add(1);
      switch (k % 4) {
        case 0:
          if (in_flight_ > 0) {
            plan_->injected_eagain.fetch_add(1);
            return -EAGAIN;
          }
          break;
        case 1:
          plan_->injected_eintr.fetch_add(1);
          return -EINTR;
        case 2:
          if (nr > 1) {
            plan_->injected_partial.fetch_add(1);
            nr = 1;
          }
          break;
        default:
          break;
      }
    }
    std::vector<iocb*> swapped_now;
    if (plan_->corrupt_write_offset.load() >= 0) {
      for (long i = 0; i < nr; ++i) {
        iocb* cb = iocbs[i];
        const int64_t target = plan_->corrupt_write_offset.load();
        if (target < 0 || cb->aio_lio_opcode != IO_CMD_PWRITE) continue;
        const int64_t off = IocbOffset(cb);
        const int64_t len = IocbLength(cb);
        if (target < off || target >= off + len) continue;
        int64_t expected = target;
        if (!plan_->corrupt_write_offset.compare_exchange_strong(expected, -1)) continue;
        void* copy = nullptr;
        if (::posix_memalign(&copy, 4096, static_cast<size_t>(len)) != 0) continue;
        std::memcpy(copy, cb->u.c.buf, static_cast<size_t>(len));
        static_cast<uint8_t*>(copy)[target - off] ^= 0xFF;
        swapped_[cb] = Swap{cb->u.c.buf, copy};
        cb->u.c.buf = copy;
        swapped_now.push_back(cb);
        plan_->injected_write_corruptions.fetch_add(1);
      }
    }
    const int r = real_->Submit(nr, iocbs);
    if (r > 0) in_flight_ += r;
    // Requests the kernel did not take go back to the engine exactly as they came.
    for (long i = r > 0 ? r : 0; i < nr; ++i) Restore(iocbs[i]);
    return r;
  }

  int GetEvents(long min_nr, long nr, struct io_event* events, struct timespec* timeout) override {
    struct timespec guard = {2, 0};
    if (timeout == nullptr && min_nr > in_flight_) {
      plan_->getevents_overreach.fetch_add(1);
      timeout = &guard;
    }
    const int r = real_->GetEvents(min_nr, nr, events, timeout);
    if (r <= 0) return r;
    in_flight_ -= r;
    for (int i = 0; i < r; ++i) Mutate(&events[i]);
    return r;
  }

 private:
  struct Swap {
    void* original;
    void* copy;
  };

  void Restore(iocb* cb) {
    auto it = swapped_.find(cb);
    if (it == swapped_.end()) return;
    cb->u.c.buf = it->second.original;
    std::free(it->second.copy);
    swapped_.erase(it);
  }

  void Mutate(io_event* ev) {
    iocb* cb = ev->obj;
    Restore(cb);
    const auto res = static_cast<long>(ev->res);
    const int64_t off = IocbOffset(cb);
    const int64_t len = IocbLength(cb);

    const int err = plan_->fail_errno.load();
    const int64_t fail_at = plan_->fail_offset.load();
    if (err != 0 && res >= 0 && (plan_->fail_write ? IsWrite(cb) : IsRead(cb)) && fail_at >= off &&
        fail_at < off + len) {
      ev->res = static_cast<unsigned long>(-static_cast<long>(err));
      int64_t none = -1;
      if (plan_->failed_request_offset.compare_exchange_strong(none, off)) {
        plan_->failed_request_length = len;
      }
      plan_->injected_errors.fetch_add(1);
      return;
    }

    const int64_t corrupt_at = plan_->corrupt_read_offset.load();
    if (corrupt_at >= 0 && IsRead(cb) && res > 0 && corrupt_at >= off && corrupt_at < off + res) {
      if (uint8_t* p = IocbByte(cb, corrupt_at - off)) {
        *p ^= 0xFF;
        plan_->injected_read_corruptions.fetch_add(1);
      }
    }

    if (plan_->short_completions && res > 2) {
      const uint64_t k = plan_->completions_seen.fetch_add(1);
      if (k % 3 == 0) {
        long shorter;
        if ((k / 3) % 2 == 0 && res >= 8192) {
          shorter = (res / 2) / 4096 * 4096;
          plan_->injected_short_aligned.fetch_add(1);
        } else {
          shorter = res / 2 + 1;
          if (shorter % 4096 == 0) --shorter;
          plan_->injected_short_unaligned.fetch_add(1);
        }
        ev->res = static_cast<unsigned long>(shorter);
      }
    }
  }

  std::unique_ptr<AioBackend> real_;
  std::shared_ptr<FaultPlan> plan_;
  long in_flight_ = 0;  // this backend belongs to one worker thread
  std::unordered_map<iocb*, Swap> swapped_;
};

class FaultFactory : public AioBackendFactory {
 public:
  explicit FaultFactory(std::shared_ptr<FaultPlan> plan)
      : real_(LibaioBackendFactory()), plan_(std::move(plan)) {}
  Result<std::unique_ptr<AioBackend>> Create(unsigned depth) override {
    DNVME_ASSIGN_OR_RETURN(std::unique_ptr<AioBackend> real, real_->Create(depth));
    plan_->backends_created.fetch_add(1);
    return std::unique_ptr<AioBackend>(std::make_unique<FaultBackend>(std::move(real), plan_));
  }

 private:
  std::shared_ptr<AioBackendFactory> real_;
  std::shared_ptr<FaultPlan> plan_;
};

// ---- Fixture
// -------------------------------------------------------------------------------------

HandleConfig FaultConfig(int intra_op, bool single_submit, bool overlap_events) {
  HandleConfig c;
  c.block_size = 128 * kKiB;
  c.queue_depth = 8;
  c.intra_op_parallelism = intra_op;
  c.single_submit = single_submit;
  c.overlap_events = overlap_events;
  c.bounce_bytes_per_worker = 2 * kMiB;
  return c;
}

class FaultTest : public test::ScratchTest {
 protected:
  void Open(const HandleConfig& config) {
    plan_ = std::make_shared<FaultPlan>();
    HandleOptions options;
    options.backend = std::make_shared<FaultFactory>(plan_);
    Result<std::unique_ptr<AioHandle>> h = AioHandle::Create(config, options);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    handle_ = std::move(h).value();
    ASSERT_GE(plan_->backends_created.load(), 1u) << "the handle did not use the backend factory";
  }
  void TearDown() override {
    handle_.reset();
    if (plan_) {
      EXPECT_EQ(plan_->getevents_overreach.load(), 0u)
          << "the engine waited (no timeout) for more completions than it had in flight; on a "
             "real libaio context that blocks forever";
    }
    test::ScratchTest::TearDown();
  }

  // Write a pattern, check it with plain POSIX, read it back through the engine, check again.
  void WriteThenReadBack(const std::string& path, int64_t size, size_t misalign, int64_t offset,
                         uint64_t seed) {
    test::Watchdog wd(std::chrono::seconds(300), "write+read under fault injection");
    AlignedBuffer w(static_cast<size_t>(size), misalign);
    w.Fill(offset, seed);
    DNVME_ASSERT_OK(handle_->sync_pwrite(w.data(), size, path, offset));
    ASSERT_EQ(test::FileSize(path), offset + size);
    const std::vector<uint8_t> file = test::ReadWholeFile(path);
    ASSERT_EQ(static_cast<int64_t>(file.size()), offset + size);
    EXPECT_TRUE(test::AllBytesAre(file.data(), static_cast<size_t>(offset), 0));
    EXPECT_TRUE(test::MatchesPattern(file.data() + offset, static_cast<size_t>(size), offset, seed))
        << "file content after the write";
    AlignedBuffer r(static_cast<size_t>(size), misalign);
    r.Set(0xEE);
    DNVME_ASSERT_OK(handle_->sync_pread(r.data(), size, path, offset));
    EXPECT_TRUE(test::MatchesPattern(r.data(), r.size(), offset, seed)) << "data read back";
    EXPECT_TRUE(r.GuardsIntact());
  }

  std::shared_ptr<FaultPlan> plan_;
  std::unique_ptr<AioHandle> handle_;
};

struct ModeParam {
  const char* name;
  bool single_submit;
  bool overlap_events;
  int intra_op;
  size_t misalign;
};

const ModeParam kModes[] = {
    {"batch_lockstep_intra1_aligned", false, false, 1, 0},
    {"batch_overlap_intra1_mis1", false, true, 1, 1},
    {"batch_lockstep_intra3_mis7", false, false, 3, 7},
    {"batch_overlap_intra4_aligned", false, true, 4, 0},
    {"single_lockstep_intra2_mis512", true, false, 2, 512},
};

std::string ModeName(const ::testing::TestParamInfo<ModeParam>& info) { return info.param.name; }
void PrintTo(const ModeParam& p, std::ostream* os) { *os << p.name; }

// ---- (a) io_submit: EAGAIN, EINTR, partial acceptance
// ----------------------------------------------

class SubmitFaultTest : public FaultTest, public ::testing::WithParamInterface<ModeParam> {};

TEST_P(SubmitFaultTest, DataCorrectAndRetriesCounted) {
  const ModeParam& m = GetParam();
  ASSERT_NO_FATAL_FAILURE(Open(FaultConfig(m.intra_op, m.single_submit, m.overlap_events)));
  plan_->submit_faults = true;
  ASSERT_NO_FATAL_FAILURE(WriteThenReadBack(Path("f"), 4 * kMiB + 123, m.misalign, 4095, 1));

  const HandleStats s = handle_->stats();
  EXPECT_GT(plan_->injected_eintr.load(), 0u);
  EXPECT_GT(s.submit_retries, 0u) << s.ToJson();
  EXPECT_GE(s.submit_retries, plan_->injected_eintr.load() + plan_->injected_eagain.load())
      << "every EINTR/EAGAIN answer is a retry: " << s.ToJson();
  EXPECT_EQ(s.ops_failed, 0u);
  EXPECT_LE(s.submit_calls, s.requests) << s.ToJson();
  if (m.single_submit) {
    EXPECT_EQ(s.submit_calls, s.requests) << s.ToJson();
  } else {
    EXPECT_GT(plan_->injected_partial.load(), 0u) << "no batch of more than one request was seen";
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, SubmitFaultTest, ::testing::ValuesIn(kModes), ModeName);

// ---- (b) short completions
// --------------------------------------------------------------------------

class ShortTransferTest : public FaultTest, public ::testing::WithParamInterface<ModeParam> {};

TEST_P(ShortTransferTest, DataExactlyCorrect) {
  const ModeParam& m = GetParam();
  ASSERT_NO_FATAL_FAILURE(Open(FaultConfig(m.intra_op, m.single_submit, m.overlap_events)));
  plan_->short_completions = true;
  ASSERT_NO_FATAL_FAILURE(WriteThenReadBack(Path("f"), 3 * kMiB + 4097, m.misalign, 4095, 2));
  // Aligned start and end too, so the O_DIRECT part runs right up to the end of the file.
  ASSERT_NO_FATAL_FAILURE(WriteThenReadBack(Path("g"), 2 * kMiB, m.misalign, 0, 3));

  const HandleStats s = handle_->stats();
  EXPECT_GT(plan_->injected_short_aligned.load(), 0u);
  EXPECT_GT(plan_->injected_short_unaligned.load(), 0u);
  EXPECT_GT(s.short_transfers, 0u) << s.ToJson();
  EXPECT_EQ(s.ops_failed, 0u) << s.ToJson();
}

INSTANTIATE_TEST_SUITE_P(Modes, ShortTransferTest, ::testing::ValuesIn(kModes), ModeName);

// ---- (c)/(d) error completions
// ------------------------------------------------------------------------

struct ErrorParam {
  const char* name;
  int intra_op;
  size_t misalign;
};

void PrintTo(const ErrorParam& p, std::ostream* os) { *os << p.name; }

class ErrorCompletionTest : public FaultTest, public ::testing::WithParamInterface<ErrorParam> {
 protected:
  void Arm(int err, bool write, int64_t offset) {
    plan_->failed_request_offset = -1;
    plan_->failed_request_length = -1;
    plan_->fail_write = write;
    plan_->fail_offset = offset;
    plan_->fail_errno = err;
  }
  void Disarm() { plan_->fail_errno = 0; }

  // The status names the path and the failing request's offset, and carries the errno.
  void ExpectReported(const Status& st, Code code, int err, const std::string& path,
                      int64_t target) {
    EXPECT_EQ(st.code(), code) << st.ToString();
    EXPECT_EQ(st.error_number(), err) << st.ToString();
    EXPECT_NE(st.message().find(path), std::string::npos) << "path missing: " << st.message();
    const int64_t req = plan_->failed_request_offset.load();
    ASSERT_GE(req, 0) << "nothing was injected (no request covered offset " << target << ")";
    EXPECT_LE(req, target);
    EXPECT_GT(req + plan_->failed_request_length.load(), target);
    EXPECT_NE(st.message().find(std::to_string(req)), std::string::npos)
        << "offset " << req << " of the failing request missing: " << st.message();
  }
};

TEST_P(ErrorCompletionTest, SyncWriteEio) {
  const ErrorParam& p = GetParam();
  ASSERT_NO_FATAL_FAILURE(Open(FaultConfig(p.intra_op, false, true)));
  test::Watchdog wd(std::chrono::seconds(300), "EIO write");
  const std::string path = Path("w");
  AlignedBuffer buf(4 * kMiB, p.misalign);
  buf.Fill(0, 1);
  const int64_t target = 2 * kMiB + 8192;
  Arm(EIO, true, target);
  const Status st = handle_->sync_pwrite(buf.data(), buf.ssize(), path, 0);
  Disarm();
  ASSERT_NO_FATAL_FAILURE(ExpectReported(st, Code::kIoError, EIO, path, target));
  EXPECT_GE(handle_->stats().ops_failed, 1u);

  // Still usable: the same write now succeeds and reads back.
  ASSERT_NO_FATAL_FAILURE(WriteThenReadBack(path, 4 * kMiB, p.misalign, 0, 1));
}

TEST_P(ErrorCompletionTest, SyncReadEio) {
  const ErrorParam& p = GetParam();
  ASSERT_NO_FATAL_FAILURE(Open(FaultConfig(p.intra_op, false, false)));
  test::Watchdog wd(std::chrono::seconds(300), "EIO read");
  const std::string path = Path("r");
  ASSERT_TRUE(test::WritePatternFile(path, 4 * kMiB, 2));
  AlignedBuffer buf(3 * kMiB, p.misalign);
  const int64_t target = kMiB + 3 * 4096;
  Arm(EIO, false, target);
  const Status st = handle_->sync_pread(buf.data(), buf.ssize(), path, 4096);
  Disarm();
  ASSERT_NO_FATAL_FAILURE(ExpectReported(st, Code::kIoError, EIO, path, target));
  EXPECT_TRUE(buf.GuardsIntact());

  DNVME_ASSERT_OK(handle_->sync_pread(buf.data(), buf.ssize(), path, 4096));
  EXPECT_TRUE(test::MatchesPattern(buf.data(), buf.size(), 4096, 2));
}

TEST_P(ErrorCompletionTest, AsyncEioLandsInCompleted) {
  const ErrorParam& p = GetParam();
  ASSERT_NO_FATAL_FAILURE(Open(FaultConfig(p.intra_op, false, true)));
  test::Watchdog wd(std::chrono::seconds(300), "async EIO");
  AlignedBuffer good(kMiB, p.misalign);
  good.Fill(0, 3);
  AlignedBuffer bad(kMiB, p.misalign);
  bad.Fill(8 * kMiB, 4);
  const std::string good_path = Path("good");
  const std::string bad_path = Path("bad");
  const int64_t target = 8 * kMiB + 4096;
  Arm(EIO, true, target);
  DNVME_ASSERT_OK_AND_ASSIGN(OpId id0, handle_->async_pwrite(good.data(), kMiB, good_path, 0));
  DNVME_ASSERT_OK_AND_ASSIGN(OpId id1, handle_->async_pwrite(bad.data(), kMiB, bad_path, 8 * kMiB));
  ASSERT_EQ(handle_->wait(), 2);
  Disarm();
  ASSERT_EQ(handle_->completed().size(), 2u);

  const OpResult& r0 = handle_->completed()[0];
  EXPECT_EQ(r0.id, id0);
  DNVME_EXPECT_OK(r0.status);
  EXPECT_EQ(r0.bytes_done, kMiB);
  EXPECT_EQ(r0.error_offset, -1);

  const OpResult& r1 = handle_->completed()[1];
  EXPECT_EQ(r1.id, id1);
  EXPECT_EQ(r1.path, bad_path);
  ASSERT_NO_FATAL_FAILURE(ExpectReported(r1.status, Code::kIoError, EIO, bad_path, target));
  EXPECT_EQ(r1.error_offset, plan_->failed_request_offset.load());
  EXPECT_LT(r1.bytes_done, r1.length);

  const std::vector<uint8_t> file = test::ReadWholeFile(good_path);
  EXPECT_TRUE(test::MatchesPattern(file.data(), file.size(), 0, 3));

  // Still usable, asynchronously too.
  DNVME_ASSERT_OK_AND_ASSIGN(OpId id2, handle_->async_pwrite(bad.data(), kMiB, bad_path, 8 * kMiB));
  ASSERT_EQ(handle_->wait(), 1);
  EXPECT_EQ(handle_->completed()[0].id, id2);
  DNVME_EXPECT_OK(handle_->completed()[0].status);
}

TEST_P(ErrorCompletionTest, EnospcIsNoSpace) {
  const ErrorParam& p = GetParam();
  ASSERT_NO_FATAL_FAILURE(Open(FaultConfig(p.intra_op, true, false)));
  test::Watchdog wd(std::chrono::seconds(300), "ENOSPC");
  const std::string path = Path("full");
  AlignedBuffer buf(2 * kMiB + 17, p.misalign);
  buf.Fill(4095, 5);
  const int64_t target = kMiB + 4096;
  Arm(ENOSPC, true, target);
  const Status st = handle_->sync_pwrite(buf.data(), buf.ssize(), path, 4095);
  ASSERT_NO_FATAL_FAILURE(ExpectReported(st, Code::kNoSpace, ENOSPC, path, target));

  Arm(ENOSPC, true, target);
  DNVME_ASSERT_OK_AND_ASSIGN(OpId id, handle_->async_pwrite(buf.data(), buf.ssize(), path, 4095));
  ASSERT_EQ(handle_->wait(), 1);
  Disarm();
  const OpResult& r = handle_->completed()[0];
  EXPECT_EQ(r.id, id);
  ASSERT_NO_FATAL_FAILURE(ExpectReported(r.status, Code::kNoSpace, ENOSPC, path, target));
  EXPECT_EQ(r.error_offset, plan_->failed_request_offset.load());

  DNVME_EXPECT_OK(handle_->sync_pwrite(buf.data(), buf.ssize(), path, 4095));
}

INSTANTIATE_TEST_SUITE_P(Shapes, ErrorCompletionTest,
                         ::testing::Values(ErrorParam{"intra1_aligned", 1, 0},
                                           ErrorParam{"intra3_bounce", 3, 1}),
                         [](const ::testing::TestParamInfo<ErrorParam>& info) {
                           return std::string(info.param.name);
                         });

// ---- validate=true against data corrupted in flight ------------------------------------------

TEST_F(FaultTest, ValidateReadDetectsCorruptedData) {
  ASSERT_NO_FATAL_FAILURE(Open(FaultConfig(2, false, true)));
  test::Watchdog wd(std::chrono::seconds(300), "validate read");
  const std::string path = Path("v");
  ASSERT_TRUE(test::WritePatternFile(path, 2 * kMiB, 6));
  const int64_t target = kMiB + 12345;
  AlignedBuffer buf(2 * kMiB, 0);

  plan_->corrupt_read_offset = target;
  // Control: without validation the corruption goes unnoticed (so the injection works).
  DNVME_ASSERT_OK(handle_->pread(buf.data(), buf.ssize(), path, false, false, 0));
  ASSERT_GT(plan_->injected_read_corruptions.load(), 0u) << "no read request covered the target";
  EXPECT_EQ(test::FirstPatternMismatch(buf.data(), buf.size(), 0, 6), target);

  Status st = handle_->pread(buf.data(), buf.ssize(), path, true, false, 0);
  EXPECT_EQ(st.code(), Code::kDataMismatch) << st.ToString();
  EXPECT_NE(st.message().find(std::to_string(target)), std::string::npos)
      << "first differing offset " << target << " missing: " << st.message();
  EXPECT_NE(st.message().find(path), std::string::npos) << st.message();

  DNVME_ASSERT_OK(handle_->pread(buf.data(), buf.ssize(), path, true, true, 0));
  ASSERT_EQ(handle_->wait(), 1);
  EXPECT_EQ(handle_->completed()[0].status.code(), Code::kDataMismatch)
      << handle_->completed()[0].status.ToString();

  plan_->corrupt_read_offset = -1;
  DNVME_EXPECT_OK(handle_->pread(buf.data(), buf.ssize(), path, true, false, 0));
  EXPECT_TRUE(test::MatchesPattern(buf.data(), buf.size(), 0, 6));
  EXPECT_GE(handle_->stats().validate_checks, 3u);
}

TEST_F(FaultTest, ValidateWriteDetectsCorruptedData) {
  ASSERT_NO_FATAL_FAILURE(Open(FaultConfig(1, false, false)));
  test::Watchdog wd(std::chrono::seconds(300), "validate write");
  const std::string path = Path("v");
  AlignedBuffer buf(2 * kMiB, 0);
  buf.Fill(0, 7);
  const int64_t target = kMiB + 777;
  plan_->corrupt_write_offset = target;
  const Status st = handle_->pwrite(buf.data(), buf.ssize(), path, true, false, 0);
  ASSERT_EQ(plan_->injected_write_corruptions.load(), 1u)
      << "no plain PWRITE request covered the target";
  // The disk really holds the wrong byte, and the caller's buffer is untouched.
  const std::vector<uint8_t> file = test::ReadWholeFile(path);
  EXPECT_EQ(test::FirstPatternMismatch(file.data(), file.size(), 0, 7), target);
  EXPECT_TRUE(test::MatchesPattern(buf.data(), buf.size(), 0, 7));

  EXPECT_EQ(st.code(), Code::kDataMismatch) << st.ToString();
  EXPECT_NE(st.message().find(std::to_string(target)), std::string::npos)
      << "first differing offset " << target << " missing: " << st.message();

  DNVME_EXPECT_OK(handle_->pwrite(buf.data(), buf.ssize(), path, true, false, 0));
}

}  // namespace
}  // namespace dnvme
