// The data path of the mount: write-behind into pinned chunks flushed as parallel O_DIRECT
// requests, and read-ahead of sequential readers into pinned chunks.
//
// Why write-behind: without the kernel's writeback cache, FUSE sends a writer's data one
// request (<= 1 MiB) at a time and the write(2) waits for our reply. Writing each request before
// replying would run the disk at queue depth one. Instead a sequential writer's data is copied
// into a pinned chunk (write_chunk bytes, aligned) and the reply goes out at once; a full chunk
// is submitted to the engine asynchronously, which cuts it into block_size O_DIRECT requests.
// POSIX allows this: the data is visible to every reader at once (reads drain the inode first)
// and durable after fsync (which drains, then fsyncs); a flush error is kept on the inode and
// returned by the next write, flush (close) or fsync.
#include <sys/stat.h>
#include <unistd.h>

#include <time.h>

#include <algorithm>
#include <cstring>

#include "engine/common/log.h"
#include "fs/fs.h"

namespace dnvme::fs {
namespace {

constexpr int64_t kAlign = 4096;
constexpr size_t kSpliceHintMinBytes = 64 << 10;
// Smaller payloads are copied into a chunk rather than adopted: each adopted payload is its own
// disk write and holds a whole 1 MiB request buffer, so sequential 4 KiB O_DIRECT writes ran at
// half the speed adopted (79 against 173 MiB/s), 64 KiB ones too (569 against 1032); from 256
// KiB on, adopting costs nothing (docs/performance.md).
constexpr size_t kAdoptMinBytes = 256 << 10;

int ErrnoOf(const Status& st) {
  return st.ok() ? 0 : (st.error_number() ? st.error_number() : EIO);
}

}  // namespace

void Fs::FinishFlushLocked(Inode& in, const Status& st, bool adopted) {
  if (adopted) --in.wb_adopted_inflight;
  if (!st.ok()) {
    counters_.errors.fetch_add(1, std::memory_order_relaxed);
    Logger().error("write-behind flush failed: {}", st.ToString());
    if (in.wb_error.ok()) in.wb_error = st;
  }
  if (--in.wb_inflight == 0 && !in.wb_chunk && !in.wb_pipe && in.wb_bufs.empty()) in.wb_end = 0;
}

void Fs::FinishFlush(Inode* ip, const Status& st, bool adopted) {
  {
    std::lock_guard g(ip->m);
    FinishFlushLocked(*ip, st, adopted);
  }
  ip->cv.notify_all();
}

void Fs::FlushAdoptedLocked(Inode& in, std::vector<RequestBuffer> bufs, const FileRef& file,
                            int64_t start) {
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
  parts->bufs = std::move(bufs);
  parts->left = parts->bufs.size();
  // True when this was the last part (the caller then completes the extent).
  auto part_done = [](Parts& p, size_t i, const Status& st) {
    p.bufs[i].Reset();
    std::lock_guard g(p.mu);
    if (!st.ok() && p.first.ok()) p.first = st;
    return --p.left == 0;
  };
  Inode* ip = &in;
  ++in.wb_adopted_inflight;
  int64_t at = start;
  for (size_t i = 0; i < parts->bufs.size(); ++i) {
    const char* data = parts->bufs[i].payload();
    const auto n = static_cast<int64_t>(parts->bufs[i].payload_size());
    Status st = Engine()->submit_pwrite(data, n, file, at,
                                        [this, ip, parts, i, part_done](const OpResult& r) {
                                          if (part_done(*parts, i, r.status))
                                            FinishFlush(ip, parts->first, /*adopted=*/true);
                                        });
    // Not queued: its completion will not come, so count it here, where in.m is held.
    if (!st.ok() && part_done(*parts, i, st)) {
      FinishFlushLocked(in, parts->first, /*adopted=*/true);
      in.cv.notify_all();
    }
    at += n;
  }
  counters_.bytes_written_adopted.fetch_add(static_cast<uint64_t>(at - start),
                                            std::memory_order_relaxed);
}

void Fs::FlushExtentLocked(Inode& in, std::unique_lock<std::mutex>& lock) {
  (void)lock;  // documents that in.m is held
  if (!in.wb_chunk && !in.wb_pipe && in.wb_bufs.empty()) return;
  auto chunk = std::move(in.wb_chunk);
  PipePool::Lease pipe = std::move(in.wb_pipe);
  std::vector<RequestBuffer> bufs = std::move(in.wb_bufs);
  const int64_t start = in.wb_start;
  const int64_t len = in.wb_len;
  FileRef file = std::move(in.wb_file);
  in.wb_chunk.reset();
  in.wb_bufs.clear();
  in.wb_file = FileRef();
  in.wb_len = 0;
  if (len == 0) return;
  ++in.wb_inflight;
  counters_.write_behind_flushes.fetch_add(1, std::memory_order_relaxed);
  if (!bufs.empty()) {
    FlushAdoptedLocked(in, std::move(bufs), file, start);
    return;
  }
  Inode* ip = &in;
  if (pipe) {
    // std::function wants a copyable task: the lease rides in a shared_ptr.
    auto held = std::make_shared<PipePool::Lease>(std::move(pipe));
    splicers_->Submit([this, ip, held, file, start, len] {
      SpliceWriteResult r = SpliceToFile(**held, file.direct_fd(), start, len,
                                         [this, &file](const char* data, int64_t n, int64_t at) {
                                           return Engine()->sync_pwrite(data, n, file, at);
                                         });
      counters_.bytes_written_spliced.fetch_add(static_cast<uint64_t>(r.spliced),
                                                std::memory_order_relaxed);
      counters_.bytes_splice_fallback.fetch_add(static_cast<uint64_t>(r.fell_back),
                                                std::memory_order_relaxed);
      held->Reset();  // emptied (or discarded) and back in the pool before waiters wake
      FinishFlush(ip, r.status);
    });
    return;
  }
  Status st = Engine()->submit_pwrite(chunk->data(), len, file, start,
                                      [this, ip, chunk](const OpResult& r) mutable {
                                        chunk.reset();  // back to the pool before waiters wake
                                        FinishFlush(ip, r.status);
                                      });
  if (!st.ok()) {
    --in.wb_inflight;
    if (in.wb_error.ok()) in.wb_error = st;
    counters_.errors.fetch_add(1, std::memory_order_relaxed);
  }
}

int Fs::TakeErrorLocked(Inode& in) {
  int err = ErrnoOf(in.wb_error);
  in.wb_error = Status::Ok();
  return err;
}

int Fs::DrainLocked(Inode& in, std::unique_lock<std::mutex>& lock, bool take_error) {
  FlushExtentLocked(in, lock);
  in.cv.wait(lock, [&] { return in.wb_inflight == 0; });
  in.wb_end = 0;
  return take_error ? TakeErrorLocked(in) : ErrnoOf(in.wb_error);
}

int Fs::Drain(Inode& in, bool take_error) {
  std::unique_lock lock(in.m);
  return DrainLocked(in, lock, take_error);
}

void Fs::ApplyPending(Inode& in, struct stat* st) {
  std::lock_guard lock(in.m);
  if (in.wb_end == 0) return;  // nothing pending: the backing file is the truth
  if (in.wb_end > st->st_size) st->st_size = in.wb_end;
  auto later = [](const timespec& a, const timespec& b) {
    return a.tv_sec != b.tv_sec ? a.tv_sec > b.tv_sec : a.tv_nsec > b.tv_nsec;
  };
  if (later(in.wb_mtime, st->st_mtim)) st->st_mtim = in.wb_mtime;
  if (later(in.wb_mtime, st->st_ctim)) st->st_ctim = in.wb_mtime;
}

void Fs::InvalidateReadAheadLocked(Inode& in) {
  in.ra_chunks.clear();  // chunks still in flight live on in their completion callbacks
  in.ra_next = -1;
}

void Fs::InvalidateReadAhead(Inode& in) {
  std::lock_guard lock(in.m);
  InvalidateReadAheadLocked(in);
}

bool WriteSource::in_pipe() const {
  if (src_->idx >= src_->count) return false;
  const fuse_buf& b = src_->buf[src_->idx];
  return (b.flags & FUSE_BUF_IS_FD) && !(b.flags & FUSE_BUF_FD_SEEK);
}

int64_t WriteSource::SpliceTo(int pipe_w, size_t n) {
  fuse_buf& b = src_->buf[src_->idx];
  n = std::min(n, b.size - src_->off);
  size_t moved = 0;
  while (moved < n) {
    ssize_t r = splice(b.fd, nullptr, pipe_w, nullptr, n - moved, SPLICE_F_NONBLOCK);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && errno == EAGAIN) break;  // the destination is full
    if (r < 0) return -errno;
    if (r == 0) return -EIO;  // the request pipe holds less than the request said
    moved += static_cast<size_t>(r);
  }
  src_->off += moved;  // keeps fuse_buf_copy's view of what is left in step
  return static_cast<int64_t>(moved);
}

