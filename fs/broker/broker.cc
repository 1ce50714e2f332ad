#include "fs/broker/broker.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <iterator>
#include <map>
#include <random>
#include <vector>

#include "dnvme/broker.h"
#include "engine/common/log.h"
#include "fs/broker/leases.h"
#include "fs/control/as_caller.h"
#include "fs/control/control.h"

namespace dnvme::fs {

namespace {

// Refused connections wait this long at most for the client to read why (Broker::Refuse), and
// this many at most at once (the oldest goes first).
constexpr auto kRefusedLinger = std::chrono::seconds(2);
constexpr size_t kMaxRefused = 64;

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

// Sends one message with up to two descriptors.
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

// Reads and drops what a refused client sent (its hello): a unix socket closed with unread data
// resets the peer, whose next recv then fails with ECONNRESET instead of reading the reply that
// says why it was refused.
void DiscardPending(int sock) {
  char scrap[64];
  while (recv(sock, scrap, sizeof(scrap), MSG_DONTWAIT | MSG_TRUNC) > 0) {
  }
}

broker::Reply ErrorReply(const Status& st) {
  broker::Reply r;
  r.error = st.ErrnoOr();
  std::snprintf(r.message, sizeof(r.message), "%s", st.message().c_str());
  return r;
}

}  // namespace

// One client connection: its peer, its lease page and its leases.
struct Broker::Conn {
  uint64_t id = 0;
  UniqueFd sock;
  Caller peer;
  UniqueFd page_fd;
  broker::LeaseWord* page = nullptr;
  struct Lease {
    Inode* inode = nullptr;
    uint32_t slot = 0;
  };
  std::map<uint64_t, Lease> leases;  // touched by the serving thread only
  std::vector<bool> slot_used = std::vector<bool>(broker::kMaxLeases, false);
  uint64_t next_lease = 1;
  std::thread thread;
  std::atomic<bool> finished{false};
  UidCharge charge;  // its place in the peer uid's broker_max_conns_per_uid

  ~Conn() {
    if (page != nullptr) munmap(page, broker::kLeasePageBytes);
  }
};

Broker::Broker(BrokerCore& core) : core_(core) {}

Result<std::unique_ptr<Broker>> Broker::Start(BrokerCore& core) {
  auto b = std::unique_ptr<Broker>(new Broker(core));
  int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0) return Status::FromErrno(errno, "broker socket");
  b->listen_.Reset(fd);
  std::random_device rd;
  char name[64];
  std::snprintf(name, sizeof(name), "dnvmefs.%d.%08x%08x", static_cast<int>(getpid()), rd(), rd());
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const size_t len = std::strlen(name);
  std::memcpy(addr.sun_path + 1, name, len);  // abstract: leading NUL, no file to leave behind
  const socklen_t alen = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + len);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), alen) != 0) {
    return Status::FromErrno(errno, std::string("broker bind @") + name);
  }
  if (listen(fd, 64) != 0) return Status::FromErrno(errno, "broker listen");
  int ev = eventfd(0, EFD_CLOEXEC);
  if (ev < 0) return Status::FromErrno(errno, "broker eventfd");
  b->stop_event_.Reset(ev);
  b->name_ = std::string("@") + name;
  b->acceptor_ = std::thread([p = b.get()] { p->AcceptLoop(); });
  Logger().info("preload broker listening on {}", b->name_);
  return b;
}

Broker::~Broker() {
  // Nothing joined below can block for ever: the acceptor wakes on the eventfd, and every
  // connection thread is woken out of recv/sendmsg by shutdown(2) (see the thread contract).
  stopping_.store(true);
  uint64_t one = 1;
  if (stop_event_.valid() && write(stop_event_.get(), &one, sizeof(one)) != sizeof(one)) {
    Logger().error("broker: waking the acceptor: {}", std::strerror(errno));
  }
  if (acceptor_.joinable()) acceptor_.join();
  {
    std::lock_guard lock(mu_);
    for (auto& c : conns_) (void)shutdown(c->sock.get(), SHUT_RDWR);
  }
  ReapFinished(/*all=*/true);
}

std::string Broker::Announcement() const {
  return "protocol " + std::to_string(broker::kProtocol) + "\nsocket " + name_ + "\n";
}

