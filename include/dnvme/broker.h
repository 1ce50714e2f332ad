// The descriptor broker's wire format: how a process under `dnvme run` (libdnvme_preload.so)
// gets descriptors of a backing file from the daemon (docs/preload.md).
//
// Transport: a SOCK_SEQPACKET unix socket in the abstract namespace, named in
// `<mount>/.dnvme/broker` (a mount serves its own name, so a client never trusts a name another
// user could have bound: it learns it through the mount). One message per request and per reply,
// both fixed-size structs in host byte order (client and daemon run on one machine).
//
// The daemon identifies the peer by SO_PEERCRED and SO_PEERGROUPS at accept and opens every file
// as that peer (fsuid, fsgid, groups; openat2 RESOLVE_BENEATH under BACKING_DIR), so the kernel
// decides permission as open(2) would have.
//
// A connection owns a lease page (a memfd the daemon sends with the hello reply, mapped by both;
// sealed against resizing, so a client cannot make the daemon's stores to it fault):
// kMaxLeases LeaseWords, read without a round trip. The daemon sets two flags:
//   shared:      someone other than this client has the file open through the mount (or another
//                client holds a lease on it): the client invalidates after every direct write.
//   mount_dirty: a WRITE reached the daemon through the mount since the last drain: before its
//                next direct transfer the client asks the daemon to land the write-behind data.
// The client keeps one counter:
//   writes_inflight: its direct writes of the file submitted and not yet complete (write-behind:
//                the program's write(2) has returned). Before the mount lets someone else open
//                the file, or truncates it or sets its times, the daemon waits for it to reach
//                0 (marking the leases shared first; for a truncate or utimes only when a count
//                is above 0), so a write that returned to its program lands before what follows.
//                Ordering (all seq_cst): the client increments it *before* it reads `shared`
//                after a write, the daemon sets `shared` *before* it reads the counter -- so
//                either the daemon waits for the write or the client sees `shared` and lands
//                and announces the write before write(2) returns. The daemon trusts the counter
//                for nothing but this bounded wait (a client only delays opens of its own files).
// Thread contract: the structs are plain data; LeaseWord fields are atomics shared by processes.
#pragma once

#include <atomic>
#include <cstdint>

namespace dnvme::broker {

inline constexpr uint32_t kMagic = 0x444e5642;  // "DNVB"
inline constexpr uint32_t kProtocol = 2;        // 2: LeaseWord::writes_inflight
inline constexpr uint32_t kMaxLeases = 512;     // per connection (the page's words)
inline constexpr uint32_t kMaxPath = 4096;
inline constexpr const char* kAnnounceFile = "broker";  // in <mount>/.dnvme/

enum class Op : uint32_t {
  kHello = 1,  // reply: protocol in `flags`; SCM_RIGHTS: the lease page (memfd)
  kOpen = 2,   // path (relative to the mount root), flags = O_RDONLY|O_WRONLY|O_RDWR, ino = the
               // inode the client's mount descriptor shows; reply: lease, slot, size; SCM_RIGHTS:
               // the buffered descriptor and (when the file takes O_DIRECT) the direct one
  kWrote = 3,  // lease, offset, length: bytes written around the mount; the daemon drops its
               // read-ahead and the kernel's cached pages and attributes (length 0: to the end)
  kDrain = 4,  // lease: land the mount's write-behind data of the file, clear mount_dirty
  kClose = 5,  // lease, offset, length (as kWrote, length < 0: nothing written): end the lease
};

struct alignas(16) LeaseWord {
  std::atomic<uint32_t> shared;           // daemon writes, client reads
  std::atomic<uint32_t> mount_dirty;      // daemon writes, client reads and the daemon clears
  std::atomic<uint32_t> writes_inflight;  // client writes, daemon reads
  uint32_t reserved;
};
static_assert(sizeof(LeaseWord) == 16);
static_assert(std::atomic<uint32_t>::is_always_lock_free);  // shared between processes
inline constexpr uint64_t kLeasePageBytes = kMaxLeases * sizeof(LeaseWord);

struct Request {
  uint32_t magic = kMagic;
  uint32_t op = 0;
  uint64_t lease = 0;
  uint64_t ino = 0;
  int64_t offset = 0;
  int64_t length = 0;
  uint32_t flags = 0;
  uint32_t path_len = 0;
  char path[kMaxPath] = {};
};

struct Reply {
  uint32_t magic = kMagic;
  int32_t error = 0;       // 0 or a positive errno
  uint64_t lease = 0;      // kOpen: the lease's id
  uint32_t slot = 0;       // kOpen: its LeaseWord in the page
  uint32_t flags = 0;      // kHello: protocol; kOpen: kHasDirect when two descriptors came
  int64_t size = 0;        // kOpen: the backing file's size
  char message[512] = {};  // the reason, when error != 0
};
inline constexpr uint32_t kHasDirect = 1;

}  // namespace dnvme::broker