const char* WriteSource::RestInMemory(size_t* n) const {
  if (src_->idx + 1 != src_->count) return nullptr;  // exactly one piece left
  const fuse_buf& b = src_->buf[src_->idx];
  if ((b.flags & FUSE_BUF_IS_FD) || b.mem == nullptr) return nullptr;
  *n = b.size - src_->off;
  return static_cast<const char*>(b.mem) + src_->off;
}

bool WriteSource::adoptable() const {
  size_t n = 0;
  const char* rest = RestInMemory(&n);
  return rest != nullptr && reinterpret_cast<uintptr_t>(rest) % kAlign == 0 &&
         InRequestBuffer(rest, n);
}

RequestBuffer WriteSource::Adopt(size_t n) {
  if (!adoptable()) return {};
  size_t left = 0;
  const char* rest = RestInMemory(&left);
  if (left != n) return {};
  RequestBuffer r = AdoptRequestBuffer(rest, n);
  if (r) src_->off += n;  // consumed, as a copy would have
  return r;
}

const char* WriteSource::InMemory(size_t n) {
  size_t left = 0;
  const char* rest = RestInMemory(&left);
  if (rest == nullptr || left != n) return nullptr;
  src_->off += n;
  return rest;
}

bool WriteSource::CopyTo(char* dst, size_t n) {
  fuse_bufvec d = FUSE_BUFVEC_INIT(n);
  d.buf[0].mem = dst;
  ssize_t r = fuse_buf_copy(&d, src_, static_cast<fuse_buf_copy_flags>(0));
  if (r < 0) {
    errno = static_cast<int>(-r);
    return false;
  }
  if (static_cast<size_t>(r) != n) {
    errno = EIO;
    return false;
  }
  return true;
}

