#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <nlohmann/json.hpp>

#include "dnvme/handle.h"
#include "dnvme/log.h"
#include "engine/handle/op.h"
#include "engine/handle/worker.h"

namespace dnvme {

const char* OpTypeName(OpType type) { return type == OpType::kWrite ? "write" : "read"; }

HandleStats& HandleStats::operator+=(const HandleStats& o) {
  ops_read += o.ops_read;
  ops_written += o.ops_written;
  ops_failed += o.ops_failed;
  bytes_read += o.bytes_read;
  bytes_written += o.bytes_written;
  bytes_direct += o.bytes_direct;
  bytes_bounce += o.bytes_bounce;
  bytes_buffered += o.bytes_buffered;
  direct_fallbacks += o.direct_fallbacks;
  requests += o.requests;
  submit_calls += o.submit_calls;
  submit_retries += o.submit_retries;
  short_transfers += o.short_transfers;
  validate_checks += o.validate_checks;
  inflight_requests += o.inflight_requests;
  max_inflight_requests = std::max(max_inflight_requests, o.max_inflight_requests);
  return *this;
}

std::string HandleStats::ToJson() const {
  nlohmann::json j = {
      {"ops_read", ops_read},
      {"ops_written", ops_written},
      {"ops_failed", ops_failed},
      {"bytes_read", bytes_read},
      {"bytes_written", bytes_written},
      {"bytes_direct", bytes_direct},
      {"bytes_bounce", bytes_bounce},
      {"bytes_buffered", bytes_buffered},
      {"direct_fallbacks", direct_fallbacks},
      {"requests", requests},
      {"submit_calls", submit_calls},
      {"submit_retries", submit_retries},
      {"short_transfers", short_transfers},
      {"validate_checks", validate_checks},
      {"inflight_requests", inflight_requests},
      {"max_inflight_requests", max_inflight_requests},
  };
  return j.dump();
}

// The state behind AioHandle. Thread contract: as AioHandle (one driving thread); the workers and
// the counters are the only parts shared with other threads.
class HandleImpl {
 public:
  HandleImpl(const HandleConfig& config, std::shared_ptr<AioBackendFactory> factory)
      : config_(config), factory_(std::move(factory)), owner_pid_(::getpid()) {}

  ~HandleImpl() {
    if (::getpid() != owner_pid_) {
      // A forked child's copy: the workers (and the operations they owed) are the parent's, and
      // joining a thread that does not exist here would never return. The workers' memory is
      // left; the operations' state goes with pending_ (nothing here waits on it).
      for (auto& w : workers_) static_cast<void>(w.release());
      return;
    }
    Quiesce();
  }

  // Waits for every pending operation, then joins the workers (their queues are empty by then).
  void Quiesce() {
    for (auto& op : pending_) op->WaitDone();
    workers_.clear();
  }

  Status StartWorkers() {
    for (int i = 0; i < config_.intra_op_parallelism; ++i) {
      auto w = Worker::Create(i, config_, factory_, &counters_);
      if (!w.ok()) return w.status().WithContext("starting I/O worker " + std::to_string(i));
      workers_.push_back(std::move(w).value());
    }
    return Status::Ok();
  }

  // What an operation is on: a path, a caller's fd, or an already opened FileRef.
  struct Target {
    const std::string* path = nullptr;
    int fd = -1;
    std::shared_ptr<IoFile> file;
    std::string Label() const {
      if (file) return file->label;
      return path ? *path : "fd:" + std::to_string(fd);
    }
  };

  Result<std::shared_ptr<IoFile>> Open(const Target& t, FileAccess access, bool want_read_fd) {
    auto file = t.path ? OpenIoFile(*t.path, access, config_.direct, want_read_fd)
                       : AdoptIoFd(t.fd, access, config_.direct, want_read_fd);
    if (!file.ok()) return file.status();
    if (file.value()->fell_back) {
      counters_.direct_fallbacks.fetch_add(1, std::memory_order_relaxed);
      if (!warned_fallback_.exchange(true)) {
        // Throttled too: the daemon's control file opens a handle per request if a user wants.
        DNVME_LOG_THROTTLED(
            warn,
            "O_DIRECT is not supported for '{}': using buffered I/O (direct=auto; this warning is "
            "shown once per handle, stats count every fallback)",
            LogEscape(file.value()->label));
      }
    }
    return file;
  }

