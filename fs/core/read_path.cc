// The mount's READ path (declared in read_path.h): a read reaches the engine through the
// inode's WriteBehind (drained first) and ReadAhead (datapath/, shared with `dnvme run`).
#include "fs/core/read_path.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "engine/common/log.h"

namespace dnvme::fs {
namespace {

// What a READ of `size` bytes at `off` gets: the bytes the file has there, after the inode's
// write-behind landed (readers see every accepted byte; a flush error is the writer's to hear,
// at fsync or close). 0 at or past the end.
Result<int64_t> ReadableBytes(FileHandle& fh, size_t size, off_t off, int64_t* file_size) {
  (void)fh.inode->wb.Drain(nullptr);
  struct stat st {};
  if (fstat(fh.fd.get(), &st) != 0) return Status::FromErrno(errno, "fstat before a read");
  *file_size = st.st_size;
  if (off >= st.st_size) return int64_t{0};
  return std::min<int64_t>(static_cast<int64_t>(size), st.st_size - off);
}

// The file shrank between the fstat and the engine's read: what is there now, as read(2) would
// answer, through the buffered descriptor.
Result<int64_t> ReadShrunk(int fd, char* buf, int64_t n, int64_t off) {
  ssize_t got;
  do {
    got = pread(fd, buf, static_cast<size_t>(n), off);
  } while (got < 0 && errno == EINTR);
  if (got < 0) return Status::FromErrno(errno, "pread after the file shrank");
  return static_cast<int64_t>(got);
}

}  // namespace

bool ReadAsync(Mount& mount, FileHandle& fh, size_t size, off_t off, ReadDone done) {
  PinnedPool* const pool = mount.reply_pool();
  if (pool == nullptr || size > pool->buffer_size()) return false;
  PinnedPool::Lease lease = pool->TryAcquire();
  MountCounters& counters = mount.counters();
  if (!lease) return false;
  counters.read_ops.fetch_add(1, std::memory_order_relaxed);
  int64_t file_size = 0;
  Result<int64_t> readable = ReadableBytes(fh, size, off, &file_size);
  if (!readable.ok() || *readable == 0) {
    if (readable.ok()) {
      done(std::span<const char>());
    } else {
      done(readable.status());
    }
    return true;
  }
  const int64_t n = *readable;
  auto buf = std::make_shared<PinnedPool::Lease>(std::move(lease));
  const int fd = fh.fd.get();  // valid until release, which cannot come while a read is pending
  // Shared by the callback and the submit-failure path below: exactly one of them runs it.
  auto finish = std::make_shared<ReadDone>(std::move(done));
  Status s = mount.engine()->submit_pread(
      buf->data(), n, fh.file, off, [&counters, finish, buf, n, fd, off](const OpResult& r) {
        if (r.status.ok()) {
          counters.bytes_read_engine.fetch_add(static_cast<uint64_t>(n), std::memory_order_relaxed);
          (*finish)(std::span<const char>(buf->data(), static_cast<size_t>(n)));
        } else if (r.status.code() == Status::Code::kEndOfFile) {
          Result<int64_t> got = ReadShrunk(fd, buf->data(), n, off);
          if (got.ok()) {
            (*finish)(std::span<const char>(buf->data(), static_cast<size_t>(*got)));
          } else {
            (*finish)(got.status());
          }
        } else {
          counters.errors.fetch_add(1, std::memory_order_relaxed);
          (*finish)(r.status);
        }
      });
  if (!s.ok()) {
    counters.errors.fetch_add(1, std::memory_order_relaxed);
    (*finish)(s);
  }
  return true;
}

Result<int64_t> Read(Mount& mount, FileHandle& fh, char* out, size_t size, off_t off,
                     datapath::ReadReply* reply) {
  mount.counters().read_ops.fetch_add(1, std::memory_order_relaxed);
  // Before the drain: a change after it makes what the window would fetch suspect.
  const uint64_t generation = fh.inode->ra.Generation();
  int64_t file_size = 0;
  Result<int64_t> readable = ReadableBytes(fh, size, off, &file_size);
  if (!readable.ok() || *readable == 0) return readable;
  const int64_t n = *readable;
  // O_DIRECT clients asked for no caching: they read on demand. The window's counters and the
  // rest read into the caller's (pinned, aligned) scratch buffer are the data path's.
  const bool first_read_only = !fh.client_direct && !fh.writable && !fh.read_before.exchange(true);
  Result<int64_t> got =
      fh.inode->ra.Read(*mount.engine(), fh.file, off, n, file_size, !fh.client_direct, out, reply,
                        generation, first_read_only);
  if (got.ok() || got.status().code() != Status::Code::kEndOfFile) return got;
  const int64_t served = reply->bytes();
  Result<int64_t> rest = ReadShrunk(fh.fd.get(), out + served, n - served, off + served);
  if (!rest.ok()) return rest.status();
  reply->iov.push_back({out + served, static_cast<size_t>(*rest)});
  return served + *rest;
}

}  // namespace dnvme::fs
