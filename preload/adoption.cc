// Adoption (adoption.h).
#include "preload/adoption.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <mutex>
#include <string>

#include "dnvme/log.h"
#include "preload/broker_client.h"
#include "preload/counters.h"
#include "preload/descriptor_state.h"
#include "preload/descriptor_table.h"
#include "preload/lease.h"
#include "preload/libc.h"
#include "preload/mounts.h"
#include "preload/settings.h"
#include "preload/staging.h"

namespace dnvme::preload {
namespace {

// The broker connection of the mount `fd` (with device `dev`) is on, connecting at the first
// file of a mount; null when the file is not on an allowed dnvmefs mount with a broker.
std::shared_ptr<BrokerConnection> BrokerFor(dev_t dev) {
  if (auto conn = ConnectionOf(dev)) return conn;
  MountInfo m;
  if (!Mounts().find_mount(dev, &m) || !MountAllowed(m.point)) return nullptr;
  std::shared_ptr<BrokerConnection> conn = ConnectToBroker(m.point);
  if (!conn) return nullptr;
  std::shared_ptr<BrokerConnection> kept = KeepConnection(dev, conn);
  if (kept != conn) CloseBrokerConnection(*conn);  // another thread connected first
  return kept;
}

// Asks the broker to open `rel` (the path inside the mount) as this process: Ok with the
// backing file's descriptors in fds[0] (buffered) and fds[1] (direct, when there is one).
Status OpenAtBroker(BrokerConnection& conn, const std::string& rel, ino_t ino, int flags,
                    broker::Reply* rep, int fds[2], int* nfds) {
  broker::Request req;
  req.op = static_cast<uint32_t>(broker::Op::kOpen);
  req.ino = ino;
  req.flags = static_cast<uint32_t>(flags & O_ACCMODE);
  req.path_len = static_cast<uint32_t>(rel.size());
  std::memcpy(req.path, rel.data(), rel.size());
  Status s;
  {
    std::lock_guard lock(conn.mu);
    s = CallBroker(conn, req, rep, fds, 2, nfds);
  }
  for (int i = 0; i < *nfds; ++i) SetState(fds[i], kNotOurs);  // the engine's, not the program's
  if (s.ok() && *nfds != ((rep->flags & broker::kHasDirect) ? 2 : 1)) {
    s = Status::IoError(EPROTO, "broker sent " + std::to_string(*nfds) + " descriptors");
  }
  // The slot indexes the lease page (kMaxLeases words): one past it would make every later
  // coherence check of the file read, and every write count into, memory that is not the page.
  // A bad slot is a daemon that does not speak our protocol: the file stays on the mount, and
  // the lease it granted is given back so its table does not keep it.
  if (s.ok() && rep->slot >= broker::kMaxLeases) {
    s = Status::IoError(EPROTO, "broker sent lease slot " + std::to_string(rep->slot) +
                                    ", past the " + std::to_string(broker::kMaxLeases) +
                                    " words of its lease page");
    broker::Request close_req;
    close_req.op = static_cast<uint32_t>(broker::Op::kClose);
    close_req.lease = rep->lease;
    close_req.length = -1;  // nothing written
    broker::Reply close_rep;
    std::lock_guard lock(conn.mu);
    if (Status c = CallBroker(conn, close_req, &close_rep, nullptr, 0, nullptr); !c.ok()) {
      dnvme::Logger().debug("dnvme run: giving back a lease: {}", c.ToString());
    }
  }
  if (!s.ok()) {
    for (int i = 0; i < *nfds; ++i) Libc().close(fds[i]);
  }
  return s;
}

}  // namespace

std::shared_ptr<AdoptedFile> Adopt(int fd) {
  if (!PreloadSettings().enabled) {
    SetState(fd, kNotOurs);
    return nullptr;
  }
  struct stat st {};
  if (!Mounts().on_fuse(fd) || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    SetState(fd, kNotOurs);
    return nullptr;
  }
  const int flags = Libc().fcntl(fd, F_GETFL);
  if (flags < 0 || (flags & O_APPEND) || (flags & O_PATH)) {
    SetState(fd, kNotOurs);
    return nullptr;
  }
  if (auto same = ShareWithDuplicate(fd)) return same;
  std::shared_ptr<BrokerConnection> conn = BrokerFor(st.st_dev);
  if (!conn) {
    SetState(fd, kNotOurs);
    return nullptr;
  }
  // The path inside the mount, as the kernel resolved it for this descriptor.
  char link[PATH_MAX + 1];
  const std::string proc = "/proc/self/fd/" + std::to_string(fd);
  ssize_t n = readlink(proc.c_str(), link, PATH_MAX);
  if (n <= 0) {
    SetState(fd, kNotOurs);
    return nullptr;
  }
  std::string path(link, static_cast<size_t>(n));
  const std::string prefix = conn->mountpoint == "/" ? "/" : conn->mountpoint + "/";
  if (path.compare(0, prefix.size(), prefix) != 0 ||
      (path.size() > 10 && path.compare(path.size() - 10, 10, " (deleted)") == 0)) {
    SetState(fd, kNotOurs);
    return nullptr;
  }
  const std::string rel = path.substr(prefix.size());
  AioHandle* engine = Engine();
  if (engine == nullptr || rel.size() >= broker::kMaxPath) {
    SetState(fd, kNotOurs);
    return nullptr;
  }
  broker::Reply rep;
  int fds[2] = {-1, -1};
  int nfds = 0;
  if (Status s = OpenAtBroker(*conn, rel, st.st_ino, flags, &rep, fds, &nfds); !s.ok()) {
    ProcessCounters().refused.fetch_add(1, std::memory_order_relaxed);
    dnvme::Logger().debug("dnvme run: '{}' stays on the mount: {}", dnvme::LogEscape(path),
                          dnvme::LogEscape(s.ToString()));
    SetState(fd, kNotOurs);
    return nullptr;
  }
  auto f = std::make_shared<AdoptedFile>();
  f->conn = conn;
  f->lease = rep.lease;
  f->word = &conn->page[rep.slot];
  const int acc = flags & O_ACCMODE;
  f->can_read = acc != O_WRONLY;
  f->can_write = acc != O_RDONLY;
  f->data.Open(&f->open, /*read_only=*/!f->can_write);
  const auto access = acc == O_RDONLY   ? FileAccess::kRead
                      : acc == O_WRONLY ? FileAccess::kWrite
                                        : FileAccess::kReadWrite;
  auto file = engine->adopt_fds(nfds == 2 ? fds[1] : -1, fds[0], access, path);
  f->witness = Libc().fcntl(fd, F_DUPFD_CLOEXEC, 0);
  SetState(f->witness, kNotOurs);
  if (!file.ok() || f->witness < 0) {
    dnvme::Logger().warn(
        "dnvme run: '{}' stays on the mount: {}", dnvme::LogEscape(path),
        dnvme::LogEscape(file.ok() ? std::string(std::strerror(errno)) : file.status().ToString()));
    EndLease(*f);
    SetState(fd, kNotOurs);
    return nullptr;
  }
  f->file = std::move(file).value();
  ProcessCounters().adopted.fetch_add(1, std::memory_order_relaxed);
  AddAdopted(fd, f);
  return f;
}

std::shared_ptr<AdoptedFile> AdoptedForTransfer(int fd) {
  const DescriptorState s = StateOf(fd);
  if (s == kNotOurs) return nullptr;
  if (s == kUnknown) return Adopt(fd);
  auto f = LookupAdopted(fd);
  if (!f) return nullptr;
  // Still the same open file? (fclose and close_range close behind our back.)
  if (!SameOpenFile(fd, f->witness)) {
    ProcessCounters().stale.fetch_add(1, std::memory_order_relaxed);
    (void)DropDescriptor(fd);  // the old open file is closed: its error has no one to hear it
    return Adopt(fd);
  }
  return f;
}

}  // namespace dnvme::preload
