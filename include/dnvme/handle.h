// AioHandle: DeepNVMe's aio_handle, with every completion checked.
//
// An operation moves `num_bytes` between caller memory and a file at `file_offset`. It is cut into
// `intra_op_parallelism` contiguous slices, one per worker thread; each worker owns a libaio
// context and submits its slice as `block_size` O_DIRECT requests, `queue_depth` at a time
// (lock-step batches, or a sliding window with overlap_events). Alignment is handled, not required:
//   - the part of the range that is aligned to the file's direct-I/O alignment (statx DIOALIGN,
//   else
//     the device's logical block size, else 4096; never less than the page size) goes O_DIRECT;
//   - when the caller's memory is misaligned for that part, requests go through pinned bounce
//     buffers (a per-worker pool);
//   - the unaligned head and tail (less than one alignment unit each) go through the page cache
//   with
//     pread/pwrite, so a tail is written and read exactly, a write never truncates the file, and
//     the file size ends at max(old size, file_offset + num_bytes).
// When the filesystem refuses O_DIRECT, HandleConfig::direct decides: fall back to buffered I/O
// (auto, warned once and counted in stats) or fail (required).
//
// Errors are reported, never asserted: every io_submit and io_getevents result is checked (EINTR
// retried, EAGAIN answered by reaping then resubmitting), every completion's byte count is read
// (short transfers are continued), and EIO/ENOSPC land in the operation's status with the path,
// the failing file offset and the errno. A read that reaches end of file before `num_bytes` fails
// with Status::Code::kEndOfFile.
//
// Thread contract: an AioHandle is driven by one thread at a time (submission, wait and fsync are
// not synchronised against each other); internally its worker threads run the I/O. The caller's
// buffer must stay valid and untouched until the operation completes (sync call returns, or
// wait()). Destroying a handle waits for every pending operation.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dnvme/config.h"
#include "dnvme/identity.h"
#include "dnvme/pinned.h"
#include "dnvme/status.h"

namespace dnvme {

class AioBackendFactory;  // dnvme/aio_backend.h: the seam tests use to inject libaio faults
class HandleImpl;
struct IoFile;

enum class FileAccess { kRead, kWrite, kReadWrite };

enum class OpType { kRead, kWrite };
const char* OpTypeName(OpType type);

using OpId = uint64_t;

// The outcome of one operation, as reported by wait().
struct OpResult {
  OpId id = 0;
  OpType type = OpType::kRead;
  std::string path;           // the path given, or "fd:N" for fd-based operations
  int64_t file_offset = 0;    // of the whole operation
  int64_t length = 0;         // bytes asked for
  int64_t bytes_done = 0;     // bytes transferred; equals length when status is OK
  int64_t error_offset = -1;  // file offset of the first failing request, -1 when OK
  Status status;              // first failure; the message names path, offset and errno
};

// Counters since the handle was created (monotonic) and two gauges; read with
// AioHandle::stats().
struct HandleStats {
  uint64_t ops_read = 0;
  uint64_t ops_written = 0;
  uint64_t ops_failed = 0;
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
  uint64_t bytes_direct = 0;      // O_DIRECT straight from/to caller memory
  uint64_t bytes_bounce = 0;      // O_DIRECT through pinned bounce buffers
  uint64_t bytes_buffered = 0;    // page cache: unaligned edges and the no-O_DIRECT fallback
  uint64_t direct_fallbacks = 0;  // files opened buffered because O_DIRECT was refused
  uint64_t requests = 0;          // libaio requests (iocbs) submitted, continuations included
  uint64_t submit_calls = 0;      // io_submit calls that accepted at least one request
  uint64_t submit_retries = 0;    // io_submit answered EINTR or EAGAIN (or accepted nothing)
  uint64_t short_transfers = 0;   // completions with fewer bytes than asked, then continued
  uint64_t validate_checks = 0;   // operations checked by validate=true
  // Gauges, not counters: libaio requests in flight now (the queue depth in use, all workers
  // together), and the most that were ever in flight at once.
  uint64_t inflight_requests = 0;
  uint64_t max_inflight_requests = 0;

  // Adds another handle's numbers (counters and in-flight summed; the high-water mark is the
  // larger of the two), for totals over several handles.
  HandleStats& operator+=(const HandleStats& o);
  std::string ToJson() const;
};

// A file opened once for many operations (a mount's open file): its O_DIRECT and buffered fds and
// its direct-I/O alignment are set up by AioHandle::open_file / adopt_fd and shared by every
// operation on it. Copies share the same open files, which close with the last copy (and never
// while an operation still uses them). Thread-safe to copy and use from several threads.
class FileRef {
 public:
  FileRef() = default;
  bool valid() const { return file_ != nullptr; }
  const std::string& label() const;
  // True when O_DIRECT is in use for this file (false after a direct=auto fallback).
  bool direct() const;
  // The buffered descriptor (for fsync, fstat, ftruncate by the owner); -1 when invalid.
  int buffered_fd() const;
  // The O_DIRECT descriptor (for an owner that moves data to the file itself, e.g. with
  // splice); -1 when invalid or when direct I/O is not in use.
  int direct_fd() const;
  // The identity writes to this file are submitted under (adopt_fd's `write_as`); null: the
  // engine threads' own. Another writer of the file (a splice thread) takes it the same way.
  const FsIdentity* write_identity() const;