void Fs::NoteWriteKind(bool page_cache) {
  int s = splice_score_.load(std::memory_order_relaxed);
  const int next =
      page_cache ? std::min(s + 1, kSpliceScoreLimit) : std::max(s - 1, -kSpliceScoreLimit);
  // A lost race only delays the switch by a request: no retry loop needed.
  if (next != s) splice_score_.compare_exchange_weak(s, next, std::memory_order_relaxed);
}

int Fs::Write(FileHandle& fh, WriteSource& src, size_t size, off_t off, char* scratch) {
  Inode& in = *fh.inode;
  counters_.write_ops.fetch_add(1, std::memory_order_relaxed);
  // Small writes cost about the same either way; only large ones steer the receive mode.
  if (wb_pipes_ && size >= kSpliceHintMinBytes) NoteWriteKind(fh.page_cache_writes);
  std::unique_lock lock(in.m);
  InvalidateReadAheadLocked(in);
  // An earlier flush failed: this writer hears of it now.
  if (int err = TakeErrorLocked(in)) return err;
  size_t done = 0;
  // O_DIRECT clients take the same path: O_DIRECT promises no page cache, not durability (that
  // is fsync's job, which drains), and FUSE runs a file's direct writes one at a time (libfuse
  // 3.14 cannot ask for FOPEN_PARALLEL_DIRECT_WRITES), so replying only after the disk would run
  // them at queue depth one.
  if (wb_pool_) {
    bool splice_ok = true;  // cleared if a pipe refuses the request's pages
    // The whole payload, page-aligned in the buffer the session loop received it in, for a
    // page-aligned file range: that buffer can be written as it is (fs/request_buffer.h).
    bool adopt_ok = size >= kAdoptMinBytes && src.adoptable() && size % kAlign == 0 &&
                    off % kAlign == 0 && static_cast<int64_t>(size) <= opts_.write_chunk;
    while (done < size) {
      const int64_t pos = off + static_cast<int64_t>(done);
      // Page references can go straight to an O_DIRECT write only when they are whole pages at
      // page-aligned file offsets of a file the engine opened with O_DIRECT.
      const bool spliceable = splice_ok && wb_pipes_ && fh.page_cache_writes && src.in_pipe() &&
                              pos % kAlign == 0 && (size - done) % kAlign == 0 &&
                              fh.file.direct_fd() >= 0;
      const bool have = in.wb_chunk || in.wb_pipe || !in.wb_bufs.empty();
      if (have && pos != in.wb_start + in.wb_len) {
        FlushExtentLocked(in, lock);
      } else if (in.wb_pipe && !spliceable) {
        FlushExtentLocked(in, lock);  // a pipe extent takes only more spliceable data
      } else if (!in.wb_bufs.empty() &&
                 (!adopt_ok || done != 0 ||
                  in.wb_len + static_cast<int64_t>(size) > opts_.write_chunk)) {
        FlushExtentLocked(in, lock);  // adopted extents take whole payloads, up to write_chunk
      }
      // A chunk being filled (contiguous, so not flushed above) is filled on; the next extent
      // adopts.
      const bool adoptable = adopt_ok && done == 0 && !in.wb_chunk;
      if (!in.wb_chunk && !in.wb_pipe && in.wb_bufs.empty()) {
        if (pos % kAlign != 0) break;  // extents start aligned so flushes stay O_DIRECT
        // A new extent that does not continue the last one may overlap a flush in flight; two
        // overlapping O_DIRECT writes complete in any order, so let those land first.
        if (in.wb_inflight > 0 && pos != in.wb_next) {
          in.cv.wait(lock, [&] { return in.wb_inflight == 0; });
          continue;  // another writer may have started an extent meanwhile: look again
        }
        if (spliceable) in.wb_pipe = wb_pipes_->TryAcquire();
        if (!in.wb_pipe && !adoptable) {
          PinnedPool::Lease lease = wb_pool_->TryAcquire();
          if (!lease) {
            // Every chunk is busy. Waiting is safe only for our own flushes (they will finish);
            // otherwise write this request through the engine directly.
            if (in.wb_inflight == 0) break;
            in.cv.wait(lock);
            continue;
          }
          in.wb_chunk = std::make_shared<PinnedPool::Lease>(std::move(lease));
        }
        in.wb_start = pos;  // with neither chunk nor pipe: an extent of adopted buffers
        in.wb_len = 0;
        in.wb_file = fh.file;
      }
      if (!in.wb_chunk && !in.wb_pipe) {  // adoptable
        RequestBuffer b = src.Adopt(size);
        if (!b) {
          // Every spare request buffer holds data in flight. Ours come back as our flushes
          // complete: wait for one rather than copy (which would only move the backlog into
          // the chunks). With none of ours in flight, copy into a chunk instead.
          if (!in.wb_bufs.empty()) FlushExtentLocked(in, lock);
          if (in.wb_adopted_inflight > 0) {
            in.cv.wait(lock);
          } else {
            adopt_ok = false;
          }
          continue;
        }
        in.wb_bufs.push_back(std::move(b));
        in.wb_len += static_cast<int64_t>(size);
        done = size;
        in.wb_end = std::max(in.wb_end, in.wb_start + in.wb_len);
        in.wb_next = in.wb_start + in.wb_len;
        if (in.wb_len >= opts_.write_chunk) FlushExtentLocked(in, lock);
        break;
      }
      const int64_t cap = in.wb_pipe ? wb_pipes_->capacity() : opts_.write_chunk;
      const size_t want = static_cast<size_t>(
          std::min<int64_t>(static_cast<int64_t>(size - done), cap - in.wb_len));
      size_t n = want;
      if (in.wb_pipe) {
        const int64_t moved = src.SpliceTo(in.wb_pipe->write_fd(), want);
        if (moved < 0) return static_cast<int>(-moved);
        n = static_cast<size_t>(moved);
        if (n == 0 && in.wb_len == 0) {
          in.wb_pipe.Reset();  // an empty pipe took nothing: copy this request instead
          splice_ok = false;
          continue;
        }
      } else if (!src.CopyTo(in.wb_chunk->data() + in.wb_len, n)) {
        return errno;
      }
      in.wb_len += static_cast<int64_t>(n);
      done += n;
      in.wb_end = std::max(in.wb_end, in.wb_start + in.wb_len);
      in.wb_next = in.wb_start + in.wb_len;
      // Full (or a pipe that took less than it should hold): flush, go on in a new extent.
      if (in.wb_len == cap || n < want) FlushExtentLocked(in, lock);
    }
    if (done > 0) clock_gettime(CLOCK_REALTIME, &in.wb_mtime);
    counters_.bytes_written_behind.fetch_add(done, std::memory_order_relaxed);
    if (done == size) return 0;
  }
  // Synchronous path (small, unaligned, no free chunk): earlier data must land first.
  if (int err = DrainLocked(in, lock, /*take_error=*/true)) return err;
  lock.unlock();
  const int64_t rest = static_cast<int64_t>(size - done);
  // Straight from the request when it is in memory (the session loop receives a WRITE's payload
  // page-aligned, so the engine writes it without a bounce copy); otherwise into the thread's
  // aligned scratch buffer first.
  const char* data = src.InMemory(static_cast<size_t>(rest));
  if (data == nullptr) {
    if (!src.CopyTo(scratch, static_cast<size_t>(rest))) return errno;
    data = scratch;
  }
  Status st = Engine()->sync_pwrite(data, rest, fh.file, off + static_cast<int64_t>(done));
  if (!st.ok()) {
    counters_.errors.fetch_add(1, std::memory_order_relaxed);
    return ErrnoOf(st);
  }
  counters_.bytes_written_sync.fetch_add(static_cast<uint64_t>(rest), std::memory_order_relaxed);
  return 0;
}

