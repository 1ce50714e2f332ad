#include "datapath/write_behind.h"

#include <sys/stat.h>

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <string>
#include <thread>

#include "datapath/space.h"
#include "dnvme/identity.h"
#include "dnvme/log.h"

namespace dnvme::datapath {
namespace {

constexpr int64_t kAlign = 4096;
// Smaller payloads are copied into a chunk rather than adopted: each adopted payload is its own
// disk write and holds a whole 1 MiB request buffer, so sequential 4 KiB O_DIRECT writes ran at
// half the speed adopted (79 against 173 MiB/s), 64 KiB ones too (569 against 1032); from 256
// KiB on, adopting costs nothing (docs/performance-journal.md).
constexpr size_t kAdoptMinBytes = 256 << 10;

// The flush errors that KeepWhatFits answers: the file system is out of space (or the writer out
// of quota), and a buffered write may still fit part of what the direct one could not.
bool OutOfSpace(const Status& st) {
  return st.error_number() == ENOSPC || st.error_number() == EDQUOT;
}

// A flush's O_DIRECT request either fits whole or leaves nothing (ext4 allocates the request's
// range, and when that fails the whole request fails and the blocks it got are freed), so with
// 680 KiB free a 1 MiB request kept none of it. A buffered write keeps what fits, page by page,
// as ext4 keeps the part of a writer's data that fit. So the bytes of a flush from its first
// request that failed for want of space, `n` bytes at `data` for file offset `at`, are written
// again through the page cache (the file's buffered descriptor, as the writer: its quota and
// ext4's reserved blocks apply as to the direct write), in pieces halved down to a page at each
// refusal: what fits stays, the file's size covers it. Ok when every byte landed (space came
// back: nothing was lost, so no error); otherwise the error of the first piece that did not fit,
// or `why` when the write could not be tried. Blocks the calling thread (an engine or splice
// thread, on this error path only).
Status KeepWhatFits(const FileRef& file, const char* data, int64_t n, int64_t at,
                    const Status& why) {
  if (n <= 0 || file.buffered_fd() < 0) return why;
  // Scoped, not SwitchThreadFsIdentity: whichever thread completes the flush goes on as itself.
  Result<ScopedFsIdentity> as = ScopedFsIdentity::EnterIf(file.write_identity());
  if (!as.ok()) return why;
  int64_t piece = n;
  while (n > 0) {
    const int64_t want = std::min(piece, n);
    const ssize_t got = pwrite(file.buffered_fd(), data, static_cast<size_t>(want), at);
    if (got > 0) {
      data += got;
      at += got;
      n -= got;
      continue;
    }
    if (got < 0 && errno == EINTR) continue;
    const int err = got < 0 ? errno : EIO;
    if ((err == ENOSPC || err == EDQUOT) && want > kAlign) {
      piece = std::max<int64_t>(kAlign, want / 2 / kAlign * kAlign);
      continue;
    }
    return Status::FromErrno(err, "write-behind data at offset " + std::to_string(at) +
                                      " written again through the page cache (" +
                                      std::to_string(n) + " bytes did not fit)");
  }
  DNVME_LOG_THROTTLED(warn, "write-behind flush: {}; its bytes fit through the page cache",
                      why.ToString());
  return Status::Ok();
}

// The outcome of an engine write of `len` bytes at `data` to file offset `start` that completed
// with `r`: out of space, KeepWhatFits from its first failing request (or the whole write when the
// engine did not say which).
Status AfterFlushWrite(const FileRef& file, const char* data, int64_t start, int64_t len,
                       const OpResult& r) {
  if (!OutOfSpace(r.status)) return r.status;
  const int64_t from =
      r.error_offset >= start && r.error_offset < start + len ? r.error_offset : start;
  return KeepWhatFits(file, data + (from - start), start + len - from, from, r.status);
}

}  // namespace

// Counts one write's engine writes until each is in the kernel (the Submitted notice), for
// Ack::kSubmitted. Shared by the writer and the notices (which may come after Write gave up on
// an error, so it lives in a shared_ptr).
//
// Wait() first yields for a moment before it sleeps: the engine's worker usually submits within
// tens of microseconds, and being woken from a futex costs about as much again. For a program
// writing 128 KiB per call on the RAM ext4 that was 1.2-1.4 GiB/s sleeping at once against
// 1.8-2.5 yielding first; 1 MiB writes moved within the noise (docs/performance-journal.md,
// 2026-11-25).
class WriteBehind::SubmitLatch {
 public:
  void Add() {
    std::lock_guard lock(mu_);
    left_.fetch_add(1, std::memory_order_relaxed);
  }
  void Done() {
    std::lock_guard lock(mu_);
    if (left_.fetch_sub(1, std::memory_order_release) == 1) cv_.notify_all();
  }
  void Wait() {
    for (int i = 0; i < kYields; ++i) {
      if (left_.load(std::memory_order_acquire) == 0) return;
      std::this_thread::yield();
    }
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return left_.load(std::memory_order_acquire) == 0; });
  }

 private:
  static constexpr int kYields = 200;
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<int> left_{0};  // written under mu_
};

