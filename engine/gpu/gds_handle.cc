#include "dnvme/gds_handle.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "dnvme/identity.h"
#include "dnvme/log.h"
#include "engine/gpu/copy_engine.h"
#include "engine/gpu/cufile.h"
#include "engine/posix/file.h"
#include "nlohmann/json.hpp"

namespace dnvme {

const char* GdsModeName(GdsMode mode) {
  switch (mode) {
    case GdsMode::kGds:
      return "gds";
    case GdsMode::kP2pDma:
      return "p2pdma";
    case GdsMode::kCompat:
      return "compat";
    case GdsMode::kBounce:
      return "bounce";
  }
  return "?";
}

CuFileProbe ProbeCuFile(const std::string& library) {
  CuFileProbe p;
  p.library = library;
  Result<const gpu::CuFileDriver*> drv = gpu::CuFileDriver::Get(library);
  // CuFileDriver::Get reports a failed dlopen as NotFound; any other failure came after it loaded.
  p.found = drv.ok() || drv.status().code() != Status::Code::kNotFound;
  p.loaded = drv.ok();
  if (!drv.ok()) {
    p.error = drv.status().message();
    return p;
  }
  const gpu::CuFileDriver& d = **drv;
  p.version = d.version;
  p.nvfs_loaded = d.nvfs_loaded;
  p.nvfs_major = static_cast<int>(d.props.nvfs.major_version);
  p.nvfs_minor = static_cast<int>(d.props.nvfs.minor_version);
  p.p2pdma = d.p2pdma;
  return p;
}

const char* CuFilePolicyName(CuFilePolicy policy) {
  switch (policy) {
    case CuFilePolicy::kAuto:
      return "auto";
    case CuFilePolicy::kRequire:
      return "require";
    case CuFilePolicy::kNever:
      return "never";
  }
  return "?";
}

Result<CuFilePolicy> ParseCuFilePolicy(std::string_view name) {
  if (name == "auto") return CuFilePolicy::kAuto;
  if (name == "require") return CuFilePolicy::kRequire;
  if (name == "never") return CuFilePolicy::kNever;
  return Status::InvalidArgument("cufile policy must be auto, require or never, not '" +
                                 std::string(name) + "'");
}

std::string GdsStats::ToJson() const {
  nlohmann::json j = {{"ops_read", ops_read},
                      {"ops_written", ops_written},
                      {"ops_failed", ops_failed},
                      {"bytes_read", bytes_read},
                      {"bytes_written", bytes_written},
                      {"bytes_cufile", bytes_cufile},
                      {"bytes_bounce", bytes_bounce},
                      {"bytes_host", bytes_host},
                      {"cufile_calls", cufile_calls},
                      {"copies", copies},
                      {"buffers_pinned", buffers_pinned},
                      {"engine", nlohmann::json::parse(engine.ToJson())}};
  return j.dump();
}

namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

// One queued operation. Owned by a shared_ptr shared by the submitter (sync calls wait on it)
// and the dispatcher thread.
struct Job {
  OpResult result;
  char* buffer = nullptr;
  bool device = false;  // buffer is device memory
  bool validate = false;
  bool sync = false;
  Completion done;
  // The file: a FileRef of the libaio engine (host buffers and the bounce path) or an IoFile
  // opened for cuFile (O_DIRECT where the filesystem allows it).
  FileRef ref;
  std::shared_ptr<IoFile> io;

  std::mutex m;
  std::condition_variable cv;
  bool finished = false;  // guarded by m
};

// The outcome of one piece of an operation: the first error by file offset wins.
struct Outcome {
  std::mutex m;
  Status status;
  int64_t error_offset = -1;
  std::atomic<int64_t> bytes{0};

  void Fail(Status st, int64_t offset) {
    std::lock_guard lock(m);
    if (status.ok() || offset < error_offset) {
      status = std::move(st);
      error_offset = offset;
    }
  }
  bool ok() {
    std::lock_guard lock(m);
    return status.ok();
  }
};

}  // namespace

class GdsHandle::Impl {
 public:
  HandleConfig config;
  GdsOptions options;
  GdsMode mode = GdsMode::kBounce;
  std::string reason;
  const gpu::CuFileDriver* cufile = nullptr;
  std::unique_ptr<AioHandle> aio;
  std::unique_ptr<gpu::CopyEngine> copier;
  int64_t chunk = 0;
  std::vector<void*> staging;  // bounce slots, allocated on first use

