// A broker connection's requests, served in order on the connection's thread (Broker::Serve):
// hello (the lease page), open (the two descriptors of a backing file, opened as the peer, and a
// lease), wrote, drain and close; and the replies, with the descriptors they carry.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

#include "dnvme/broker.h"
#include "dnvme/log.h"
#include "fs/broker/broker.h"
#include "fs/broker/connection.h"
#include "fs/broker/leases.h"
#include "fs/control/as_caller.h"
#include "fs/control/control.h"

namespace dnvme::fs {

namespace {

// Clears O_NONBLOCK (OpenBeneath sets it so that opening never blocks) before a descriptor goes to
// a client, whose reads and writes of a regular file must not see it.
Status ClearNonBlock(int fd) {
  const int fl = fcntl(fd, F_GETFL);
  if (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0) {
    return Status::FromErrno(errno, "clearing O_NONBLOCK");
  }
  return Status::Ok();
}

// A request's path: relative to the mount root, no "..", nothing under .dnvme. The kernel's
// openat2(RESOLVE_BENEATH) is the real fence; this refuses early with a clear reason.
Status CheckPath(const std::string& rel) {
  if (rel.empty()) return Status::InvalidArgument("empty path");
  if (rel[0] == '/') return Status::InvalidArgument("'" + rel + "' is not relative to the mount");
  size_t start = 0;
  bool first = true;
  while (start <= rel.size()) {
    size_t slash = rel.find('/', start);
    if (slash == std::string::npos) slash = rel.size();
    const std::string part = rel.substr(start, slash - start);
    if (part == "..") return Status::InvalidArgument("'" + rel + "' has a '..' component");
    if (first && part == ".dnvme") {
      return Status::InvalidArgument("'" + rel + "' is a control file");
    }
    first = false;
    start = slash + 1;
  }
  return Status::Ok();
}

// The daemon's write open that keeps file leases off a leased file (PreloadLeases::EnsureGuard),
// made from the client's descriptor `fd` as the daemon. O_APPEND: an append-only file opens for
// writing only so (nothing is ever written through it); never waits for a lease someone already
// holds (ReopenNoWait; O_NONBLOCK kept: nothing reads or writes it). A read-only file system needs
// no guard (no open there can break a lease: they fail EROFS first), so none is made.
// The guard is one of the daemon's descriptors, charged to the client that made it (`uid`): the
// file's leases keep it until the last one ends.
Result<PreloadLeases::Guard> OpenLeaseGuard(UidLimits& limits, uid_t uid, int fd,
                                            const std::string& rel) {
  DNVME_ASSIGN_OR_RETURN(UidCharge charge, limits.ChargeFds(uid, 1, FdUse::kOther));
  UniqueFd g(ReopenNoWait(fd, O_WRONLY | O_APPEND | O_NONBLOCK | O_CLOEXEC | O_NOCTTY));
  if (g.valid()) return PreloadLeases::Guard{std::move(g), std::move(charge)};
  if (errno == EROFS) return PreloadLeases::Guard{};
  const int err = errno;
  return Status::FromErrno(err, "'" + rel + "' cannot be held open for writing by the daemon" +
                                    (err == EWOULDBLOCK ? " (a file lease is held on it)" : "") +
                                    ", which keeps file leases off the descriptors it hands out");
}
}  // namespace

Status SendReply(int sock, const broker::Reply& r, const int* fds, int nfds) {
  struct iovec iov {
    const_cast<broker::Reply*>(&r), sizeof(r)
  };
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(2 * sizeof(int))] = {};
  if (nfds > 0) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(static_cast<size_t>(nfds) * sizeof(int));
    cmsghdr* cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(static_cast<size_t>(nfds) * sizeof(int));
    std::memcpy(CMSG_DATA(cm), fds, static_cast<size_t>(nfds) * sizeof(int));
  }
  ssize_t n;
  do {
    n = sendmsg(sock, &msg, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return Status::FromErrno(errno, "broker reply");
  if (static_cast<size_t>(n) != sizeof(r)) return Status::IoError(EIO, "broker reply cut short");
  return Status::Ok();
}
broker::Reply ErrorReply(const Status& st) {
  broker::Reply r;
  r.error = st.ErrnoOr();
  std::snprintf(r.message, sizeof(r.message), "%s", st.message().c_str());
  return r;
}

void Broker::Serve(Conn* c) {
  auto release = [&](Conn::Lease& l, bool invalidate) {
    PreloadLeases& leases = core_.LeasesOf(*l.inode);
    leases.Remove(&c->page[l.slot]);
    if (invalidate) {
      core_.AfterExternalWrite(*l.inode);
      counters_.invalidations.fetch_add(1);
    }
    core_.Unpin(l.inode);
    c->slot_used[l.slot] = false;
    counters_.leases_open.fetch_sub(1);
  };
  for (;;) {
    broker::Request req;
    ssize_t n;
    do {
      n = recv(c->sock.get(), &req, sizeof(req), 0);
    } while (n < 0 && errno == EINTR);
    if (n <= 0) break;  // the client closed (or died): its leases end below
    counters_.requests.fetch_add(1);
    broker::Reply rep;
    int fds[2] = {-1, -1};
    int nfds = 0;
    UniqueFd direct, buffered;
    Status st;
    const auto op = static_cast<broker::Op>(req.op);
    if (static_cast<size_t>(n) != sizeof(req) || req.magic != broker::kMagic) {
      st = Status::InvalidArgument("malformed broker request");
    } else if (op == broker::Op::kHello) {
      if (c->page == nullptr) {
        // The client gets this descriptor read-write (it counts its writes in flight in the
        // page). Sealed against resizing: a client that shrank the memfd would make the daemon's
        // next store to the page fault (SIGBUS) and take the mount down for every user.
        int mfd = memfd_create("dnvmefs-leases", MFD_CLOEXEC | MFD_ALLOW_SEALING);
        if (mfd < 0) {
          st = Status::FromErrno(errno, "memfd_create");
        } else {
          c->page_fd.Reset(mfd);
          if (ftruncate(mfd, static_cast<off_t>(broker::kLeasePageBytes)) != 0) {
            st = Status::FromErrno(errno, "ftruncate of the lease page");
          } else if (fcntl(mfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
            st = Status::FromErrno(errno, "sealing the lease page");
          } else {
            void* p =
                mmap(nullptr, broker::kLeasePageBytes, PROT_READ | PROT_WRITE, MAP_SHARED, mfd, 0);
            if (p == MAP_FAILED) {
              st = Status::FromErrno(errno, "mmap of the lease page");
            } else {
              c->page = static_cast<broker::LeaseWord*>(p);
            }
          }
        }
      }
      if (st.ok()) {
        rep.flags = broker::kProtocol;
        fds[0] = c->page_fd.get();
        nfds = 1;
      }
    } else if (c->page == nullptr) {
      st = Status::InvalidArgument("broker request before hello");
    } else if (op == broker::Op::kOpen) {
      const std::string rel(req.path, std::min<size_t>(req.path_len, broker::kMaxPath));
      const int acc = static_cast<int>(req.flags) & O_ACCMODE;
      uint32_t slot = 0;
      while (slot < broker::kMaxLeases && c->slot_used[slot]) ++slot;
      st = CheckPath(rel);
      if (st.ok() && req.path_len > broker::kMaxPath) st = Status::InvalidArgument("path too long");
      if (st.ok() && acc != O_RDONLY && acc != O_WRONLY && acc != O_RDWR) {
        st = Status::InvalidArgument("bad access mode");
      }
      if (st.ok() && slot == broker::kMaxLeases) {
        st = Status::ResourceExhausted(
            EMFILE, "this connection holds " + std::to_string(broker::kMaxLeases) + " leases");
      }
      if (st.ok()) {
        // Opened as the peer: the kernel decides, as it did for the peer's open of the mount.
        auto as = AsCaller::Enter(c->peer);
        if (!as.ok()) {
          st = as.status();
        } else {
          // Only a regular file is opened at all (OpenKindBeneath): a FIFO is neither waited on
          // nor a device's open run for the peer.
          auto d = OpenKindBeneath(core_.root_fd(), rel, acc | O_DIRECT);
          if (d.ok()) {
            direct = std::move(d.value());
          } else if (d.status().error_number() != EINVAL) {
            st = d.status();
          }
          if (st.ok()) {
            auto b = OpenKindBeneath(core_.root_fd(), rel, acc);
            if (b.ok()) {
              buffered = std::move(b.value());
            } else {
              st = b.status();
            }
          }
        }
      }
      struct stat sb {};
      if (st.ok() && fstat(buffered.get(), &sb) != 0) st = Status::FromErrno(errno, "fstat");
      if (st.ok() && !S_ISREG(sb.st_mode)) {
        st = Status::InvalidArgument("'" + rel + "' is not a regular file");
      }
      if (st.ok() && sb.st_ino != req.ino) {
        st = Status::IoError(ESTALE, "'" + rel + "' is no longer the file the client has open");
      }
      // The two opens resolved the name twice: both must be the one file checked.
      struct stat sd {};
      if (st.ok() && direct.valid() &&
          (fstat(direct.get(), &sd) != 0 || sd.st_dev != sb.st_dev || sd.st_ino != sb.st_ino)) {
        st = Status::IoError(ESTALE, "'" + rel + "' changed while it was being opened");
      }
      if (st.ok()) st = ClearNonBlock(buffered.get());
      if (st.ok() && direct.valid()) st = ClearNonBlock(direct.get());
      Inode* in = nullptr;
      if (st.ok()) {
        in = core_.PinInode(sb.st_dev, sb.st_ino);
        if (in == nullptr) st = Status::IoError(ESTALE, "'" + rel + "' is not open on the mount");
      }
      bool other_client = false;  // another connection holds a lease of the file
      if (st.ok()) {
        // Land what writers left in write-behind; for a writable lease, also make every cached
        // view (read-ahead, the kernel's pages and attributes) go back to the file (below): from
        // now on bytes may reach it around the mount. Attributes are then answered uncached
        // while the lease lives.
        st = core_.DrainForExternal(*in);
        // No file lease can be taken on the descriptors about to be sent (PreloadLeases).
        if (st.ok()) {
          st = core_.LeasesOf(*in).EnsureGuard([this, c, fd = buffered.get(), &rel] {
            return OpenLeaseGuard(core_.uid_limits(), c->peer.uid, fd, rel);
          });
        }
        if (st.ok()) {
          broker::LeaseWord& w = c->page[slot];
          w.shared.store(0);
          w.mount_dirty.store(0);
          w.writes_inflight.store(0);
          st = core_.LeasesOf(*in).Add(c->id, c->peer.uid, &w, acc != O_RDONLY, &other_client);
        }
        if (st.ok()) {
          PreloadLeases& leases = core_.LeasesOf(*in);
          broker::LeaseWord& w = c->page[slot];
          // Another client's writes that returned to its program land before this one reads
          // the file (Add marked the holders shared first: include/dnvme/broker.h).
          if (other_client && !leases.WaitForWrites(/*share_if_busy=*/false)) {
            DNVME_LOG_THROTTLED(warn,
                                "broker: another client's writes of '{}' did not land in {} ms",
                                LogEscape(rel), PreloadLeases::kWriteWait.count());
          }
          // Opens through the mount beyond this client's leases: someone else has it open.
          if (!other_client && core_.OpenCount(*in) > leases.count()) w.shared.store(1);
          // Cached views go only for a lease that may write around the mount: a read-only one
          // changes nothing (the drain above landed what the mount held), and a user who may
          // only read the file must not drop every reader's pages at will, lease after lease.
          if (acc != O_RDONLY) {
            core_.AfterExternalWrite(*in);
            counters_.invalidations.fetch_add(1);
          }
          c->slot_used[slot] = true;
          const uint64_t id = c->next_lease++;
          c->leases[id] = Conn::Lease{in, slot, acc != O_RDONLY};
          counters_.leases.fetch_add(1);
          counters_.leases_open.fetch_add(1);
          rep.lease = id;
          rep.slot = slot;
          rep.size = sb.st_size;
          fds[0] = buffered.get();
          nfds = 1;
          if (direct.valid()) {
            fds[1] = direct.get();
            nfds = 2;
            rep.flags = broker::kHasDirect;
          }
        } else {
          core_.Unpin(in);
        }
      }
    } else if (op == broker::Op::kWrote || op == broker::Op::kDrain || op == broker::Op::kClose) {
      auto it = c->leases.find(req.lease);
      if (it == c->leases.end()) {
        st = Status::InvalidArgument("no lease " + std::to_string(req.lease));
      } else if (op == broker::Op::kDrain) {
        c->page[it->second.slot].mount_dirty.store(0);
        st = core_.DrainForExternal(*it->second.inode);
        counters_.drains.fetch_add(1);
      } else if (op == broker::Op::kWrote && !it->second.writable) {
        st = Status::FromErrno(EBADF, "lease " + std::to_string(req.lease) + " is read-only");
      } else if (op == broker::Op::kWrote) {
        core_.AfterExternalWrite(*it->second.inode);
        counters_.invalidations.fetch_add(1);
      } else {
        release(it->second, req.length >= 0 && it->second.writable);
        c->leases.erase(it);
      }
    } else {
      st = Status::InvalidArgument("unknown broker op " + std::to_string(req.op));
    }
    if (!st.ok()) {
      rep = ErrorReply(st);
      nfds = 0;
      counters_.refused.fetch_add(1);
      // A client sends refused requests at will: throttled, as every line a user causes.
      DNVME_LOG_THROTTLED(debug, "broker: pid {} uid {}: {}", c->peer.pid, c->peer.uid,
                          LogEscape(st.ToString()));
    }
    if (Status s = SendReply(c->sock.get(), rep, fds, nfds); !s.ok()) {
      DNVME_LOG_THROTTLED(debug, "broker: pid {}: {}", c->peer.pid, s.ToString());
      break;
    }
  }
  // The client is gone (closed, exited or killed): whatever it wrote around the mount is in the
  // backing file; make every cached view of its files go back to it.
  // (Not at unmount: the session is going away, nothing is cached any more.)
  for (auto& [id, lease] : c->leases) release(lease, /*invalidate=*/!stopping_.load());
  c->leases.clear();
  c->charge.Reset();
  c->fds.Reset();
  {
    std::lock_guard lock(mu_);
    if (c->peer.uid != 0) --user_conns_;
  }
  counters_.connections_open.fetch_sub(1);
  c->finished.store(true);
}

}  // namespace dnvme::fs