  // Validates, opens (unless the target is a FileRef), slices and posts one operation.
  // Thread-safe: touches only atomics, the workers' queues and the new OpState.
  Result<std::shared_ptr<OpState>> Start(OpType type, const void* buffer, int64_t num_bytes,
                                         const Target& target, int64_t file_offset, bool validate,
                                         Completion on_done = nullptr,
                                         Submitted on_submitted = nullptr,
                                         bool page_cache = false) {
    const std::string label = target.Label();
    const char* verb = OpTypeName(type);
    // A forked child inherits this object but not the worker threads (nor the aio contexts):
    // an operation queued here would wait forever. Refuse it instead.
    if (::getpid() != owner_pid_) {
      return Status::Unsupported(
          ECHILD, std::string(verb) + " of '" + label +
                      "': this I/O handle was created by process " + std::to_string(owner_pid_) +
                      "; a forked child has none of its threads: create a handle in the child");
    }
    if (num_bytes < 0) {
      return Status::InvalidArgument(std::string(verb) + " of '" + label +
                                     "': negative byte count " + std::to_string(num_bytes));
    }
    if (file_offset < 0) {
      return Status::InvalidArgument(std::string(verb) + " of '" + label +
                                     "': negative file offset " + std::to_string(file_offset));
    }
    if (num_bytes > std::numeric_limits<int64_t>::max() - file_offset) {
      return Status::InvalidArgument(std::string(verb) + " of '" + label +
                                     "': offset + length overflows");
    }
    if (buffer == nullptr && num_bytes > 0) {
      return Status::InvalidArgument(std::string(verb) + " of '" + label + "': null buffer for " +
                                     std::to_string(num_bytes) + " bytes");
    }
    const bool write = type == OpType::kWrite;
    std::shared_ptr<IoFile> file = target.file;
    if (file) {
      if (write ? !file->can_write : !file->can_read) {
        return Status::InvalidArgument(std::string(verb) + " of '" + label +
                                       "': the file is not open for " +
                                       (write ? "writing" : "reading"));
      }
    } else {
      DNVME_ASSIGN_OR_RETURN(
          file, Open(target, write ? FileAccess::kWrite : FileAccess::kRead, validate && write));
    }

    auto op = std::make_shared<OpState>();
    op->result.id = next_id_.fetch_add(1, std::memory_order_relaxed);
    op->result.type = type;
    op->result.path = label;
    op->result.file_offset = file_offset;
    op->result.length = num_bytes;
    op->file = std::move(file);
    op->on_done = std::move(on_done);
    op->tail_first = write && on_submitted != nullptr;
    op->on_submitted = std::move(on_submitted);
    // The engine never writes into a write's buffer; the cast only lets reads and writes share
    // the slice type.
    op->buffer = static_cast<char*>(const_cast<void*>(buffer));
    op->validate = validate;
    op->fdatasync_at_end = write && config_.fdatasync_on_write;
    op->page_cache = page_cache;

    // Cut points are multiples of the file's edge alignment, so the slices' aligned bodies meet
    // exactly and only the operation's own first and last pages can be edges.
    const int64_t align = op->file->direct_fd >= 0 && !page_cache ? op->file->edge_align : 4096;
    const int64_t end = file_offset + num_bytes;
    const int64_t n_workers = static_cast<int64_t>(workers_.size());
    const int64_t per = (num_bytes + n_workers - 1) / n_workers;
    const int64_t step = std::max(align, (per + align - 1) / align * align);
    std::vector<Slice> slices;
    int64_t prev = file_offset;
    for (int64_t i = 1; i < n_workers && prev < end; ++i) {
      int64_t cut = (file_offset + i * step) / align * align;
      if (cut <= prev || cut >= end) break;
      slices.push_back(Slice{op, prev, cut - prev, op->buffer + (prev - file_offset)});
      prev = cut;
    }
    if (prev < end)
      slices.push_back(Slice{op, prev, end - prev, op->buffer + (prev - file_offset)});

    if (slices.empty()) {  // zero bytes: nothing to do, but it is still an operation
      (write ? counters_.ops_written : counters_.ops_read).fetch_add(1, std::memory_order_relaxed);
      op->slices_unsubmitted.store(1, std::memory_order_relaxed);
      op->SliceSubmitted();
      op->MarkDone();
      return op;
    }
    op->slices_left.store(static_cast<int>(slices.size()), std::memory_order_relaxed);
    op->slices_unsubmitted.store(static_cast<int>(slices.size()), std::memory_order_relaxed);
    // Rotate the first worker so that many small operations from many threads (a mount's
    // requests) spread over all workers instead of queueing on worker 0.
    const size_t first = next_worker_.fetch_add(1, std::memory_order_relaxed);
    for (size_t i = 0; i < slices.size(); ++i) {
      workers_[(first + i) % workers_.size()]->Post(std::move(slices[i]));
    }
    return op;
  }

