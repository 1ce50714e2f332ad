#include "fs/control/control.h"

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/fsuid.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cassert>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <utility>

#include "engine/common/log.h"
#include "engine/posix/file.h"
#include "fs/control/as_caller.h"
#include "fs/limits/uid_limits.h"

namespace dnvme::fs {
namespace {

using nlohmann::json;

Status Err(int err, std::string msg) { return CtlError(err, std::move(msg)); }

// "/dev/shm/NAME" (one component, not . or ..) or "/proc/PID/fd/N" (decimal numbers).
bool IsDigits(std::string_view s) {
  return !s.empty() && s.size() <= 10 &&
         s.find_first_not_of("0123456789") == std::string_view::npos;
}
bool IsShmSource(std::string_view s) {
  constexpr std::string_view kPrefix = "/dev/shm/";
  if (s.substr(0, kPrefix.size()) != kPrefix) return false;
  const std::string_view name = s.substr(kPrefix.size());
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string_view::npos;
}
bool IsProcFdSource(std::string_view s) {
  constexpr std::string_view kPrefix = "/proc/";
  if (s.substr(0, kPrefix.size()) != kPrefix) return false;
  s.remove_prefix(kPrefix.size());
  const size_t mid = s.find("/fd/");
  return mid != std::string_view::npos && IsDigits(s.substr(0, mid)) && IsDigits(s.substr(mid + 4));
}

// Reads the thread group id from an open /proc/PID directory (its `status`).
Result<pid_t> TgidOf(int proc_dir) {
  UniqueFd st(openat(proc_dir, "status", O_RDONLY | O_CLOEXEC));
  if (!st.valid()) return Status::FromErrno(errno, "status of the process");
  char text[4096];
  ssize_t n;
  do {
    n = read(st.get(), text, sizeof(text) - 1);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return Status::FromErrno(errno, "status of the process");
  text[n] = '\0';
  const char* line = std::strstr(text, "\nTgid:");
  long tgid = 0;
  if (line == nullptr || std::sscanf(line + 6, "%ld", &tgid) != 1 || tgid <= 0) {
    return Status::IoError(EIO, "no Tgid in the status of the process");
  }
  return static_cast<pid_t>(tgid);
}

// Opens a client's memory object named by `source` (IsShmSource or IsProcFdSource) with `flags`,
// as whoever the calling thread acts as, never blocking (O_NONBLOCK) and never following a name
// the client could have planted:
//   /dev/shm/NAME: NAME resolved beneath /dev/shm with no symlink at all (a link planted in the
//     shared directory could point anywhere the daemon may open);
//   /proc/PID/fd/N: through a /proc/PID directory fd, so the process checked is the one opened
//     (a PID recycled in between makes the open fail). A thread of the daemon is refused: the
//     kernel lets a process open its own /proc fds without a ptrace check, and as the daemon
//     that would reach every client's lease page and every file the daemon has open.
Result<UniqueFd> OpenClientMemory(const std::string& source, int flags) {
  flags |= O_CLOEXEC | O_NONBLOCK | O_NOCTTY;
  if (IsShmSource(source)) {
    UniqueFd shm(open("/dev/shm", O_PATH | O_DIRECTORY | O_CLOEXEC));
    if (!shm.valid()) return Status::FromErrno(errno, "/dev/shm");
    auto fd = OpenBeneath(shm.get(), source.substr(std::strlen("/dev/shm/")), flags, 0);
    if (!fd.ok() && fd.status().error_number() == ELOOP) {
      return Err(ELOOP, "'" + source + "' is a symbolic link (not followed)");
    }
    return fd;
  }
  const size_t mid = source.find("/fd/");
  const std::string pid_dir = source.substr(0, mid);  // "/proc/PID"
  UniqueFd dir(open(pid_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!dir.valid()) return Status::FromErrno(errno, "open '" + pid_dir + "'");
  DNVME_ASSIGN_OR_RETURN(pid_t tgid, TgidOf(dir.get()));
  if (tgid == getpid()) {
    return Err(EACCES, "'" + source + "' is a descriptor of the daemon itself");
  }
  UniqueFd fd(openat(dir.get(), source.substr(mid + 1).c_str(), flags));
  if (!fd.valid()) return Status::FromErrno(errno, "open '" + source + "'");
  return fd;
}

// The GPU engine's pinned staging (engine/gpu/gds_handle.cc): bounce_slots chunks.
int64_t GdsPinnedEstimate(const HandleConfig& c, const GdsOptions& o) {
  const int64_t chunk =
      o.bounce_chunk_bytes > 0
          ? o.bounce_chunk_bytes
          : std::clamp<int64_t>(c.block_size * c.queue_depth, int64_t{4} << 20, int64_t{64} << 20);
  return chunk * o.bounce_slots;
}

// Waits until none of `h`'s transfers is running and takes every record (finished, uncollected).
std::vector<std::shared_ptr<CtlOpRecord>> TakeFinished(CtlHandle& h) {
  std::vector<std::shared_ptr<CtlOpRecord>> done;
  std::unique_lock lock(h.m);
  h.cv.wait(lock, [&] { return h.running == 0; });
  done.swap(h.ops);
  return done;
}

json RecordJson(const CtlOpRecord& r) {
  json j = {{"op_id", r.op_id},   {"op", r.write ? "pwrite" : "pread"},
            {"path", r.path},     {"file_offset", r.file_offset},
            {"length", r.length}, {"bytes", r.bytes_done},
            {"ok", r.status.ok()}};
  if (!r.status.ok()) {
    const int err = r.status.ErrnoOr();
    j["error"] = {{"code", ErrnoName(err)}, {"errno", err}, {"message", r.status.message()}};
  }
  return j;
}

}  // namespace

int64_t PinnedEstimate(const HandleConfig& c) {
  const int64_t request = std::max<int64_t>(4096, (c.block_size + 4095) / 4096 * 4096);
  const int64_t per_worker = std::min<int64_t>(
      std::max<int64_t>(2, c.bounce_bytes_per_worker / request), std::max(2, c.queue_depth));
  return per_worker * request * c.intra_op_parallelism;
}

CtlSession::CtlSession(ControlCore& core, uid_t owner) : fs_(core), owner_(owner) {
  fs_.ctl_counters().sessions_open.fetch_add(1, std::memory_order_relaxed);
}

CtlSession::~CtlSession() {
  // A job running the queue holds the session until it is empty and its parked reads answered.
  assert(!running_ && queue_.empty() && parked_.empty());
  std::lock_guard lock(mu_);
  for (auto& [id, h] : handles_) ReleaseHandle(*h);
  handles_.clear();  // destroys the engines (nothing in flight)
  for (auto& [id, map] : buffers_) ReleaseBuffer(id, map->size());
  for (auto& [id, g] : gpu_buffers_) ReleaseBuffer(id, g->size);
  fs_.ctl_counters().sessions_open.fetch_sub(1, std::memory_order_relaxed);
}

void CtlSession::Request(std::string_view text, const Caller& caller) {
  Run(text, text.size(), caller);
}

void CtlSession::Run(std::string_view text, size_t bytes, const Caller& caller) {
  std::lock_guard lock(mu_);
  fs_.ctl_counters().requests.fetch_add(1, std::memory_order_relaxed);
  auto req = bytes > kMaxRequestBytes ? Result<CtlRequest>(CtlTooLarge(bytes))
                                      : ParseCtlRequest(text, fs_.mountpoint());
  std::string id = req.ok() ? req->id_json : ExtractCtlId(text);
  Result<std::string> body =
      req.ok() ? Dispatch(req.value(), caller) : Result<std::string>(req.status());
  std::string answer;
  if (body.ok()) {
    answer = CtlOkResponse(id, body.value());
  } else {
    fs_.ctl_counters().request_errors.fetch_add(1, std::memory_order_relaxed);
    Logger().info("control request from pid {} uid {} refused: {}", caller.pid, caller.uid,
                  body.status().ToString());
    answer = CtlErrorResponse(id, body.status());
  }
  std::lock_guard ql(queue_mu_);
  answer_ = std::move(answer);
  answer_pos_ = 0;
}

Status CtlSession::Enqueue(std::string text, Caller caller, const Starter& start) {
  // A request too long to be taken is refused by its size alone: its text is not kept (a write
  // over max_write arrives as several of them, each refused on its own).
  const size_t bytes = text.size();
  if (bytes > kMaxRequestBytes) text = std::string();
  std::lock_guard lock(queue_mu_);
  // Bounded: the requests wait in the daemon's memory (and a lane holds one job per busy session,
  // so a uid's share stays within its lane's queue times these).
  if (queue_.size() >= kMaxQueued ||
      (!queue_.empty() && queued_bytes_ + text.size() > kMaxQueuedBytes)) {
    return Status::ResourceExhausted(
        EAGAIN, "this session has " + std::to_string(queue_.size()) + " requests (" +
                    std::to_string(queued_bytes_) + " bytes) queued, the most it may (" +
                    std::to_string(kMaxQueued) + " requests, " + std::to_string(kMaxQueuedBytes) +
                    " bytes): read the answer before writing more");
  }
  if (!running_) {
    // Handed over under the lock: a writer after us sees the job and only queues behind it, and
    // the job, which needs the lock, finds this request queued.
    DNVME_RETURN_IF_ERROR(start());
    running_ = true;
  }
  queued_bytes_ += text.size();
  queue_.push_back(QueuedRequest{std::move(text), bytes, std::move(caller)});
  return Status::Ok();
}

void CtlSession::RunQueued() {
  std::unique_lock lock(queue_mu_);
  while (!queue_.empty()) {
    QueuedRequest next = std::move(queue_.front());
    queue_.pop_front();
    queued_bytes_ -= next.text.size();
    lock.unlock();
    Run(next.text, next.bytes, next.caller);
    lock.lock();
  }
  running_ = false;
  // The parked reads take their parts of the last answer in the order they came; the replies go
  // out after the lock is given back (a reply is a write to /dev/fuse).
  std::vector<std::pair<ReadReply, std::string>> answers;
  answers.reserve(parked_.size());
  for (ParkedRead& p : parked_) answers.emplace_back(std::move(p.reply), TakeAnswerLocked(p.size));
  parked_.clear();
  lock.unlock();
  for (auto& [reply, bytes] : answers) reply(bytes);
}

void CtlSession::Read(size_t size, ReadReply reply) {
  std::unique_lock lock(queue_mu_);
  if (running_) {
    parked_.push_back(ParkedRead{size, std::move(reply)});
    return;
  }
  std::string bytes = TakeAnswerLocked(size);
  lock.unlock();
  reply(bytes);
}

std::string CtlSession::TakeAnswerLocked(size_t size) {
  const size_t n = std::min(size, answer_.size() - answer_pos_);
  std::string out = answer_.substr(answer_pos_, n);
  answer_pos_ += n;
  return out;
}

Result<std::string> CtlSession::Dispatch(const CtlRequest& r, const Caller& caller) {
  switch (r.op) {
    case CtlOp::kHello: {
      const UidLimits& l = fs_.uid_limits();
      // Per uid, all sessions together (docs/security.md).
      json j = {{"protocol", 1},
                {"version", DaemonVersion()},
                {"mountpoint", fs_.mountpoint()},
                {"limits",
                 {{"max_handles", l.Max(UidResource::kHandles)},
                  {"max_buffer_bytes", l.Max(UidResource::kRegisteredBytes)},
                  {"max_buffers", l.Max(UidResource::kBuffers)},
                  {"max_pinned_bytes", l.Max(UidResource::kPinnedBytes)},
                  {"max_pending", l.Max(UidResource::kPending)},
                  {"max_block_size", kCtlMaxBlockSize},
                  {"max_bounce_bytes_per_worker", kCtlMaxBounceBytesPerWorker},
                  {"max_request_bytes", kMaxRequestBytes}}}};
      return j.dump();
    }
    case CtlOp::kConfigGet:
      return json{{"config", json::parse(fs_.EngineConfig().ToJson())}}.dump();
    case CtlOp::kConfigSet: {
      if (!fs_.MayReconfigure(caller.uid)) {
        return Err(EPERM, "only root or the mount's owner may change the live configuration");
      }
      DNVME_ASSIGN_OR_RETURN(HandleConfig c, fs_.SetEngineConfig(r.config_json));
      return json{{"config", json::parse(c.ToJson())}}.dump();
    }
    case CtlOp::kStats:
      return json{{"stats", json::parse(fs_.StatsJson())}}.dump();
    case CtlOp::kHandleOpen:
      return OpenHandle(r);
    case CtlOp::kHandleClose:
      return CloseHandle(r.handle);
    case CtlOp::kBufferRegister:
      return Register(r, caller);
    case CtlOp::kBufferUnregister:
      return Unregister(r.buffer);
    case CtlOp::kPread:
    case CtlOp::kPwrite:
      return Transfer(r, caller);
    case CtlOp::kWait:
      return Wait(r.handle);
    case CtlOp::kFsync:
      return Fsync(r, caller);
  }
  return Err(EOPNOTSUPP, "op not handled");
}

Result<std::string> CtlSession::OpenHandle(const CtlRequest& r) {
  DNVME_ASSIGN_OR_RETURN(HandleConfig cfg,
                         HandleConfig::FromJson(r.config_json, fs_.EngineConfig()));
  // The engine pins its bounce buffers in the daemon: their size is bounded per buffer and per
  // worker, and the whole pool is charged to the owner before anything is allocated.
  if (cfg.block_size > kCtlMaxBlockSize) {
    return Err(EINVAL, "block_size " + std::to_string(cfg.block_size) +
                           " is above the control file's limit of " +
                           std::to_string(kCtlMaxBlockSize) + " bytes");
  }
  if (cfg.bounce_bytes_per_worker > kCtlMaxBounceBytesPerWorker) {
    return Err(EINVAL, "bounce_bytes_per_worker " + std::to_string(cfg.bounce_bytes_per_worker) +
                           " is above the control file's limit of " +
                           std::to_string(kCtlMaxBounceBytesPerWorker) + " bytes");
  }
  UidLimits& limits = fs_.uid_limits();
  auto h = std::make_unique<CtlHandle>();
  DNVME_ASSIGN_OR_RETURN(h->handle_charge, limits.Charge(owner_, UidResource::kHandles));
  DNVME_ASSIGN_OR_RETURN(h->pinned_charge,
                         limits.Charge(owner_, UidResource::kPinnedBytes, PinnedEstimate(cfg)));
  auto engine = AioHandle::Create(cfg);
  if (!engine.ok()) return engine.status().WithContext("handle.open");
  h->engine = std::move(engine).value();
  const int64_t id = next_handle_++;
  fs_.AddCtlEngine(h->engine.get());
  handles_.emplace(id, std::move(h));
  fs_.ctl_counters().handles_open.fetch_add(1, std::memory_order_relaxed);
  return json{{"handle", id}, {"config", json::parse(cfg.ToJson())}}.dump();
}

Result<std::string> CtlSession::CloseHandle(int64_t id) {
  auto it = handles_.find(id);
  if (it == handles_.end())
    return Err(EBADF, "no handle " + std::to_string(id) + " in this session");
  const size_t n = ReleaseHandle(*it->second);
  handles_.erase(it);  // destroys the engine (nothing in flight)
  return json{{"uncollected", n}}.dump();
}

size_t CtlSession::ReleaseHandle(CtlHandle& h) {
  std::vector<std::shared_ptr<CtlOpRecord>> done = TakeFinished(h);
  for (auto& rec : done) FinishRecord(*rec);
  fs_.RemoveCtlEngine(h.engine.get());
  h.handle_charge.Reset();
  h.pinned_charge.Reset();
  h.gds_pinned_charge.Reset();
  fs_.ctl_counters().handles_open.fetch_sub(1, std::memory_order_relaxed);
  return done.size();
}

int64_t CtlSession::KeepBuffer(BufferCharges charges, int64_t size) {
  const int64_t id = next_buffer_++;
  buffer_charges_[id] = std::move(charges);
  fs_.ctl_counters().buffers_registered.fetch_add(1, std::memory_order_relaxed);
  fs_.ctl_counters().bytes_registered.fetch_add(static_cast<uint64_t>(size),
                                                std::memory_order_relaxed);
  return id;
}

void CtlSession::ReleaseBuffer(int64_t id, int64_t size) {
  buffer_charges_.erase(id);
  fs_.ctl_counters().buffers_registered.fetch_sub(1, std::memory_order_relaxed);
  fs_.ctl_counters().bytes_registered.fetch_sub(static_cast<uint64_t>(size),
                                                std::memory_order_relaxed);
}

Result<std::string> CtlSession::Register(const CtlRequest& r, const Caller& caller) {
  BufferCharges charges;
  DNVME_ASSIGN_OR_RETURN(charges.count, fs_.uid_limits().Charge(owner_, UidResource::kBuffers));
  if (!r.cuda_ipc.empty()) return RegisterCuda(r, std::move(charges));
  std::string source = r.shm.empty() ? r.source : "/dev/shm/" + r.shm;
  // Only shared-memory objects, named in one of two shapes; anything else (a file of this mount,
  // a device) is refused before it is opened.
  if (!IsShmSource(source) && !IsProcFdSource(source)) {
    return Err(EINVAL, "'source' must be /dev/shm/NAME or /proc/PID/fd/N, not '" + source + "'");
  }
  UniqueFd fd;
  bool writable = true;
  {
    DNVME_ASSIGN_OR_RETURN(auto as, AsCaller::Enter(caller));
    // The caller's own permission decides: read-write when it may write the object (a pread
    // target), else read-only (a pwrite source only).
    auto opened = OpenClientMemory(source, O_RDWR);
    const int err = opened.ok() ? 0 : opened.status().error_number();
    if (err == EACCES || err == EPERM || err == EROFS) {
      auto ro = OpenClientMemory(source, O_RDONLY);
      // A refusal of the source itself (the daemon's own descriptors) stays the first answer.
      if (ro.ok()) writable = false;
      if (ro.ok() || ro.status().error_number() != EACCES) opened = std::move(ro);
    }
    if (!opened.ok()) return opened.status().WithContext("as uid " + std::to_string(caller.uid));
    fd = std::move(opened).value();
  }
  // The daemon-wide table of mappings keeps its last slots for root (client_memory.h).
  DNVME_ASSIGN_OR_RETURN(auto map, ClientMapping::Map(fd.get(), r.region_offset, r.region_size,
                                                      writable, source, owner_ == 0));
  DNVME_ASSIGN_OR_RETURN(
      charges.bytes, fs_.uid_limits().Charge(owner_, UidResource::kRegisteredBytes, map->size()));
  const int64_t size = map->size();
  const bool sealed = map->sealed();
  const int64_t id = KeepBuffer(std::move(charges), size);
  buffers_[id] = std::move(map);
  return json{{"buffer", id}, {"size", size}, {"writable", writable}, {"sealed", sealed}}.dump();
}

// GPU memory of the client: possession of the IPC handle is the permission (CUDA's model: only
// a process the owner handed the handle to can open it). CUDA is first initialised here, long
// after the daemon forked (main.cc defers it until then).
Result<std::string> CtlSession::RegisterCuda(const CtlRequest& r, BufferCharges charges) {
  DNVME_RETURN_IF_ERROR(gpu::DecodeIpcHandleHex(r.cuda_ipc).status());
  auto opened = gpu::IpcMapping::Open(r.cuda_ipc, static_cast<int>(r.cuda_device));
  if (!opened.ok()) {
    const Status& st = opened.status();
    // No device or no CUDA in this daemon: ENODEV, with the reason.
    if (st.code() == Status::Code::kUnsupported) {
      return Err(ENODEV, "cannot open the CUDA IPC handle: " + st.message());
    }
    return st.WithContext("cudaIpcOpenMemHandle");
  }
  auto g = std::make_shared<CtlGpuBuffer>();
  g->ipc = std::move(opened).value();
  const int64_t total = g->ipc->allocation_size();
  if (r.region_offset > total || r.region_size > total - r.region_offset) {
    return Err(EINVAL, "offset " + std::to_string(r.region_offset) + " + size " +
                           std::to_string(r.region_size) + " is past the end of the " +
                           std::to_string(total) + "-byte CUDA allocation");
  }
  g->data = g->ipc->data() + r.region_offset;
  g->size = r.region_size > 0 ? r.region_size : total - r.region_offset;
  g->device = static_cast<int>(r.cuda_device);
  DNVME_ASSIGN_OR_RETURN(charges.bytes,
                         fs_.uid_limits().Charge(owner_, UidResource::kRegisteredBytes, g->size));
  const int64_t size = g->size;
  const int64_t id = KeepBuffer(std::move(charges), size);
  gpu_buffers_[id] = std::move(g);
  return json{{"buffer", id},    {"size", size}, {"writable", true},
              {"sealed", false}, {"gpu", true},  {"device", r.cuda_device}}
      .dump();
}

Result<GdsHandle*> CtlSession::GpuEngine(CtlHandle& h, int device, const Caller& caller) {
  if (h.gds != nullptr) {
    if (h.gds_device != device) {
      return Err(EINVAL, "this handle already serves CUDA device " + std::to_string(h.gds_device) +
                             "; open another handle for device " + std::to_string(device));
    }
    return h.gds.get();
  }
  GdsOptions o;
  o.device = device;
  // A user's writes from GPU memory are the user's to the kernel, as from shared memory
  // (transfer.cc); the handle's first GPU transfer says whose (a session is its opener's).
  if (caller.uid != 0 && geteuid() == 0)
    o.write_as = std::make_shared<const FsIdentity>(IdentityOf(caller));
  DNVME_ASSIGN_OR_RETURN(h.gds_pinned_charge,
                         fs_.uid_limits().Charge(owner_, UidResource::kPinnedBytes,
                                                 GdsPinnedEstimate(h.engine->config(), o)));
  auto made = GdsHandle::Create(h.engine->config(), o);
  if (!made.ok()) h.gds_pinned_charge.Reset();
  if (!made.ok()) return made.status().WithContext("GPU engine for this handle");
  h.gds = std::move(made).value();
  h.gds_device = device;
  Logger().info("control file: GPU transfers on device {} use {} ({})", device,
                GdsModeName(h.gds->mode()), h.gds->mode_reason());
  return h.gds.get();
}

Result<std::string> CtlSession::Unregister(int64_t id) {
  if (auto g = gpu_buffers_.find(id); g != gpu_buffers_.end()) {
    if (g->second.use_count() > 1) {
      return Err(EBUSY, "buffer " + std::to_string(id) +
                            " has transfers in flight or not yet collected by wait");
    }
    ReleaseBuffer(id, g->second->size);
    gpu_buffers_.erase(g);
    return std::string("{}");
  }
  auto it = buffers_.find(id);
  if (it == buffers_.end())
    return Err(EBADF, "no buffer " + std::to_string(id) + " in this session");
  // A transfer still in flight holds the mapping: it stays mapped until that finishes.
  if (it->second.use_count() > 1) {
    return Err(EBUSY, "buffer " + std::to_string(id) +
                          " has transfers in flight or not yet collected by wait");
  }
  ReleaseBuffer(id, it->second->size());
  buffers_.erase(it);
  return std::string("{}");
}

void CtlSession::FinishRecord(CtlOpRecord& rec) {
  if (rec.pinned != nullptr) {
    // A write through the control file is seen by later reads through the mount: drop the
    // daemon's read-ahead and the kernel's cached pages and attributes of the file.
    if (rec.write) fs_.AfterExternalWrite(*rec.pinned);
    fs_.Unpin(rec.pinned);
    rec.pinned = nullptr;
  }
  rec.file = FileRef();
  rec.buffer.reset();
  rec.gpu_buffer.reset();
  rec.file_charge.Reset();
  rec.pending.Reset();
}

Result<std::string> CtlSession::Wait(int64_t id) {
  auto it = handles_.find(id);
  if (it == handles_.end())
    return Err(EBADF, "no handle " + std::to_string(id) + " in this session");
  return Collect(TakeFinished(*it->second));
}

std::string CtlSession::Collect(std::vector<std::shared_ptr<CtlOpRecord>> done) {
  json ops = json::array();
  int failed = 0;
  for (auto& rec : done) {
    FinishRecord(*rec);
    if (!rec->status.ok()) ++failed;
    ops.push_back(RecordJson(*rec));
  }
  return json{{"completed", done.size()}, {"failed", failed}, {"ops", ops}}.dump(
      -1, ' ', false, json::error_handler_t::replace);
}

}  // namespace dnvme::fs