WriteBehind::~WriteBehind() {
  // The mount drains at release; this only keeps a completion from touching a dead object.
  std::unique_lock lock(m_);
  (void)DrainLocked(lock, nullptr);
}

int WriteBehind::inflight() {
  std::lock_guard g(m_);
  return inflight_;
}

bool WriteBehind::WaitForOverlapLocked(std::unique_lock<std::mutex>& lock, int64_t pos,
                                       int64_t end) {
  if (inflight_ == 0) return false;
  const bool continues = pos == next_ || (ext_.kind != Kind::kNone && pos == ext_.start + ext_.len);
  const int64_t lo = continues ? (pos + kAlign - 1) / kAlign * kAlign : pos / kAlign * kAlign;
  const int64_t hi = (end + kAlign - 1) / kAlign * kAlign;
  if (lo >= hi || lo >= flight_hi_ || hi <= flight_lo_) return false;
  cv_.wait(lock);
  return true;
}

void WriteBehind::NoteFlightLocked(int64_t start, int64_t len) {
  const int64_t lo = start / kAlign * kAlign;
  const int64_t hi = (start + len + kAlign - 1) / kAlign * kAlign;
  // inflight_ already counts this flush.
  flight_lo_ = inflight_ == 1 ? lo : std::min(flight_lo_, lo);
  flight_hi_ = inflight_ == 1 ? hi : std::max(flight_hi_, hi);
  if (hooks_.started) hooks_.started();
}

void WriteBehind::FinishFlushLocked(const Status& st, bool adopted) {
  if (hooks_.finished) hooks_.finished();
  if (adopted) --adopted_inflight_;
  if (!st.ok()) {
    shared_->counters->errors.fetch_add(1, std::memory_order_relaxed);
    DNVME_LOG_THROTTLED(err, "write-behind flush failed: {}", st.ToString());
    RecordErrorLocked(st);
  }
  if (--inflight_ == 0 && ext_.kind == Kind::kNone) end_ = 0;
}

void WriteBehind::FinishFlush(const Status& st, bool adopted) {
  std::lock_guard g(m_);
  FinishFlushLocked(st, adopted);
  // Notified under the mutex: a drain that sees the last flush done may return and its caller
  // destroy this object at once, so nothing of it may be touched after the unlock.
  cv_.notify_all();
}

Status WriteBehind::SubmitFlushWrite(AioHandle& engine, const char* data, int64_t n,
                                     const FileRef& file, int64_t at, Completion done,
                                     const Latch& latch) {
  bool cached = false;
  if (shared_->policy != nullptr && shared_->policy->cache_writes) {
    struct stat st {};
    const int64_t size = fstat(file.buffered_fd(), &st) == 0 ? st.st_size : 0;
    cached = shared_->policy->CachesWrites(std::max(size, at + n));
  }
  if (cached) {
    shared_->counters->bytes_written_cached.fetch_add(static_cast<uint64_t>(n),
                                                      std::memory_order_relaxed);
    if (latch) latch->Add();
    Status st = engine.submit_pwrite_cached(data, n, file, at, std::move(done), [latch] {
      if (latch) latch->Done();
    });
    if (!st.ok() && latch) latch->Done();  // not queued: no notice will come
    return st;
  }
  if (!latch) return engine.submit_pwrite(data, n, file, at, std::move(done));
  latch->Add();
  Status st = engine.submit_pwrite(data, n, file, at, std::move(done), [latch] { latch->Done(); });
  if (!st.ok()) latch->Done();  // not queued: no notice will come
  return st;
}

