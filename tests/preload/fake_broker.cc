// A stand-in for a mount's descriptor broker (fake_broker.h).
#include "tests/preload/fake_broker.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <stdexcept>

namespace dnvme::preload::testing {
namespace {

void Die(const std::string& what) { throw std::runtime_error(what + ": " + std::strerror(errno)); }

// One reply, with `fds` (may be empty) as SCM_RIGHTS.
void SendReply(int conn, const broker::Reply& rep, const std::vector<int>& fds) {
  iovec iov{const_cast<broker::Reply*>(&rep), sizeof(rep)};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(4 * sizeof(int))] = {};
  if (!fds.empty()) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(fds.size() * sizeof(int));
    cmsghdr* cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(fds.size() * sizeof(int));
    std::memcpy(CMSG_DATA(cm), fds.data(), fds.size() * sizeof(int));
  }
  (void)sendmsg(conn, &msg, MSG_NOSIGNAL);
}

}  // namespace

FakeBroker::FakeBroker(const std::string& root) : root_(root) {
  static std::atomic<int> instances{0};
  const std::string name = "dnvme-fake-broker-" + std::to_string(getpid()) + "-" +
                           std::to_string(instances.fetch_add(1));
  listen_fd_ = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (listen_fd_ < 0) Die("socket");
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path + 1, name.data(), name.size());
  const auto len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  if (bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), len) != 0) Die("bind");
  if (listen(listen_fd_, 4) != 0) Die("listen");
  page_fd_ = memfd_create("dnvme-fake-leases", MFD_CLOEXEC);
  if (page_fd_ < 0 || ftruncate(page_fd_, broker::kLeasePageBytes) != 0) Die("memfd");
  void* p = mmap(nullptr, broker::kLeasePageBytes, PROT_READ | PROT_WRITE, MAP_SHARED, page_fd_, 0);
  if (p == MAP_FAILED) Die("mmap");
  page_ = static_cast<broker::LeaseWord*>(p);
  const std::string dir = root_ + "/.dnvme";
  if (mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) Die("mkdir " + dir);
  // As Broker::Announcement (fs/broker/broker.cc) writes it.
  const std::string text =
      "protocol " + std::to_string(broker::kProtocol) + "\nsocket @" + name + "\n";
  FILE* f = std::fopen((dir + "/" + broker::kAnnounceFile).c_str(), "w");
  if (f == nullptr) Die("announce file");
  std::fputs(text.c_str(), f);
  std::fclose(f);
  thread_ = std::thread([this] { Serve(); });
}

FakeBroker::~FakeBroker() {
  shutdown(listen_fd_, SHUT_RDWR);  // wakes accept
  thread_.join();
  close(listen_fd_);
  munmap(page_, broker::kLeasePageBytes);
  close(page_fd_);
}

void FakeBroker::Serve() {
  for (;;) {
    const int conn = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (conn < 0) {
      if (errno == EINTR) continue;
      return;  // shut down
    }
    broker::Request req;
    for (;;) {
      const ssize_t n = recv(conn, &req, sizeof(req), 0);
      if (n < 0 && errno == EINTR) continue;
      if (n != static_cast<ssize_t>(sizeof(req)) || req.magic != broker::kMagic) break;
      Handle(conn, req);
    }
    close(conn);
  }
}

void FakeBroker::Handle(int conn, const broker::Request& req) {
  const auto op = static_cast<broker::Op>(req.op);
  broker::Reply rep;
  int err = 0;
  {
    std::lock_guard lock(mu_);
    Seen s{op,
           req.lease,
           req.ino,
           req.offset,
           req.length,
           req.flags,
           std::string(req.path, std::min<size_t>(req.path_len, broker::kMaxPath))};
    seen_.push_back(s);
    if (auto it = errors_.find(op); it != errors_.end()) err = it->second;
  }
  if (err != 0) {
    rep.error = err;
    std::snprintf(rep.message, sizeof(rep.message), "fake broker: %s", std::strerror(err));
    SendReply(conn, rep, {});
    return;
  }
  switch (op) {
    case broker::Op::kHello:
      rep.flags = broker::kProtocol;
      SendReply(conn, rep, {page_fd_});
      return;
    case broker::Op::kOpen: {
      const std::string path = root_ + "/" + std::string(req.path, req.path_len);
      const int acc = static_cast<int>(req.flags) & O_ACCMODE;
      const int buffered = open(path.c_str(), acc | O_CLOEXEC);
      struct stat sb {};
      if (buffered < 0 || fstat(buffered, &sb) != 0 || sb.st_ino != req.ino) {
        // As the real broker: the path must still be the file the client has open.
        rep.error = buffered < 0 ? errno : ESTALE;
        if (buffered >= 0) close(buffered);
        SendReply(conn, rep, {});
        return;
      }
      const int direct = open(path.c_str(), acc | O_DIRECT | O_CLOEXEC);  // -1: buffered only
      {
        std::lock_guard lock(mu_);
        rep.lease = ++next_lease_;
        rep.slot = reply_slot_ != kAutoSlot
                       ? reply_slot_
                       : static_cast<uint32_t>(next_lease_ % broker::kMaxLeases);
        if (rep.slot < broker::kMaxLeases) {
          slots_[rep.lease] = rep.slot;
          new (&page_[rep.slot]) broker::LeaseWord{};
        }
      }
      rep.size = sb.st_size;
      rep.flags = direct >= 0 ? broker::kHasDirect : 0;
      std::vector<int> fds{buffered};
      if (direct >= 0) fds.push_back(direct);
      SendReply(conn, rep, fds);
      for (int fd : fds) close(fd);
      return;
    }
    case broker::Op::kDrain:
      if (auto* w = WordOf(req.lease)) w->mount_dirty.store(0);
      SendReply(conn, rep, {});
      return;
    case broker::Op::kWrote:
    case broker::Op::kClose:
      SendReply(conn, rep, {});
      return;
  }
  rep.error = EINVAL;
  SendReply(conn, rep, {});
}

std::vector<FakeBroker::Seen> FakeBroker::Requests() {
  std::lock_guard lock(mu_);
  return seen_;
}

std::vector<FakeBroker::Seen> FakeBroker::Requests(broker::Op op) {
  std::vector<Seen> out;
  for (const auto& s : Requests()) {
    if (s.op == op) out.push_back(s);
  }
  return out;
}

void FakeBroker::Clear() {
  std::lock_guard lock(mu_);
  seen_.clear();
}

void FakeBroker::FailWith(broker::Op op, int err) {
  std::lock_guard lock(mu_);
  if (err == 0) {
    errors_.erase(op);
  } else {
    errors_[op] = err;
  }
}

void FakeBroker::ReplySlot(uint32_t slot) {
  std::lock_guard lock(mu_);
  reply_slot_ = slot;
}

broker::LeaseWord* FakeBroker::WordOf(uint64_t lease) {
  std::lock_guard lock(mu_);
  auto it = slots_.find(lease);
  return it == slots_.end() ? nullptr : &page_[it->second];
}

}  // namespace dnvme::preload::testing