void Fs::StartReadAheadLocked(Inode& in, FileHandle& fh, int64_t from, int64_t file_size) {
  const int64_t window_end = std::min(file_size, from + opts_.read_ahead);
  int64_t next = from / ra_chunk_ * ra_chunk_;
  for (const auto& c : in.ra_chunks) next = std::max(next, c->offset + c->length);
  while (next < window_end) {
    PinnedPool::Lease lease = ra_pool_->TryAcquire();
    if (!lease) return;  // the pool is shared by all readers; try again on the next read
    auto chunk = std::make_shared<RaChunk>();
    chunk->offset = next;
    chunk->length = std::min(ra_chunk_, file_size - next);
    chunk->buf = std::make_shared<PinnedPool::Lease>(std::move(lease));
    Inode* ip = &in;
    ++in.ra_inflight;
    counters_.read_ahead_fetches.fetch_add(1, std::memory_order_relaxed);
    Status st = Engine()->submit_pread(chunk->buf->data(), chunk->length, fh.file, chunk->offset,
                                       [ip, chunk](const OpResult& r) {
                                         {
                                           std::lock_guard g(ip->m);
                                           chunk->status = r.status;
                                           chunk->ready = true;
                                           --ip->ra_inflight;
                                         }
                                         ip->cv.notify_all();
                                       });
    if (!st.ok()) {
      --in.ra_inflight;
      return;
    }
    in.ra_chunks.push_back(chunk);
    next += chunk->length;
  }
}