void WriteBehind::FlushAdoptedLocked(Extent e, const Latch& latch) {
  // The payloads are not contiguous in memory: one engine write each (the engine still cuts
  // them into block_size requests). Each completion returns its own buffer to the loop's pool;
  // the last one completes the extent with the first error.
  struct Parts {
    std::vector<std::unique_ptr<AdoptedBuffer>> bufs;  // element i: only write i's completion
    std::mutex mu;
    Status first;     // guarded by mu
    size_t left = 0;  // guarded by mu
  };
  auto parts = std::make_shared<Parts>();
  parts->bufs = std::move(e.bufs);
  parts->left = parts->bufs.size();
  // True when this was the last part (the caller then completes the extent).
  auto part_done = [](Parts& p, size_t i, const Status& st) {
    p.bufs[i].reset();
    std::lock_guard g(p.mu);
    if (!st.ok() && p.first.ok()) p.first = st;
    return --p.left == 0;
  };
  ++adopted_inflight_;
  std::shared_ptr<AioHandle> engine = shared_->engine();
  int64_t at = e.start;
  for (size_t i = 0; i < parts->bufs.size(); ++i) {
    const char* data = parts->bufs[i]->data();
    const auto n = static_cast<int64_t>(parts->bufs[i]->size());
    Completion done = [this, parts, i, part_done, file = e.file, at, n](const OpResult& r) {
      const Status st = AfterFlushWrite(file, parts->bufs[i]->data(), at, n, r);
      if (part_done(*parts, i, st)) FinishFlush(parts->first, /*adopted=*/true);
    };
    Status st = SubmitFlushWrite(*engine, data, n, e.file, at, std::move(done), latch);
    // Not queued: its completion will not come, so count it here, where m_ is held.
    if (!st.ok() && part_done(*parts, i, st)) {
      FinishFlushLocked(parts->first, /*adopted=*/true);
      cv_.notify_all();
    }
    at += n;
  }
  shared_->counters->bytes_written_adopted.fetch_add(static_cast<uint64_t>(at - e.start),
                                                     std::memory_order_relaxed);
}

