#include "engine/handle/worker.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>

#include "engine/common/log.h"

namespace dnvme {
namespace {

int64_t RoundUp(int64_t v, int64_t a) { return (v + a - 1) / a * a; }
int64_t RoundDown(int64_t v, int64_t a) { return v / a * a; }

bool Aligned(const void* p, uint32_t align) { return reinterpret_cast<uintptr_t>(p) % align == 0; }

const char* Verb(bool write) { return write ? "write" : "read"; }

// Consecutive io_submit refusals with nothing in flight before the slice gives up. With the
// backoff below this is several seconds of a kernel that accepts nothing.
constexpr int kMaxIdleSubmitRetries = 2000;

}  // namespace

// One libaio request slot. The iocb is handed to the kernel; iocb.data points back here.
struct Worker::Request {
  struct iocb cb {};
  int index = 0;
  char* user = nullptr;      // caller memory for `offset`
  int64_t offset = 0;        // file offset of the bytes still to move
  int64_t length = 0;        // bytes still to move
  PinnedPool::Lease bounce;  // empty when the request reads/writes caller memory directly
  int64_t bounce_pos = 0;    // position in the bounce buffer that matches `offset`
};

// The direct part of one slice: the submit/reap loop.
//
// Slots move between four places: free_, a batch being submitted, in flight (inflight_), and
// retry_ (prepared but refused by io_submit, or a continuation after a short transfer). They are
// never lost: every exit path releases what is not in flight, and a fatal io_getevents error
// destroys the context (io_destroy waits for in-flight requests) before buffers are released.
class Worker::SliceRun {
 public:
  SliceRun(Worker& w, const Slice& s, OpState& op, int64_t begin, int64_t end, int64_t req_size)
      : w_(w),
        s_(s),
        op_(op),
        f_(*op.file),
        write_(op.result.type == OpType::kWrite),
        cursor_(begin),
        end_(end),
        req_size_(req_size),
        qd_(static_cast<size_t>(w.config_.queue_depth)) {
    free_.reserve(qd_);
    for (size_t i = qd_; i > 0; --i) free_.push_back(static_cast<int>(i - 1));
    batch_.reserve(qd_);
  }

  // Returns the first error (by file offset); `err_offset` receives where it happened.
  Status Run(int64_t* err_offset) {
    const bool overlap = w_.config_.overlap_events;
    while (true) {
      batch_.clear();
      if (!stop_ && (overlap || inflight_ == 0)) Fill();
      bool refused = false;
      if (!batch_.empty()) refused = Submit();
      if (inflight_ == 0) {
        if (stop_ || (cursor_ >= end_ && retry_.empty())) break;
        if (refused) Backoff();
        continue;
      }
      Status st = Reap(overlap ? 1 : inflight_);
      if (!st.ok()) {
        // The context is in an unknown state: destroy it (waits for the kernel to finish with our
        // buffers); the next slice makes a fresh one.
        Logger().error("worker {}: {}; recreating the AIO context", w_.index_, st.ToString());
        w_.aio_.reset();
        inflight_ = 0;
        Fail(st, cursor_);
        for (auto& r : w_.requests_) r.bounce.Reset();
        break;
      }
    }
    while (!retry_.empty()) {
      Release(w_.requests_[retry_.front()]);
      retry_.pop_front();
    }
    HandleCounters& c = *w_.counters_;
    c.bytes_direct.fetch_add(direct_bytes_, std::memory_order_relaxed);
    c.bytes_bounce.fetch_add(bounce_bytes_, std::memory_order_relaxed);
    c.bytes_buffered.fetch_add(buffered_bytes_, std::memory_order_relaxed);
    c.requests.fetch_add(requests_, std::memory_order_relaxed);
    c.submit_calls.fetch_add(submit_calls_, std::memory_order_relaxed);
    c.submit_retries.fetch_add(retries_, std::memory_order_relaxed);
    c.short_transfers.fetch_add(shorts_, std::memory_order_relaxed);
    *err_offset = err_offset_;
    return err_;
  }

