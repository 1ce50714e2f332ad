#include "engine/handle/worker.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>

#include "dnvme/identity.h"
#include "dnvme/log.h"

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
  SliceRun* run = nullptr;   // the slice this request belongs to while it is used
  char* user = nullptr;      // caller memory for `offset`
  int64_t offset = 0;        // file offset of the bytes still to move
  int64_t length = 0;        // bytes still to move
  PinnedPool::Lease bounce;  // empty when the request reads/writes caller memory directly
  int64_t bounce_pos = 0;    // position in the bounce buffer that matches `offset`
};

// The direct (aligned) part of one slice while it is active on the worker's ring.
//
// A worker keeps several slices active at once and fills its queue_depth request slots from them
// in arrival order, so many small operations (a mount's 1 MiB requests, several async ops) keep
// the disk busy together instead of one after another. A slot moves between the worker's free
// list, a batch being submitted, in flight, and the run's retry queue (refused by io_submit, or a
// continuation after a short transfer). Every path gives slots back: a finished run releases its
// retries, and a fatal io_getevents error destroys the context (io_destroy waits for in-flight
// requests) before any buffer is released.
class Worker::SliceRun {
 public:
  SliceRun(Worker& w, Slice slice, int64_t begin, int64_t direct_end, int64_t req_size)
      : w_(w),
        slice_(std::move(slice)),
        op_(*slice_.op),
        f_(*op_.file),
        write_(op_.result.type == OpType::kWrite),
        cursor_(begin),
        end_(direct_end),
        req_size_(req_size) {}

  const Slice& slice() const { return slice_; }
  OpState& op() { return op_; }
  bool writes() const { return write_; }
  // Whose identity this run's writes are submitted under (null: the worker's own).
  const FsIdentity* write_as() const { return f_.write_as.get(); }
  int64_t direct_end() const { return end_; }

  // Nothing in flight and nothing more to submit: the worker may complete the slice.
  bool Done() const { return inflight_ == 0 && (stop_ || (cursor_ >= end_ && retry_.empty())); }
  bool Wants() const { return !stop_ && (cursor_ < end_ || !retry_.empty()); }

  // The next request to submit, or null (nothing left, no free slot, or no bounce buffer now).
  Request* Next() {
    if (stop_) return nullptr;
    if (!retry_.empty()) {
      Request* r = retry_.front();
      retry_.pop_front();
      ++handed_;
      return r;
    }
    if (cursor_ >= end_ || w_.free_.empty()) return nullptr;
    Request& r = w_.requests_[static_cast<size_t>(w_.free_.back())];
    const int64_t len = std::min(req_size_, end_ - cursor_);
    char* user = slice_.buffer + (cursor_ - slice_.offset);
    if (!Aligned(user, f_.mem_align)) {
      auto pool = w_.BouncePool(req_size_, f_.mem_align);
      if (!pool.ok()) {
        Fail(pool.status(), cursor_);
        return nullptr;
      }
      if (pool.value() == nullptr) return nullptr;  // being resized once other runs finish
      r.bounce = pool.value()->TryAcquire();
      if (!r.bounce) return nullptr;  // all bounce buffers in flight; reaping frees one
      if (write_) std::memcpy(r.bounce.data(), user, static_cast<size_t>(len));
    }
    w_.free_.pop_back();
    ++handed_;
    r.run = this;
    r.user = user;
    r.offset = cursor_;
    r.length = len;
    r.bounce_pos = 0;
    Prep(r);
    cursor_ += len;
    return &r;
  }

  void Submitted() {
    ++inflight_;
    --handed_;
    NoteIfAllSubmitted();
  }
  // Put back a request io_submit did not take; it goes out first next time, keeping order.
  void Unsubmitted(Request& r) {
    --handed_;
    retry_.push_front(&r);
  }