void WriteBehind::FlushLocked(const Latch& latch) {
  if (ext_.kind == Kind::kNone) return;
  Extent e = std::move(ext_);
  ext_ = Extent();
  if (e.len == 0) return;
  ++inflight_;
  NoteFlightLocked(e.start, e.len);
  shared_->counters->write_behind_flushes.fetch_add(1, std::memory_order_relaxed);
  switch (e.kind) {
    case Kind::kNone:
      break;
    case Kind::kAdopted:
      FlushAdoptedLocked(std::move(e), latch);
      return;
    case Kind::kPipe: {
      // std::function wants a copyable task: the extent rides in a shared_ptr.
      auto held = std::make_shared<Extent>(std::move(e));
      // The splice is the whole write: it is in the kernel when it returned.
      if (latch != nullptr) latch->Add();
      shared_->splicers->Submit([this, held, latch] {
        const FileRef& file = held->file;
        // The splice is the write: it allocates under this thread's identity, so it takes the
        // writer's as the engine's threads do (include/dnvme/identity.h).
        SpliceWriteResult r;
        bool fell_back = false;  // the pipe was read out for the engine (SpliceFallback)
        r.status = SwitchThreadFsIdentity(file.write_identity());
        if (r.status.ok()) {
          r = SpliceToFile(*held->pipe, file.direct_fd(), held->start, held->len,
                           [this, &file, &fell_back](const char* data, int64_t n, int64_t at) {
                             fell_back = true;
                             Status st = shared_->engine()->sync_pwrite(data, n, file, at);
                             return OutOfSpace(st) ? KeepWhatFits(file, data, n, at, st) : st;
                           });
        }
        if (OutOfSpace(r.status) && !fell_back) {
          // The splice that failed took nothing from the pipe: what it holds is the rest.
          int held_bytes = 0;
          const int64_t rest = held->len - r.spliced;
          if (ioctl(held->pipe->read_fd(), FIONREAD, &held_bytes) == 0 && held_bytes == rest) {
            std::unique_ptr<char[]> buf(new (std::nothrow) char[static_cast<size_t>(rest)]);
            if (buf && held->pipe->ReadExactly(buf.get(), static_cast<size_t>(rest)).ok()) {
              r.status = KeepWhatFits(file, buf.get(), rest, held->start + r.spliced, r.status);
            }
          }
        }
        shared_->counters->bytes_written_spliced.fetch_add(static_cast<uint64_t>(r.spliced),
                                                           std::memory_order_relaxed);
        shared_->counters->bytes_splice_fallback.fetch_add(static_cast<uint64_t>(r.fell_back),
                                                           std::memory_order_relaxed);
        held->pipe.Reset();  // emptied (or discarded) and back in the pool before waiters wake
        if (latch != nullptr) latch->Done();
        FinishFlush(r.status, /*adopted=*/false);
      });
      return;
    }
    case Kind::kChunk: {
      auto chunk = e.chunk;
      Completion done = [this, chunk, file = e.file, start = e.start, len = e.len,
                         lead = e.lead](const OpResult& r) mutable {
        const Status st = AfterFlushWrite(file, chunk->data() + lead, start, len, r);
        chunk.reset();  // back to the pool first
        FinishFlush(st, /*adopted=*/false);
      };
      const char* data = chunk->data() + e.lead;
      Status st = SubmitFlushWrite(*shared_->engine(), data, e.len, e.file, e.start,
                                   std::move(done), latch);
      if (!st.ok()) {
        // Not queued: no completion will come.
        if (hooks_.finished) hooks_.finished();
        --inflight_;
        RecordErrorLocked(st);
        shared_->counters->errors.fetch_add(1, std::memory_order_relaxed);
      }
      return;
    }
  }
}

void WriteBehind::RecordErrorLocked(const Status& st) {
  error_ = st;
  ++error_count_;
  error_heard_ = false;
}

Status WriteBehind::ReportLocked(ErrorCursor* errors) {
  if (errors == nullptr) return error_heard_ ? Status::Ok() : error_;
  if (errors->seen >= error_count_) return Status::Ok();
  errors->seen = error_count_;
  error_heard_ = true;
  return error_;
}

Status WriteBehind::PeekLocked(const ErrorCursor& errors) {
  if (errors.seen >= error_count_) return Status::Ok();
  error_heard_ = true;
  return error_;
}

Status WriteBehind::DrainAndPeek(const ErrorCursor& errors) {
  std::unique_lock lock(m_);
  (void)DrainLocked(lock, nullptr);
  return PeekLocked(errors);
}

ErrorCursor WriteBehind::Sample() {
  std::lock_guard lock(m_);
  return ErrorCursor{error_heard_ ? error_count_ : error_count_ - 1};
}

Status WriteBehind::DrainLocked(std::unique_lock<std::mutex>& lock, ErrorCursor* errors) {
  FlushLocked({});
  cv_.wait(lock, [&] { return inflight_ == 0; });
  // While this waited, another thread (the mount: a WRITE of another handle of the file) may
  // have started a new extent: only it is pending now, and its end still counts in the size.
  end_ = ext_.kind == Kind::kNone ? 0 : ext_.start + ext_.len;
  return ReportLocked(errors);
}

Status WriteBehind::Drain(ErrorCursor* errors) {
  std::unique_lock lock(m_);
  return DrainLocked(lock, errors);
}

