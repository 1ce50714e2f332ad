// One file's data path (file_data.h): the rules of using its WriteBehind and ReadAhead.
#include "datapath/file_data.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>

namespace dnvme::datapath {

void FileData::Open(OpenFile* o, bool read_only) {
  o->errors = wb_.Sample();
  o->read_only = read_only;
}

Result<size_t> FileData::Write(OpenFile& o, const FileRef& file, bool page_cache_writes,
                               ExtentSource& src, size_t size, int64_t off, char* scratch) {
  ra_.Invalidate();
  Result<size_t> done = WriteReserved(o, file, page_cache_writes, src, size, off, scratch);
  if (done.ok()) o.wrote.store(true, std::memory_order_relaxed);
  // Again now that the bytes are accepted: a reader that drained before them may have fetched
  // the old bytes meanwhile (ReadAhead::Generation).
  ra_.Invalidate();
  return done;
}

Result<size_t> FileData::WriteReserved(OpenFile& o, const FileRef& file, bool page_cache_writes,
                                       ExtentSource& src, size_t size, int64_t off, char* scratch) {
  const SpaceOptions& opts = shared_->space;
  // Without write-behind a write is synchronous and meets its own error; `extend` still wants
  // the size raised first (space.h).
  const bool reserving = opts.reserve && (shared_->writes.chunks != nullptr || opts.extend);
  // A grant goes stale when a Trim or a change comes between it and the write-behind: ask again,
  // and after a few such races write through (the write then needs no grant).
  constexpr int kAttempts = 4;
  for (int attempt = 0;; ++attempt) {
    WriteAdmission admit;
    size_t n = size;
    if (reserving && attempt < kAttempts) {
      Result<SpaceReservation::Grant> g = resv_.Reserve(
          opts, shared_->budget, file, off, static_cast<int64_t>(size), !alone_ || alone_());
      if (!g.ok()) {
        // An earlier flush error this description has not heard of comes first, as in
        // WriteBehind::Write.
        if (Status err = wb_.Report(&o.errors); !err.ok()) return err;
        if (shared_->writes.counters != nullptr && g.status().code() == Status::Code::kNoSpace) {
          shared_->writes.counters->space_refusals.fetch_add(1, std::memory_order_relaxed);
        }
        return g.status();
      }
      n = static_cast<size_t>(g->bytes);
      admit.through = g->through;
      admit.resv = &resv_;
      admit.epoch = g->epoch;
    } else if (reserving) {
      admit.through = true;
    }
    if (shared_->writes.counters != nullptr) {
      Counters& c = *shared_->writes.counters;
      if (admit.through) c.space_write_through.fetch_add(1, std::memory_order_relaxed);
      if (n < size) c.space_short_writes.fetch_add(1, std::memory_order_relaxed);
    }
    bool stale = false;
    DNVME_RETURN_IF_ERROR(
        wb_.Write(file, page_cache_writes, src, n, off, scratch, &o.errors, admit, &stale));
    if (!stale) return n;
  }
}

Status FileData::Trim(int fd) {
  if (!resv_.holds_past_eof()) return Status::Ok();
  Status st;
  (void)wb_.RunIdle([&] {
    if (outside_writes_.load(std::memory_order_acquire) == 0) st = resv_.Trim(fd);
  });
  return st;
}

Result<int64_t> FileData::Readable(const FileRef& file, int64_t off, int64_t size) {
  int64_t file_size = 0;
  return DrainAndClamp(file, off, size, &file_size);
}

Result<int64_t> FileData::DrainAndClamp(const FileRef& file, int64_t off, int64_t size,
                                        int64_t* file_size) {
  // A flush error is the writers' to hear (at fsync or close), not a reader's.
  (void)wb_.Drain(nullptr);
  struct stat st {};
  if (fstat(file.buffered_fd(), &st) != 0) return Status::FromErrno(errno, "fstat before a read");
  *file_size = st.st_size;
  if (off >= st.st_size) return int64_t{0};
  return std::min<int64_t>(size, st.st_size - off);
}

Result<int64_t> FileData::ReadShrunk(int fd, char* buf, int64_t n, int64_t off) const {
  ssize_t (*const read_at)(int, void*, size_t, off_t) =
      shared_->pread != nullptr ? shared_->pread : ::pread;
  int64_t done = 0;
  while (done < n) {
    const ssize_t got = read_at(fd, buf + done, static_cast<size_t>(n - done), off + done);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return Status::FromErrno(errno, "pread after the file shrank");
    if (got == 0) break;  // the end of the file as it is now
    done += got;
  }
  return done;
}

Result<int64_t> FileData::Read(OpenFile& o, const FileRef& file, const FileRead& r) {
  // Before the drain: a change after it makes what the window would fetch suspect.
  const uint64_t generation = ra_.Generation();
  int64_t file_size = 0;
  Result<int64_t> readable = DrainAndClamp(file, r.off, r.size, &file_size);
  if (!readable.ok() || *readable == 0) return readable;
  const int64_t n = *readable;
  if (r.window == Window::kDrop) ra_.Invalidate();
  std::vector<ResidentRun> plan;
  if (r.window == Window::kSkip) {
    plan.push_back({r.off, n, false});  // an O_DIRECT reader asked for the device
  } else {
    ReadPolicy policy = shared_->policy;
    // The mount sent this open to the engine: only what is cached comes from the cache.
    if (!r.may_fill && policy.mode == ReadCache::kAuto) policy.mode = ReadCache::kResident;
    if (!r.may_probe) policy.residency = &UnknownResidency();
    plan = policy.Plan(file.buffered_fd(), r.off, n, file_size, r.reader);
  }
  int64_t done = 0;
  for (const ResidentRun& run : plan) {
    const int64_t at = run.off - r.off;
    Result<int64_t> got = run.resident ? ReadCached(file, r, at, run.len)
                                       : ReadDevice(o, file, r, at, run.len, file_size, generation);
    if (!got.ok()) return done > 0 ? Result<int64_t>(done) : got;  // a short read, as read(2)
    done += *got;
    if (*got < run.len) break;  // the file ends here now
  }
  return done;
}

Result<int64_t> FileData::ReadCached(const FileRef& file, const FileRead& r, int64_t at,
                                     int64_t len) {
  Counters* const counters = shared_->reads.counters;
  char* const dst = r.buf + at;
  const int64_t off = r.off + at;
  int64_t got = 0;
  std::shared_ptr<AioHandle> engine;
  if (len >= shared_->policy.parallel_from && shared_->reads.engine) {
    engine = shared_->reads.engine();
  }
  if (engine && engine->sync_pread_cached(dst, len, file, off).ok()) {
    got = len;
  } else {
    // One pread on this thread: a small run, or the file ended inside the run (what is there
    // now, as read(2) would answer), or a worker's error (reported by this read, if it recurs).
    Result<int64_t> now = ReadShrunk(file.buffered_fd(), dst, len, off);
    if (!now.ok()) {
      if (counters != nullptr) counters->errors.fetch_add(1, std::memory_order_relaxed);
      return now.status();
    }
    got = *now;
  }
  if (counters != nullptr) {
    counters->bytes_read_cached.fetch_add(static_cast<uint64_t>(got), std::memory_order_relaxed);
  }
  if (r.reply != nullptr && got > 0) r.reply->iov.push_back({dst, static_cast<size_t>(got)});
  return got;
}

Result<int64_t> FileData::ReadDevice(OpenFile& o, const FileRef& file, const FileRead& r,
                                     int64_t at, int64_t len, int64_t file_size,
                                     uint64_t generation) {
  Counters* const counters = shared_->reads.counters;
  const int64_t off = r.off + at;
  int64_t served = 0;
  if (r.window == Window::kUse) {
    if (shared_->reads.chunks == nullptr && shared_->reads.make_chunks) {
      shared_->reads.make_chunks();
    }
    WindowRead w;
    w.off = off;
    w.n = len;
    w.file_size = file_size;
    w.generation = generation;
    w.starts_sequence = o.read_only && !o.read_before.exchange(true);
    w.copy_to = r.reply == nullptr ? r.buf + at : nullptr;
    served = ra_.Read(file, w, r.reply);
  }
  if (served == len) return len;
  char* const rest = r.buf + at + served;
  const int64_t want = len - served;
  Status st = shared_->reads.engine()->sync_pread(rest, want, file, off + served);
  int64_t got = want;
  if (st.code() == Status::Code::kEndOfFile) {
    // Truncated meanwhile: what is there now, as read(2) would answer.
    Result<int64_t> now = ReadShrunk(r.shrunk_fd, rest, want, off + served);
    if (!now.ok()) return now.status();
    got = *now;
  } else if (!st.ok()) {
    if (counters != nullptr) counters->errors.fetch_add(1, std::memory_order_relaxed);
    ra_.Invalidate();
    return st;
  } else if (counters != nullptr) {
    counters->bytes_read_engine.fetch_add(static_cast<uint64_t>(want), std::memory_order_relaxed);
  }
  if (r.reply != nullptr && got > 0) r.reply->iov.push_back({rest, static_cast<size_t>(got)});
  return served + got;
}

Status FileData::Change(const std::function<Status()>& change) {
  Status st = wb_.Drain(nullptr);
  ra_.Invalidate();
  resv_.Forget();  // a grant made before must not be taken in after the change
  if (st.ok()) st = change();
  resv_.Forget();    // nor one made while it ran
  ra_.Invalidate();  // after the change too (ReadAhead::Generation)
  return st;
}

void FileData::Invalidate() {
  ra_.Invalidate();
  // It may have been truncated too (a `dnvme run` client's ftruncate), freeing reserved blocks.
  resv_.Forget();
}

Status FileData::Drain() { return wb_.Drain(nullptr); }

Status FileData::Report(OpenFile& o) { return wb_.Report(&o.errors); }

Status FileData::Flush(const OpenFile& o) {
  if (!o.wrote.load(std::memory_order_relaxed)) return Status::Ok();
  return wb_.DrainAndPeek(o.errors);
}

Status FileData::Sync(OpenFile& o) { return wb_.Drain(&o.errors); }

void FileData::Close() { wb_.Close(); }

Status FileData::Release() {
  Status st = wb_.Drain(nullptr);
  ra_.Quiesce();
  return st;
}

}  // namespace dnvme::datapath