  // Registered device ranges: base -> size (pin_device_buffer). Guarded by mu; the shared state
  // outlives the handle when a DeviceBuffer from new_pinned_device_buffer does (the handle's
  // destructor unpins everything, so such a buffer then finds nothing to unpin).
  struct Pins {
    std::mutex mu;
    std::map<uintptr_t, size_t> ranges;
    const gpu::CuFileDriver* cufile = nullptr;

    // Forgets the range starting at `p` and deregisters it from cuFile.
    Status Unpin(void* p) {
      std::lock_guard lock(mu);
      auto it = ranges.find(reinterpret_cast<uintptr_t>(p));
      if (it == ranges.end()) {
        return Status::InvalidArgument("unpin_device_buffer: this buffer is not pinned");
      }
      ranges.erase(it);
      if (cufile == nullptr) return Status::Ok();
      return gpu::CuFileStatus(cufile->buf_deregister(p), "cuFileBufDeregister");
    }
    // Unpins every range (the handle's end); failures are logged.
    void UnpinAll() {
      std::vector<void*> bases;
      {
        std::lock_guard lock(mu);
        for (const auto& [base, size] : ranges) bases.push_back(reinterpret_cast<void*>(base));
      }
      for (void* b : bases) {
        if (Status st = Unpin(b); !st.ok()) Logger().warn("{}", st.ToString());
      }
    }
  };
  std::shared_ptr<Pins> pins = std::make_shared<Pins>();

  // Counters.
  std::atomic<uint64_t> ops_read{0}, ops_written{0}, ops_failed{0}, bytes_read{0}, bytes_written{0},
      bytes_cufile{0}, bytes_bounce{0}, bytes_host{0}, cufile_calls{0}, copies{0};

  // The dispatcher.
  std::mutex qm;
  std::condition_variable qcv, idle_cv;
  std::deque<std::shared_ptr<Job>> queue;        // guarded by qm
  std::vector<std::shared_ptr<Job>> async_jobs;  // submitted async, not yet waited; guarded by qm
  int running = 0;                               // guarded by qm
  bool stopping = false;                         // guarded by qm
  std::thread dispatcher;
  std::atomic<uint64_t> next_id{1};
  std::vector<OpResult> completed;  // the last wait()'s outcomes (owner thread only)

  ~Impl() {
    {
      std::lock_guard lock(qm);
      stopping = true;
    }
    qcv.notify_all();
    if (dispatcher.joinable()) dispatcher.join();
    pins->UnpinAll();
    for (void* p : staging) copier->FreeStaging(p);
  }