bool WriteBehind::RunIdle(const std::function<void()>& fn) {
  std::unique_lock lock(m_);
  for (int tries = 0; tries < 3; ++tries) {
    FlushLocked({});
    cv_.wait(lock, [&] { return inflight_ == 0 && sync_inflight_ == 0; });
    if (ext_.kind != Kind::kNone) continue;  // a write came meanwhile: land it too
    end_ = 0;
    fn();
    return true;
  }
  return false;
}

Status WriteBehind::Report(ErrorCursor* errors) {
  std::lock_guard lock(m_);
  return ReportLocked(errors);
}

void WriteBehind::Close() {
  std::unique_lock lock(m_);
  (void)DrainLocked(lock, nullptr);
  closed_ = true;
}

void WriteBehind::ApplyPending(struct stat* st) {
  std::lock_guard lock(m_);
  if (end_ == 0) return;  // nothing pending: the backing file is the truth
  if (end_ > st->st_size) st->st_size = end_;
  auto later = [](const timespec& a, const timespec& b) {
    return a.tv_sec != b.tv_sec ? a.tv_sec > b.tv_sec : a.tv_nsec > b.tv_nsec;
  };
  if (later(mtime_, st->st_mtim)) st->st_mtim = mtime_;
  if (later(mtime_, st->st_ctim)) st->st_ctim = mtime_;
}

