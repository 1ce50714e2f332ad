#include "fs/data/write_behind.h"

#include <algorithm>
#include <cerrno>
#include <string>

#include "engine/common/log.h"
#include "engine/posix/identity.h"

namespace dnvme::fs {
namespace {

constexpr int64_t kAlign = 4096;
// Smaller payloads are copied into a chunk rather than adopted: each adopted payload is its own
// disk write and holds a whole 1 MiB request buffer, so sequential 4 KiB O_DIRECT writes ran at
// half the speed adopted (79 against 173 MiB/s), 64 KiB ones too (569 against 1032); from 256
// KiB on, adopting costs nothing (docs/performance-journal.md).
constexpr size_t kAdoptMinBytes = 256 << 10;

}  // namespace

WriteBehind::~WriteBehind() {
  // The mount drains at release; this only keeps a completion from touching a dead object.
  std::unique_lock lock(m_);
  (void)DrainLocked(lock, nullptr);
}

int WriteBehind::inflight() {
  std::lock_guard g(m_);
  return inflight_;
}

void WriteBehind::FinishFlushLocked(const Status& st, bool adopted) {
  if (adopted) --adopted_inflight_;
  if (!st.ok()) {
    shared_->counters->errors.fetch_add(1, std::memory_order_relaxed);
    Logger().error("write-behind flush failed: {}", st.ToString());
    RecordErrorLocked(st);
  }
  if (--inflight_ == 0 && ext_.kind == Kind::kNone) end_ = 0;
}

void WriteBehind::FinishFlush(const Status& st, bool adopted) {
  {
    std::lock_guard g(m_);
    FinishFlushLocked(st, adopted);
  }
  cv_.notify_all();
}

void WriteBehind::FlushAdoptedLocked(Extent e) {
  // The payloads are not contiguous in memory: one engine write each (the engine still cuts
  // them into block_size requests). Each completion returns its own buffer to the loop's pool;
  // the last one completes the extent with the first error.
  struct Parts {
    std::vector<RequestBuffer> bufs;  // element i is touched only by write i's completion
    std::mutex mu;
    Status first;     // guarded by mu
    size_t left = 0;  // guarded by mu
  };
  auto parts = std::make_shared<Parts>();
  parts->bufs = std::move(e.bufs);
  parts->left = parts->bufs.size();
  // True when this was the last part (the caller then completes the extent).
  auto part_done = [](Parts& p, size_t i, const Status& st) {
    p.bufs[i].Reset();
    std::lock_guard g(p.mu);
    if (!st.ok() && p.first.ok()) p.first = st;
    return --p.left == 0;
  };
  ++adopted_inflight_;
  std::shared_ptr<AioHandle> engine = shared_->engine();
  int64_t at = e.start;
  for (size_t i = 0; i < parts->bufs.size(); ++i) {
    const char* data = parts->bufs[i].payload();
    const auto n = static_cast<int64_t>(parts->bufs[i].payload_size());
    Status st =
        engine->submit_pwrite(data, n, e.file, at, [this, parts, i, part_done](const OpResult& r) {
          if (part_done(*parts, i, r.status)) FinishFlush(parts->first, /*adopted=*/true);
        });
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

void WriteBehind::FlushLocked() {
  if (ext_.kind == Kind::kNone) return;
  Extent e = std::move(ext_);
  ext_ = Extent();
  if (e.len == 0) return;
  ++inflight_;
  shared_->counters->write_behind_flushes.fetch_add(1, std::memory_order_relaxed);
  switch (e.kind) {
    case Kind::kNone:
      break;
    case Kind::kAdopted:
      FlushAdoptedLocked(std::move(e));
      return;
    case Kind::kPipe: {
      // std::function wants a copyable task: the extent rides in a shared_ptr.
      auto held = std::make_shared<Extent>(std::move(e));
      shared_->splicers->Submit([this, held] {
        const FileRef& file = held->file;
        // The splice is the write: it allocates under this thread's identity, so it takes the
        // writer's as the engine's threads do (include/dnvme/identity.h).
        SpliceWriteResult r;
        r.status = SwitchThreadFsIdentity(file.write_identity());
        if (r.status.ok()) {
          r = SpliceToFile(*held->pipe, file.direct_fd(), held->start, held->len,
                           [this, &file](const char* data, int64_t n, int64_t at) {
                             return shared_->engine()->sync_pwrite(data, n, file, at);
                           });
        }
        shared_->counters->bytes_written_spliced.fetch_add(static_cast<uint64_t>(r.spliced),
                                                           std::memory_order_relaxed);
        shared_->counters->bytes_splice_fallback.fetch_add(static_cast<uint64_t>(r.fell_back),
                                                           std::memory_order_relaxed);
        held->pipe.Reset();  // emptied (or discarded) and back in the pool before waiters wake
        FinishFlush(r.status, /*adopted=*/false);
      });
      return;
    }
    case Kind::kChunk: {
      auto chunk = e.chunk;
      Status st = shared_->engine()->submit_pwrite(chunk->data(), e.len, e.file, e.start,
                                                   [this, chunk](const OpResult& r) mutable {
                                                     chunk.reset();  // back to the pool first
                                                     FinishFlush(r.status, /*adopted=*/false);
                                                   });
      if (!st.ok()) {
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
  FlushLocked();
  cv_.wait(lock, [&] { return inflight_ == 0; });
  end_ = 0;
  return ReportLocked(errors);
}

Status WriteBehind::Drain(ErrorCursor* errors) {
  std::unique_lock lock(m_);
  return DrainLocked(lock, errors);
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
                                         bool page_cache_writes, WriteSource& src, size_t size,
                                         int64_t off) {
  const int64_t write_chunk = shared_->write_chunk;
  size_t done = 0;
  bool splice_ok = true;  // cleared if a pipe refuses the request's pages
  // The whole payload, page-aligned in the buffer the session loop received it in, for a
  // page-aligned file range: that buffer can be written as it is (fs/transport/request_buffer.h).
  // A payload that ends inside a page is adopted too when its buffer has room for the rest of
  // that page: the kernel cuts a write from a buffer that is not page-aligned at max_pages, and
  // the piece after the cut, the next request, completes the page there (below).
  const size_t partial = size % kAlign;
  bool adopt_ok = size >= kAdoptMinBytes && src.adoptable() && off % kAlign == 0 &&
                  static_cast<int64_t>(size) <= write_chunk &&
                  (partial == 0 || src.adoptable_spare() >= kAlign - partial);
  while (done < size) {
    const int64_t pos = off + static_cast<int64_t>(done);
    // The adopted extent's last payload ends inside a page and this write continues it: its
    // bytes go into the room after that payload (one small copy) rather than making the extent
    // flush with a partial page and this write wait for it (an unaligned start is synchronous).
    if (ext_.kind == Kind::kAdopted && pos == ext_.start + ext_.len && ext_.len % kAlign != 0) {
      RequestBuffer& last = ext_.bufs.back();
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
        if (ext_.len >= write_chunk) FlushLocked();
        continue;
      }
    }
    // Page references can go straight to an O_DIRECT write only when they are whole pages at
    // page-aligned file offsets of a file the engine opened with O_DIRECT.
    const bool spliceable = splice_ok && shared_->pipes && page_cache_writes && src.in_pipe() &&
                            pos % kAlign == 0 && (size - done) % kAlign == 0 &&
                            file.direct_fd() >= 0;
    if (ext_.kind != Kind::kNone && pos != ext_.start + ext_.len) {
      FlushLocked();  // not contiguous
    } else if (ext_.kind == Kind::kPipe && !spliceable) {
      FlushLocked();  // a pipe extent takes only more spliceable data
    } else if (ext_.kind == Kind::kAdopted &&
               (!adopt_ok || done != 0 || ext_.len + static_cast<int64_t>(size) > write_chunk)) {
      FlushLocked();  // adopted extents take whole payloads, up to write_chunk
    }
    // A chunk being filled (contiguous, so not flushed above) is filled on; the next extent
    // adopts.
    const bool adoptable = adopt_ok && done == 0 && ext_.kind != Kind::kChunk;
    if (ext_.kind == Kind::kNone) {
      if (pos % kAlign != 0) break;  // extents start aligned so flushes stay O_DIRECT
      // A new extent that does not continue the last one may overlap a flush in flight; two
      // overlapping O_DIRECT writes complete in any order, so let those land first.
      if (inflight_ > 0 && pos != next_) {
        cv_.wait(lock, [&] { return inflight_ == 0; });
        continue;  // another writer may have started an extent meanwhile: look again
      }
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
      ext_.file = file;
    }
    if (ext_.kind == Kind::kAdopted) {
      RequestBuffer b = src.Adopt(size);
      if (!b) {
        // Every spare request buffer holds data in flight. Ours come back as our flushes
        // complete: wait for one rather than copy (which would only move the backlog into
        // the chunks). With none of ours in flight, copy into a chunk instead.
        if (!ext_.bufs.empty()) {
          FlushLocked();
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
      if (ext_.len >= write_chunk) FlushLocked();
      break;
    }
    const int64_t cap = ext_.kind == Kind::kPipe ? shared_->pipes->capacity() : write_chunk;
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
    } else if (!src.CopyTo(ext_.chunk->data() + ext_.len, n)) {
      return Status::FromErrno(errno, "copying a write's payload");
    }
    ext_.len += static_cast<int64_t>(n);
    done += n;
    end_ = std::max(end_, ext_.start + ext_.len);
    next_ = ext_.start + ext_.len;
    // Full (or a pipe that took less than it should hold): flush, go on in a new extent.
    if (ext_.len == cap || n < want) FlushLocked();
  }
  return done;
}

Status WriteBehind::Write(const FileRef& file, bool page_cache_writes, WriteSource& src,
                          size_t size, int64_t off, char* scratch, ErrorCursor* errors) {
  MountCounters& counters = *shared_->counters;
  counters.write_ops.fetch_add(1, std::memory_order_relaxed);
  std::unique_lock lock(m_);
  // An earlier flush failed: this writer hears of it now.
  if (Status err = ReportLocked(errors); !err.ok()) return err;
  size_t done = 0;
  // O_DIRECT clients take the same path: O_DIRECT promises no page cache, not durability (that
  // is fsync's job, which drains), and FUSE runs a file's direct writes one at a time (libfuse
  // 3.14 cannot ask for FOPEN_PARALLEL_DIRECT_WRITES), so replying only after the disk would run
  // them at queue depth one.
  if (shared_->chunks != nullptr) {
    Result<size_t> gathered = GatherLocked(lock, file, page_cache_writes, src, size, off);
    if (!gathered.ok()) return gathered.status();
    done = *gathered;
    if (done > 0) clock_gettime(CLOCK_REALTIME, &mtime_);
    counters.bytes_written_behind.fetch_add(done, std::memory_order_relaxed);
    if (done == size) return Status::Ok();
  }
  // Synchronous path (small, unaligned, no free chunk): earlier data must land first.
  if (Status err = DrainLocked(lock, errors); !err.ok()) return err;
  lock.unlock();
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

}  // namespace dnvme::fs
