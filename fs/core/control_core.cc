// Fs as ControlCore (fs/control/control.h): what the control plane's sessions ask of the core,
// answered by the pieces -- inodes from the InodeTable, the engine configuration from the
// Engines, the kernel's caches through the Mount's session. PinInode, Unpin, DrainForExternal and
// AfterExternalWrite serve the broker (BrokerCore) as well.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "dnvme/fd.h"
#include "dnvme/log.h"
#include "fs/control/as_caller.h"
#include "fs/core/fs.h"

#ifndef DNVME_VERSION
#define DNVME_VERSION "unknown"
#endif

namespace dnvme::fs {

std::string DaemonVersion() { return DNVME_VERSION; }

bool Fs::MayReconfigure(uid_t uid) const { return uid == 0 || uid == geteuid(); }

Result<HandleConfig> Fs::SetEngineConfig(const std::string& json_patch) {
  bool changed = false;
  auto c = mount_.engines().Reconfigure(json_patch, &changed);
  if (changed) ctl_counters_.config_changes.fetch_add(1, std::memory_order_relaxed);
  return c;
}

Status Fs::DrainForExternal(Inode& in) {
  if (!S_ISREG(in.type)) return Status::Ok();
  Status st = in.data.Drain();
  if (!st.ok()) {
    return st.WithContext("data written through the mount earlier did not reach the disk");
  }
  return Status::Ok();
}

// Notifies the kernel: never on a FUSE loop thread (its invalidation waits for READs of the
// inode in flight, which need one): the broker's connection threads, the control lanes and the
// OffLoop notifier call it (fs/core/off_loop.h).
void Fs::AfterExternalWrite(Inode& in) {
  in.data.Invalidate();
  fuse_session* const se = mount_.session();
  if (se == nullptr) return;
  const auto ino = reinterpret_cast<fuse_ino_t>(&in);
  int rc = fuse_lowlevel_notify_inval_inode(se, ino, 0, 0);
  if (rc != 0 && rc != -ENOENT) {
    DNVME_LOG_THROTTLED(warn, "invalidating the kernel cache of inode {} failed: {}", in.ino,
                        std::strerror(-rc));
  }
  // Invalidated attributes are fetched again only by whoever asks for them (stat, lseek
  // SEEK_END); an O_APPEND write takes its offset from the kernel's cached size as it is. Storing
  // the file's last byte (NOTIFY_STORE) moves that size up at once: the kernel extends i_size to
  // the end of a store (of at least one byte), so appends through the mount land after the bytes
  // written around it. (Files shrink only through the mount, whose SETATTR updates the size.)
  struct stat st {};
  if (!S_ISREG(in.type) || fstat(in.fd, &st) != 0 || st.st_size == 0) return;
  // A lease on the file is answered EWOULDBLOCK (the size is then not pushed; the next stat
  // fetches it), never waited for (ReopenNoWait, docs/security.md).
  UniqueFd rd(ReopenNoWait(in.fd, O_RDONLY | O_CLOEXEC | O_NOATIME));
  if (!rd.valid() && errno == EPERM) rd.Reset(ReopenNoWait(in.fd, O_RDONLY | O_CLOEXEC));
  char last = 0;
  if (!rd.valid() || pread(rd.get(), &last, 1, st.st_size - 1) != 1) {
    DNVME_LOG_THROTTLED(warn, "reading the last byte of inode {}: {}", in.ino,
                        std::strerror(errno));
    return;
  }
  fuse_bufvec one = FUSE_BUFVEC_INIT(1);
  one.buf[0].mem = &last;
  rc = fuse_lowlevel_notify_store(se, ino, st.st_size - 1, &one, fuse_buf_copy_flags{});
  if (rc != 0 && rc != -ENOENT) {
    DNVME_LOG_THROTTLED(warn, "pushing the size of inode {} to the kernel failed: {}", in.ino,
                        std::strerror(-rc));
  }
}

void Fs::AfterExternalCreate(const std::string& dir_rel, const std::string& name) {
  fuse_session* const se = mount_.session();
  if (se == nullptr) return;
  fuse_ino_t parent = FUSE_ROOT_ID;
  Inode* pinned = nullptr;
  if (!dir_rel.empty()) {
    // Resolved as the transfer's own open was: no symlink, nothing outside BACKING_DIR (the
    // directory may have been swapped for a link since).
    auto dir = OpenBeneath(inodes_.root_fd(), dir_rel, O_PATH | O_DIRECTORY, 0);
    if (!dir.ok()) return;
    struct stat st {};
    if (fstat(dir.value().get(), &st) != 0) return;
    pinned = inodes_.Pin(st.st_dev, st.st_ino);
    if (pinned == nullptr) return;  // the kernel never saw the directory: nothing cached
    parent = reinterpret_cast<fuse_ino_t>(pinned);
  }
  int rc = fuse_lowlevel_notify_inval_entry(se, parent, name.c_str(), name.size());
  if (rc != 0 && rc != -ENOENT) {
    DNVME_LOG_THROTTLED(warn, "invalidating the kernel entry '{}' failed: {}", name,
                        std::strerror(-rc));
  }
  if (pinned != nullptr) inodes_.Unpin(pinned);
}

}  // namespace dnvme::fs