Result<size_t> WriteBehind::GatherLocked(std::unique_lock<std::mutex>& lock, const FileRef& file,
                                         bool page_cache_writes, ExtentSource& src, size_t size,
                                         int64_t off, const Latch& latch) {
  const int64_t write_chunk = shared_->write_chunk;
  size_t done = 0;
  bool splice_ok = true;  // cleared if a pipe refuses the request's pages
  // The whole payload, page-aligned in memory the source can hand over (a FUSE request buffer),
  // for a page-aligned file range: that buffer can be written as it is.
  // A payload that ends inside a page is adopted too when its buffer has room for the rest of
  // that page: the kernel cuts a write from a buffer that is not page-aligned at max_pages, and
  // the piece after the cut, the next request, completes the page there (below).
  const size_t partial = size % kAlign;
  bool adopt_ok = size >= kAdoptMinBytes && src.adoptable() && off % kAlign == 0 &&
                  static_cast<int64_t>(size) <= write_chunk &&
                  (partial == 0 || src.adoptable_spare() >= kAlign - partial);
  const int64_t end = off + static_cast<int64_t>(size);
  while (done < size) {
    const int64_t pos = off + static_cast<int64_t>(done);
    // Two O_DIRECT writes of the same pages complete in any order: the older could win.
    if (WaitForOverlapLocked(lock, pos, end)) continue;
    // The adopted extent's last payload ends inside a page and this write continues it: its
    // bytes go into the room after that payload (one small copy) rather than making the extent
    // flush with a partial page and this write wait for it (an unaligned start is synchronous).
    if (ext_.kind == Kind::kAdopted && pos == ext_.start + ext_.len && ext_.len % kAlign != 0) {
      AdoptedBuffer& last = *ext_.bufs.back();
      const size_t n =
          std::min({size - done, last.spare(), static_cast<size_t>(kAlign - ext_.len % kAlign)});
      if (n > 0) {
        if (!src.CopyTo(last.spare_data(), n)) {
          return Status::FromErrno(errno, "completing an adopted payload's page");
        }
        last.Grow(n);
        ext_.len += static_cast<int64_t>(n);
        done += n;
        end_ = std::max(end_, ext_.start + ext_.len);
        next_ = ext_.start + ext_.len;
        if (ext_.len >= write_chunk) FlushLocked(latch);
        continue;
      }
    }
    // Page references can go straight to an O_DIRECT write only when they are whole pages at
    // page-aligned file offsets of a file the engine opened with O_DIRECT.
    const bool spliceable = splice_ok && shared_->pipes && page_cache_writes && src.in_pipe() &&
                            pos % kAlign == 0 && (size - done) % kAlign == 0 &&
                            file.direct_fd() >= 0;
    if (ext_.kind != Kind::kNone && pos != ext_.start + ext_.len) {
      FlushLocked(latch);  // not contiguous
    } else if (ext_.kind == Kind::kPipe && !spliceable) {
      FlushLocked(latch);  // a pipe extent takes only more spliceable data
    } else if (ext_.kind == Kind::kAdopted &&
               (!adopt_ok || done != 0 || ext_.len + static_cast<int64_t>(size) > write_chunk)) {
      FlushLocked(latch);  // adopted extents take whole payloads, up to write_chunk
    }
    // A chunk being filled (contiguous, so not flushed above) is filled on; the next extent
    // adopts.
    const bool adoptable = adopt_ok && done == 0 && ext_.kind != Kind::kChunk;
    if (ext_.kind == Kind::kNone) {
      // Extents start aligned so flushes stay O_DIRECT, unless a chunk may hold the data at its
      // place in the page.
      if (pos % kAlign != 0 && !shared_->unaligned_extents) break;
      // Again here: the extent just flushed above (not contiguous with this write) may share
      // these pages, and it is in flight only now.
      if (WaitForOverlapLocked(lock, pos, end)) continue;
      if (spliceable) {
        ext_.pipe = shared_->pipes->TryAcquire();
        if (ext_.pipe) ext_.kind = Kind::kPipe;
      }
      if (ext_.kind == Kind::kNone && adoptable) {
        ext_.kind = Kind::kAdopted;
      } else if (ext_.kind == Kind::kNone) {
        PinnedPool::Lease lease = shared_->chunks->TryAcquire();
        if (!lease) {
          // Every chunk is busy. Waiting is safe only for our own flushes (they will finish);
          // otherwise write this request through the engine directly.
          if (inflight_ == 0) break;
          cv_.wait(lock);
          continue;
        }
        ext_.kind = Kind::kChunk;
        ext_.chunk = std::make_shared<PinnedPool::Lease>(std::move(lease));
      }
      ext_.start = pos;
      ext_.len = 0;
      ext_.lead = ext_.kind == Kind::kChunk ? pos % kAlign : 0;
      ext_.file = file;
    }
    if (ext_.kind == Kind::kAdopted) {
      std::unique_ptr<AdoptedBuffer> b = src.Adopt(size);
      if (!b) {
        // Every spare request buffer holds data in flight. Ours come back as our flushes
        // complete: wait for one rather than copy (which would only move the backlog into
        // the chunks). With none of ours in flight, copy into a chunk instead.
        if (!ext_.bufs.empty()) {
          FlushLocked(latch);
        } else {
          ext_ = Extent();  // an adopted extent with nothing in it yet
        }
        if (adopted_inflight_ > 0) {
          cv_.wait(lock);
        } else {
          adopt_ok = false;
        }
        continue;
      }
      ext_.bufs.push_back(std::move(b));
      ext_.len += static_cast<int64_t>(size);
      done = size;
      end_ = std::max(end_, ext_.start + ext_.len);
      next_ = ext_.start + ext_.len;
      if (ext_.len >= write_chunk) FlushLocked(latch);
      break;
    }
    const int64_t cap =
        ext_.kind == Kind::kPipe
            ? shared_->pipes->capacity()
            : std::min(write_chunk, static_cast<int64_t>(ext_.chunk->size()) - ext_.lead);
    const size_t want =
        static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(size - done), cap - ext_.len));
    size_t n = want;
    if (ext_.kind == Kind::kPipe) {
      const int64_t moved = src.SpliceTo(ext_.pipe->write_fd(), want);
      if (moved < 0) {
        return Status::FromErrno(static_cast<int>(-moved), "splicing a write's pages");
      }
      n = static_cast<size_t>(moved);
      if (n == 0 && ext_.len == 0) {
        ext_ = Extent();  // an empty pipe took nothing: copy this request instead
        splice_ok = false;
        continue;
      }
    } else if (!src.CopyTo(ext_.chunk->data() + ext_.lead + ext_.len, n)) {
      return Status::FromErrno(errno, "copying a write's payload");
    }
    ext_.len += static_cast<int64_t>(n);
    done += n;
    end_ = std::max(end_, ext_.start + ext_.len);
    next_ = ext_.start + ext_.len;
    // Full (or a pipe that took less than it should hold): flush, go on in a new extent.
    if (ext_.len == cap || n < want) FlushLocked(latch);
  }
  return done;
}