void Fs::QuiesceReadAhead(Inode& in) {
  std::unique_lock lock(in.m);
  in.cv.wait(lock, [&] { return in.ra_inflight == 0; });
  InvalidateReadAheadLocked(in);
}

bool Fs::ReadAndReplyAsync(fuse_req_t req, FileHandle& fh, size_t size, off_t off) {
  if (!reply_pool_ || size > reply_pool_->buffer_size()) return false;
  PinnedPool::Lease lease = reply_pool_->TryAcquire();
  if (!lease) return false;
  counters_.read_ops.fetch_add(1, std::memory_order_relaxed);
  Drain(*fh.inode, /*take_error=*/false);  // readers see every accepted byte
  struct stat st {};
  if (fstat(fh.fd.get(), &st) != 0) {
    fuse_reply_err(req, errno);
    return true;
  }
  if (off >= st.st_size) {
    fuse_reply_buf(req, nullptr, 0);
    return true;
  }
  const int64_t n = std::min<int64_t>(static_cast<int64_t>(size), st.st_size - off);
  auto buf = std::make_shared<PinnedPool::Lease>(std::move(lease));
  const int fd = fh.fd.get();  // valid until release, which cannot come while a read is pending
  Status s = Engine()->submit_pread(
      buf->data(), n, fh.file, off, [this, req, buf, n, fd, off](const OpResult& r) {
        if (r.status.ok()) {
          counters_.bytes_read_engine.fetch_add(static_cast<uint64_t>(n),
                                                std::memory_order_relaxed);
          fuse_reply_buf(req, buf->data(), static_cast<size_t>(n));
        } else if (r.status.code() == Status::Code::kEndOfFile) {
          // The file shrank since fstat: answer with what is there, as
          // read(2) would.
          ssize_t got;
          do {
            got = pread(fd, buf->data(), static_cast<size_t>(n), off);
          } while (got < 0 && errno == EINTR);
          if (got < 0) {
            fuse_reply_err(req, errno);
          } else {
            fuse_reply_buf(req, buf->data(), static_cast<size_t>(got));
          }
        } else {
          counters_.errors.fetch_add(1, std::memory_order_relaxed);
          fuse_reply_err(req, ErrnoOf(r.status));
        }
      });
  if (!s.ok()) {
    counters_.errors.fetch_add(1, std::memory_order_relaxed);
    fuse_reply_err(req, ErrnoOf(s));
  }
  return true;
}

