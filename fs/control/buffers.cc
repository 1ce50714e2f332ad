// CtlSession's buffer requests: buffer.register of the client's shared memory (/dev/shm/NAME or
// /proc/PID/fd/N, opened as the caller and mapped; fs/control/client_memory.h) or of its CUDA
// device memory (an IPC handle), and buffer.unregister; each buffer charged to the session
// owner's uid until it goes.
#include "fs/control/control.h"

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/fsuid.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
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
}  // namespace

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
  DNVME_ASSIGN_OR_RETURN(charges.count, fs_.uid_limits().Charge(owner(), UidResource::kBuffers));
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
                                                      writable, source, owner() == 0));
  DNVME_ASSIGN_OR_RETURN(
      charges.bytes, fs_.uid_limits().Charge(owner(), UidResource::kRegisteredBytes, map->size()));
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
                         fs_.uid_limits().Charge(owner(), UidResource::kRegisteredBytes, g->size));
  const int64_t size = g->size;
  const int64_t id = KeepBuffer(std::move(charges), size);
  gpu_buffers_[id] = std::move(g);
  return json{{"buffer", id},    {"size", size}, {"writable", true},
              {"sealed", false}, {"gpu", true},  {"device", r.cuda_device}}
      .dump();
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

}  // namespace dnvme::fs
