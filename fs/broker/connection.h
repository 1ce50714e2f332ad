// One connection of the broker (fs/broker/broker.h) as its two sides share it: the acceptor
// (broker.cc: admits, refuses, reaps) makes a Conn and its thread, which serves the connection's
// requests (connection.cc: hello, open, wrote, drain, close). Private to fs/broker/.
//
// Thread contract: a Conn's fields are the serving thread's once it started, except `finished`
// (atomic: the acceptor reaps finished ones) and `thread` (joined by the acceptor or ~Broker).
#pragma once

#include <sys/mman.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <thread>
#include <vector>

#include "dnvme/broker.h"
#include "dnvme/fd.h"
#include "dnvme/status.h"
#include "fs/broker/broker.h"
#include "fs/control/as_caller.h"
#include "fs/limits/uid_limits.h"

namespace dnvme::fs {

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
    // Its descriptors may write. A read-only lease's client changed nothing: its kWrote is
    // refused and its close drops no one's cached views (every reader's pages and read-ahead).
    bool writable = false;
  };
  std::map<uint64_t, Lease> leases;  // touched by the serving thread only
  std::vector<bool> slot_used = std::vector<bool>(broker::kMaxLeases, false);
  uint64_t next_lease = 1;
  std::thread thread;
  std::atomic<bool> finished{false};
  UidCharge charge;  // its place in the peer uid's broker_max_conns_per_uid
  // The daemon's descriptors it holds (kConnFds): its socket, its lease page, and the two an open
  // holds until the reply has sent them.
  UidCharge fds;
  static constexpr int64_t kConnFds = 4;

  ~Conn() {
    if (page != nullptr) munmap(page, broker::kLeasePageBytes);
  }
};

// Sends one reply with up to two descriptors (SCM_RIGHTS).
Status SendReply(int sock, const broker::Reply& r, const int* fds, int nfds);
// The reply that refuses a request (or a connection) with `st`'s errno and message.
broker::Reply ErrorReply(const Status& st);

}  // namespace dnvme::fs
