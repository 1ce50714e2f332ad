// The data path of the mount for READs: how a read reaches the engine through the inode's
// WriteBehind (drained first, fs/data/write_behind.h) and ReadAhead (fs/data/read_ahead.h). A
// WRITE goes from the op (fs/fuse/ops_file.cc) straight to the inode's WriteBehind. Errors leave
// as Status; the FUSE ops turn them into errno replies.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "engine/common/log.h"
#include "fs/fs.h"

namespace dnvme::fs {

bool Fs::ReadAsync(FileHandle& fh, size_t size, off_t off, ReadDone done) {
  if (!reply_pool_ || size > reply_pool_->buffer_size()) return false;
  PinnedPool::Lease lease = reply_pool_->TryAcquire();
  if (!lease) return false;
  counters_.read_ops.fetch_add(1, std::memory_order_relaxed);
  (void)fh.inode->wb.Drain(nullptr);  // readers see every accepted byte
  struct stat st {};
  if (fstat(fh.fd.get(), &st) != 0) {
    done(Status::FromErrno(errno, "fstat before a read"));
    return true;
  }
  if (off >= st.st_size) {
    done(std::span<const char>());
    return true;
  }
  const int64_t n = std::min<int64_t>(static_cast<int64_t>(size), st.st_size - off);
  auto buf = std::make_shared<PinnedPool::Lease>(std::move(lease));
  const int fd = fh.fd.get();  // valid until release, which cannot come while a read is pending
  // Shared by the callback and the submit-failure path below: exactly one of them runs it.
  auto finish = std::make_shared<ReadDone>(std::move(done));
  Status s = Engine()->submit_pread(
      buf->data(), n, fh.file, off, [this, finish, buf, n, fd, off](const OpResult& r) {
        if (r.status.ok()) {
          counters_.bytes_read_engine.fetch_add(static_cast<uint64_t>(n),
                                                std::memory_order_relaxed);
          (*finish)(std::span<const char>(buf->data(), static_cast<size_t>(n)));
        } else if (r.status.code() == Status::Code::kEndOfFile) {
          // The file shrank since fstat: answer with what is there, as read(2) would.
          ssize_t got;
          do {
            got = pread(fd, buf->data(), static_cast<size_t>(n), off);
          } while (got < 0 && errno == EINTR);
          if (got < 0) {
            (*finish)(Status::FromErrno(errno, "pread after the file shrank"));
          } else {
            (*finish)(std::span<const char>(buf->data(), static_cast<size_t>(got)));
          }
        } else {
          counters_.errors.fetch_add(1, std::memory_order_relaxed);
          (*finish)(r.status);
        }
      });
  if (!s.ok()) {
    counters_.errors.fetch_add(1, std::memory_order_relaxed);
    (*finish)(s);
  }
  return true;
}

Result<int64_t> Fs::Read(FileHandle& fh, char* out, size_t size, off_t off, ReadReply* reply) {
  Inode& in = *fh.inode;
  counters_.read_ops.fetch_add(1, std::memory_order_relaxed);
  // Readers see every accepted byte (a flush error is the writer's to hear, at fsync or close).
  (void)in.wb.Drain(nullptr);
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
