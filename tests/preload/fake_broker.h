// A stand-in for a dnvmefs mount's descriptor broker (fs/broker/), for the preload library's unit
// tests: it speaks include/dnvme/broker.h on an abstract unix socket, named in
// <root>/.dnvme/broker as a mount names its own, and opens files under `root` (a plain
// directory) for kOpen, as the real broker opens them under BACKING_DIR.
//
// It records every request, answers with the errno a test chose for an op, and maps the lease
// page it hands out, so a test can set a lease's `shared`/`mount_dirty` flags as the daemon would
// and read `writes_inflight` back.
//
// Thread contract: one server thread serves one connection at a time (the library keeps one per
// mount); every public method is thread-safe.
#ifndef DNVME_TESTS_PRELOAD_FAKE_BROKER_H_
#define DNVME_TESTS_PRELOAD_FAKE_BROKER_H_

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "dnvme/broker.h"

namespace dnvme::preload::testing {

class FakeBroker {
 public:
  struct Seen {
    broker::Op op;
    uint64_t lease = 0;
    uint64_t ino = 0;
    int64_t offset = 0;
    int64_t length = 0;
    uint32_t flags = 0;
    std::string path;
  };

  // Serves the mount at `root` (a directory; <root>/.dnvme/broker is written).
  explicit FakeBroker(const std::string& root);
  ~FakeBroker();
  FakeBroker(const FakeBroker&) = delete;
  FakeBroker& operator=(const FakeBroker&) = delete;

  // Requests since the last Clear() (kHello included).
  std::vector<Seen> Requests();
  // The requests of one kind since the last Clear().
  std::vector<Seen> Requests(broker::Op op);
  void Clear();
  // Every later request `op` is answered with `err` (0: served again).
  void FailWith(broker::Op op, int err);
  // Every later kOpen reply names lease slot `slot` (kMaxLeases or more: a daemon that does not
  // speak the protocol); kAutoSlot: the broker's own choice again.
  static constexpr uint32_t kAutoSlot = UINT32_MAX - 1;
  void ReplySlot(uint32_t slot);
  // The word of lease `lease` in the page handed out (nullptr if no such lease).
  broker::LeaseWord* WordOf(uint64_t lease);

 private:
  void Serve();
  void Handle(int conn, const broker::Request& req);

  std::string root_;
  int listen_fd_ = -1;
  int page_fd_ = -1;
  broker::LeaseWord* page_ = nullptr;
  std::thread thread_;
  std::mutex mu_;                       // guards the members below
  std::vector<Seen> seen_;              //
  std::map<broker::Op, int> errors_;    //
  std::map<uint64_t, uint32_t> slots_;  // lease -> slot
  uint64_t next_lease_ = 0;             //
  uint32_t reply_slot_ = kAutoSlot;     //
};

}  // namespace dnvme::preload::testing

#endif  // DNVME_TESTS_PRELOAD_FAKE_BROKER_H_