  void Complete(Request& r, long res) {
    --inflight_;
    if (res < 0) {
      Fail(Status::FromErrno(static_cast<int>(-res),
                             std::string(Verb(write_)) + " of " + std::to_string(r.length) +
                                 " bytes at offset " + std::to_string(r.offset) + " of '" +
                                 f_.label + "'"),
           r.offset);
      w_.Release(r);
      return;
    }
    if (res > r.length) {
      Fail(Status::Internal("libaio completed " + std::to_string(res) + " bytes for a request of " +
                            std::to_string(r.length) + " at offset " + std::to_string(r.offset) +
                            " of '" + f_.label + "'"),
           r.offset);
      w_.Release(r);
      return;
    }
    if (!write_ && r.bounce && res > 0) {
      std::memcpy(r.user, r.bounce.data() + r.bounce_pos, static_cast<size_t>(res));
    }
    (r.bounce ? bounce_bytes_ : direct_bytes_) += static_cast<uint64_t>(res);
    op_.bytes_done.fetch_add(res, std::memory_order_relaxed);
    if (res == r.length) {
      w_.Release(r);
      return;
    }
    // A short transfer: never ignored. Continue from where the kernel stopped.
    ++shorts_;
    if (res == 0) {
      Fail(write_ ? Status::IoError(EIO, "write at offset " + std::to_string(r.offset) + " of '" +
                                             f_.label + "' completed with 0 bytes")
                  : EndOfFileStatus(f_.direct_fd, f_.label, r.offset, r.length),
           r.offset);
      w_.Release(r);
      return;
    }
    r.offset += res;
    r.user += res;
    r.bounce_pos += res;
    r.length -= res;
    if (stop_) {
      w_.Release(r);
      return;
    }
    const void* next = r.bounce ? r.bounce.data() + r.bounce_pos : r.user;
    if (r.offset % f_.offset_align == 0 && r.length % f_.offset_align == 0 &&
        Aligned(next, f_.mem_align)) {
      Prep(r);
      retry_.push_back(&r);
      return;
    }
    // The remainder is no longer aligned for O_DIRECT: finish it through the page cache. (At end
    // of file this is where a read learns there is nothing more.)
    int64_t done = 0;
    Status st = write_ ? SwitchThreadFsIdentity(f_.write_as.get()) : Status::Ok();
    if (st.ok()) {
      st = write_ ? PwriteFull(f_.buffered_fd, r.user, r.length, r.offset, f_.label, &done)
                  : PreadFull(f_.buffered_fd, r.user, r.length, r.offset, f_.label, &done);
    }
    buffered_bytes_ += static_cast<uint64_t>(done);
    op_.bytes_done.fetch_add(done, std::memory_order_relaxed);
    if (!st.ok()) Fail(std::move(st), r.offset + done);
    w_.Release(r);
  }

  // Called by the worker for a request io_submit refused outright (not EAGAIN).
  void SubmitFailed(Request& r, int err) {
    --handed_;
    Fail(Status::FromErrno(err, std::string("io_submit of a ") + Verb(write_) + " of " +
                                    std::to_string(r.length) + " bytes at offset " +
                                    std::to_string(r.offset) + " of '" + f_.label + "'"),
         r.offset);
    w_.Release(r);
  }

  // After a fatal context error: every request of this run was in flight and is gone with the
  // context.
  void Abort(const Status& st) {
    Fail(st, cursor_);
    inflight_ = 0;
    while (!retry_.empty()) {
      w_.Release(*retry_.front());
      retry_.pop_front();
    }
  }

  void Fail(Status st, int64_t offset) {
    if (err_.ok() || offset < err_offset_) {
      err_ = std::move(st);
      err_offset_ = offset;
    }
    stop_ = true;
    NoteIfAllSubmitted();
  }

  // Releases what is left and publishes the counters; returns the first error.
  Status Finish(int64_t* err_offset) {
    if (!noted_) {  // (a path that never passed through the checks: still exactly once)
      noted_ = true;
      op_.SliceSubmitted();
    }
    while (!retry_.empty()) {
      w_.Release(*retry_.front());
      retry_.pop_front();
    }
    HandleCounters& c = *w_.counters_;
    c.bytes_direct.fetch_add(direct_bytes_, std::memory_order_relaxed);
    c.bytes_bounce.fetch_add(bounce_bytes_, std::memory_order_relaxed);
    c.bytes_buffered.fetch_add(buffered_bytes_, std::memory_order_relaxed);
    c.short_transfers.fetch_add(shorts_, std::memory_order_relaxed);
    *err_offset = err_offset_;
    return err_;
  }

 private:
  // The slice's part of OpState::SliceSubmitted: once every request is in the kernel (or the run
  // stopped), counting only requests the kernel accepted or that went back to the run.
  void NoteIfAllSubmitted() {
    if (noted_ || handed_ != 0 || !(stop_ || (cursor_ >= end_ && retry_.empty()))) return;
    noted_ = true;
    op_.SliceSubmitted();
  }

  void Prep(Request& r) {
    void* buf = r.bounce ? r.bounce.data() + r.bounce_pos : r.user;
    if (write_) {
      io_prep_pwrite(&r.cb, f_.direct_fd, buf, static_cast<size_t>(r.length), r.offset);
    } else {
      io_prep_pread(&r.cb, f_.direct_fd, buf, static_cast<size_t>(r.length), r.offset);
    }
    r.cb.data = &r;
    if (w_.wake_.valid()) io_set_eventfd(&r.cb, w_.wake_.get());
  }

