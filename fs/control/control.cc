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

#include "dnvme/fd.h"
#include "dnvme/log.h"
#include "fs/control/as_caller.h"
#include "fs/limits/uid_limits.h"

namespace dnvme::fs {
namespace {

using nlohmann::json;

Status Err(int err, std::string msg) { return CtlError(err, std::move(msg)); }

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

WorkerCost EngineWorkerCost(const HandleConfig& c) {
  return WorkerCost{c.intra_op_parallelism,
                    int64_t{c.intra_op_parallelism} * std::max(1, c.queue_depth)};
}

WorkerCost GdsWorkerCost(const HandleConfig& c) {
  const WorkerCost aio = EngineWorkerCost(c);
  // + the dispatcher and the cuFile slice threads of the operation it runs (one at a time).
  return WorkerCost{aio.threads + 1 + (c.intra_op_parallelism - 1), aio.aio_events};
}

CtlSession::CtlSession(ControlCore& core, Caller opener) : fs_(core), opener_(std::move(opener)) {
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

Result<Caller> CtlSession::Acting(const Caller& writer) const {
  // Run as the writer, a set-user-ID program writing to a ctl descriptor it inherited would act
  // as root for whoever opened it; run as the opener whoever writes, a process that opened ctl as
  // root and then dropped privileges (or passed the descriptor on) would keep root's powers in
  // every request. Refusing other uids is safe both ways: a request can do no more than both its
  // opener and its writer could. Same uid: the opener's gid and groups, as captured at OPEN (a
  // set-group-ID program writing to its caller's descriptor gains nothing either).
  if (writer.uid != opener_.uid) {
    return Err(EPERM, "this ctl session was opened by uid " + std::to_string(opener_.uid) +
                          "; a write by uid " + std::to_string(writer.uid) +
                          " is refused (requests run as the session's opener: open ctl yourself)");
  }
  Caller acting = opener_;
  acting.pid = writer.pid;
  return acting;
}

Status CtlSession::Request(std::string_view text, const Caller& writer) {
  DNVME_ASSIGN_OR_RETURN(Caller acting, Acting(writer));
  Run(text, text.size(), acting);
  return Status::Ok();
}

void CtlSession::Run(std::string_view text, size_t bytes, const Caller& caller) {
  std::lock_guard lock(mu_);
  fs_.ctl_counters().requests.fetch_add(1, std::memory_order_relaxed);
  auto req = bytes > kMaxRequestBytes ? Result<CtlRequest>(CtlTooLarge(bytes))
                                      : ParseCtlRequest(text, fs_.mountpoint());
  std::string id = req.ok() ? req->id_json : ExtractCtlId(text);
  Result<std::string> body =
      !req.ok()        ? Result<std::string>(req.status())
      : fs_.Stopping() ? Result<std::string>(Status::FromErrno(
                             ECANCELED, "the daemon is stopping: the request was not run"))
                       : Dispatch(req.value(), caller);
  std::string answer;
  if (body.ok()) {
    answer = CtlOkResponse(id, body.value());
  } else {
    fs_.ctl_counters().request_errors.fetch_add(1, std::memory_order_relaxed);
    DNVME_LOG_THROTTLED(info, "control request from pid {} uid {} refused: {}", caller.pid,
                        caller.uid, LogEscape(body.status().ToString()));
    answer = CtlErrorResponse(id, body.status());
  }
  std::lock_guard ql(queue_mu_);
  answer_ = std::move(answer);
  answer_pos_ = 0;
}

Status CtlSession::Enqueue(std::string text, const Caller& writer, const Starter& start) {
  DNVME_ASSIGN_OR_RETURN(Caller caller, Acting(writer));
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
                  {"max_opens", l.Max(UidResource::kControlOpens)},
                  {"max_workers", l.Max(UidResource::kWorkers)},
                  {"max_aio_events", l.Max(UidResource::kAioEvents)},
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
      return json{{"stats", json::parse(fs_.StatsJsonFor(caller.uid))}}.dump();
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
  DNVME_ASSIGN_OR_RETURN(h->handle_charge, limits.Charge(owner(), UidResource::kHandles));
  DNVME_ASSIGN_OR_RETURN(h->pinned_charge,
                         limits.Charge(owner(), UidResource::kPinnedBytes, PinnedEstimate(cfg)));
  // Its threads, eventfds and libaio contexts: bounded per handle by the configuration's ranges
  // (256 workers of queue depth 4096), so counted per uid too, before any is made.
  const WorkerCost cost = EngineWorkerCost(cfg);
  DNVME_ASSIGN_OR_RETURN(h->workers_charge,
                         limits.Charge(owner(), UidResource::kWorkers, cost.threads));
  DNVME_ASSIGN_OR_RETURN(h->aio_charge,
                         limits.Charge(owner(), UidResource::kAioEvents, cost.aio_events));
  DNVME_ASSIGN_OR_RETURN(h->fds_charge, limits.ChargeFds(owner(), cost.threads, FdUse::kOther));
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
  // The engines go first (nothing is in flight: TakeFinished waited), so the uid is charged for
  // their threads and pinned memory until they are gone.
  h.gds.reset();
  h.engine.reset();
  h.handle_charge.Reset();
  h.pinned_charge.Reset();
  h.gds_pinned_charge.Reset();
  h.workers_charge.Reset();
  h.aio_charge.Reset();
  h.gds_workers_charge.Reset();
  h.gds_aio_charge.Reset();
  fs_.ctl_counters().handles_open.fetch_sub(1, std::memory_order_relaxed);
  return done.size();
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
  // The GPU engine's staging, threads and libaio events are charged like the handle's own
  // (OpenHandle); all or nothing.
  UidLimits& limits = fs_.uid_limits();
  const WorkerCost cost = GdsWorkerCost(h.engine->config());
  DNVME_ASSIGN_OR_RETURN(UidCharge pinned, limits.Charge(owner(), UidResource::kPinnedBytes,
                                                         GdsPinnedEstimate(h.engine->config(), o)));
  DNVME_ASSIGN_OR_RETURN(UidCharge workers,
                         limits.Charge(owner(), UidResource::kWorkers, cost.threads));
  DNVME_ASSIGN_OR_RETURN(UidCharge aio,
                         limits.Charge(owner(), UidResource::kAioEvents, cost.aio_events));
  DNVME_ASSIGN_OR_RETURN(UidCharge fds, limits.ChargeFds(owner(), cost.threads, FdUse::kOther));
  auto made = GdsHandle::Create(h.engine->config(), o);
  if (!made.ok()) return made.status().WithContext("GPU engine for this handle");
  h.gds_pinned_charge = std::move(pinned);
  h.gds_workers_charge = std::move(workers);
  h.gds_aio_charge = std::move(aio);
  h.gds_fds_charge = std::move(fds);
  h.gds = std::move(made).value();
  h.gds_device = device;
  // Once per handle, and a user opens handles at will: throttled as every line a user causes.
  DNVME_LOG_THROTTLED(info, "control file: GPU transfers on device {} use {} ({})", device,
                      GdsModeName(h.gds->mode()), h.gds->mode_reason());
  return h.gds.get();
}

void CtlSession::FinishRecord(CtlOpRecord& rec) {
  if (rec.pinned != nullptr) {
    // A write through the control file is seen by later reads through the mount: drop the
    // daemon's read-ahead and the kernel's cached pages and attributes of the file.
    if (rec.write) fs_.AfterExternalWrite(*rec.pinned);
    if (rec.outside_write) fs_.OutsideWrite(*rec.pinned, false);
    rec.outside_write = false;
    fs_.Unpin(rec.pinned);
    rec.pinned = nullptr;
  }
  rec.file = FileRef();
  rec.buffer.reset();
  rec.gpu_buffer.reset();
  rec.file_charge.Reset();
  rec.fds.Reset();
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
