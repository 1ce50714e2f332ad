// The data path of the mount: how a WRITE and a READ reach the engine. Each inode's data state
// lives in its WriteBehind (fs/data/write_behind.h) and ReadAhead (fs/data/read_ahead.h); this
// file composes them with the engine and the receive mode's splice hint.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "engine/common/log.h"
#include "fs/fs.h"
#include "fs/fuse/fuse_status.h"

namespace dnvme::fs {
namespace {

constexpr size_t kSpliceHintMinBytes = 64 << 10;

}  // namespace

void Fs::NoteWriteKind(bool page_cache) {
  int s = splice_score_.load(std::memory_order_relaxed);
  const int next =
      page_cache ? std::min(s + 1, kSpliceScoreLimit) : std::max(s - 1, -kSpliceScoreLimit);
  // A lost race only delays the switch by a request: no retry loop needed.
  if (next != s) splice_score_.compare_exchange_weak(s, next, std::memory_order_relaxed);
}

Status Fs::Write(FileHandle& fh, WriteSource& src, size_t size, off_t off, char* scratch) {
  // Small writes cost about the same either way; only large ones steer the receive mode.
  if (wb_pipes_ && size >= kSpliceHintMinBytes) NoteWriteKind(fh.page_cache_writes);
  fh.inode->ra.Invalidate();
  return fh.inode->wb.Write(fh.file, fh.page_cache_writes, src, size, off, scratch);
}

bool Fs::ReadAndReplyAsync(fuse_req_t req, FileHandle& fh, size_t size, off_t off) {
  if (!reply_pool_ || size > reply_pool_->buffer_size()) return false;
  PinnedPool::Lease lease = reply_pool_->TryAcquire();
  if (!lease) return false;
  counters_.read_ops.fetch_add(1, std::memory_order_relaxed);
  (void)fh.inode->wb.Drain(/*take_error=*/false);  // readers see every accepted byte
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

Result<int64_t> Fs::Read(FileHandle& fh, char* out, size_t size, off_t off, ReadReply* reply) {
  Inode& in = *fh.inode;
  counters_.read_ops.fetch_add(1, std::memory_order_relaxed);
  // Readers see every accepted byte (a flush error is the writer's to hear, at fsync or close).
  (void)in.wb.Drain(/*take_error=*/false);
  struct stat st {};
  if (fstat(fh.fd.get(), &st) != 0) return Status::FromErrno(errno, "fstat before a read");
  if (off >= st.st_size) return int64_t{0};
  const int64_t n = std::min<int64_t>(static_cast<int64_t>(size), st.st_size - off);
  // O_DIRECT clients asked for no caching: they read on demand.
  const int64_t copied = fh.client_direct ? 0 : in.ra.Serve(fh.file, off, n, st.st_size, reply);
  if (copied == n) return n;
  // The rest is read on demand into the caller's (pinned, aligned) scratch buffer.
  Status s = Engine()->sync_pread(out + copied, n - copied, fh.file, off + copied);
  if (s.code() == Status::Code::kEndOfFile) {
    // The file shrank since fstat: return what is there, as read(2) would.
    ssize_t r;
    do {
      r = pread(fh.fd.get(), out + copied, static_cast<size_t>(n - copied), off + copied);
    } while (r < 0 && errno == EINTR);
    if (r < 0) return Status::FromErrno(errno, "pread after the file shrank");
    reply->iov.push_back({out + copied, static_cast<size_t>(r)});
    return copied + r;
  }
  if (!s.ok()) {
    counters_.errors.fetch_add(1, std::memory_order_relaxed);
    return s;
  }
  counters_.bytes_read_engine.fetch_add(static_cast<uint64_t>(n - copied),
                                        std::memory_order_relaxed);
  reply->iov.push_back({out + copied, static_cast<size_t>(n - copied)});
  return n;
}

}  // namespace dnvme::fs