  Worker& w_;
  const Slice slice_;
  OpState& op_;
  const IoFile& f_;
  const bool write_;
  int64_t cursor_;
  const int64_t end_;  // end of the direct part (a buffered tail may follow it)
  const int64_t req_size_;

  size_t inflight_ = 0;
  size_t handed_ = 0;   // requests Next() gave out that io_submit has not yet taken or refused
  bool noted_ = false;  // SliceSubmitted called
  std::deque<Request*> retry_;
  Status err_;
  int64_t err_offset_ = -1;
  bool stop_ = false;

  uint64_t direct_bytes_ = 0, bounce_bytes_ = 0, buffered_bytes_ = 0, shorts_ = 0;
};

Worker::Worker(int index, const HandleConfig& config, std::shared_ptr<AioBackendFactory> factory,
               HandleCounters* counters)
    : index_(index), config_(config), factory_(std::move(factory)), counters_(counters) {
  requests_.resize(static_cast<size_t>(config_.queue_depth));
  for (size_t i = 0; i < requests_.size(); ++i) requests_[i].index = static_cast<int>(i);
  free_.reserve(requests_.size());
  for (size_t i = requests_.size(); i > 0; --i) free_.push_back(static_cast<int>(i - 1));
  events_.resize(static_cast<size_t>(config_.queue_depth));
  batch_.reserve(static_cast<size_t>(config_.queue_depth));
  if (config_.overlap_events) wake_.Reset(eventfd(0, EFD_CLOEXEC));
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
  if (wake_.valid()) {  // the worker may be waiting for completions (ReapOrWake)
    const uint64_t one = 1;
    ssize_t n;
    do {
      n = ::write(wake_.get(), &one, sizeof(one));
    } while (n < 0 && errno == EINTR);
  }
}

void Worker::Release(Request& r) {
  r.bounce.Reset();
  r.run = nullptr;
  free_.push_back(r.index);
}

bool Worker::TakeSlice(bool block, Slice* out) {
  {
    std::unique_lock lock(mu_);
    if (block) not_empty_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return false;
    *out = std::move(queue_.front());
    queue_.pop_front();
  }
  not_full_.notify_one();
  return true;
}

bool Worker::Stopping() {
  std::lock_guard lock(mu_);
  return stopping_ && queue_.empty();
}

void Worker::Loop() {
  const bool overlap = config_.overlap_events;
  const size_t qd = static_cast<size_t>(config_.queue_depth);
  while (true) {
    // Admit new slices while the ring has room for more runs; block only when idle.
    while (active_.size() < kMaxActiveRuns) {
      Slice slice;
      if (!TakeSlice(/*block=*/active_.empty(), &slice)) break;
      StartSlice(std::move(slice));
    }
    if (active_.empty()) {
      if (Stopping()) return;  // stopping, and everything posted has run
      continue;
    }

    batch_.clear();
    if (overlap || inflight_ == 0) {
      // Oldest run first: it fills the window, later runs take what is left.
      for (auto& run : active_) {
        while (inflight_ + batch_.size() < qd) {
          Request* r = run->Next();
          if (r == nullptr) break;
          batch_.push_back(&r->cb);
        }
        if (inflight_ + batch_.size() >= qd) break;
      }
    }
    bool refused = false;
    if (!batch_.empty()) refused = SubmitBatch();
    if (inflight_ == 0) {
      FinishDoneRuns();
      if (refused) Backoff();
      continue;
    }
    Status st = !overlap        ? Reap(static_cast<long>(inflight_))
                : wake_.valid() ? ReapOrWake()
                                : Reap(1);
    if (!st.ok()) {
      // The context is in an unknown state: destroy it (waits for the kernel to finish with our
      // buffers) and fail every active run; the next slice gets a fresh context.
      DNVME_LOG_THROTTLED(err, "worker {}: {}; recreating the AIO context", index_, st.ToString());
      aio_.reset();
      for (auto& run : active_) run->Abort(st);  // releases the runs' queued retries
      for (auto& r : requests_) {
        if (r.run != nullptr) Release(r);  // what is left was in flight, now gone
      }
      counters_->AddInflight(-static_cast<int64_t>(inflight_));
      inflight_ = 0;
    }
    FinishDoneRuns();
  }
}

