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
#include <system_error>
#include <thread>
#include <vector>

#include "dnvme/broker.h"
#include "dnvme/log.h"
#include "fs/broker/connection.h"
#include "fs/broker/leases.h"
#include "fs/control/as_caller.h"
#include "fs/control/control.h"

namespace dnvme::fs {

namespace {

// Refused connections wait this long at most for the client to read why (Broker::Refuse), and
// this many at most at once (the oldest goes first).
constexpr auto kRefusedLinger = std::chrono::seconds(2);
constexpr size_t kMaxRefused = 64;
// Reads and drops what a refused client sent (its hello): a unix socket closed with unread data
// resets the peer, whose next recv then fails with ECONNRESET instead of reading the reply that
// says why it was refused.
void DiscardPending(int sock) {
  char scrap[64];
  while (recv(sock, scrap, sizeof(scrap), MSG_DONTWAIT | MSG_TRUNC) > 0) {
  }
}
}  // namespace

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

Status Broker::Admit(uid_t uid, UidCharge* charge, UidCharge* fds) {
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
  DNVME_ASSIGN_OR_RETURN(*fds, core_.uid_limits().ChargeFds(uid, Conn::kConnFds, FdUse::kOther));
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
        DNVME_LOG_THROTTLED(warn, "broker accept: {}", std::strerror(errno));
      }
      continue;
    }
    auto c = std::make_unique<Conn>();
    c->sock.Reset(s);
    ucred cred{};
    socklen_t clen = sizeof(cred);
    if (getsockopt(s, SOL_SOCKET, SO_PEERCRED, &cred, &clen) != 0) {
      DNVME_LOG_THROTTLED(warn, "broker: SO_PEERCRED: {}", std::strerror(errno));
      continue;
    }
    if (Status why = Admit(cred.uid, &c->charge, &c->fds); !why.ok()) {
      DNVME_LOG_THROTTLED(warn, "broker: refusing pid {} uid {}: {}", cred.pid, cred.uid,
                          why.message());
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
    // Supplementary groups as they were at connect (SO_PEERGROUPS, Linux 4.13). Fails closed:
    // a client whose groups cannot be read is refused, never served with a guess (the buffer's
    // unwritten entries would read as group 0).
    auto groups = PeerGroups(s);
    if (!groups.ok()) {
      DNVME_LOG_THROTTLED(warn, "broker: refusing pid {} uid {}: {}", cred.pid, cred.uid,
                          groups.status().message());
      counters_.refused.fetch_add(1);
      Refuse(std::move(c->sock), groups.status());
      continue;
    }
    c->peer.groups = std::move(groups).value();
    std::lock_guard lock(mu_);
    c->id = next_conn_++;
    Conn* raw = c.get();
    try {
      raw->thread = std::thread([this, raw] { Serve(raw); });
    } catch (const std::system_error& e) {
      // No thread to be had (RLIMIT_NPROC, memory): this client is refused, the daemon goes on.
      DNVME_LOG_THROTTLED(warn, "broker: refusing pid {} uid {}: no thread for it: {}", cred.pid,
                          cred.uid, e.what());
      counters_.refused.fetch_add(1);
      Refuse(std::move(c->sock), Status::ResourceExhausted(EAGAIN,
                                                           "the daemon has no thread "
                                                           "for another connection"));
      continue;  // `c` returns its charges
    }
    if (cred.uid != 0) ++user_conns_;
    conns_.push_back(std::move(c));
    counters_.connections.fetch_add(1);
    counters_.connections_open.fetch_add(1);
  }
}

Result<std::vector<gid_t>> Broker::PeerGroups(int sock) {
  std::vector<gid_t> groups(64);
  for (int attempt = 0; attempt < 2; ++attempt) {
    socklen_t glen = static_cast<socklen_t>(groups.size() * sizeof(gid_t));
    if (getsockopt(sock, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &glen) == 0) {
      groups.resize(glen / sizeof(gid_t));
      return groups;
    }
    if (errno != ERANGE) break;
    groups.resize(glen / sizeof(gid_t));  // glen: the size needed
  }
  return Status::FromErrno(errno, "reading the client's groups (SO_PEERGROUPS)");
}

}  // namespace dnvme::fs