  Status RunSync(OpType type, const void* buffer, int64_t n, const Target& target, int64_t off,
                 bool validate, bool page_cache = false) {
    auto op = Start(type, buffer, n, target, off, validate, nullptr, nullptr, page_cache);
    if (!op.ok()) return op.status();
    op.value()->WaitDone();
    return op.value()->result.status;
  }

  Result<OpId> RunAsync(OpType type, const void* buffer, int64_t n, const Target& target,
                        int64_t off, bool validate) {
    auto op = Start(type, buffer, n, target, off, validate);
    if (!op.ok()) return op.status();
    pending_.push_back(op.value());
    return op.value()->result.id;
  }

  int Wait() {
    completed_.clear();
    completed_.reserve(pending_.size());
    const bool forked = ::getpid() != owner_pid_;
    for (auto& op : pending_) {
      if (forked) {  // the parent's operations: this process will never see them end
        OpResult r = op->result;
        r.status = Status::Unsupported(ECHILD, "operation queued by process " +
                                                   std::to_string(owner_pid_) +
                                                   " before fork(): its outcome is that process's");
        completed_.push_back(std::move(r));
        continue;
      }
      op->WaitDone();
      completed_.push_back(op->result);
    }
    pending_.clear();
    return static_cast<int>(completed_.size());
  }

  HandleStats Stats() const {
    HandleStats s;
    auto r = [](const std::atomic<uint64_t>& a) { return a.load(std::memory_order_relaxed); };
    s.ops_read = r(counters_.ops_read);
    s.ops_written = r(counters_.ops_written);
    s.ops_failed = r(counters_.ops_failed);
    s.bytes_read = r(counters_.bytes_read);
    s.bytes_written = r(counters_.bytes_written);
    s.bytes_direct = r(counters_.bytes_direct);
    s.bytes_bounce = r(counters_.bytes_bounce);
    s.bytes_buffered = r(counters_.bytes_buffered);
    s.direct_fallbacks = r(counters_.direct_fallbacks);
    s.requests = r(counters_.requests);
    s.submit_calls = r(counters_.submit_calls);
    s.submit_retries = r(counters_.submit_retries);
    s.short_transfers = r(counters_.short_transfers);
    s.validate_checks = r(counters_.validate_checks);
    s.inflight_requests = static_cast<uint64_t>(
        std::max<int64_t>(0, counters_.inflight.load(std::memory_order_relaxed)));
    s.max_inflight_requests =
        static_cast<uint64_t>(counters_.max_inflight.load(std::memory_order_relaxed));
    return s;
  }

  const HandleConfig& config() const { return config_; }
  const std::vector<OpResult>& completed() const { return completed_; }
  int pending() const { return static_cast<int>(pending_.size()); }