  void Loop() {
    // Staging copies and cuFile calls of this thread act on the handle's device.
    if (Status bound = copier->BindThread(); !bound.ok()) {
      Logger().warn("gds_handle: {}", bound.ToString());
    }
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock lock(qm);
        qcv.wait(lock, [&] { return stopping || !queue.empty(); });
        if (queue.empty()) return;  // stopping, and everything queued has run
        job = queue.front();
        queue.pop_front();
        ++running;
      }
      Run(*job);
      // The callback runs before `finished`: a waiter that sees finished may drop the job.
      if (job->done) job->done(job->result);
      {
        std::lock_guard lock(job->m);
        job->finished = true;
        job->cv.notify_all();
      }
      {
        std::lock_guard lock(qm);
        --running;
      }
      idle_cv.notify_all();
    }
  }

  // Queues `job`; a synchronous one is waited for and its status returned.
  Status Submit(std::shared_ptr<Job> job, bool validate, bool async_op) {
    job->validate = validate;
    job->sync = !async_op;
    DNVME_RETURN_IF_ERROR(Enqueue(job));
    if (async_op) return Status::Ok();
    std::unique_lock lock(job->m);
    job->cv.wait(lock, [&] { return job->finished; });
    return job->result.status;
  }

  Status Enqueue(std::shared_ptr<Job> job) {
    {
      std::lock_guard lock(qm);
      if (stopping) return Status::Internal("GdsHandle is shutting down");
      queue.push_back(job);
      if (!job->sync && !job->done) async_jobs.push_back(job);
    }
    qcv.notify_one();
    return Status::Ok();
  }

  // Builds a job: classifies the buffer and opens the file (errors here mean nothing is queued).
  Result<std::shared_ptr<Job>> MakeJob(OpType type, void* buffer, int64_t n,
                                       const std::string* path, int fd, int64_t offset) {
    if (n < 0 || offset < 0) {
      return Status::InvalidArgument("negative length or file offset");
    }
    if (buffer == nullptr && n > 0) return Status::InvalidArgument("null buffer");
    auto job = std::make_shared<Job>();
    job->result.id = next_id.fetch_add(1);
    job->result.type = type;
    job->result.path = path != nullptr ? *path : "fd:" + std::to_string(fd);
    job->result.file_offset = offset;
    job->result.length = n;
    job->buffer = static_cast<char*>(buffer);
    DNVME_ASSIGN_OR_RETURN(job->device, copier->IsDevice(buffer));
    const FileAccess access = type == OpType::kRead ? FileAccess::kRead : FileAccess::kWrite;
    if (job->device && cufile != nullptr) {
      auto io = path != nullptr ? OpenIoFile(*path, access, config.direct, false)
                                : AdoptIoFd(fd, access, config.direct, false);
      if (!io.ok()) return io.status();
      job->io = std::move(io).value();
    } else {
      auto ref =
          path != nullptr
              ? aio->open_file(*path, access)
              : aio->adopt_fd(fd, access, type == OpType::kWrite ? options.write_as : nullptr);
      if (!ref.ok()) return ref.status();
      job->ref = std::move(ref).value();
    }
    return job;
  }

  void Run(Job& job) {
    Outcome out;
    const int64_t n = job.result.length;
    if (n > 0) {
      if (!job.device) {
        RunHost(job, out);
      } else if (cufile != nullptr) {
        // cuFile writes from this thread: as the writer, for this job alone (a caller's thread
        // may run it inline, and must come back as itself).
        Result<ScopedFsIdentity> as = ScopedFsIdentity::EnterIf(
            job.result.type == OpType::kWrite ? options.write_as.get() : nullptr);
        if (!as.ok()) {
          out.Fail(as.status(), job.result.file_offset);
        } else {
          RunCuFile(job, out);
        }
      } else {
        RunBounce(job, out);
      }
    }
    if (out.ok() && job.validate && n > 0) {
      Status v = Validate(job);
      if (!v.ok()) out.Fail(v, job.result.file_offset);
    }
    const bool write = job.result.type == OpType::kWrite;
    if (out.ok() && write && config.fdatasync_on_write) {
      const int fd = job.io ? job.io->buffered_fd : job.ref.buffered_fd();
      if (fdatasync(fd) != 0) {
        out.Fail(Status::FromErrno(errno, "fdatasync '" + job.result.path + "'"),
                 job.result.file_offset);
      }
    }
    job.result.bytes_done = out.bytes.load();
    {
      std::lock_guard lock(out.m);
      job.result.status = out.status;
      job.result.error_offset = out.error_offset;
    }
    if (!job.result.status.ok()) {
      ops_failed.fetch_add(1, std::memory_order_relaxed);
    } else if (write) {
      ops_written.fetch_add(1, std::memory_order_relaxed);
      bytes_written.fetch_add(static_cast<uint64_t>(n), std::memory_order_relaxed);
    } else {
      ops_read.fetch_add(1, std::memory_order_relaxed);
      bytes_read.fetch_add(static_cast<uint64_t>(n), std::memory_order_relaxed);
    }
    job.ref = FileRef();  // close the files now, not when the result is collected
    job.io.reset();
  }

  void RunHost(Job& job, Outcome& out) {
    const int64_t n = job.result.length;
    Status st = job.result.type == OpType::kWrite
                    ? aio->sync_pwrite(job.buffer, n, job.ref, job.result.file_offset)
                    : aio->sync_pread(job.buffer, n, job.ref, job.result.file_offset);
    if (!st.ok()) {
      out.Fail(st, job.result.file_offset);
      return;
    }
    out.bytes = n;
    bytes_host.fetch_add(static_cast<uint64_t>(n), std::memory_order_relaxed);
  }

  // cuFile: intra_op_parallelism contiguous slices, each a loop of block_size calls.
  void RunCuFile(Job& job, Outcome& out) {
    const bool write = job.result.type == OpType::kWrite;
    const int fd = job.io->direct_fd >= 0 ? job.io->direct_fd : job.io->buffered_fd;
    gpu::cufile_abi::Descr d{};
    d.type = gpu::cufile_abi::kHandleTypeOpaqueFd;
    d.handle.fd = fd;
    void* fh = nullptr;
    Status reg = gpu::CuFileStatus(cufile->handle_register(&fh, &d),
                                   "cuFileHandleRegister '" + job.result.path + "'");
    if (!reg.ok()) {
      out.Fail(reg, job.result.file_offset);
      return;
    }
    // A buffer inside a pinned range goes as (base, offset) so cuFile uses the registration.
    char* base = job.buffer;
    int64_t base_off = 0;
    {
      std::lock_guard lock(pins->mu);
      const auto a = reinterpret_cast<uintptr_t>(job.buffer);
      auto it = pins->ranges.upper_bound(a);
      if (it != pins->ranges.begin()) {
        --it;
        if (a + static_cast<uintptr_t>(job.result.length) <= it->first + it->second) {
          base = reinterpret_cast<char*>(it->first);
          base_off = static_cast<int64_t>(a - it->first);
        }
      }
    }
    const int64_t n = job.result.length;
    // cuFile's direct path moves 4 KiB-aligned requests; a smaller block_size (DeepSpeed's tests
    // use 1K) is rounded up as the libaio workers round it to the file's alignment.
    const int64_t block = (config.block_size + 4095) / 4096 * 4096;
    const int parts =
        static_cast<int>(std::min<int64_t>(config.intra_op_parallelism, (n + block - 1) / block));
    const int64_t per = (n / parts + 4095) / 4096 * 4096;
    auto slice = [&](int64_t begin, int64_t end) {
      if (Status bound = copier->BindThread(); !bound.ok()) {
        out.Fail(bound, job.result.file_offset + begin);
        return;
      }
      int64_t pos = begin;
      while (pos < end) {
        const int64_t want = std::min(block, end - pos);
        const int64_t file_off = job.result.file_offset + pos;
        errno = 0;
        const ssize_t r =
            write ? cufile->write(fh, base, static_cast<size_t>(want), file_off, base_off + pos)
                  : cufile->read(fh, base, static_cast<size_t>(want), file_off, base_off + pos);
        const int saved = errno;
        cufile_calls.fetch_add(1, std::memory_order_relaxed);
        if (r < 0) {
          out.Fail(
              gpu::CuFileIoStatus(r, saved,
                                  std::string(write ? "cuFileWrite" : "cuFileRead") + " '" +
                                      job.result.path + "' at offset " + std::to_string(file_off)),
              file_off);
          return;
        }
        if (r == 0) {
          out.Fail(write ? Status::IoError(EIO, "cuFileWrite '" + job.result.path +
                                                    "' wrote nothing at offset " +
                                                    std::to_string(file_off))
                         : EndOfFileStatus(job.io->buffered_fd, job.result.path, file_off, want),
                   file_off);
          return;
        }
        pos += r;  // a short transfer is continued
        out.bytes.fetch_add(r, std::memory_order_relaxed);
        bytes_cufile.fetch_add(static_cast<uint64_t>(r), std::memory_order_relaxed);
        if (!out.ok()) return;  // another slice failed: stop early
      }
    };
    std::vector<std::thread> threads;
    for (int i = 1; i < parts; ++i) {
      const int64_t b = std::min(n, per * i), e = i + 1 == parts ? n : std::min(n, per * (i + 1));
      if (b < e) threads.emplace_back(slice, b, e);
    }
    slice(0, std::min(n, parts == 1 ? n : per));
    for (auto& t : threads) t.join();
    cufile->handle_deregister(fh);
  }

  Status EnsureStaging() {
    if (!staging.empty()) return Status::Ok();
    for (int i = 0; i < options.bounce_slots; ++i) {
      auto p = copier->AllocStaging(static_cast<size_t>(chunk));
      if (!p.ok()) {
        for (void* q : staging) copier->FreeStaging(q);
        staging.clear();
        return p.status().WithContext("bounce staging buffers");
      }
      staging.push_back(p.value());
    }
    return Status::Ok();
  }

  // The bounce path: chunks through `slots` staging buffers; the copy of one chunk overlaps the
  // libaio transfers of the chunks in the other slots.
  void RunBounce(Job& job, Outcome& out) {
    Status st = EnsureStaging();
    if (!st.ok()) {
      out.Fail(st, job.result.file_offset);
      return;
    }
    const bool write = job.result.type == OpType::kWrite;
    const int64_t n = job.result.length;
    const int slots = static_cast<int>(staging.size());
    const int64_t chunks = (n + chunk - 1) / chunk;
    struct Slot {
      std::mutex m;
      std::condition_variable cv;
      bool busy = false;
      int64_t chunk = -1;
    };
    std::vector<Slot> slot(static_cast<size_t>(slots));
    auto wait_slot = [&](Slot& s) {
      std::unique_lock lock(s.m);
      s.cv.wait(lock, [&] { return !s.busy; });
    };
    auto len_of = [&](int64_t i) { return std::min(chunk, n - i * chunk); };
    auto submit = [&](int64_t i) -> bool {
      Slot& s = slot[static_cast<size_t>(i % slots)];
      void* buf = staging[static_cast<size_t>(i % slots)];
      const int64_t off = job.result.file_offset + i * chunk;
      const int64_t len = len_of(i);
      {
        std::lock_guard lock(s.m);
        s.busy = true;
        s.chunk = i;
      }
      Completion done = [&out, &s, this, len, off](const OpResult& r) {
        if (r.status.ok()) {
          out.bytes.fetch_add(len, std::memory_order_relaxed);
          bytes_bounce.fetch_add(static_cast<uint64_t>(len), std::memory_order_relaxed);
        } else {
          out.Fail(r.status, r.error_offset >= 0 ? r.error_offset : off);
        }
        // Notify under the lock: once busy is false the pipeline may return and destroy `s`.
        std::lock_guard lock(s.m);
        s.busy = false;
        s.cv.notify_all();
      };
      Status sub = write ? aio->submit_pwrite(buf, len, job.ref, off, done)
                         : aio->submit_pread(buf, len, job.ref, off, done);
      if (!sub.ok()) {
        out.Fail(sub, off);
        std::lock_guard lock(s.m);
        s.busy = false;
        return false;
      }
      return true;
    };
    auto copy = [&](int64_t i) -> bool {
      const int si = static_cast<int>(i % slots);
      char* dev = job.buffer + i * chunk;
      void* host = staging[static_cast<size_t>(si)];
      const int64_t len = len_of(i);
      Status c = write ? copier->Start(si, host, dev, static_cast<size_t>(len), false)
                       : copier->Start(si, dev, host, static_cast<size_t>(len), true);
      if (c.ok()) c = copier->Finish(si);
      copies.fetch_add(1, std::memory_order_relaxed);
      if (!c.ok()) {
        out.Fail(c, job.result.file_offset + i * chunk);
        return false;
      }
      return true;
    };

    if (write) {
      for (int64_t i = 0; i < chunks && out.ok(); ++i) {
        wait_slot(slot[static_cast<size_t>(i % slots)]);
        if (!out.ok() || !copy(i) || !submit(i)) break;
      }
    } else {
      int64_t next = 0;
      for (; next < std::min<int64_t>(chunks, slots); ++next) {
        if (!submit(next)) break;
      }
      for (int64_t i = 0; i < chunks && out.ok(); ++i) {
        wait_slot(slot[static_cast<size_t>(i % slots)]);
        if (!out.ok() || !copy(i)) break;
        if (next < chunks && next == i + slots) {
          if (!submit(next)) break;
          ++next;
        }
      }
      // The bytes of a read count when they reach the device; the engine counted them at the
      // staging buffer, which is the same number unless a copy failed (then the op failed).
    }
    for (auto& s : slot) wait_slot(s);  // nothing may still write into staging or the file
  }

  // Compares the buffer with the file's bytes read through the page cache.
  Status Validate(Job& job) {
    const int64_t n = job.result.length;
    std::vector<char> file(static_cast<size_t>(n)), mem;
    // The operation's own fd may be write-only: reopen the same file for reading.
    const int op_fd = job.io ? job.io->buffered_fd : job.ref.buffered_fd();
    const std::string proc = "/proc/self/fd/" + std::to_string(op_fd);
    UniqueFd fd(open(proc.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd.valid()) {
      return Status::FromErrno(errno, "validate: reopen '" + job.result.path + "' for reading");
    }
    int64_t got = 0;
    DNVME_RETURN_IF_ERROR(
        PreadFull(fd.get(), file.data(), n, job.result.file_offset, job.result.path, &got));
    const char* cmp = job.buffer;
    if (job.device) {
      mem.resize(static_cast<size_t>(n));
      DNVME_RETURN_IF_ERROR(copier->CopySync(mem.data(), job.buffer, static_cast<size_t>(n)));
      cmp = mem.data();
    }
    for (int64_t i = 0; i < n; ++i) {
      if (file[static_cast<size_t>(i)] != cmp[i]) {
        return Status::DataMismatch("validate: '" + job.result.path +
                                    "' differs from the buffer at file offset " +
                                    std::to_string(job.result.file_offset + i));
      }
    }
    return Status::Ok();
  }
};