// The longest run of batch_ from `from` on that one identity can submit, and that identity: a
// write's file's writer (null: the worker's own). A read allocates nothing and joins any run; a
// run of reads alone (`any`) is submitted under whatever the thread runs as.
Worker::IdentityRun Worker::NextIdentityRun(size_t from) const {
  IdentityRun run;
  size_t i = from;
  for (; i < batch_.size(); ++i) {
    const SliceRun& owner = *static_cast<Request*>(batch_[i]->data)->run;
    if (!owner.writes()) continue;
    const FsIdentity* who = owner.write_as();
    if (run.any) {
      run.any = false;
      run.who = who;
    } else if (who != run.who && (who == nullptr || run.who == nullptr || !(*who == *run.who))) {
      break;
    }
  }
  run.count = i - from;
  return run;
}

// Returns true when io_submit refused (part of) the batch for now (EAGAIN, or nothing taken); the
// refused requests go back to their runs, in order.
bool Worker::SubmitBatch() {
  size_t done = 0;
  bool refused = false;
  while (done < batch_.size()) {
    // Writes go to the kernel under their file's writer identity (allocation, quotas and the
    // set-user-ID rules are decided at submission): submit a run of requests that agree on it.
    const IdentityRun same = NextIdentityRun(done);
    if (Status st = same.any ? Status::Ok() : SwitchThreadFsIdentity(same.who); !st.ok()) {
      for (size_t i = done; i < done + same.count; ++i) {
        Request& r = *static_cast<Request*>(batch_[i]->data);
        r.run->SubmitFailed(r, st.ErrnoOr(EPERM));
      }
      done += same.count;
      continue;
    }
    long n = config_.single_submit ? 1 : static_cast<long>(same.count);
    int rc = aio_->Submit(n, &batch_[done]);
    if (rc > 0) {
      for (int i = 0; i < rc; ++i) {
        static_cast<Request*>(batch_[done + static_cast<size_t>(i)]->data)->run->Submitted();
      }
      done += static_cast<size_t>(rc);
      inflight_ += static_cast<size_t>(rc);
      counters_->AddInflight(rc);
      counters_->submit_calls.fetch_add(1, std::memory_order_relaxed);
      counters_->requests.fetch_add(static_cast<uint64_t>(rc), std::memory_order_relaxed);
      idle_retries_ = 0;
      continue;
    }
    counters_->submit_retries.fetch_add(1, std::memory_order_relaxed);
    if (rc == -EINTR) continue;
    if (rc == 0 || rc == -EAGAIN) {
      refused = true;
      break;
    }
    Request& r = *static_cast<Request*>(batch_[done]->data);
    r.run->SubmitFailed(r, -rc);
    ++done;
  }
  for (size_t i = batch_.size(); i > done; --i) {
    Request& r = *static_cast<Request*>(batch_[i - 1]->data);
    r.run->Unsubmitted(r);
  }
  return refused;
}

// Nothing in flight and the kernel refused new work: wait a little, then give up eventually.
void Worker::Backoff() {
  if (++idle_retries_ > kMaxIdleSubmitRetries) {
    for (auto& run : active_) {
      if (run->Wants()) {
        run->Fail(
            Status::ResourceExhausted(EAGAIN, "io_submit kept refusing requests (EAGAIN) for '" +
                                                  run->op().result.path + "'"),
            run->slice().offset);
      }
    }
    idle_retries_ = 0;
    return;
  }
  auto delay = std::chrono::microseconds(std::min(1000, 10 << std::min(idle_retries_, 7)));
  std::this_thread::sleep_for(delay);
}

Status Worker::Reap(long min_nr, struct timespec* timeout) {
  int n = aio_->GetEvents(min_nr, static_cast<long>(events_.size()), events_.data(), timeout);
  if (n == -EINTR) return Status::Ok();  // the loop calls again
  if (n < 0) return Status::FromErrno(-n, "io_getevents");
  for (int i = 0; i < n; ++i) {
    const io_event& ev = events_[static_cast<size_t>(i)];
    Request& r = *static_cast<Request*>(ev.obj->data);
    --inflight_;
    counters_->AddInflight(-1);
    r.run->Complete(r, static_cast<long>(ev.res));
  }
  return Status::Ok();
}

