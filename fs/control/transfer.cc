// CtlSession's data requests: pread/pwrite between registered client memory (shared memory or
// CUDA IPC device memory) and files below BACKING_DIR, opened as the caller, kept coherent with
// the mount's write-behind, read-ahead and the kernel's page cache; and fsync.
#include "fs/control/control.h"

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/fsuid.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <nlohmann/json.hpp>

#include "dnvme/fd.h"
#include "dnvme/log.h"
#include "fs/control/as_caller.h"
#include "fs/limits/uid_limits.h"
#include "fs/setid.h"

namespace dnvme::fs {
namespace {

using nlohmann::json;

}  // namespace

Result<std::string> CtlSession::Transfer(const CtlRequest& r, const Caller& caller) {
  const bool write = r.op == CtlOp::kPwrite;
  auto hit = handles_.find(r.handle);
  if (hit == handles_.end()) {
    return CtlError(EBADF, "no handle " + std::to_string(r.handle) + " in this session");
  }
  auto bit = buffers_.find(r.buffer);
  auto git = gpu_buffers_.find(r.buffer);
  if (bit == buffers_.end() && git == gpu_buffers_.end()) {
    return CtlError(EBADF, "no buffer " + std::to_string(r.buffer) + " in this session");
  }
  CtlHandle& h = *hit->second;
  std::shared_ptr<ClientMapping> map = bit != buffers_.end() ? bit->second : nullptr;
  std::shared_ptr<CtlGpuBuffer> gbuf = map == nullptr ? git->second : nullptr;
  const int64_t bsize = map != nullptr ? map->size() : gbuf->size;
  if (r.buffer_offset > bsize || r.length > bsize - r.buffer_offset) {
    return CtlError(EINVAL, "buffer_offset " + std::to_string(r.buffer_offset) + " + length " +
                                std::to_string(r.length) + " is past the end of buffer " +
                                std::to_string(r.buffer) + " (" + std::to_string(bsize) +
                                " bytes)");
  }
  GdsHandle* gds = nullptr;
  if (gbuf != nullptr) {
    DNVME_ASSIGN_OR_RETURN(gds, GpuEngine(h, gbuf->device, caller));
  } else if (!write && !map->writable()) {
    return CtlError(EACCES, "buffer " + std::to_string(r.buffer) +
                                " is registered read-only (the caller may not write it): it can be "
                                "the source of a pwrite, not the target of a pread");
  }
  if (map != nullptr && map->revoked())
    return CtlError(EFAULT, "buffer " + std::to_string(r.buffer) + " was shrunk by its owner");
  if (map != nullptr) DNVME_RETURN_IF_ERROR(map->CheckAllocated(r.buffer_offset, r.length));
  // An async transfer holds its file open until `wait` collects it: both count against the
  // owner's limits from now on (a user cannot fill the daemon's descriptor table).
  UidCharge pending, file_charge;
  UidLimits& limits = fs_.uid_limits();
  if (r.async) {
    DNVME_ASSIGN_OR_RETURN(pending, limits.Charge(owner(), UidResource::kPending));
    DNVME_ASSIGN_OR_RETURN(file_charge, limits.Charge(owner(), UidResource::kFiles));
  }
  // Every transfer holds the file and the engine's two reopens of it while it runs.
  DNVME_ASSIGN_OR_RETURN(UidCharge fds, limits.ChargeFds(owner(), 3, FdUse::kOther));

  // Open the file as the caller: the same permission decision as open(2) on the mount.
  UniqueFd fd;
  bool created = false;
  {
    DNVME_ASSIGN_OR_RETURN(auto as, AsCaller::Enter(caller));
    const int flags = (write ? O_WRONLY : O_RDONLY) | O_NONBLOCK;
    auto opened = OpenKindBeneath(fs_.root_fd(), r.path, flags);
    if (!opened.ok() && write && opened.status().error_number() == ENOENT) {
      // DeepSpeed's pwrite creates the file, mode 0600 (its open_file); so does this one, owned by
      // the caller. The FUSE write carries no umask, and 0600 needs none.
      opened = OpenBeneath(fs_.root_fd(), r.path, flags | O_CREAT | O_EXCL, 0600);
      created = opened.ok();
    }
    if (!opened.ok()) return opened.status();
    fd = std::move(opened).value();
  }
  struct stat st {};
  if (fstat(fd.get(), &st) != 0) return Status::FromErrno(errno, "fstat '" + r.path + "'");
  if (!S_ISREG(st.st_mode)) return CtlError(EINVAL, "'" + r.path + "' is not a regular file");
  if (created) fs_.AfterExternalCreate(Dirname(r.path), Basename(r.path));
  // The daemon writes with CAP_FSETID: a user's pwrite clears set-user-ID / set-group-ID itself,
  // as the same write through the mount would (the kernel's cached mode goes with the inode's
  // attributes after the transfer, FinishRecord).
  if (write && caller.uid != 0 && (st.st_mode & (S_ISUID | S_ISGID)) != 0) {
    DNVME_RETURN_IF_ERROR(DropSetIdForWriter(fd.get(), caller.gid, caller.groups).status());
  }

  auto rec = std::make_shared<CtlOpRecord>();
  rec->op_id = next_op_++;
  rec->write = write;
  rec->path = r.path;
  rec->file_offset = r.file_offset;
  rec->length = r.length;
  rec->buffer = map;
  rec->gpu_buffer = gbuf;
  rec->pending = std::move(pending);
  rec->file_charge = std::move(file_charge);
  rec->fds = std::move(fds);
  // Coherence with the mount: data still in the mount's write-behind must reach the file first
  // (a read sees it; a write is not overwritten by it later).
  rec->pinned = fs_.PinInode(st.st_dev, st.st_ino);
  if (rec->pinned != nullptr) {
    if (write) {
      fs_.OutsideWrite(*rec->pinned, true);  // before the drain: no Trim can pass it
      rec->outside_write = true;
    }
    Status drained = fs_.DrainForExternal(*rec->pinned);
    if (!drained.ok()) {
      FinishRecord(*rec);
      return drained;
    }
  }
  // GPU buffers go through the handle's GdsHandle, which reopens `fd` itself.
  if (gds == nullptr) {
    // A user's data is written as the user (dnvme/identity.h): the file system stops
    // it at the space users may take, and the kernel applies its own set-ID rules.
    std::shared_ptr<const FsIdentity> who;
    if (write && caller.uid != 0 && geteuid() == 0) {
      who = std::make_shared<const FsIdentity>(IdentityOf(caller));
    }
    auto file = h.engine->adopt_fd(fd.get(), write ? FileAccess::kWrite : FileAccess::kRead, who);
    if (!file.ok()) {
      FinishRecord(*rec);
      return file.status();
    }
    rec->file = std::move(file).value();
  }
  char* buf = (map != nullptr ? map->data() : gbuf->data) + r.buffer_offset;
  CtlCounters& cc = fs_.ctl_counters();

  if (!r.async) {
    Status st2;
    if (gds != nullptr) {
      st2 = write ? gds->sync_pwrite(buf, r.length, fd.get(), r.file_offset)
                  : gds->sync_pread(buf, r.length, fd.get(), r.file_offset);
    } else {
      st2 = write ? h.engine->sync_pwrite(buf, r.length, rec->file, r.file_offset)
                  : h.engine->sync_pread(buf, r.length, rec->file, r.file_offset);
    }
    if (st2.ok() && map != nullptr && map->revoked()) {
      st2 = CtlError(EFAULT, "buffer " + std::to_string(r.buffer) +
                                 " was shrunk by its owner during the transfer");
    }
    FinishRecord(*rec);
    if (!st2.ok()) {
      cc.ops_failed.fetch_add(1, std::memory_order_relaxed);
      return st2;
    }
    (write ? cc.ops_written : cc.ops_read).fetch_add(1, std::memory_order_relaxed);
    (write ? cc.bytes_written : cc.bytes_read)
        .fetch_add(static_cast<uint64_t>(r.length), std::memory_order_relaxed);
    return json{{"bytes", r.length}, {"op_id", rec->op_id}}.dump();
  }

  {
    std::lock_guard hl(h.m);
    h.ops.push_back(rec);
    ++h.running;
  }
  CtlHandle* hp = &h;
  Completion done = [hp, rec, &cc](const OpResult& res) {
    {
      std::lock_guard hl(hp->m);
      rec->bytes_done = res.bytes_done;
      rec->status = res.status;
      if (rec->status.ok() && rec->buffer != nullptr && rec->buffer->revoked()) {
        rec->status =
            Status::IoError(EFAULT, "the buffer was shrunk by its owner during the transfer");
      }
      if (rec->status.ok()) {
        (rec->write ? cc.ops_written : cc.ops_read).fetch_add(1, std::memory_order_relaxed);
        (rec->write ? cc.bytes_written : cc.bytes_read)
            .fetch_add(static_cast<uint64_t>(rec->length), std::memory_order_relaxed);
      } else {
        cc.ops_failed.fetch_add(1, std::memory_order_relaxed);
      }
      --hp->running;
    }
    hp->cv.notify_all();
  };
  Status sub;
  if (gds != nullptr) {
    sub = write ? gds->submit_pwrite(buf, r.length, fd.get(), r.file_offset, done)
                : gds->submit_pread(buf, r.length, fd.get(), r.file_offset, done);
  } else {
    sub = write ? h.engine->submit_pwrite(buf, r.length, rec->file, r.file_offset, done)
                : h.engine->submit_pread(buf, r.length, rec->file, r.file_offset, done);
  }
  if (!sub.ok()) {
    {
      std::lock_guard hl(h.m);
      --h.running;
      h.ops.pop_back();
    }
    FinishRecord(*rec);
    return sub;
  }
  return json{{"op_id", rec->op_id}, {"async", true}}.dump();
}

Result<std::string> CtlSession::Fsync(const CtlRequest& r, const Caller& caller) {
  UniqueFd fd;
  {
    DNVME_ASSIGN_OR_RETURN(auto as, AsCaller::Enter(caller));
    const std::string rel = r.path.empty() ? "." : r.path;
    auto opened = OpenKindBeneath(fs_.root_fd(), rel, O_RDONLY, FileKind::kRegularOrDirectory);
    if (!opened.ok() && opened.status().error_number() == EACCES) {
      opened = OpenKindBeneath(fs_.root_fd(), rel, O_WRONLY, FileKind::kRegularOrDirectory);
    }
    if (!opened.ok()) return opened.status();
    fd = std::move(opened).value();
  }
  struct stat st {};
  if (fstat(fd.get(), &st) != 0) return Status::FromErrno(errno, "fstat '" + r.path + "'");
  if (S_ISREG(st.st_mode)) {
    Inode* in = fs_.PinInode(st.st_dev, st.st_ino);
    if (in != nullptr) {
      Status drained = fs_.DrainForExternal(*in);
      fs_.Unpin(in);
      DNVME_RETURN_IF_ERROR(drained);
    }
  }
  if (fsync(fd.get()) != 0) return Status::FromErrno(errno, "fsync '" + r.path + "'");
  return std::string("{}");
}

}  // namespace dnvme::fs