 private:
  friend class HandleImpl;
  friend class AioHandle;
  explicit FileRef(std::shared_ptr<IoFile> file) : file_(std::move(file)) {}
  std::shared_ptr<IoFile> file_;
};

// Called once per submitted operation, on an engine worker thread (or inline, before submit_*
// returns, for a zero-byte operation). Must not block for long: it holds up that worker.
using Completion = std::function<void(const OpResult&)>;

// Called once per write submitted with one (submit_pwrite below), on an engine worker thread (or
// inline, before submit_pwrite returns, for a zero-byte write), as soon as the write no longer
// needs this process to reach the file: every O_DIRECT request of it was accepted by io_submit
// and its unaligned edges were written to the page cache -- or it failed, and nothing more of it
// will be handed to the kernel (the error comes with the Completion). Always before the write's
// Completion, usually long before it. The kernel finishes a submitted request even when the
// process then exits or is killed (exit_aio waits for it, and the request keeps its pages), so
// from here the bytes survive the process as a returned write(2) does. Exception: the remainder
// of a request the kernel completed short (a regular file does that only on an error such as
// ENOSPC) is resubmitted after the notice. Must not block for long: it holds up that worker.
using Submitted = std::function<void()>;

struct HandleOptions {
  // Null means the real libaio syscalls. Tests pass a factory that injects EAGAIN, short transfers
  // and EIO completions.
  std::shared_ptr<AioBackendFactory> backend;
};

class AioHandle {
 public:
  // Starts the worker threads and creates one libaio context per worker. Fails with a clear Status
  // (e.g. naming /proc/sys/fs/aio-max-nr) instead of aborting.
  static Result<std::unique_ptr<AioHandle>> Create(const HandleConfig& config = {},
                                                   HandleOptions options = {});
  ~AioHandle();
  AioHandle(const AioHandle&) = delete;
  AioHandle& operator=(const AioHandle&) = delete;

  const HandleConfig& config() const;
  int64_t get_block_size() const { return config().block_size; }
  int get_queue_depth() const { return config().queue_depth; }
  bool get_single_submit() const { return config().single_submit; }
  bool get_overlap_events() const { return config().overlap_events; }
  int get_intra_op_parallelism() const { return config().intra_op_parallelism; }

  // Synchronous: return when the whole range is done (OK means exactly num_bytes moved). These do
  // not touch the set of operations wait() reports.
  Status sync_pread(void* buffer, int64_t num_bytes, const std::string& path,
                    int64_t file_offset = 0);
  Status sync_pwrite(const void* buffer, int64_t num_bytes, const std::string& path,
                     int64_t file_offset = 0);
  Status sync_pread(void* buffer, int64_t num_bytes, int fd, int64_t file_offset = 0);
  Status sync_pwrite(const void* buffer, int64_t num_bytes, int fd, int64_t file_offset = 0);

  // Asynchronous: queue the operation and return its id; its outcome comes from wait(). An error
  // here (bad argument, file that cannot be opened) means nothing was queued.
  Result<OpId> async_pread(void* buffer, int64_t num_bytes, const std::string& path,
                           int64_t file_offset = 0);
  Result<OpId> async_pwrite(const void* buffer, int64_t num_bytes, const std::string& path,
                            int64_t file_offset = 0);
  Result<OpId> async_pread(void* buffer, int64_t num_bytes, int fd, int64_t file_offset = 0);
  Result<OpId> async_pwrite(const void* buffer, int64_t num_bytes, int fd, int64_t file_offset = 0);

  // DeepSpeed's general form (buffer, filename, validate, async, file_offset). With validate the
  // data is read back (write) or re-read through the page cache (read) and compared; a difference
  // fails the operation with kDataMismatch and the first differing offset. With async_op the
  // outcome comes from wait().
  Status pread(void* buffer, int64_t num_bytes, const std::string& path, bool validate,
               bool async_op, int64_t file_offset = 0);
  Status pwrite(const void* buffer, int64_t num_bytes, const std::string& path, bool validate,
                bool async_op, int64_t file_offset = 0);
  Status pread(void* buffer, int64_t num_bytes, int fd, bool validate, bool async_op,
               int64_t file_offset = 0);
  Status pwrite(const void* buffer, int64_t num_bytes, int fd, bool validate, bool async_op,
                int64_t file_offset = 0);