Status WriteBehind::Write(const FileRef& file, bool page_cache_writes, ExtentSource& src,
                          size_t size, int64_t off, char* scratch, ErrorCursor* errors,
                          const WriteAdmission& admit, bool* stale) {
  Counters& counters = *shared_->counters;
  std::unique_lock lock(m_);
  if (closed_) return Status::FromErrno(EBADF, "write after the file's write-behind closed");
  // An earlier flush failed: this writer hears of it now.
  if (Status err = ReportLocked(errors); !err.ok()) return err;
  if (admit.resv != nullptr && admit.resv->epoch() != admit.epoch) {
    if (stale != nullptr) *stale = true;
    return Status::Ok();
  }
  counters.write_ops.fetch_add(1, std::memory_order_relaxed);
  size_t done = 0;
  // O_DIRECT clients take the same path: O_DIRECT promises no page cache, not durability (that
  // is fsync's job, which drains), and FUSE runs a file's direct writes one at a time (libfuse
  // 3.14 cannot ask for FOPEN_PARALLEL_DIRECT_WRITES), so replying only after the disk would run
  // them at queue depth one.
  if (shared_->chunks != nullptr && !admit.through) {
    Latch latch;
    if (shared_->ack == Ack::kSubmitted) latch = std::make_shared<SubmitLatch>();
    Result<size_t> gathered = GatherLocked(lock, file, page_cache_writes, src, size, off, latch);
    if (gathered.ok()) {
      done = *gathered;
      if (done > 0) clock_gettime(CLOCK_REALTIME, &mtime_);
      counters.bytes_written_behind.fetch_add(done, std::memory_order_relaxed);
    }
    if (latch) {
      // What was gathered goes to the kernel now, and the write returns once it is there.
      FlushLocked(latch);
      lock.unlock();
      latch->Wait();
      lock.lock();
      // A flush of this write that failed at once is this write's error.
      if (gathered.ok()) {
        if (Status err = ReportLocked(errors); !err.ok()) return err;
      }
    }
    if (!gathered.ok()) return gathered.status();
    if (done == size) return Status::Ok();
  }
  // Synchronous path (small, unaligned, no free chunk, written through): earlier data must land
  // first. Counted while it runs outside the mutex (RunIdle waits for it), and the hooks hear
  // of it as of a flush: `dnvme run`'s lease word must count every write in flight, this one too.
  if (Status err = DrainLocked(lock, errors); !err.ok()) return err;
  ++sync_inflight_;
  if (hooks_.started) hooks_.started();
  lock.unlock();
  struct Landed {
    WriteBehind* wb;
    ~Landed() {
      std::lock_guard g(wb->m_);
      if (wb->hooks_.finished) wb->hooks_.finished();
      --wb->sync_inflight_;
      wb->cv_.notify_all();
    }
  } landed{this};
  const int64_t rest = static_cast<int64_t>(size - done);
  // Straight from the request when it is in memory (the session loop receives a WRITE's payload
  // page-aligned, so the engine writes it without a bounce copy); otherwise into the thread's
  // aligned scratch buffer first.
  const char* data = src.InMemory(static_cast<size_t>(rest));
  if (data == nullptr) {
    if (!src.CopyTo(scratch, static_cast<size_t>(rest))) {
      return Status::FromErrno(errno, "copying a write's payload");
    }
    data = scratch;
  }
  Status st = shared_->engine()->sync_pwrite(data, rest, file, off + static_cast<int64_t>(done));
  if (!st.ok()) {
    counters.errors.fetch_add(1, std::memory_order_relaxed);
    return st;
  }
  counters.bytes_written_sync.fetch_add(static_cast<uint64_t>(rest), std::memory_order_relaxed);
  return Status::Ok();
}

}  // namespace dnvme::datapath