 private:
  const HandleConfig config_;
  const std::shared_ptr<AioBackendFactory> factory_;
  const pid_t owner_pid_;  // the process whose threads these are (fork: see Start)
  HandleCounters counters_;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::vector<std::shared_ptr<OpState>> pending_;
  std::vector<OpResult> completed_;
  std::atomic<OpId> next_id_{1};
  std::atomic<size_t> next_worker_{0};
  std::atomic<bool> warned_fallback_{false};
};

AioHandle::AioHandle(std::unique_ptr<HandleImpl> impl) : impl_(std::move(impl)) {}
AioHandle::~AioHandle() = default;

Result<std::unique_ptr<AioHandle>> AioHandle::Create(const HandleConfig& config,
                                                     HandleOptions options) {
  DNVME_RETURN_IF_ERROR(config.Validate());
  auto factory = options.backend ? options.backend : LibaioBackendFactory();
  auto impl = std::make_unique<HandleImpl>(config, std::move(factory));
  DNVME_RETURN_IF_ERROR(impl->StartWorkers());
  return std::unique_ptr<AioHandle>(new AioHandle(std::move(impl)));
}

const HandleConfig& AioHandle::config() const { return impl_->config(); }

Status AioHandle::sync_pread(void* buffer, int64_t n, const std::string& path, int64_t off) {
  return impl_->RunSync(OpType::kRead, buffer, n, HandleImpl::Target{&path, -1, nullptr}, off,
                        false);
}
Status AioHandle::sync_pwrite(const void* buffer, int64_t n, const std::string& path, int64_t off) {
  return impl_->RunSync(OpType::kWrite, buffer, n, HandleImpl::Target{&path, -1, nullptr}, off,
                        false);
}
Status AioHandle::sync_pread(void* buffer, int64_t n, int fd, int64_t off) {
  return impl_->RunSync(OpType::kRead, buffer, n, HandleImpl::Target{nullptr, fd, nullptr}, off,
                        false);
}
Status AioHandle::sync_pwrite(const void* buffer, int64_t n, int fd, int64_t off) {
  return impl_->RunSync(OpType::kWrite, buffer, n, HandleImpl::Target{nullptr, fd, nullptr}, off,
                        false);
}

Result<OpId> AioHandle::async_pread(void* buffer, int64_t n, const std::string& path, int64_t off) {
  return impl_->RunAsync(OpType::kRead, buffer, n, HandleImpl::Target{&path, -1, nullptr}, off,
                         false);
}
Result<OpId> AioHandle::async_pwrite(const void* buffer, int64_t n, const std::string& path,
                                     int64_t off) {
  return impl_->RunAsync(OpType::kWrite, buffer, n, HandleImpl::Target{&path, -1, nullptr}, off,
                         false);
}
Result<OpId> AioHandle::async_pread(void* buffer, int64_t n, int fd, int64_t off) {
  return impl_->RunAsync(OpType::kRead, buffer, n, HandleImpl::Target{nullptr, fd, nullptr}, off,
                         false);
}
Result<OpId> AioHandle::async_pwrite(const void* buffer, int64_t n, int fd, int64_t off) {
  return impl_->RunAsync(OpType::kWrite, buffer, n, HandleImpl::Target{nullptr, fd, nullptr}, off,
                         false);
}

namespace {
Status AsyncStatus(Result<OpId> r) { return r.ok() ? Status::Ok() : r.status(); }
}  // namespace

Status AioHandle::pread(void* buffer, int64_t n, const std::string& path, bool validate,
                        bool async_op, int64_t off) {
  if (async_op)
    return AsyncStatus(impl_->RunAsync(OpType::kRead, buffer, n,
                                       HandleImpl::Target{&path, -1, nullptr}, off, validate));
  return impl_->RunSync(OpType::kRead, buffer, n, HandleImpl::Target{&path, -1, nullptr}, off,
                        validate);
}
Status AioHandle::pwrite(const void* buffer, int64_t n, const std::string& path, bool validate,
                         bool async_op, int64_t off) {
  if (async_op) {
    return AsyncStatus(impl_->RunAsync(OpType::kWrite, buffer, n,
                                       HandleImpl::Target{&path, -1, nullptr}, off, validate));
  }
  return impl_->RunSync(OpType::kWrite, buffer, n, HandleImpl::Target{&path, -1, nullptr}, off,
                        validate);
}
Status AioHandle::pread(void* buffer, int64_t n, int fd, bool validate, bool async_op,
                        int64_t off) {
  if (async_op) {
    return AsyncStatus(impl_->RunAsync(OpType::kRead, buffer, n,
                                       HandleImpl::Target{nullptr, fd, nullptr}, off, validate));
  }
  return impl_->RunSync(OpType::kRead, buffer, n, HandleImpl::Target{nullptr, fd, nullptr}, off,
                        validate);
}
Status AioHandle::pwrite(const void* buffer, int64_t n, int fd, bool validate, bool async_op,
                         int64_t off) {
  if (async_op) {
    return AsyncStatus(impl_->RunAsync(OpType::kWrite, buffer, n,
                                       HandleImpl::Target{nullptr, fd, nullptr}, off, validate));
  }
  return impl_->RunSync(OpType::kWrite, buffer, n, HandleImpl::Target{nullptr, fd, nullptr}, off,
                        validate);
}

const std::string& FileRef::label() const {
  static const std::string kNone = "(no file)";
  return file_ ? file_->label : kNone;
}
bool FileRef::direct() const { return file_ && file_->direct_fd >= 0; }
int FileRef::buffered_fd() const { return file_ ? file_->buffered_fd : -1; }
int FileRef::direct_fd() const { return file_ ? file_->direct_fd : -1; }
const FsIdentity* FileRef::write_identity() const {
  return file_ ? file_->write_as.get() : nullptr;
}

Result<FileRef> AioHandle::open_file(const std::string& path, FileAccess access) {
  DNVME_ASSIGN_OR_RETURN(auto file, impl_->Open(HandleImpl::Target{&path, -1, nullptr}, access,
                                                access != FileAccess::kRead));
  return FileRef(std::move(file));
}

Result<FileRef> AioHandle::adopt_fd(int fd, FileAccess access,
                                    std::shared_ptr<const FsIdentity> write_as) {
  DNVME_ASSIGN_OR_RETURN(auto file, impl_->Open(HandleImpl::Target{nullptr, fd, nullptr}, access,
                                                access != FileAccess::kRead));
  file->write_as = std::move(write_as);
  return FileRef(std::move(file));
}

Result<FileRef> AioHandle::adopt_fds(int direct_fd, int buffered_fd, FileAccess access,
                                     const std::string& label) {
  UniqueFd direct(direct_fd), buffered(buffered_fd);
  DNVME_ASSIGN_OR_RETURN(auto file, AdoptIoFds(std::move(direct), std::move(buffered), access,
                                               config().direct, label));
  return FileRef(std::move(file));
}

namespace {
Status NoFile() { return Status::InvalidArgument("operation on an empty FileRef"); }
}  // namespace

Status AioHandle::sync_pread(void* buffer, int64_t n, const FileRef& file, int64_t off) {
  if (!file.valid()) return NoFile();
  return impl_->RunSync(OpType::kRead, buffer, n, HandleImpl::Target{nullptr, -1, file.file_}, off,
                        false);
}

Status AioHandle::sync_pread_cached(void* buffer, int64_t n, const FileRef& file, int64_t off) {
  if (!file.valid()) return NoFile();
  return impl_->RunSync(OpType::kRead, buffer, n, HandleImpl::Target{nullptr, -1, file.file_}, off,
                        false, /*page_cache=*/true);
}

Status AioHandle::sync_pwrite(const void* buffer, int64_t n, const FileRef& file, int64_t off) {
  if (!file.valid()) return NoFile();
  return impl_->RunSync(OpType::kWrite, buffer, n, HandleImpl::Target{nullptr, -1, file.file_}, off,
                        false);
}

Status AioHandle::submit_pread(void* buffer, int64_t n, const FileRef& file, int64_t off,
                               Completion done) {
  if (!file.valid()) return NoFile();
  auto op = impl_->Start(OpType::kRead, buffer, n, HandleImpl::Target{nullptr, -1, file.file_}, off,
                         false, std::move(done));
  return op.ok() ? Status::Ok() : op.status();
}

Status AioHandle::submit_pwrite(const void* buffer, int64_t n, const FileRef& file, int64_t off,
                                Completion done) {
  return submit_pwrite(buffer, n, file, off, std::move(done), nullptr);
}

Status AioHandle::submit_pwrite(const void* buffer, int64_t n, const FileRef& file, int64_t off,
                                Completion done, Submitted submitted) {
  if (!file.valid()) return NoFile();
  auto op = impl_->Start(OpType::kWrite, buffer, n, HandleImpl::Target{nullptr, -1, file.file_},
                         off, false, std::move(done), std::move(submitted));
  return op.ok() ? Status::Ok() : op.status();
}

Status AioHandle::submit_pwrite_cached(const void* buffer, int64_t n, const FileRef& file,
                                       int64_t off, Completion done, Submitted submitted) {
  if (!file.valid()) return NoFile();
  auto op = impl_->Start(OpType::kWrite, buffer, n, HandleImpl::Target{nullptr, -1, file.file_},
                         off, false, std::move(done), std::move(submitted), /*page_cache=*/true);
  return op.ok() ? Status::Ok() : op.status();
}

int AioHandle::wait() { return impl_->Wait(); }
const std::vector<OpResult>& AioHandle::completed() const { return impl_->completed(); }
int AioHandle::pending() const { return impl_->pending(); }

Status AioHandle::fsync(int fd) {
  int rc;
  do {
    rc = ::fsync(fd);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) return Status::FromErrno(errno, "fsync of fd:" + std::to_string(fd));
  return Status::Ok();
}

Status AioHandle::fsync(const std::string& path) {
  int fd;
  do {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return Status::FromErrno(errno, "open for fsync '" + path + "'");
  UniqueFd owned(fd);
  Status st = fsync(fd);
  if (!st.ok()) return Status::FromErrno(st.error_number(), "fsync of '" + path + "'");
  return st;
}

HandleStats AioHandle::stats() const { return impl_->Stats(); }

HandleStats AioHandle::Retire() {
  impl_->Quiesce();
  return impl_->Stats();
}

Result<PinnedBuffer> AioHandle::new_cpu_locked_buffer(size_t num_bytes) {
  return PinnedBuffer::Allocate(num_bytes, 4096);
}

}  // namespace dnvme
