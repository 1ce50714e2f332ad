// The mount's READ path (declared in read_path.h): a read goes through the inode's data path
// (datapath/file_data.h, shared with `dnvme run`); an O_DIRECT client's may be answered from the
// engine's completion.
#include "fs/core/read_path.h"

namespace dnvme::fs {

bool ReadAsync(Mount& mount, FileHandle& fh, size_t size, off_t off, ReadDone done) {
  PinnedPool* const pool = mount.reply_pool();
  if (pool == nullptr || size > pool->buffer_size()) return false;
  PinnedPool::Lease lease = pool->TryAcquire();
  MountCounters& counters = mount.counters();
  if (!lease) return false;
  counters.read_ops.fetch_add(1, std::memory_order_relaxed);
  datapath::FileData& data = fh.inode->data;
  Result<int64_t> readable = data.Readable(fh.file, off, static_cast<int64_t>(size));
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
      buf->data(), n, fh.file, off, [&counters, &data, finish, buf, n, fd, off](const OpResult& r) {
        if (r.status.ok()) {
          counters.bytes_read_engine.fetch_add(static_cast<uint64_t>(n), std::memory_order_relaxed);
          (*finish)(std::span<const char>(buf->data(), static_cast<size_t>(n)));
        } else if (r.status.code() == Status::Code::kEndOfFile) {
          Result<int64_t> got = data.ReadShrunk(fd, buf->data(), n, off);
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

Result<int64_t> Read(Mount& mount, FileHandle& fh, char* scratch, size_t size, off_t off,
                     datapath::ReadReply* reply, pid_t reader) {
  mount.counters().read_ops.fetch_add(1, std::memory_order_relaxed);
  datapath::FileRead r;
  r.off = off;
  r.size = static_cast<int64_t>(size);
  // O_DIRECT clients asked for no caching: they read on demand.
  r.window = fh.client_direct ? datapath::Window::kSkip : datapath::Window::kUse;
  r.buf = scratch;
  r.reply = reply;
  r.shrunk_fd = fh.fd.get();
  r.may_fill = !fh.engine_reads;
  r.reader = reader;
  r.may_probe = fh.may_probe;
  return fh.inode->data.Read(fh.open, fh.file, r);
}

}  // namespace dnvme::fs
