#include "fs/control/control.h"

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/fsuid.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <nlohmann/json.hpp>

#include "engine/common/log.h"
#include "engine/posix/file.h"
#include "fs/control/as_caller.h"

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
    const int err = r.status.error_number() ? r.status.error_number() : EIO;
    j["error"] = {{"code", ErrnoName(err)}, {"errno", err}, {"message", r.status.message()}};
  }
  return j;
}

}  // namespace

CtlSession::CtlSession(ControlCore& core, uid_t owner) : fs_(core), owner_(owner) {
  fs_.ctl_counters().sessions_open.fetch_add(1, std::memory_order_relaxed);
}

CtlSession::~CtlSession() {
  std::lock_guard lock(mu_);
  for (auto& [id, h] : handles_) ReleaseHandle(*h);
  handles_.clear();  // destroys the engines (nothing in flight)
  for (auto& [id, map] : buffers_) ReleaseBuffer(map->size());
  for (auto& [id, g] : gpu_buffers_) ReleaseBuffer(g->size);
  fs_.ctl_counters().sessions_open.fetch_sub(1, std::memory_order_relaxed);
}

void CtlSession::Request(std::string_view text, const Caller& caller) {
  std::lock_guard lock(mu_);
  fs_.ctl_counters().requests.fetch_add(1, std::memory_order_relaxed);
  auto req = ParseCtlRequest(text, fs_.mountpoint());
  std::string id = req.ok() ? req->id_json : ExtractCtlId(text);
  Result<std::string> body =
      req.ok() ? Dispatch(req.value(), caller) : Result<std::string>(req.status());
  if (body.ok()) {
    answer_ = CtlOkResponse(id, body.value());
  } else {
    fs_.ctl_counters().request_errors.fetch_add(1, std::memory_order_relaxed);
    Logger().info("control request from pid {} uid {} refused: {}", caller.pid, caller.uid,
                  body.status().ToString());
    answer_ = CtlErrorResponse(id, body.status());
  }
  answer_pos_ = 0;
}

std::string CtlSession::ReadAnswer(size_t size) {
  std::lock_guard lock(mu_);
  const size_t n = std::min(size, answer_.size() - answer_pos_);
  std::string out = answer_.substr(answer_pos_, n);
  answer_pos_ += n;
  return out;
}

Result<std::string> CtlSession::Dispatch(const CtlRequest& r, const Caller& caller) {
  switch (r.op) {
    case CtlOp::kHello: {
      const CtlLimits& l = fs_.ctl_limits();
      json j = {{"protocol", 1},
                {"version", DaemonVersion()},
                {"mountpoint", fs_.mountpoint()},
                {"limits",
                 {{"max_handles", l.max_handles},
                  {"max_buffer_bytes", l.max_buffer_bytes},
                  {"max_buffers", l.max_buffers},
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
  DNVME_RETURN_IF_ERROR(fs_.TakeHandleQuota(owner_));
  auto engine = AioHandle::Create(cfg);
  if (!engine.ok()) {
    fs_.ReleaseHandleQuota(owner_);
    return engine.status().WithContext("handle.open");
  }
  auto h = std::make_unique<CtlHandle>();
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
  fs_.ReleaseHandleQuota(owner_);
  fs_.ctl_counters().handles_open.fetch_sub(1, std::memory_order_relaxed);
  return done.size();
}

void CtlSession::ReleaseBuffer(int64_t size) {
  fs_.ReleaseBufferQuota(owner_, size);
  fs_.ctl_counters().buffers_registered.fetch_sub(1, std::memory_order_relaxed);
  fs_.ctl_counters().bytes_registered.fetch_sub(static_cast<uint64_t>(size),
                                                std::memory_order_relaxed);
}

Result<std::string> CtlSession::Register(const CtlRequest& r, const Caller& caller) {
  const size_t registered = buffers_.size() + gpu_buffers_.size();
  if (static_cast<int64_t>(registered) >= fs_.ctl_limits().max_buffers) {
    return Err(EMFILE, "this session already has " + std::to_string(registered) +
                           " buffers registered (the limit)");
  }
  if (!r.cuda_ipc.empty()) return RegisterCuda(r);
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
    // /proc/PID/fd/N is a link by nature; a /dev/shm name must not be one (a link planted in
    // the shared directory could point anywhere).
    const int nofollow = IsShmSource(source) ? O_NOFOLLOW : 0;
    int raw = open(source.c_str(), O_RDWR | O_CLOEXEC | O_NONBLOCK | nofollow);
    if (raw < 0 && (errno == EACCES || errno == EPERM || errno == EROFS)) {
      writable = false;
      raw = open(source.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | nofollow);
    }
    if (raw < 0)
      return Status::FromErrno(errno, "open '" + source + "' as uid " + std::to_string(caller.uid));
    fd.Reset(raw);
  }
  DNVME_ASSIGN_OR_RETURN(
      auto map, ClientMapping::Map(fd.get(), r.region_offset, r.region_size, writable, source));
  DNVME_RETURN_IF_ERROR(fs_.TakeBufferQuota(owner_, map->size()));
  const int64_t id = next_buffer_++;
  const int64_t size = map->size();
  const bool sealed = map->sealed();
  buffers_[id] = std::move(map);
  fs_.ctl_counters().buffers_registered.fetch_add(1, std::memory_order_relaxed);
  fs_.ctl_counters().bytes_registered.fetch_add(static_cast<uint64_t>(size),
                                                std::memory_order_relaxed);
  return json{{"buffer", id}, {"size", size}, {"writable", writable}, {"sealed", sealed}}.dump();
}

// GPU memory of the client: possession of the IPC handle is the permission (CUDA's model: only
// a process the owner handed the handle to can open it). CUDA is first initialised here, long
// after the daemon forked (main.cc defers it until then).
Result<std::string> CtlSession::RegisterCuda(const CtlRequest& r) {
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
  DNVME_RETURN_IF_ERROR(fs_.TakeBufferQuota(owner_, g->size));
  const int64_t id = next_buffer_++;
  const int64_t size = g->size;
  gpu_buffers_[id] = std::move(g);
  fs_.ctl_counters().buffers_registered.fetch_add(1, std::memory_order_relaxed);
  fs_.ctl_counters().bytes_registered.fetch_add(static_cast<uint64_t>(size),
                                                std::memory_order_relaxed);
  return json{{"buffer", id},    {"size", size}, {"writable", true},
              {"sealed", false}, {"gpu", true},  {"device", r.cuda_device}}
      .dump();
}

Result<GdsHandle*> CtlSession::GpuEngine(CtlHandle& h, int device) {
  if (h.gds != nullptr) {
    if (h.gds_device != device) {
      return Err(EINVAL, "this handle already serves CUDA device " + std::to_string(h.gds_device) +
                             "; open another handle for device " + std::to_string(device));
    }
    return h.gds.get();
  }
  GdsOptions o;
  o.device = device;
  auto made = GdsHandle::Create(h.engine->config(), o);
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
    ReleaseBuffer(g->second->size);
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
  ReleaseBuffer(it->second->size());
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