std::string Broker::StatsJson() const {
  auto v = [](const std::atomic<uint64_t>& a) { return std::to_string(a.load()); };
  return "{\"socket\": \"" + name_ + "\", \"connections\": " + v(counters_.connections) +
         ", \"connections_open\": " + v(counters_.connections_open) +
         ", \"requests\": " + v(counters_.requests) + ", \"refused\": " + v(counters_.refused) +
         ", \"leases\": " + v(counters_.leases) + ", \"leases_open\": " + v(counters_.leases_open) +
         ", \"invalidations\": " + v(counters_.invalidations) +
         ", \"drains\": " + v(counters_.drains) + "}";
}

void Broker::ReapFinished(bool all) {
  std::list<std::unique_ptr<Conn>> done;
  {
    std::lock_guard lock(mu_);
    for (auto it = conns_.begin(); it != conns_.end();) {
      if (all || (*it)->finished.load()) {
        done.push_back(std::move(*it));
        it = conns_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& c : done) {
    if (c->thread.joinable()) c->thread.join();
  }
}

Status Broker::Admit(uid_t uid, UidCharge* charge) {
  {
    std::lock_guard lock(mu_);
    const size_t open = counters_.connections_open.load();
    if (open >= kMaxConnections) {
      return Status::ResourceExhausted(EMFILE, "the broker has " + std::to_string(open) +
                                                   " connections open, the most it takes");
    }
    if (uid != 0 && user_conns_ >= kMaxUserConnections) {
      return Status::ResourceExhausted(
          EMFILE, "users other than root have " + std::to_string(user_conns_) +
                      " broker connections open, the most the broker takes for them");
    }
  }
  DNVME_ASSIGN_OR_RETURN(*charge, core_.uid_limits().Charge(uid, UidResource::kBrokerConns));
  return Status::Ok();
}

void Broker::Refuse(UniqueFd sock, const Status& why) {
  // A fresh socket's send buffer is empty: this cannot block, and must not.
  const int fl = fcntl(sock.get(), F_GETFL);
  if (fl >= 0) (void)fcntl(sock.get(), F_SETFL, fl | O_NONBLOCK);
  (void)SendReply(sock.get(), ErrorReply(why), nullptr, 0);
  (void)shutdown(sock.get(), SHUT_WR);
  if (refused_.size() >= kMaxRefused) refused_.pop_front();
  refused_.push_back({std::move(sock), std::chrono::steady_clock::now() + kRefusedLinger});
}

void Broker::CloseRefused(bool all) {
  const auto now = std::chrono::steady_clock::now();
  refused_.remove_if([&](Refused& r) {
    if (!all && r.until > now) return false;
    DiscardPending(r.sock.get());
    return true;
  });
}

void Broker::AcceptLoop() {
  while (!stopping_.load()) {
    std::vector<pollfd> p = {{listen_.get(), POLLIN, 0}, {stop_event_.get(), POLLIN, 0}};
    for (const Refused& r : refused_) p.push_back({r.sock.get(), POLLIN, 0});
    int n = poll(p.data(), p.size(), refused_.empty() ? 1000 : 250);
    if (n < 0) {
      if (errno == EINTR) continue;
      Logger().error("broker poll: {}", std::strerror(errno));
      return;
    }
    ReapFinished(false);
    if (stopping_.load() || (p[1].revents & POLLIN)) return;
    // A refused client that sent its hello (or went away) has the reason in its socket already.
    size_t i = 2;
    for (auto it = refused_.begin(); it != refused_.end(); ++i) {
      if (p[i].revents == 0) {
        ++it;
        continue;
      }
      DiscardPending(it->sock.get());
      it = refused_.erase(it);
    }
    CloseRefused(false);
    if (!(p[0].revents & POLLIN)) continue;
    int s = accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC);
    if (s < 0) {
      if (errno != EINTR && errno != EAGAIN && errno != ECONNABORTED) {
        Logger().warn("broker accept: {}", std::strerror(errno));
      }
      continue;
    }
    auto c = std::make_unique<Conn>();
    c->sock.Reset(s);
    ucred cred{};
    socklen_t clen = sizeof(cred);
    if (getsockopt(s, SOL_SOCKET, SO_PEERCRED, &cred, &clen) != 0) {
      Logger().warn("broker: SO_PEERCRED: {}", std::strerror(errno));
      continue;
    }
    if (Status why = Admit(cred.uid, &c->charge); !why.ok()) {
      Logger().warn("broker: refusing pid {} uid {}: {}", cred.pid, cred.uid, why.message());
      counters_.refused.fetch_add(1);
      Refuse(std::move(c->sock), why);
      continue;
    }
    // A client that stops reading its replies cannot hold the connection's thread for ever.
    const timeval send_timeout{kSendTimeoutSec, 0};
    (void)setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &send_timeout, sizeof(send_timeout));
    c->peer.uid = cred.uid;
    c->peer.gid = cred.gid;
    c->peer.pid = cred.pid;
    // Supplementary groups as they were at connect (SO_PEERGROUPS, Linux 4.13).
    std::vector<gid_t> groups(64);
    socklen_t glen = static_cast<socklen_t>(groups.size() * sizeof(gid_t));
    if (getsockopt(s, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &glen) != 0 && errno == ERANGE) {
      groups.resize(glen / sizeof(gid_t));
      glen = static_cast<socklen_t>(groups.size() * sizeof(gid_t));
      if (getsockopt(s, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &glen) != 0) glen = 0;
    }
    groups.resize(glen / sizeof(gid_t));
    c->peer.groups = std::move(groups);
    std::lock_guard lock(mu_);
    if (cred.uid != 0) ++user_conns_;
    c->id = next_conn_++;
    Conn* raw = c.get();
    conns_.push_back(std::move(c));
    counters_.connections.fetch_add(1);
    counters_.connections_open.fetch_add(1);
    raw->thread = std::thread([this, raw] { Serve(raw); });
  }
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
          // Never blocks (OpenBeneath opens O_NONBLOCK): a FIFO is refused below, not waited on.
          auto d = OpenBeneath(core_.root_fd(), rel, acc | O_DIRECT | O_NOFOLLOW, 0);
          if (d.ok()) {
            direct = std::move(d.value());
          } else if (d.status().error_number() != EINVAL) {
            st = d.status();
          }
          if (st.ok()) {
            auto b = OpenBeneath(core_.root_fd(), rel, acc | O_NOFOLLOW, 0);
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
      if (st.ok()) {
        // Land what writers left in write-behind, and make every cached view (read-ahead, the
        // kernel's pages and attributes) go back to the file: from now on bytes may reach it
        // around the mount. Attributes are then answered uncached while the lease lives.
        st = core_.DrainForExternal(*in);
        if (st.ok()) {
          PreloadLeases& leases = core_.LeasesOf(*in);
          broker::LeaseWord& w = c->page[slot];
          w.shared.store(0);
          w.mount_dirty.store(0);
          w.writes_inflight.store(0);
          const bool other_client = leases.Add(c->id, c->peer.uid, &w, acc != O_RDONLY);
          // Another client's writes that returned to its program land before this one reads
          // the file (Add marked the holders shared first: include/dnvme/broker.h).
          if (other_client && !leases.WaitForWrites(/*share_if_busy=*/false)) {
            Logger().warn("broker: another client's writes of '{}' did not land in {} ms", rel,
                          PreloadLeases::kWriteWait.count());
          }
          // Opens through the mount beyond this client's leases: someone else has it open.
          if (!other_client && core_.OpenCount(*in) > leases.count()) w.shared.store(1);
          core_.AfterExternalWrite(*in);
          counters_.invalidations.fetch_add(1);
          c->slot_used[slot] = true;
          const uint64_t id = c->next_lease++;
          c->leases[id] = Conn::Lease{in, slot};
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
      } else if (op == broker::Op::kWrote) {
        core_.AfterExternalWrite(*it->second.inode);
        counters_.invalidations.fetch_add(1);
      } else {
        release(it->second, req.length >= 0);
        c->leases.erase(it);
      }
    } else {
      st = Status::InvalidArgument("unknown broker op " + std::to_string(req.op));
    }
    if (!st.ok()) {
      rep = ErrorReply(st);
      nfds = 0;
      counters_.refused.fetch_add(1);
      Logger().debug("broker: pid {} uid {}: {}", c->peer.pid, c->peer.uid, st.ToString());
    }
    if (Status s = SendReply(c->sock.get(), rep, fds, nfds); !s.ok()) {
      Logger().debug("broker: pid {}: {}", c->peer.pid, s.ToString());
      break;
    }
  }
  // The client is gone (closed, exited or killed): whatever it wrote around the mount is in the
  // backing file; make every cached view of its files go back to it.
  // (Not at unmount: the session is going away, nothing is cached any more.)
  for (auto& [id, lease] : c->leases) release(lease, /*invalidate=*/!stopping_.load());
  c->leases.clear();
  c->charge.Reset();
  {
    std::lock_guard lock(mu_);
    if (c->peer.uid != 0) --user_conns_;
  }
  counters_.connections_open.fetch_sub(1);
  c->finished.store(true);
}

}  // namespace dnvme::fs
