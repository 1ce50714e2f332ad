// The client side of a mount's descriptor broker (broker_client.h).
#include "preload/broker_client.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>

#include "dnvme/log.h"
#include "preload/descriptor_state.h"
#include "preload/libc.h"

namespace dnvme::preload {

Status CallBroker(BrokerConnection& c, const broker::Request& req, broker::Reply* rep, int* fds,
                  int max_fds, int* nfds) {
  ssize_t n;
  do {
    n = send(c.sock, &req, sizeof(req), MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return Status::FromErrno(errno, "broker request");
  iovec iov{rep, sizeof(*rep)};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(4 * sizeof(int))] = {};
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  do {
    n = recvmsg(c.sock, &msg, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (nfds) *nfds = 0;
  for (cmsghdr* cm = CMSG_FIRSTHDR(&msg); n > 0 && cm != nullptr; cm = CMSG_NXTHDR(&msg, cm)) {
    if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS) continue;
    const int count = static_cast<int>((cm->cmsg_len - CMSG_LEN(0)) / sizeof(int));
    const int* got = reinterpret_cast<const int*>(CMSG_DATA(cm));
    for (int i = 0; i < count; ++i) {
      if (fds && nfds && *nfds < max_fds) {
        fds[(*nfds)++] = got[i];
      } else {
        Libc().close(got[i]);
      }
    }
  }
  if (n < 0) return Status::FromErrno(errno, "broker reply");
  if (n == 0) return Status::IoError(ENOTCONN, "the broker closed the connection (daemon gone?)");
  if (static_cast<size_t>(n) != sizeof(*rep) || rep->magic != broker::kMagic) {
    return Status::IoError(EPROTO, "malformed broker reply");
  }
  if (rep->error != 0) {
    return Status::IoError(rep->error, std::string(rep->message));
  }
  return Status::Ok();
}

bool BrokerGone(BrokerConnection& c) {
  if (c.gone.load(std::memory_order_relaxed)) return true;
  // The daemon's end closes when it exits however it ends (kill -9 included), and its broker
  // shuts every connection down when it stops: the socket then polls as hung up (POLLRDHUP, and
  // POLLHUP once both directions are shut). The protocol has no unsolicited message, so nothing
  // is ever waiting to be read here.
  pollfd p{c.sock, POLLRDHUP, 0};
  int n;
  do {
    n = poll(&p, 1, 0);
  } while (n < 0 && errno == EINTR);
  if (n <= 0 || (p.revents & (POLLHUP | POLLRDHUP | POLLERR | POLLNVAL)) == 0) return false;
  if (!c.gone.exchange(true)) {
    dnvme::Logger().warn(
        "dnvme run: the broker of {} hung up (daemon gone?): writes to its files "
        "fail with ENOTCONN",
        c.mountpoint);
  }
  return true;
}

std::shared_ptr<BrokerConnection> ConnectToBroker(const std::string& point) {
  const std::string announce = point + "/.dnvme/" + broker::kAnnounceFile;
  int fd = Libc().open(announce.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return nullptr;
  char text[512] = {};
  ssize_t n;
  do {
    n = Libc().read(fd, text, sizeof(text) - 1);
  } while (n < 0 && errno == EINTR);
  Libc().close(fd);
  if (n <= 0) return nullptr;  // -o preload=0: empty
  const char* sock_line = std::strstr(text, "socket @");
  if (sock_line == nullptr) return nullptr;
  std::string name(sock_line + 8);
  name = name.substr(0, name.find('\n'));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (name.empty() || name.size() + 1 > sizeof(addr.sun_path)) return nullptr;
  std::memcpy(addr.sun_path + 1, name.data(), name.size());
  auto c = std::make_shared<BrokerConnection>();
  c->mountpoint = point;
  c->sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (c->sock < 0) return nullptr;
  SetState(c->sock, kNotOurs);
  const socklen_t alen = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  if (connect(c->sock, reinterpret_cast<sockaddr*>(&addr), alen) != 0) {
    dnvme::Logger().warn("dnvme run: cannot reach the broker of {}: {}", point,
                         std::strerror(errno));
    Libc().close(c->sock);
    return nullptr;
  }
  broker::Request req;
  req.op = static_cast<uint32_t>(broker::Op::kHello);
  broker::Reply rep;
  int page_fd = -1, nfds = 0;
  Status st = CallBroker(*c, req, &rep, &page_fd, 1, &nfds);
  if (st.ok() && (nfds != 1 || rep.flags != broker::kProtocol)) {
    st = Status::IoError(EPROTO, "broker protocol " + std::to_string(rep.flags));
  }
  if (st.ok()) {
    // Writable: this process keeps its words' writes_inflight (include/dnvme/broker.h).
    void* p =
        mmap(nullptr, broker::kLeasePageBytes, PROT_READ | PROT_WRITE, MAP_SHARED, page_fd, 0);
    if (p == MAP_FAILED) {
      st = Status::FromErrno(errno, "mmap of the lease page");
    } else {
      c->page = static_cast<broker::LeaseWord*>(p);
    }
  }
  if (page_fd >= 0) Libc().close(page_fd);
  if (!st.ok()) {
    dnvme::Logger().warn("dnvme run: broker of {}: {}", point, st.ToString());
    Libc().close(c->sock);
    return nullptr;
  }
  return c;
}

void CloseBrokerConnection(BrokerConnection& c) {
  Libc().close(c.sock);
  munmap(c.page, broker::kLeasePageBytes);
}

}  // namespace dnvme::preload