ssize_t Fs::Read(FileHandle& fh, char* out, size_t size, off_t off, ReadReply* reply) {
  Inode& in = *fh.inode;
  counters_.read_ops.fetch_add(1, std::memory_order_relaxed);
  Drain(in, /*take_error=*/false);  // readers see every accepted byte
  struct stat st {};
  if (fstat(fh.fd.get(), &st) != 0) return -errno;
  if (off >= st.st_size) return 0;
  const int64_t n = std::min<int64_t>(static_cast<int64_t>(size), st.st_size - off);
  int64_t copied = 0;

  if (ra_pool_ && !fh.client_direct) {
    std::unique_lock lock(in.m);
    const bool sequential = off == in.ra_next;
    in.ra_next = off + n;
    // Drop chunks wholly behind the reader; they will not be asked for again.
    std::erase_if(in.ra_chunks, [&](const std::shared_ptr<RaChunk>& c) {
      return c->ready && c->offset + c->length <= off;
    });
    if (sequential) StartReadAheadLocked(in, fh, off, st.st_size);
    while (copied < n) {
      const int64_t pos = off + copied;
      std::shared_ptr<RaChunk> c;
      for (const auto& x : in.ra_chunks) {
        if (x->offset <= pos && pos < x->offset + x->length) c = x;
      }
      if (!c) break;
      in.cv.wait(lock, [&] { return c->ready; });
      if (!c->status.ok()) break;  // the on-demand read below reports the error properly
      const int64_t k = std::min(n - copied, c->offset + c->length - pos);
      // No copy here: the reply points into the chunk, which the reply keeps alive.
      reply->iov.push_back({c->buf->data() + (pos - c->offset), static_cast<size_t>(k)});
      reply->pins.push_back(c);
      copied += k;
    }
    counters_.bytes_read_ahead_hit.fetch_add(static_cast<uint64_t>(copied),
                                             std::memory_order_relaxed);
    if (copied == n) return n;
  }
  // The rest is read on demand into the caller's (pinned, aligned) scratch buffer.
  Status s = Engine()->sync_pread(out + copied, n - copied, fh.file, off + copied);
  if (s.code() == Status::Code::kEndOfFile) {
    // The file shrank since fstat: return what is there, as read(2) would.
    ssize_t r;
    do {
      r = pread(fh.fd.get(), out + copied, static_cast<size_t>(n - copied), off + copied);
    } while (r < 0 && errno == EINTR);
    if (r < 0) return -errno;
    reply->iov.push_back({out + copied, static_cast<size_t>(r)});
    return copied + r;
  }
  if (!s.ok()) {
    counters_.errors.fetch_add(1, std::memory_order_relaxed);
    return -ErrnoOf(s);
  }
  counters_.bytes_read_engine.fetch_add(static_cast<uint64_t>(n - copied),
                                        std::memory_order_relaxed);
  reply->iov.push_back({out + copied, static_cast<size_t>(n - copied)});
  return n;
}

}  // namespace dnvme::fs