  // Files kept open for many operations (see FileRef). Writing through a kRead file (or reading a
  // kWrite one) is InvalidArgument. adopt_fd reopens the caller's fd through /proc/self/fd; the
  // caller may close its own fd afterwards. `write_as` (a root process writing for a user): the
  // engine's threads submit this file's writes under that identity (include/dnvme/identity.h),
  // so the file system allocates for the user; a process that cannot switch fails those writes
  // with EPERM.
  Result<FileRef> open_file(const std::string& path, FileAccess access);
  Result<FileRef> adopt_fd(int fd, FileAccess access,
                           std::shared_ptr<const FsIdentity> write_as = nullptr);
  // Takes ownership of two descriptors of one file opened elsewhere (e.g. received over a unix
  // socket): `direct_fd` opened with O_DIRECT (-1 when the file refused it: the direct policy
  // decides) and `buffered_fd` without; both are closed with the last FileRef copy, or at once
  // when this fails. `label` names the file in errors.
  Result<FileRef> adopt_fds(int direct_fd, int buffered_fd, FileAccess access,
                            const std::string& label);

  // Thread-safe operations on a FileRef: synchronous, and asynchronous with a completion callback
  // (an error return means nothing was queued and `done` will not be called).
  Status sync_pread(void* buffer, int64_t num_bytes, const FileRef& file, int64_t file_offset);
  Status sync_pwrite(const void* buffer, int64_t num_bytes, const FileRef& file,
                     int64_t file_offset);
  // A read through the page cache (the file's buffered descriptor), cut into slices on the
  // workers as every operation is: the page cache serves what it holds and keeps what the kernel
  // reads for it, as read(2) does, while the copy and the faults of the caller's fresh pages are
  // shared among the workers (one thread copying a large read is what bounds it). For reads the
  // page cache holds or should keep (datapath/read_policy.h); counted as bytes_buffered.
  Status sync_pread_cached(void* buffer, int64_t num_bytes, const FileRef& file,
                           int64_t file_offset);
  Status submit_pread(void* buffer, int64_t num_bytes, const FileRef& file, int64_t file_offset,
                      Completion done);
  Status submit_pwrite(const void* buffer, int64_t num_bytes, const FileRef& file,
                       int64_t file_offset, Completion done);
  // The same, with a notice when the write is in the kernel (see Submitted). Such a write writes
  // its unaligned tail edge before its direct part (without a notice the tail comes last), so the
  // notice need not wait for the direct part to complete. When the write ends inside a page, the
  // file is then already file_offset + num_bytes long while the direct part runs, and keeps that
  // size if the direct part fails: a caller that wants no zero-filled range after a failure
  // reserves the range first (fallocate). `buffer` must stay untouched until `done` runs.
  Status submit_pwrite(const void* buffer, int64_t num_bytes, const FileRef& file,
                       int64_t file_offset, Completion done, Submitted submitted);

  // submit_pwrite with the notice, through the page cache (the buffered descriptor) on every
  // slice: the bytes stay cached for the next reader and go to the disk by the kernel's writeback
  // (fsync makes them durable, as for write(2)); the notice comes once every slice's pwrite(2)
  // returned. For a file the page cache should keep (datapath/read_policy.h).
  Status submit_pwrite_cached(const void* buffer, int64_t num_bytes, const FileRef& file,
                              int64_t file_offset, Completion done, Submitted submitted);
  // Blocks until every queued asynchronous operation has finished; returns how many finished since
  // the previous wait() (0 when none was pending). Their outcomes, in submission order, are then in
  // completed() until the next wait().
  int wait();
  const std::vector<OpResult>& completed() const;
  // Asynchronous operations queued and not yet collected by wait().
  int pending() const;

  // Durability: fsync the file (by path, or the caller's fd).
  Status fsync(const std::string& path);
  Status fsync(int fd);

  HandleStats stats() const;
  // Waits for every operation submitted so far (callbacks included) and stops the workers, then
  // returns the final stats: what a handle's last user calls so that operations still in flight
  // are counted. Nothing may be submitted afterwards; destroying the handle is all that is left.
  HandleStats Retire();

  // The new_cpu_locked_tensor equivalent: page-locked, page-aligned, zeroed host memory. Freed by
  // destroying the PinnedBuffer (free_cpu_locked_tensor).
  static Result<PinnedBuffer> new_cpu_locked_buffer(size_t num_bytes);

 private:
  explicit AioHandle(std::unique_ptr<HandleImpl> impl);
  std::unique_ptr<HandleImpl> impl_;
};

}  // namespace dnvme