 private:
  void Prep(Request& r) {
    void* buf = r.bounce ? r.bounce.data() + r.bounce_pos : r.user;
    if (write_) {
      io_prep_pwrite(&r.cb, f_.direct_fd, buf, static_cast<size_t>(r.length), r.offset);
    } else {
      io_prep_pread(&r.cb, f_.direct_fd, buf, static_cast<size_t>(r.length), r.offset);
    }
    r.cb.data = &r;
  }

  // Gathers up to queue_depth - inflight requests: refused/continued ones first, then new ones.
  void Fill() {
    while (inflight_ + batch_.size() < qd_) {
      if (!retry_.empty()) {
        batch_.push_back(&w_.requests_[retry_.front()].cb);
        retry_.pop_front();
        continue;
      }
      if (cursor_ >= end_ || free_.empty()) break;
      Request& r = w_.requests_[free_.back()];
      const int64_t len = std::min(req_size_, end_ - cursor_);
      char* user = s_.buffer + (cursor_ - s_.offset);
      if (!Aligned(user, f_.mem_align)) {
        if (pool_ == nullptr) {
          // Bounce buffers are pinned on first need: aligned callers never pin any.
          auto pool = w_.BouncePool(req_size_, f_.mem_align);
          if (!pool.ok()) {
            Fail(pool.status(), cursor_);
            break;
          }
          pool_ = pool.value();
        }
        r.bounce = pool_->TryAcquire();
        if (!r.bounce) break;  // all bounce buffers in flight; reaping frees one
        if (write_) std::memcpy(r.bounce.data(), user, static_cast<size_t>(len));
      }
      free_.pop_back();
      r.user = user;
      r.offset = cursor_;
      r.length = len;
      r.bounce_pos = 0;
      Prep(r);
      batch_.push_back(&r.cb);
      cursor_ += len;
    }
  }

  // Returns true when io_submit refused (part of) the batch for now (EAGAIN, or nothing taken);
  // refused requests wait in retry_, in order.
  bool Submit() {
    size_t done = 0;
    bool refused = false;
    while (done < batch_.size()) {
      long n = w_.config_.single_submit ? 1 : static_cast<long>(batch_.size() - done);
      int rc = w_.aio_->Submit(n, &batch_[done]);
      if (rc > 0) {
        done += static_cast<size_t>(rc);
        inflight_ += rc;
        ++submit_calls_;
        requests_ += static_cast<uint64_t>(rc);
        idle_retries_ = 0;
        continue;
      }
      ++retries_;
      if (rc == -EINTR) continue;
      if (rc == 0 || rc == -EAGAIN) {
        refused = true;
        break;
      }
      Request& r = *static_cast<Request*>(batch_[done]->data);
      Fail(Status::FromErrno(-rc, std::string("io_submit of a ") + Verb(write_) + " of " +
                                      std::to_string(r.length) + " bytes at offset " +
                                      std::to_string(r.offset) + " of '" + f_.label + "'"),
           r.offset);
      for (size_t i = done; i < batch_.size(); ++i) {
        Release(*static_cast<Request*>(batch_[i]->data));
      }
      return false;
    }
    for (size_t i = batch_.size(); i > done; --i) {
      retry_.push_front(static_cast<Request*>(batch_[i - 1]->data)->index);
    }
    return refused;
  }

  // Nothing in flight and the kernel refused new work: wait a little, then give up eventually.
  void Backoff() {
    if (++idle_retries_ > kMaxIdleSubmitRetries) {
      int64_t off = w_.requests_[retry_.front()].offset;
      Fail(Status::ResourceExhausted(EAGAIN, "io_submit kept refusing requests (EAGAIN) for '" +
                                                 f_.label + "' at offset " + std::to_string(off)),
           off);
      return;
    }
    auto delay = std::chrono::microseconds(std::min(1000, 10 << std::min(idle_retries_, 7)));
    std::this_thread::sleep_for(delay);
  }

