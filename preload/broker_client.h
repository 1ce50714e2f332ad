// The client side of one dnvmefs mount's descriptor broker (wire format: include/dnvme/broker.h;
// the server: fs/broker/).
//
// A BrokerConnection is made once per mount (per device) at the first adoption of one of its
// files and lives until the process exits (or forks: the child closes it and connects again).
//
// Thread contract: CallBroker needs the connection's `mu` held by the caller (one request in
// flight per connection: replies carry no request id); ConnectToBroker and CloseBrokerConnection
// are thread-safe for a connection nobody else uses yet (or any more).
#ifndef DNVME_PRELOAD_BROKER_CLIENT_H_
#define DNVME_PRELOAD_BROKER_CLIENT_H_

#include <atomic>
#include <memory>
#include <mutex>
#include <string>

#include "dnvme/broker.h"
#include "dnvme/status.h"

namespace dnvme::preload {

struct BrokerConnection {
  std::mutex mu;  // held across a request and its reply
  int sock = -1;  // SOCK_SEQPACKET to the broker; the library's own (kNotOurs)
  // The lease page (kMaxLeases words) the broker sent with the hello reply, mapped shared and
  // writable (this process keeps its words' writes_inflight). Never unmapped while in use:
  // AdoptedFiles point into it.
  broker::LeaseWord* page = nullptr;
  std::string mountpoint;
  // The broker hung up: the daemon died (or ended this connection, and with it its leases).
  // Set once by BrokerGone, never cleared.
  std::atomic<bool> gone{false};
};

// Connects to the broker of the mount at `point` (its socket's name is in .dnvme/broker) and
// says hello (protocol check, lease page). Null, logged, when there is none to reach (-o
// preload=0, daemon gone, another protocol).
std::shared_ptr<BrokerConnection> ConnectToBroker(const std::string& point);

// Closes the socket and unmaps the page of a connection that was never used (lost a race).
void CloseBrokerConnection(BrokerConnection& c);

// Whether the broker has hung up on `c` (the daemon is gone): a poll of the socket for its hangup,
// which never waits and takes no lock (any thread); once seen, remembered. A direct write asks
// before it starts, so that a program writing around a dead mount hears ENOTCONN at its next
// write as it would through the mount, not at close (docs/preload.md, Durability).
bool BrokerGone(BrokerConnection& c);

// One request and its reply on `c` (caller holds c.mu). Descriptors that came with the reply
// (SCM_RIGHTS, close-on-exec) are put in fds[0..max_fds) and counted in *nfds; any beyond are
// closed. A reply with an error becomes that errno's Status with the broker's message; a
// closed connection ENOTCONN, a malformed reply EPROTO.
Status CallBroker(BrokerConnection& c, const broker::Request& req, broker::Reply* rep, int* fds,
                  int max_fds, int* nfds);

}  // namespace dnvme::preload

#endif  // DNVME_PRELOAD_BROKER_CLIENT_H_
