// The descriptor broker: hands processes under `dnvme run` (libdnvme_preload.so) descriptors of
// backing files, so their large transfers go straight to BACKING_DIR through their own engine
// while the mount keeps serving names, metadata, mmap and small I/O (docs/preload.md; the wire
// format is include/dnvme/broker.h).
//
// Nothing is handed out that the caller could not open itself: each file is opened as the peer
// (SO_PEERCRED + SO_PEERGROUPS, AsCaller) beneath BACKING_DIR (openat2 RESOLVE_BENEATH), never
// created or truncated (the client opened it through the mount first), and must be the inode the
// client's mount descriptor shows. Before handing it out the broker lands the file's write-behind
// data and drops the read-ahead and the kernel's cached pages and attributes; from then on the
// lease tells the ops (fs/broker/leases.h) to keep the client informed.
//
// Files are opened with O_NONBLOCK (a FIFO or device planted under a name never blocks a
// thread) and must be regular; the flag is cleared before the descriptors are sent.
//
// Limits (docs/security.md): each uid has at most broker_max_conns_per_uid connections
// (UidLimits, UidResource::kBrokerConns), users other than root together at most
// kMaxUserConnections, everyone at most kMaxConnections. A refused connection gets one error
// reply saying which limit, then the daemon shuts its side (the client logs the reason and goes
// through the mount).
//
// Thread contract: Start/Stop from one thread (the daemon's main thread, after it forked); one
// thread accepts, one thread serves each connection (requests of a connection run in order).
// Connection threads call BrokerCore only. Stopping never waits for something a client
// controls: the acceptor polls an eventfd; a connection thread blocks only in recv/sendmsg on its
// socket (woken by shutdown(2), and sends also time out after kSendTimeout), in opens that
// cannot block (O_NONBLOCK), in the wait for another client's writes (PreloadLeases::kWriteWait)
// and in landing write-behind data (the disk's time).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "dnvme/fd.h"
#include "dnvme/status.h"
#include "fs/limits/uid_limits.h"

namespace dnvme::fs {

struct Inode;
class PreloadLeases;

// What the broker needs of the filesystem core (Fs implements it).
// Thread contract: thread-safe.
class BrokerCore {
 public:
  virtual ~BrokerCore() = default;
  virtual int root_fd() const = 0;
  virtual Inode* PinInode(dev_t dev, ino_t ino) = 0;
  virtual void Unpin(Inode* in) = 0;
  virtual Status DrainForExternal(Inode& in) = 0;
  virtual void AfterExternalWrite(Inode& in) = 0;
  // Opens of the inode through the mount now (passthrough and not).
  virtual int OpenCount(Inode& in) = 0;
  virtual PreloadLeases& LeasesOf(Inode& in) = 0;
  // Per-uid limits: connections count as UidResource::kBrokerConns.
  virtual UidLimits& uid_limits() = 0;
};

struct BrokerCounters {
  std::atomic<uint64_t> connections{0}, connections_open{0}, requests{0}, refused{0};
  std::atomic<uint64_t> leases{0}, leases_open{0}, invalidations{0}, drains{0};
};

class Broker {
 public:
  // Connections of all users but root together, and of everyone (root's beyond the first).
  static constexpr size_t kMaxUserConnections = 1024;
  static constexpr size_t kMaxConnections = 4096;
  // A reply the client does not take in this long ends its connection.
  static constexpr int kSendTimeoutSec = 10;

  // Binds a fresh abstract socket name and starts accepting.
  static Result<std::unique_ptr<Broker>> Start(BrokerCore& core);
  ~Broker();  // stops: ends every connection (their leases are released) and joins the threads
  Broker(const Broker&) = delete;
  Broker& operator=(const Broker&) = delete;

  // "@dnvmefs.<pid>.<random>": the abstract name ('@' stands for the leading NUL).
  const std::string& name() const { return name_; }
  // What `<mount>/.dnvme/broker` serves.
  std::string Announcement() const;
  const BrokerCounters& counters() const { return counters_; }
  std::string StatsJson() const;

  // The connecting client's supplementary groups (SO_PEERGROUPS), however many; an error when
  // they cannot be read (the client is then refused, never served with a guess).
  static Result<std::vector<gid_t>> PeerGroups(int sock);

 private:
  struct Conn;
  explicit Broker(BrokerCore& core);
  void AcceptLoop();
  void Serve(Conn* c);
  void ReapFinished(bool all);
  // Why a new connection of `uid` must be refused (Ok: take it, its charges in `charge` and
  // `fds`).
  Status Admit(uid_t uid, UidCharge* charge, UidCharge* fds);
  // Answers a refused connection with `why` and keeps it until the client has read it (or
  // kRefusedLinger passed), so the client's hello finds the reason, not a closed socket.
  void Refuse(UniqueFd sock, const Status& why);
  void CloseRefused(bool all);

  BrokerCore& core_;
  std::string name_;
  UniqueFd listen_;
  UniqueFd stop_event_;  // eventfd: wakes the accept loop for Stop
  std::thread acceptor_;
  std::atomic<bool> stopping_{false};
  std::mutex mu_;
  std::list<std::unique_ptr<Conn>> conns_;  // guarded by mu_
  uint64_t next_conn_ = 1;                  // guarded by mu_
  size_t user_conns_ = 0;                   // of conns_, those of uids other than 0; mu_
  struct Refused {
    UniqueFd sock;
    std::chrono::steady_clock::time_point until;
  };
  std::list<Refused> refused_;  // the acceptor's alone
  BrokerCounters counters_;
};

}  // namespace dnvme::fs