  Status Reap(long min_nr) {
    int n = w_.aio_->GetEvents(min_nr, static_cast<long>(qd_), w_.events_.data(), nullptr);
    if (n == -EINTR) return Status::Ok();  // the loop calls again
    if (n < 0) return Status::FromErrno(-n, "io_getevents on '" + f_.label + "'");
    for (int i = 0; i < n; ++i) {
      const io_event& ev = w_.events_[static_cast<size_t>(i)];
      Complete(*static_cast<Request*>(ev.obj->data), static_cast<long>(ev.res));
    }
    return Status::Ok();
  }

  void Complete(Request& r, long res) {
    --inflight_;
    if (res < 0) {
      Fail(Status::FromErrno(static_cast<int>(-res),
                             std::string(Verb(write_)) + " of " + std::to_string(r.length) +
                                 " bytes at offset " + std::to_string(r.offset) + " of '" +
                                 f_.label + "'"),
           r.offset);
      Release(r);
      return;
    }
    if (res > r.length) {
      Fail(Status::Internal("libaio completed " + std::to_string(res) + " bytes for a request of " +
                            std::to_string(r.length) + " at offset " + std::to_string(r.offset) +
                            " of '" + f_.label + "'"),
           r.offset);
      Release(r);
      return;
    }
    if (!write_ && r.bounce && res > 0) {
      std::memcpy(r.user, r.bounce.data() + r.bounce_pos, static_cast<size_t>(res));
    }
    (r.bounce ? bounce_bytes_ : direct_bytes_) += static_cast<uint64_t>(res);
    op_.bytes_done.fetch_add(res, std::memory_order_relaxed);
    if (res == r.length) {
      Release(r);
      return;
    }
    // A short transfer: never ignored. Continue from where the kernel stopped.
    ++shorts_;
    if (res == 0) {
      Fail(write_ ? Status::IoError(EIO, "write at offset " + std::to_string(r.offset) + " of '" +
                                             f_.label + "' completed with 0 bytes")
                  : EndOfFileStatus(f_.direct_fd, f_.label, r.offset, r.length),
           r.offset);
      Release(r);
      return;
    }
    r.offset += res;
    r.user += res;
    r.bounce_pos += res;
    r.length -= res;
    if (stop_) {
      Release(r);
      return;
    }
    const void* next = r.bounce ? r.bounce.data() + r.bounce_pos : r.user;
    if (r.offset % f_.offset_align == 0 && r.length % f_.offset_align == 0 &&
        Aligned(next, f_.mem_align)) {
      Prep(r);
      retry_.push_back(r.index);
      return;
    }
    // The remainder is no longer aligned for O_DIRECT: finish it through the page cache. (At end
    // of file this is where a read learns there is nothing more.)
    int64_t done = 0;
    Status st = write_ ? PwriteFull(f_.buffered_fd, r.user, r.length, r.offset, f_.label, &done)
                       : PreadFull(f_.buffered_fd, r.user, r.length, r.offset, f_.label, &done);
    buffered_bytes_ += static_cast<uint64_t>(done);
    op_.bytes_done.fetch_add(done, std::memory_order_relaxed);
    if (!st.ok()) Fail(std::move(st), r.offset + done);
    Release(r);
  }

  void Fail(Status st, int64_t offset) {
    if (err_.ok() || offset < err_offset_) {
      err_ = std::move(st);
      err_offset_ = offset;
    }
    stop_ = true;
  }

  void Release(Request& r) {
    r.bounce.Reset();
    free_.push_back(r.index);
  }

  Worker& w_;
  const Slice& s_;
  OpState& op_;
  const IoFile& f_;
  const bool write_;
  int64_t cursor_;
  const int64_t end_;
  PinnedPool* pool_ = nullptr;
  const int64_t req_size_;
  const size_t qd_;

