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
// Thread contract: Start/Stop from one thread (the daemon's main thread, after it forked); one
// thread accepts, one thread serves each connection (requests of a connection run in order).
// Connection threads call BrokerCore only.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "dnvme/status.h"
#include "engine/posix/file.h"

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
};

struct BrokerCounters {
  std::atomic<uint64_t> connections{0}, connections_open{0}, requests{0}, refused{0};
  std::atomic<uint64_t> leases{0}, leases_open{0}, invalidations{0}, drains{0};
};

class Broker {
 public:
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

 private:
  struct Conn;
  explicit Broker(BrokerCore& core);
  void AcceptLoop();
  void Serve(Conn* c);
  void ReapFinished(bool all);

  BrokerCore& core_;
  std::string name_;
  UniqueFd listen_;
  UniqueFd stop_event_;  // eventfd: wakes the accept loop for Stop
  std::thread acceptor_;
  std::atomic<bool> stopping_{false};
  std::mutex mu_;
  std::list<std::unique_ptr<Conn>> conns_;  // guarded by mu_
  uint64_t next_conn_ = 1;                  // guarded by mu_
  BrokerCounters counters_;
};

}  // namespace dnvme::fs