// The sliding window's wait: completions if there are any, else sleep until a request completes
// or a slice is posted (both signal wake_). The eventfd is read only after the queue was seen
// empty and no event was ready, and both signal it after they happen, so neither is missed (a
// signal from before the checks only makes the loop run once more).
Status Worker::ReapOrWake() {
  struct timespec now {};
  const size_t before = inflight_;
  DNVME_RETURN_IF_ERROR(Reap(0, &now));
  if (inflight_ < before) return Status::Ok();
  {
    std::lock_guard lock(mu_);
    if (!queue_.empty() && active_.size() < kMaxActiveRuns) return Status::Ok();
  }
  uint64_t count = 0;
  ssize_t n;
  do {
    n = ::read(wake_.get(), &count, sizeof(count));
  } while (n < 0 && errno == EINTR);
  return Status::Ok();
}

void Worker::FinishDoneRuns() {
  for (auto it = active_.begin(); it != active_.end();) {
    if (!(*it)->Done()) {
      ++it;
      continue;
    }
    std::unique_ptr<SliceRun> run = std::move(*it);
    it = active_.erase(it);
    int64_t err_off = run->slice().offset;
    Status st = run->Finish(&err_off);
    CompleteSlice(run->slice(), std::move(st), err_off, run->direct_end());
  }
}

// Buffered piece of a slice: caller memory straight to/from the page cache.
Status Worker::Buffered(const Slice& slice, int64_t from, int64_t to, int64_t* err_off) {
  if (from >= to) return Status::Ok();
  OpState& op = *slice.op;
  const IoFile& f = *op.file;
  int64_t done = 0;
  char* p = slice.buffer + (from - slice.offset);
  const bool write = op.result.type == OpType::kWrite;
  Status st = write ? SwitchThreadFsIdentity(f.write_as.get()) : Status::Ok();
  if (st.ok()) {
    st = write ? PwriteFull(f.buffered_fd, p, to - from, from, f.label, &done)
               : PreadFull(f.buffered_fd, p, to - from, from, f.label, &done);
  }
  counters_->bytes_buffered.fetch_add(static_cast<uint64_t>(done), std::memory_order_relaxed);
  op.bytes_done.fetch_add(done, std::memory_order_relaxed);
  if (!st.ok()) *err_off = from + done;
  return st;
}

void Worker::StartSlice(Slice slice) {
  const IoFile& f = *slice.op->file;
  const int64_t begin = slice.offset;
  const int64_t end = slice.offset + slice.length;
  int64_t err_off = begin;
  if (f.direct_fd < 0 || slice.op->page_cache) {
    Status st = Buffered(slice, begin, end, &err_off);
    slice.op->SliceSubmitted();
    CompleteSlice(slice, std::move(st), err_off, end);
    return;
  }
  const int64_t e = f.edge_align;
  int64_t a = RoundUp(begin, e);
  int64_t b = RoundDown(end, e);
  if (a >= b) a = b = end;  // no whole aligned unit inside: all of it is an edge
  Status st = Buffered(slice, begin, a, &err_off);
  // A write that reports "submitted" (OpState::tail_first) writes its tail edge now as well, so
  // the notice does not wait for the direct part to complete.
  if (st.ok() && slice.op->tail_first) st = Buffered(slice, b, end, &err_off);
  if (st.ok() && a < b) {
    st = EnsureBackend();
    if (st.ok()) {
      active_.push_back(std::make_unique<SliceRun>(*this, std::move(slice), a, b,
                                                   RoundUp(config_.block_size, e)));
      return;
    }
    err_off = a;
  }
  slice.op->SliceSubmitted();
  CompleteSlice(slice, std::move(st), err_off, b);
}

// The direct part (if any) is done: write/read the tail edge (unless the write wrote it first),
// validate, and account.
void Worker::CompleteSlice(const Slice& slice, Status st, int64_t err_off, int64_t tail_from) {
  OpState& op = *slice.op;
  if (st.ok() && !op.tail_first) {
    st = Buffered(slice, tail_from, slice.offset + slice.length, &err_off);
  }
  if (st.ok() && op.validate) st = Validate(slice, op, &err_off);
  if (!st.ok()) op.RecordError(std::move(st), err_off);
  if (op.SliceDone()) Finish(op);
}

Status Worker::EnsureBackend() {
  if (aio_) return Status::Ok();
  auto b = factory_->Create(static_cast<unsigned>(config_.queue_depth));
  if (!b.ok()) return b.status();
  aio_ = std::move(b).value();
  return Status::Ok();
}

Result<PinnedPool*> Worker::BouncePool(int64_t req_size, uint32_t mem_align) {
  const size_t align = std::max<size_t>(mem_align, 4096);
  if (!bounce_ || bounce_->buffer_size() < static_cast<size_t>(req_size) || bounce_align_ < align) {
    // Another active run still holds buffers of the old pool: wait until they come back.
    if (bounce_ && bounce_->available() != bounce_->count()) return nullptr;
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