  size_t inflight_ = 0;
  std::vector<int> free_;
  std::deque<int> retry_;
  std::vector<struct iocb*> batch_;
  Status err_;
  int64_t err_offset_ = -1;
  bool stop_ = false;
  int idle_retries_ = 0;

  uint64_t direct_bytes_ = 0, bounce_bytes_ = 0, buffered_bytes_ = 0;
  uint64_t requests_ = 0, submit_calls_ = 0, retries_ = 0, shorts_ = 0;
};

Worker::Worker(int index, const HandleConfig& config, std::shared_ptr<AioBackendFactory> factory,
               HandleCounters* counters)
    : index_(index), config_(config), factory_(std::move(factory)), counters_(counters) {
  requests_.resize(static_cast<size_t>(config_.queue_depth));
  for (size_t i = 0; i < requests_.size(); ++i) requests_[i].index = static_cast<int>(i);
  events_.resize(static_cast<size_t>(config_.queue_depth));
}

Result<std::unique_ptr<Worker>> Worker::Create(int index, const HandleConfig& config,
                                               std::shared_ptr<AioBackendFactory> factory,
                                               HandleCounters* counters) {
  std::unique_ptr<Worker> w(new Worker(index, config, std::move(factory), counters));
  DNVME_RETURN_IF_ERROR(w->EnsureBackend());
  w->thread_ = std::thread([p = w.get()] { p->Loop(); });
  return w;
}

Worker::~Worker() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  not_empty_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Worker::Post(Slice slice) {
  {
    std::unique_lock lock(mu_);
    not_full_.wait(lock, [&] { return queue_.size() < kQueueCapacity; });
    queue_.push_back(std::move(slice));
  }
  not_empty_.notify_one();
}

void Worker::Loop() {
  while (true) {
    Slice slice;
    {
      std::unique_lock lock(mu_);
      not_empty_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and everything posted has run
      slice = std::move(queue_.front());
      queue_.pop_front();
    }
    not_full_.notify_one();
    RunSlice(slice);
  }
}

Status Worker::EnsureBackend() {
  if (aio_) return Status::Ok();
  auto b = factory_->Create(static_cast<unsigned>(config_.queue_depth));
  if (!b.ok()) return b.status();
  aio_ = std::move(b).value();
  return Status::Ok();
}

void Worker::RunSlice(const Slice& slice) {
  OpState& op = *slice.op;
  const IoFile& f = *op.file;
  const bool write = op.result.type == OpType::kWrite;
  const int64_t begin = slice.offset;
  const int64_t end = slice.offset + slice.length;

  Status st;
  int64_t err_off = begin;
  // Buffered piece: caller memory straight to/from the page cache.
  auto buffered = [&](int64_t from, int64_t to) {
    if (!st.ok() || from >= to) return;
    int64_t done = 0;
    char* p = slice.buffer + (from - begin);
    st = write ? PwriteFull(f.buffered_fd, p, to - from, from, f.label, &done)
               : PreadFull(f.buffered_fd, p, to - from, from, f.label, &done);
    counters_->bytes_buffered.fetch_add(static_cast<uint64_t>(done), std::memory_order_relaxed);
    op.bytes_done.fetch_add(done, std::memory_order_relaxed);
    if (!st.ok()) err_off = from + done;
  };

  if (f.direct_fd < 0) {
    buffered(begin, end);
  } else {
    const int64_t e = f.edge_align;
    int64_t a = RoundUp(begin, e);
    int64_t b = RoundDown(end, e);
    if (a >= b) a = b = end;  // no whole aligned unit inside: all of it is an edge
    buffered(begin, a);
    if (st.ok() && a < b) {
      st = EnsureBackend();
      if (st.ok()) {
        SliceRun run(*this, slice, op, a, b, RoundUp(config_.block_size, e));
        st = run.Run(&err_off);
      } else {
        err_off = a;
      }
    }
    buffered(b, end);
  }
  if (st.ok() && op.validate) st = Validate(slice, op, &err_off);
  if (!st.ok()) op.RecordError(std::move(st), err_off);
  if (op.SliceDone()) Finish(op);
}

Result<PinnedPool*> Worker::BouncePool(int64_t req_size, uint32_t mem_align) {
  const size_t align = std::max<size_t>(mem_align, 4096);
  if (!bounce_ || bounce_->buffer_size() < static_cast<size_t>(req_size) || bounce_align_ < align) {
    // Buffers are pinned lazily: a handle that only ever sees aligned memory never pins any.
    const int64_t want = std::max<int64_t>(2, config_.bounce_bytes_per_worker / req_size);
    const size_t count =
        static_cast<size_t>(std::min<int64_t>(want, std::max(2, config_.queue_depth)));
    bounce_.reset();
    // Under a tight RLIMIT_MEMLOCK take fewer buffers rather than fail: two are enough to make
    // progress (one in flight while the next is filled).
    size_t n = count;
    auto pool = PinnedPool::Create(static_cast<size_t>(req_size), n, align);
    while (!pool.ok() && pool.status().code() == Status::Code::kResourceExhausted && n > 2) {
      n = std::max<size_t>(2, n / 2);
      pool = PinnedPool::Create(static_cast<size_t>(req_size), n, align);
    }
    if (!pool.ok()) return pool.status();
    if (n < count) {
      Logger().warn("worker {}: pinned {} bounce buffers instead of {} (RLIMIT_MEMLOCK)", index_, n,
                    count);
    }
    bounce_ = std::move(pool).value();
    bounce_align_ = align;
  }
  return bounce_.get();
}

Status Worker::Validate(const Slice& slice, OpState& op, int64_t* err_off) {
  const IoFile& f = *op.file;
  const int fd = f.read_fd >= 0 ? f.read_fd : f.buffered_fd;
  constexpr int64_t kChunk = 8 << 20;
  std::unique_ptr<char[]> tmp(new char[static_cast<size_t>(std::min(kChunk, slice.length))]);
  for (int64_t pos = 0; pos < slice.length; pos += kChunk) {
    const int64_t n = std::min(kChunk, slice.length - pos);
    int64_t got = 0;
    Status st = PreadFull(fd, tmp.get(), n, slice.offset + pos, f.label, &got);
    if (!st.ok()) {
      *err_off = slice.offset + pos + got;
      return st.WithContext("validate");
    }
    const char* want = slice.buffer + pos;
    if (std::memcmp(tmp.get(), want, static_cast<size_t>(n)) != 0) {
      int64_t i = 0;
      while (tmp[static_cast<size_t>(i)] == want[i]) ++i;
      *err_off = slice.offset + pos + i;
      return Status::DataMismatch("validate: byte at offset " + std::to_string(*err_off) + " of '" +
                                  f.label + "' differs from the buffer after the " +
                                  OpTypeName(op.result.type));
    }
  }
  return Status::Ok();
}

void Worker::Finish(OpState& op) {
  const bool write = op.result.type == OpType::kWrite;
  if (write && op.fdatasync_at_end && op.ok()) {
    const IoFile& f = *op.file;
    int fd = f.direct_fd >= 0 ? f.direct_fd : f.buffered_fd;
    int rc;
    do {
      rc = ::fdatasync(fd);
    } while (rc != 0 && errno == EINTR);
    if (rc != 0) op.RecordError(Status::FromErrno(errno, "fdatasync of '" + f.label + "'"), 0);
  }
  const int64_t bytes = op.bytes_done.load(std::memory_order_relaxed);
  HandleCounters& c = *counters_;
  if (op.validate) c.validate_checks.fetch_add(1, std::memory_order_relaxed);
  (write ? c.ops_written : c.ops_read).fetch_add(1, std::memory_order_relaxed);
  (write ? c.bytes_written : c.bytes_read)
      .fetch_add(static_cast<uint64_t>(bytes), std::memory_order_relaxed);
  if (!op.ok()) c.ops_failed.fetch_add(1, std::memory_order_relaxed);
  op.MarkDone();
}

}  // namespace dnvme