GdsHandle::GdsHandle(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GdsHandle::~GdsHandle() = default;

Result<std::unique_ptr<GdsHandle>> GdsHandle::Create(const HandleConfig& config,
                                                     GdsOptions options) {
  DNVME_RETURN_IF_ERROR(config.Validate());
  if (options.bounce_slots < 2 || options.bounce_slots > 8) {
    return Status::InvalidArgument("bounce_slots must be 2..8, not " +
                                   std::to_string(options.bounce_slots));
  }
  if (options.bounce_chunk_bytes < 0 || options.bounce_chunk_bytes % 4096 != 0) {
    return Status::InvalidArgument("bounce_chunk_bytes must be a multiple of 4096, not " +
                                   std::to_string(options.bounce_chunk_bytes));
  }
  auto impl = std::make_unique<Impl>();
  impl->config = config;
  impl->options = options;
  impl->chunk =
      options.bounce_chunk_bytes > 0
          ? options.bounce_chunk_bytes
          : std::clamp<int64_t>(config.block_size * config.queue_depth, 4 * kMiB, 64 * kMiB);

  // The copy engine first: it tells whether there is a device at all.
  if (options.copy_engine) {
    DNVME_ASSIGN_OR_RETURN(impl->copier,
                           options.copy_engine->Create(options.device, options.bounce_slots));
  } else {
    DNVME_ASSIGN_OR_RETURN(impl->copier,
                           gpu::MakeCudaCopyEngine(options.device, options.bounce_slots));
  }
  DNVME_ASSIGN_OR_RETURN(impl->aio, AioHandle::Create(config));

  // Then the data path.
  if (options.cufile == CuFilePolicy::kNever) {
    impl->mode = GdsMode::kBounce;
    impl->reason = "cuFile not used (cufile=never)";
  } else {
    auto drv = gpu::CuFileDriver::Get(options.cufile_library);
    if (!drv.ok()) {
      impl->reason = drv.status().message();
    } else if (drv.value()->nvfs_loaded) {
      impl->cufile = drv.value();
      impl->mode = GdsMode::kGds;
      impl->reason = "nvidia-fs " + std::to_string(drv.value()->props.nvfs.major_version) + "." +
                     std::to_string(drv.value()->props.nvfs.minor_version) + " loaded";
    } else if (drv.value()->p2pdma) {
      impl->cufile = drv.value();
      impl->mode = GdsMode::kP2pDma;
      impl->reason = "cuFile reports NVMe P2PDMA support (no nvidia-fs)";
    } else if (options.cufile_compat) {
      impl->cufile = drv.value();
      impl->mode = GdsMode::kCompat;
      impl->reason = "cuFile compat mode (no nvidia-fs, no P2PDMA), as asked";
    } else {
      impl->reason =
          "cuFile offers only compat mode (no nvidia-fs, no P2PDMA): the parallel bounce path is "
          "used instead";
    }
    if (impl->cufile == nullptr && options.cufile == CuFilePolicy::kRequire) {
      return Status::Unsupported(EOPNOTSUPP,
                                 "GPUDirect Storage required but unavailable: " + impl->reason);
    }
  }
  impl->pins->cufile = impl->cufile;
  // Once per handle; the control file makes one per user handle: throttled.
  DNVME_LOG_THROTTLED(debug, "gds_handle: mode {} ({}), copy engine {}", GdsModeName(impl->mode),
                      impl->reason, impl->copier->name());
  Impl* raw = impl.get();
  impl->dispatcher = std::thread([raw] { raw->Loop(); });
  return std::unique_ptr<GdsHandle>(new GdsHandle(std::move(impl)));
}

const HandleConfig& GdsHandle::config() const { return impl_->config; }
GdsMode GdsHandle::mode() const { return impl_->mode; }
const std::string& GdsHandle::mode_reason() const { return impl_->reason; }

Status GdsHandle::sync_pread(void* buffer, int64_t n, const std::string& path, int64_t off) {
  return pread(buffer, n, path, false, false, off);
}
Status GdsHandle::sync_pwrite(const void* buffer, int64_t n, const std::string& path, int64_t off) {
  return pwrite(buffer, n, path, false, false, off);
}

Result<OpId> GdsHandle::async_pread(void* buffer, int64_t n, const std::string& path, int64_t off) {
  DNVME_ASSIGN_OR_RETURN(auto job, impl_->MakeJob(OpType::kRead, buffer, n, &path, -1, off));
  const OpId id = job->result.id;
  DNVME_RETURN_IF_ERROR(impl_->Enqueue(job));
  return id;
}

Result<OpId> GdsHandle::async_pwrite(const void* buffer, int64_t n, const std::string& path,
                                     int64_t off) {
  DNVME_ASSIGN_OR_RETURN(
      auto job, impl_->MakeJob(OpType::kWrite, const_cast<void*>(buffer), n, &path, -1, off));
  const OpId id = job->result.id;
  DNVME_RETURN_IF_ERROR(impl_->Enqueue(job));
  return id;
}

Status GdsHandle::pread(void* buffer, int64_t n, const std::string& path, bool validate,
                        bool async_op, int64_t off) {
  DNVME_ASSIGN_OR_RETURN(auto job, impl_->MakeJob(OpType::kRead, buffer, n, &path, -1, off));
  return impl_->Submit(std::move(job), validate, async_op);
}

Status GdsHandle::pwrite(const void* buffer, int64_t n, const std::string& path, bool validate,
                         bool async_op, int64_t off) {
  DNVME_ASSIGN_OR_RETURN(
      auto job, impl_->MakeJob(OpType::kWrite, const_cast<void*>(buffer), n, &path, -1, off));
  return impl_->Submit(std::move(job), validate, async_op);
}

Status GdsHandle::pread(void* buffer, int64_t n, int fd, bool validate, bool async_op,
                        int64_t off) {
  DNVME_ASSIGN_OR_RETURN(auto job, impl_->MakeJob(OpType::kRead, buffer, n, nullptr, fd, off));
  return impl_->Submit(std::move(job), validate, async_op);
}

Status GdsHandle::pwrite(const void* buffer, int64_t n, int fd, bool validate, bool async_op,
                         int64_t off) {
  DNVME_ASSIGN_OR_RETURN(
      auto job, impl_->MakeJob(OpType::kWrite, const_cast<void*>(buffer), n, nullptr, fd, off));
  return impl_->Submit(std::move(job), validate, async_op);
}

Status GdsHandle::sync_pread(void* buffer, int64_t n, int fd, int64_t off) {
  DNVME_ASSIGN_OR_RETURN(auto job, impl_->MakeJob(OpType::kRead, buffer, n, nullptr, fd, off));
  return impl_->Submit(std::move(job), false, false);
}

Status GdsHandle::sync_pwrite(const void* buffer, int64_t n, int fd, int64_t off) {
  DNVME_ASSIGN_OR_RETURN(
      auto job, impl_->MakeJob(OpType::kWrite, const_cast<void*>(buffer), n, nullptr, fd, off));
  return impl_->Submit(std::move(job), false, false);
}

Status GdsHandle::submit_pread(void* buffer, int64_t n, int fd, int64_t off, Completion done) {
  DNVME_ASSIGN_OR_RETURN(auto job, impl_->MakeJob(OpType::kRead, buffer, n, nullptr, fd, off));
  job->done = std::move(done);
  return impl_->Enqueue(std::move(job));
}

Status GdsHandle::submit_pwrite(const void* buffer, int64_t n, int fd, int64_t off,
                                Completion done) {
  DNVME_ASSIGN_OR_RETURN(
      auto job, impl_->MakeJob(OpType::kWrite, const_cast<void*>(buffer), n, nullptr, fd, off));
  job->done = std::move(done);
  return impl_->Enqueue(std::move(job));
}

int GdsHandle::wait() {
  std::vector<std::shared_ptr<Job>> jobs;
  {
    std::lock_guard lock(impl_->qm);
    jobs.swap(impl_->async_jobs);
  }
  impl_->completed.clear();
  for (auto& job : jobs) {
    std::unique_lock lock(job->m);
    job->cv.wait(lock, [&] { return job->finished; });
    impl_->completed.push_back(job->result);
  }
  return static_cast<int>(jobs.size());
}

const std::vector<OpResult>& GdsHandle::completed() const { return impl_->completed; }

int GdsHandle::pending() const {
  std::lock_guard lock(impl_->qm);
  return static_cast<int>(impl_->async_jobs.size());
}

Status GdsHandle::fsync(const std::string& path) { return impl_->aio->fsync(path); }

Status GdsHandle::pin_device_buffer(void* buffer, int64_t n) {
  if (buffer == nullptr || n <= 0) {
    return Status::InvalidArgument("pin_device_buffer needs a buffer and a positive size");
  }
  DNVME_ASSIGN_OR_RETURN(bool dev, impl_->copier->IsDevice(buffer));
  if (!dev) return Status::InvalidArgument("pin_device_buffer: not device memory");
  auto& pins = *impl_->pins;
  std::lock_guard lock(pins.mu);
  const auto a = reinterpret_cast<uintptr_t>(buffer);
  if (pins.ranges.count(a) != 0) {
    return Status::InvalidArgument("pin_device_buffer: this buffer is already pinned");
  }
  if (impl_->cufile != nullptr) {
    DNVME_RETURN_IF_ERROR(gpu::CuFileStatus(
        impl_->cufile->buf_register(buffer, static_cast<size_t>(n), 0), "cuFileBufRegister"));
  }
  pins.ranges[a] = static_cast<size_t>(n);
  return Status::Ok();
}

Status GdsHandle::unpin_device_buffer(void* buffer) { return impl_->pins->Unpin(buffer); }

Result<gpu::DeviceBuffer> GdsHandle::new_pinned_device_buffer(int64_t n) {
  if (n <= 0) return Status::InvalidArgument("new_pinned_device_buffer needs a positive size");
  DNVME_ASSIGN_OR_RETURN(gpu::DeviceBuffer b, impl_->copier->AllocDevice(static_cast<size_t>(n)));
  Status pinned = pin_device_buffer(b.data(), n);
  if (!pinned.ok()) return pinned;  // b frees the memory
  std::weak_ptr<Impl::Pins> weak = impl_->pins;
  b.set_on_free([weak](void* q) {
    // Already unpinned (by unpin_device_buffer or the handle's end) is fine here.
    auto pins = weak.lock();
    if (!pins) return;
    Status st = pins->Unpin(q);
    if (!st.ok() && st.code() != Status::Code::kInvalidArgument) Logger().warn("{}", st.ToString());
  });
  return b;
}

Status GdsHandle::free_pinned_device_buffer(gpu::DeviceBuffer buffer) {
  if (buffer.empty()) return Status::InvalidArgument("free_pinned_device_buffer: empty buffer");
  return Status::Ok();  // `buffer` unpins and frees itself here
}

GdsStats GdsHandle::stats() const {
  GdsStats s;
  const Impl& i = *impl_;
  s.ops_read = i.ops_read.load();
  s.ops_written = i.ops_written.load();
  s.ops_failed = i.ops_failed.load();
  s.bytes_read = i.bytes_read.load();
  s.bytes_written = i.bytes_written.load();
  s.bytes_cufile = i.bytes_cufile.load();
  s.bytes_bounce = i.bytes_bounce.load();
  s.bytes_host = i.bytes_host.load();
  s.cufile_calls = i.cufile_calls.load();
  s.copies = i.copies.load();
  {
    std::lock_guard lock(i.pins->mu);
    s.buffers_pinned = i.pins->ranges.size();
  }
  s.engine = i.aio->stats();
  return s;
}

}  // namespace dnvme
