// libdnvme_preload.so: what `dnvme run -- CMD` preloads (docs/preload.md).
//
// For a regular file on a dnvmefs mount, a read or write of at least DNVME_PRELOAD_MIN_BYTES
// (128 KiB) is done by this process's own engine (AioHandle: parallel O_DIRECT libaio, from the
// caller's buffer when aligned, else through pinned bounce buffers) on descriptors of the backing
// file the daemon's broker handed over (include/dnvme/broker.h) -- no copy through /dev/fuse.
// Everything else (small transfers, metadata, mmap, files elsewhere, anything not understood)
// goes to libc unchanged, and so through the mount.
//
// The program keeps its own descriptor of the mount: its file offset, O_CLOEXEC, locks and
// mmap stay the kernel's. A file is adopted lazily, at the first large transfer on its descriptor
// (whatever opened it: open, fopen, a shell's redirection before exec): fstatfs says FUSE,
// /proc/self/mountinfo says which dnvmefs mount, /proc/self/fd says the path, and the broker
// opens that path as this process and checks it is the same inode. O_APPEND descriptors are not
// adopted (the mount keeps appends atomic).
//
// Writes are write-behind from pinned staging buffers, but a write returns only once every byte
// of it is in the kernel (the engine's Submitted notice): submitted AIO outlives the process, so
// a returned write survives exit, _exit and kill -9 as on ext4.
// A write that extends the file reserves its space first (fallocate): ENOSPC is that write's
// error, and it leaves no zero-filled tail.
// fallocate(2) of an adopted file goes to the backing file in every mode (docs/preload.md).
//
// Coherence (fs/broker/leases.h): before a direct transfer, data that reached the mount's
// write-behind is drained when the lease word says so; after a direct write the daemon drops its
// read-ahead and the kernel's cached pages and attributes -- at once when the lease is shared,
// else before this process next uses the mount for that file, and at fsync, close, mmap, fork and
// exec. Attributes of a leased file are answered uncached, so stat(2) sees the size at once.
//
// Descriptors closed behind libc's back (fclose, close_range) are noticed: before each transfer
// on an adopted descriptor, kcmp(KCMP_FILE) compares it with the duplicate taken at adoption.
//
// Thread contract: every interposed function is thread-safe. One mutex guards the record table;
// it is never held across I/O, a broker round trip or the engine. Each broker connection has its
// own mutex (one request in flight per connection). fork() keeps working: prepare flushes pending
// invalidations and takes the locks; the child forgets every record, connection and the engine
// (their threads did not survive) and adopts again on demand.
#include <dlfcn.h>
#include <fcntl.h>
#include <linux/kcmp.h>
#include <linux/magic.h>
#include <pthread.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "dnvme/broker.h"
#include "dnvme/config.h"
#include "dnvme/handle.h"
#include "dnvme/log.h"
#include "dnvme/pinned.h"
#include "engine/common/log.h"
#include "preload/internal.h"

namespace {

using dnvme::AioHandle;
using dnvme::FileRef;
using dnvme::Status;
namespace broker = dnvme::broker;

// ---- libc's own functions ----

template <typename F>
F Next(const char* name) {
  return reinterpret_cast<F>(dlsym(RTLD_NEXT, name));
}

struct Libc {
  ssize_t (*read)(int, void*, size_t);
  ssize_t (*write)(int, const void*, size_t);
  ssize_t (*pread)(int, void*, size_t, off_t);
  ssize_t (*pwrite)(int, const void*, size_t, off_t);
  ssize_t (*readv)(int, const iovec*, int);
  ssize_t (*writev)(int, const iovec*, int);
  ssize_t (*preadv)(int, const iovec*, int, off_t);
  ssize_t (*pwritev)(int, const iovec*, int, off_t);
  ssize_t (*preadv2)(int, const iovec*, int, off_t, int);
  ssize_t (*pwritev2)(int, const iovec*, int, off_t, int);
  int (*open)(const char*, int, ...);
  int (*open64)(const char*, int, ...);
  int (*openat)(int, const char*, int, ...);
  int (*openat64)(int, const char*, int, ...);
  int (*creat)(const char*, mode_t);
  int (*creat64)(const char*, mode_t);
  int (*close)(int);
  int (*fcntl)(int, int, ...);
  int (*dup)(int);
  int (*dup2)(int, int);
  int (*dup3)(int, int, int);
  int (*fsync)(int);
  int (*fdatasync)(int);
  ssize_t (*copy_file_range)(int, off64_t*, int, off64_t*, size_t, unsigned);
  ssize_t (*sendfile)(int, int, off_t*, size_t);
  ssize_t (*splice)(int, off64_t*, int, off64_t*, size_t, unsigned);
  int (*ftruncate)(int, off_t);
  int (*ftruncate64)(int, off_t);
  int (*fallocate)(int, int, off_t, off_t);
  void* (*mmap)(void*, size_t, int, int, int, off_t);
  void* (*mmap64)(void*, size_t, int, int, int, off_t);
  int (*execve)(const char*, char* const[], char* const[]);
  int (*execv)(const char*, char* const[]);
  int (*execvp)(const char*, char* const[]);
  int (*execvpe)(const char*, char* const[], char* const[]);
  int (*posix_spawn)(pid_t*, const char*, const posix_spawn_file_actions_t*,
                     const posix_spawnattr_t*, char* const[], char* const[]);
  int (*posix_spawnp)(pid_t*, const char*, const posix_spawn_file_actions_t*,
                      const posix_spawnattr_t*, char* const[], char* const[]);
};

Libc& C() {
  static Libc c = [] {
    Libc l{};
    l.read = Next<decltype(l.read)>("read");
    l.write = Next<decltype(l.write)>("write");
    l.pread = Next<decltype(l.pread)>("pread64");
    l.pwrite = Next<decltype(l.pwrite)>("pwrite64");
    l.readv = Next<decltype(l.readv)>("readv");
    l.writev = Next<decltype(l.writev)>("writev");
    l.preadv = Next<decltype(l.preadv)>("preadv64");
    l.pwritev = Next<decltype(l.pwritev)>("pwritev64");
    l.preadv2 = Next<decltype(l.preadv2)>("preadv64v2");
    l.pwritev2 = Next<decltype(l.pwritev2)>("pwritev64v2");
    l.open = Next<decltype(l.open)>("open");
    l.open64 = Next<decltype(l.open64)>("open64");
    l.openat = Next<decltype(l.openat)>("openat");
    l.openat64 = Next<decltype(l.openat64)>("openat64");
    l.creat = Next<decltype(l.creat)>("creat");
    l.creat64 = Next<decltype(l.creat64)>("creat64");
    l.close = Next<decltype(l.close)>("close");
    l.fcntl = Next<decltype(l.fcntl)>("fcntl");
    l.dup = Next<decltype(l.dup)>("dup");
    l.dup2 = Next<decltype(l.dup2)>("dup2");
    l.dup3 = Next<decltype(l.dup3)>("dup3");
    l.fsync = Next<decltype(l.fsync)>("fsync");
    l.fdatasync = Next<decltype(l.fdatasync)>("fdatasync");
    l.copy_file_range = Next<decltype(l.copy_file_range)>("copy_file_range");
    l.sendfile = Next<decltype(l.sendfile)>("sendfile64");
    l.splice = Next<decltype(l.splice)>("splice");
    l.ftruncate = Next<decltype(l.ftruncate)>("ftruncate64");
    l.ftruncate64 = l.ftruncate;
    l.fallocate = Next<decltype(l.fallocate)>("fallocate64");
    l.mmap = Next<decltype(l.mmap)>("mmap64");
    l.mmap64 = l.mmap;
    l.execve = Next<decltype(l.execve)>("execve");
    l.execv = Next<decltype(l.execv)>("execv");
    l.execvp = Next<decltype(l.execvp)>("execvp");
    l.execvpe = Next<decltype(l.execvpe)>("execvpe");
    l.posix_spawn = Next<decltype(l.posix_spawn)>("posix_spawn");
    l.posix_spawnp = Next<decltype(l.posix_spawnp)>("posix_spawnp");
    return l;
  }();
  return c;
}

// ---- settings (environment, read once) ----

struct Settings {
  bool enabled = true;
  int64_t min_bytes = 128 << 10;
  std::vector<std::string> mounts;  // DNVME_PRELOAD_MOUNTS (':'-separated); empty: every mount
  std::string stats_file;           // DNVME_PRELOAD_STATS: a JSON line per process at exit
  std::string config_file;          // DNVME_PRELOAD_CONFIG: the engine's HandleConfig
  int64_t readahead = 32 << 20;     // DNVME_PRELOAD_READAHEAD: bytes of read-ahead buffers; 0 off
};

Settings& S() {
  static Settings s = [] {
    Settings v;
    if (const char* e = getenv("DNVME_PRELOAD_DISABLE"); e && *e && std::strcmp(e, "0") != 0) {
      v.enabled = false;
    }
    if (const char* e = getenv("DNVME_PRELOAD_MIN_BYTES"); e && *e) {
      char* end = nullptr;
      long long n = std::strtoll(e, &end, 10);
      if (end && *end == '\0' && n > 0) v.min_bytes = n;
    }
    if (const char* e = getenv("DNVME_PRELOAD_MOUNTS"); e && *e) {
      std::string all(e);
      size_t start = 0;
      while (start <= all.size()) {
        size_t colon = all.find(':', start);
        if (colon == std::string::npos) colon = all.size();
        std::string m = all.substr(start, colon - start);
        while (m.size() > 1 && m.back() == '/') m.pop_back();
        if (!m.empty()) v.mounts.push_back(m);
        start = colon + 1;
      }
    }
    if (const char* e = getenv("DNVME_PRELOAD_READAHEAD"); e && *e) {
      char* end = nullptr;
      long long n = std::strtoll(e, &end, 10);
      if (end && *end == '\0' && n >= 0) v.readahead = n;
    }
    if (const char* e = getenv("DNVME_PRELOAD_STATS"); e && *e) v.stats_file = e;
    if (const char* e = getenv("DNVME_PRELOAD_CONFIG"); e && *e) v.config_file = e;
    if (const char* e = getenv("DNVME_PRELOAD_LOG"); e && *e) {
      (void)dnvme::SetLogLevel(e);
    } else {
      (void)dnvme::SetLogLevel("warn");
    }
    return v;
  }();
  return s;
}

struct Counters {
  std::atomic<uint64_t> adopted{0}, refused{0}, reads{0}, writes{0};
  std::atomic<uint64_t> bytes_read{0}, bytes_written{0}, drains{0}, invalidations{0};
  std::atomic<uint64_t> errors{0}, stale{0}, ahead_bytes{0};
};
Counters g_counters;

// ---- descriptor states ----

// Per descriptor number: what a large transfer on it should do. Unknown ones are classified once.
enum : uint8_t { kUnknown = 0, kNotOurs = 1, kOurs = 2 };
constexpr int kMaxTracked = 1 << 20;
std::atomic<uint8_t> g_state[kMaxTracked];

uint8_t StateOf(int fd) {
  if (fd < 0 || fd >= kMaxTracked) return kNotOurs;
  return g_state[fd].load(std::memory_order_acquire);
}
void SetState(int fd, uint8_t s) {
  if (fd >= 0 && fd < kMaxTracked) g_state[fd].store(s, std::memory_order_release);
}

// One connection to one mount's broker.
struct Conn {
  std::mutex mu;  // one request at a time
  int sock = -1;
  broker::LeaseWord* page = nullptr;
  std::string mountpoint;
};

// A piece of read-ahead: [off, off + len) of the file, read into `buf` at off's offset in the
// page (so the engine's requests go O_DIRECT).
struct Ahead {
  dnvme::PinnedPool::Lease buf;
  int64_t off = 0;
  int64_t len = 0;
  bool done = false;  // guarded by the record's `am`
  bool ok = false;    // guarded by the record's `am`
  const char* data() const { return buf.data() + off % 4096; }
};

// An adopted file: the program's descriptor(s) of the mount share it (dup).
struct Record {
  std::shared_ptr<Conn> conn;
  FileRef file;      // the backing file (O_DIRECT + buffered), as the broker opened it
  int witness = -1;  // our duplicate of the program's descriptor (kcmp, and the FUSE open)
  uint64_t lease = 0;
  broker::LeaseWord* word = nullptr;
  bool can_read = false, can_write = false;
  std::mutex mu;                             // guards the two below
  int64_t pending_lo = -1, pending_hi = -1;  // written around the mount, kernel not yet told
  bool mapped = false;                       // mmap'ed: every write is announced at once
  // Write-behind: writes copied into staging buffers and submitted return at once (the program
  // computes its next piece -- torch's CRC, say -- while the disk writes this one). The first
  // failure is kept and reported at the next write, fsync or close, as POSIX allows.
  std::mutex wm;
  std::condition_variable wcv;
  int inflight = 0;   // guarded by wm
  int first_err = 0;  // guarded by wm
  // Set by EndLease once the writes drained: the lease word may belong to another file after
  // kClose, so no write may be counted in it any more (a thread still inside a transfer on a
  // descriptor another thread closed gets EBADF).
  bool ended = false;  // guarded by wm
  // The bytes the writes in flight cover, as one range (guarded by wm; valid while inflight > 0).
  // Requests in flight complete in any order, so a write over these bytes waits for them first.
  int64_t wb_lo = 0, wb_hi = 0;
  // Space for the writes that extend the file (Reserve), serialised by `xm` (also held by
  // fallocate and ftruncate of the record, which invalidate it). Blocks [resv_lo, resv_hi) were
  // allocated past the end of the file (fallocate KEEP_SIZE) for this writer.
  std::mutex xm;
  int64_t resv_lo = 0, resv_hi = 0;  // guarded by xm; empty when equal
  int64_t size_set = -1;             // guarded by xm: the size Reserve last gave the file
  bool past_eof = false;             // guarded by xm: blocks may lie past the end (Trim frees them)
  bool no_fallocate = false;         // guarded by xm: the backing file system has no fallocate
  // Read-ahead of a sequential reader (the kernel's read-ahead does this for a buffered file;
  // O_DIRECT gets none): the next bytes are read into pinned buffers while the program works on
  // the current ones. Reads of the record are serialised by `rm`, held across the wait for a
  // buffer; completions take only `am`. Every piece in `ahead` is waited for before it is dropped
  // (its request uses `file`).
  std::mutex rm;
  std::deque<std::shared_ptr<Ahead>> ahead;  // guarded by rm: contiguous, ascending
  int64_t next_read = -1;                    // guarded by rm: where the last read ended
  std::mutex am;
  std::condition_variable acv;
  int fds = 0;  // guarded by g_mu: the program's descriptors in g_records
};

std::mutex g_mu;                                             // guards the three below
std::unordered_map<int, std::shared_ptr<Record>> g_records;  // program fd -> record
std::map<dev_t, std::shared_ptr<Conn>> g_conns;              // mount device -> broker connection
AioHandle* g_engine = nullptr;  // created at the first adoption; leaked in forked children
bool g_engine_failed = false;
// Staging buffers of write-behind (null: writes are synchronous, e.g. RLIMIT_MEMLOCK too low).
dnvme::PinnedPool* g_pool = nullptr;    // written once, under g_mu, before g_pool_tried (WritePool)
std::atomic<bool> g_pool_tried{false};  // set (under g_mu) once g_pool is final
constexpr size_t kChunk = 8 << 20;
constexpr size_t kChunks = 6;
// Read-ahead buffers (null: no read-ahead).
dnvme::PinnedPool* g_rpool = nullptr;    // written once, under g_mu, before g_rpool_tried
std::atomic<bool> g_rpool_tried{false};  // set (under g_mu) once g_rpool is final
constexpr int64_t kAheadChunk = 4 << 20;
// A read this far past where the last one ended still counts as sequential (a zip reader such as
// torch.load skips each record's local header with a small read through the mount).
constexpr int64_t kAheadSkip = 1 << 20;
// Reads this large are not read ahead: one such call keeps the disk busy by itself (torch.load
// reads a tensor per call), and on two cores the copy out of read-ahead buffers measured slower.
constexpr int64_t kAheadMaxRead = 8 << 20;
// Space reserved ahead of a writer that extends its file: as much again as the file holds, at
// least kReserveMin, at most kReserveMax. ext4's fallocate waits for every O_DIRECT request in
// flight on the inode (inode_dio_wait), so each reservation drains the write-behind once;
// growing steps keep that to a few drains per file (docs/performance-journal.md).
constexpr int64_t kReserveMin = 64 << 20;
constexpr int64_t kReserveMax = 1 << 30;

// Waits for the record's write-behind; returns (and clears) its first error, 0 if none.
int WaitWrites(Record& r) {
  std::unique_lock lock(r.wm);
  r.wcv.wait(lock, [&] { return r.inflight == 0; });
  const int err = r.first_err;
  r.first_err = 0;
  return err;
}

// The same without taking the error (it stays for fsync or close).
void DrainWrites(Record& r) {
  std::unique_lock lock(r.wm);
  r.wcv.wait(lock, [&] { return r.inflight == 0; });
}

// ---- mounts ----

struct MountInfo {
  dev_t dev = 0;
  std::string point;
};

std::string Unescape(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 3 < s.size() && std::isdigit(static_cast<unsigned char>(s[i + 1]))) {
      out.push_back(static_cast<char>(std::strtol(s.substr(i + 1, 3).c_str(), nullptr, 8)));
      i += 3;
    } else {
      out.push_back(s[i]);
    }
  }
  return out;
}

// The dnvmefs mount with device `dev`, from /proc/self/mountinfo (read with libc's own calls).
bool FindMount(dev_t dev, MountInfo* out) {
  int fd = C().open("/proc/self/mountinfo", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  std::string text;
  char buf[16384];
  for (;;) {
    ssize_t n = C().read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    text.append(buf, static_cast<size_t>(n));
  }
  C().close(fd);
  size_t pos = 0;
  while (pos < text.size()) {
    size_t eol = text.find('\n', pos);
    if (eol == std::string::npos) eol = text.size();
    const std::string line = text.substr(pos, eol - pos);
    pos = eol + 1;
    // id parent major:minor root mountpoint options [optional...] - fstype source superopts
    unsigned maj = 0, min = 0;
    char root[4096], point[4096];
    if (std::sscanf(line.c_str(), "%*d %*d %u:%u %4095s %4095s", &maj, &min, root, point) != 4) {
      continue;
    }
    if (makedev(maj, min) != dev) continue;
    const size_t dash = line.find(" - ");
    if (dash == std::string::npos) continue;
    if (line.compare(dash + 3, 13, "fuse.dnvmefs ") != 0) return false;
    out->dev = dev;
    out->point = Unescape(point);
    return true;
  }
  return false;
}

bool MountAllowed(const std::string& point) {
  if (S().mounts.empty()) return true;
  for (const auto& m : S().mounts) {
    if (m == point) return true;
  }
  return false;
}

// ---- the broker ----

Status Call(Conn& c, const broker::Request& req, broker::Reply* rep, int* fds, int max_fds,
            int* nfds) {
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
        C().close(got[i]);
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

// Connects to the broker of the mount at `point` (its name is in .dnvme/broker).
std::shared_ptr<Conn> Connect(const std::string& point) {
  const std::string announce = point + "/.dnvme/" + broker::kAnnounceFile;
  int fd = C().open(announce.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return nullptr;
  char text[512] = {};
  ssize_t n;
  do {
    n = C().read(fd, text, sizeof(text) - 1);
  } while (n < 0 && errno == EINTR);
  C().close(fd);
  if (n <= 0) return nullptr;  // -o preload=0: empty
  const char* sock_line = std::strstr(text, "socket @");
  if (sock_line == nullptr) return nullptr;
  std::string name(sock_line + 8);
  name = name.substr(0, name.find('\n'));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (name.empty() || name.size() + 1 > sizeof(addr.sun_path)) return nullptr;
  std::memcpy(addr.sun_path + 1, name.data(), name.size());
  auto c = std::make_shared<Conn>();
  c->mountpoint = point;
  c->sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (c->sock < 0) return nullptr;
  SetState(c->sock, kNotOurs);
  const socklen_t alen = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  if (connect(c->sock, reinterpret_cast<sockaddr*>(&addr), alen) != 0) {
    dnvme::Logger().warn("dnvme run: cannot reach the broker of {}: {}", point,
                         std::strerror(errno));
    C().close(c->sock);
    return nullptr;
  }
  broker::Request req;
  req.op = static_cast<uint32_t>(broker::Op::kHello);
  broker::Reply rep;
  int page_fd = -1, nfds = 0;
  Status st = Call(*c, req, &rep, &page_fd, 1, &nfds);
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
  if (page_fd >= 0) C().close(page_fd);
  if (!st.ok()) {
    dnvme::Logger().warn("dnvme run: broker of {}: {}", point, st.ToString());
    C().close(c->sock);
    return nullptr;
  }
  return c;
}

Status LeaseCall(Record& r, broker::Op op, int64_t off, int64_t len) {
  broker::Request req;
  req.op = static_cast<uint32_t>(op);
  req.lease = r.lease;
  req.offset = off;
  req.length = len;
  broker::Reply rep;
  std::lock_guard lock(r.conn->mu);
  return Call(*r.conn, req, &rep, nullptr, 0, nullptr);
}

// Tells the daemon what was written around the mount since the last time (kernel caches drop),
// once it is in the file.
Status Announce(Record& r) {
  DrainWrites(r);
  int64_t lo, hi;
  {
    std::lock_guard lock(r.mu);
    lo = r.pending_lo;
    hi = r.pending_hi;
    r.pending_lo = r.pending_hi = -1;
  }
  if (lo < 0) return Status::Ok();
  g_counters.invalidations.fetch_add(1, std::memory_order_relaxed);
  return LeaseCall(r, broker::Op::kWrote, lo, hi - lo);
}

void NoteWritten(Record& r, int64_t off, int64_t len) {
  std::lock_guard lock(r.mu);
  if (r.pending_lo < 0) {
    r.pending_lo = off;
    r.pending_hi = off + len;
  } else {
    r.pending_lo = std::min(r.pending_lo, off);
    r.pending_hi = std::max(r.pending_hi, off + len);
  }
}

bool HasPending(Record& r) {
  std::lock_guard lock(r.mu);
  return r.pending_lo >= 0;
}

// Every record's pending announcement (before fork, exec, and a mount-path use of a file).
void AnnounceAll() {
  std::vector<std::shared_ptr<Record>> all;
  {
    std::lock_guard lock(g_mu);
    for (auto& [fd, r] : g_records) all.push_back(r);
  }
  for (auto& r : all) {
    if (HasPending(*r)) {
      if (Status st = Announce(*r); !st.ok()) dnvme::Logger().warn("dnvme run: {}", st.ToString());
    }
  }
}

void TrimReservation(Record& r);

void EndLease(Record& r) {
  {
    std::unique_lock lock(r.wm);
    r.wcv.wait(lock, [&] { return r.inflight == 0; });
    r.ended = true;
  }
  TrimReservation(r);
  int64_t lo, hi;
  {
    std::lock_guard lock(r.mu);
    lo = r.pending_lo;
    hi = r.pending_hi;
  }
  Status st = LeaseCall(r, broker::Op::kClose, lo < 0 ? 0 : lo, lo < 0 ? -1 : hi - lo);
  if (!st.ok()) dnvme::Logger().debug("dnvme run: ending a lease: {}", st.ToString());
  if (r.witness >= 0) C().close(r.witness);
  r.witness = -1;
}

// ---- the engine ----

AioHandle* Engine() {
  std::lock_guard lock(g_mu);
  if (g_engine || g_engine_failed) return g_engine;
  dnvme::HandleConfig cfg;
  cfg.queue_depth = 32;
  cfg.bounce_bytes_per_worker = 8 << 20;
  if (!S().config_file.empty()) {
    auto c = dnvme::HandleConfig::FromJsonFile(S().config_file);
    if (!c.ok()) {
      dnvme::Logger().warn("dnvme run: {}: {}; the mount serves every transfer", S().config_file,
                           c.status().ToString());
      g_engine_failed = true;
      return nullptr;
    }
    cfg = c.value();
  }
  // Always a sliding window: a write waits for its Submitted notice, and with lock-step batches a
  // worker would submit it only after the previous write's batch completed (one request in
  // flight for a program writing 1 MiB per call: 0.85x the old write-behind on the RAM ext4).
  cfg.overlap_events = true;
  auto h = AioHandle::Create(cfg);
  if (!h.ok()) {
    dnvme::Logger().warn("dnvme run: no engine ({}); the mount serves every transfer",
                         h.status().ToString());
    g_engine_failed = true;
    return nullptr;
  }
  g_engine = std::move(h).value().release();
  return g_engine;
}

// The pools are made at their first use (pinning fresh memory costs): a program that only reads
// pins no write-behind buffers, one that only writes or reads in large calls no read-ahead ones.
// Null when they cannot be pinned (RLIMIT_MEMLOCK): the caller then does without.
// Every transfer asks, so after the first the answer costs one atomic load, not g_mu.
dnvme::PinnedPool* PoolOnce(dnvme::PinnedPool** pool, std::atomic<bool>* tried, size_t size,
                            size_t count, const char* without) {
  if (tried->load(std::memory_order_acquire)) return *pool;
  std::lock_guard lock(g_mu);
  if (!tried->load(std::memory_order_relaxed)) {
    auto made = dnvme::PinnedPool::Create(size, count);
    if (made.ok()) {
      *pool = std::move(made).value().release();
    } else {
      dnvme::Logger().info("dnvme run: no pinned buffers ({}); {}", made.status().ToString(),
                           without);
    }
    tried->store(true, std::memory_order_release);
  }
  return *pool;
}

dnvme::PinnedPool* WritePool() {
  return PoolOnce(&g_pool, &g_pool_tried, kChunk + 4096, kChunks, "writes are synchronous");
}

dnvme::PinnedPool* ReadPool() {
  if (S().readahead <= 0) return nullptr;
  const auto count = static_cast<size_t>(std::max<int64_t>(2, S().readahead / kAheadChunk));
  return PoolOnce(&g_rpool, &g_rpool_tried, kAheadChunk + 4096, count, "no read-ahead");
}

// ---- read-ahead ----

void WaitAhead(Record& r, const Ahead& a) {
  std::unique_lock lock(r.am);
  r.acv.wait(lock, [&] { return a.done; });
}

// Drops the record's read-ahead once its requests are done. Caller holds r.rm.
void ForgetAheadLocked(Record& r) {
  for (const auto& a : r.ahead) WaitAhead(r, *a);
  r.ahead.clear();
  r.next_read = -1;
}

// Before a write, a truncate or the end of the record: what was read ahead may be stale.
void ForgetAhead(Record& r) {
  std::lock_guard lock(r.rm);
  ForgetAheadLocked(r);
}

// Queues reads of the file from the end of the read-ahead (or `from` when there is none) up to
// `until`, as far as free buffers go. Caller holds r.rm.
void QueueAhead(const std::shared_ptr<Record>& rp, int64_t from, int64_t until) {
  Record& r = *rp;
  int64_t pos = r.ahead.empty() ? from : r.ahead.back()->off + r.ahead.back()->len;
  while (pos < until) {
    dnvme::PinnedPool::Lease lease = g_rpool->TryAcquire();
    if (!lease) break;  // all out: what is not read ahead is read when asked for
    auto a = std::make_shared<Ahead>();
    a->buf = std::move(lease);
    a->off = pos;
    // Pieces end on a page boundary of the file, so only the first can start unaligned.
    a->len = std::min(kAheadChunk - pos % 4096, until - pos);
    // The completion holds the record, so its `file` outlives the request.
    Status st = g_engine->submit_pread(const_cast<char*>(a->data()), a->len, r.file, pos,
                                       [rp, a](const dnvme::OpResult& res) {
                                         std::lock_guard lock(rp->am);
                                         a->ok = res.status.ok();
                                         a->done = true;
                                         rp->acv.notify_all();
                                       });
    if (!st.ok()) break;
    r.ahead.push_back(std::move(a));
    pos += r.ahead.back()->len;
  }
}

// Copies what the read-ahead holds of [off, off + n) from its start into `buf`; returns the bytes
// copied. A failed piece drops the read-ahead: the caller reads the rest itself and so reports
// the error. Caller holds r.rm.
int64_t FromAhead(Record& r, char* buf, int64_t n, int64_t off) {
  int64_t done = 0;
  while (!r.ahead.empty() && done < n) {
    const Ahead& a = *r.ahead.front();
    const int64_t pos = off + done;
    if (a.off > pos) break;  // the reader is behind the read-ahead
    WaitAhead(r, a);
    if (!a.ok) {
      ForgetAheadLocked(r);
      break;
    }
    if (a.off + a.len <= pos) {  // behind the reader (it skipped past)
      r.ahead.pop_front();
      continue;
    }
    const int64_t take = std::min(n - done, a.off + a.len - pos);
    std::memcpy(buf + done, a.data() + (pos - a.off), static_cast<size_t>(take));
    done += take;
    if (pos + take == a.off + a.len) r.ahead.pop_front();
  }
  return done;
}

// ---- adoption ----

// Whether descriptors `a` and `b` of this process name the same open file (dup, fcntl, fork).
bool SameOpenFile(int a, int b) {
  return syscall(SYS_kcmp, getpid(), getpid(), KCMP_FILE, a, b) == 0;
}

// The record of `fd` if it is an adopted file still open as adopted; adopts an unknown one.
std::shared_ptr<Record> Lookup(int fd) {
  std::lock_guard lock(g_mu);
  auto it = g_records.find(fd);
  return it == g_records.end() ? nullptr : it->second;
}

// Forgets `fd`; returns the first write-behind error of its record when this was the record's last
// descriptor (close reports it), else 0.
int Drop(int fd) {
  std::shared_ptr<Record> r;
  bool last = false;
  {
    std::lock_guard lock(g_mu);
    auto it = g_records.find(fd);
    if (it != g_records.end()) {
      r = std::move(it->second);
      g_records.erase(it);
      last = --r->fds == 0;
    }
    SetState(fd, kUnknown);
  }
  if (!r) return 0;
  int err = WaitWrites(*r);
  // The last descriptor of the record: the lease ends (announcing what was written).
  if (last) {
    ForgetAhead(*r);
    EndLease(*r);
    return err;
  }
  if (err != 0) {  // not the last: the next fsync or close of the file reports it
    std::lock_guard lock(r->wm);
    r->first_err = err;
  }
  return 0;
}

std::shared_ptr<Record> Adopt(int fd) {
  if (!S().enabled) {
    SetState(fd, kNotOurs);
    return nullptr;
  }
  struct statfs sfs {};
  struct stat st {};
  if (fstatfs(fd, &sfs) != 0 || sfs.f_type != FUSE_SUPER_MAGIC || fstat(fd, &st) != 0 ||
      !S_ISREG(st.st_mode)) {
    SetState(fd, kNotOurs);
    return nullptr;
  }
  const int flags = C().fcntl(fd, F_GETFL);
  if (flags < 0 || (flags & O_APPEND) || (flags & O_PATH)) {
    SetState(fd, kNotOurs);
    return nullptr;
  }
  // A duplicate made before the file was adopted (dup, or the open file inherited twice) shares
  // the record already made for its open file: one offset, one write-behind, one lease.
  {
    std::lock_guard lock(g_mu);
    std::shared_ptr<Record> same;
    for (const auto& [n, rec] : g_records) {
      if (rec->witness >= 0 && SameOpenFile(fd, rec->witness)) {
        same = rec;
        break;
      }
    }
    if (same) {
      g_records[fd] = same;
      ++same->fds;
      SetState(fd, kOurs);
      return same;
    }
  }
  MountInfo m;
  std::shared_ptr<Conn> conn;
  {
    std::lock_guard lock(g_mu);
    auto it = g_conns.find(st.st_dev);
    if (it != g_conns.end()) conn = it->second;
  }
  if (!conn) {
    if (!FindMount(st.st_dev, &m) || !MountAllowed(m.point)) {
      SetState(fd, kNotOurs);
      return nullptr;
    }
    conn = Connect(m.point);
    if (!conn) {
      SetState(fd, kNotOurs);
      return nullptr;
    }
    std::lock_guard lock(g_mu);
    auto [it, fresh] = g_conns.emplace(st.st_dev, conn);
    if (!fresh) {  // another thread connected first
      C().close(conn->sock);
      munmap(conn->page, broker::kLeasePageBytes);
      conn = it->second;
    }
  }
  // The path inside the mount, as the kernel resolved it for this descriptor.
  char link[PATH_MAX + 1];
  const std::string proc = "/proc/self/fd/" + std::to_string(fd);
  ssize_t n = readlink(proc.c_str(), link, PATH_MAX);
  if (n <= 0) {
    SetState(fd, kNotOurs);
    return nullptr;
  }
  std::string path(link, static_cast<size_t>(n));
  const std::string prefix = conn->mountpoint == "/" ? "/" : conn->mountpoint + "/";
  if (path.compare(0, prefix.size(), prefix) != 0 ||
      (path.size() > 10 && path.compare(path.size() - 10, 10, " (deleted)") == 0)) {
    SetState(fd, kNotOurs);
    return nullptr;
  }
  const std::string rel = path.substr(prefix.size());
  AioHandle* engine = Engine();
  if (engine == nullptr || rel.size() >= broker::kMaxPath) {
    SetState(fd, kNotOurs);
    return nullptr;
  }
  broker::Request req;
  req.op = static_cast<uint32_t>(broker::Op::kOpen);
  req.ino = st.st_ino;
  req.flags = static_cast<uint32_t>(flags & O_ACCMODE);
  req.path_len = static_cast<uint32_t>(rel.size());
  std::memcpy(req.path, rel.data(), rel.size());
  broker::Reply rep;
  int fds[2] = {-1, -1};
  int nfds = 0;
  Status s;
  {
    std::lock_guard lock(conn->mu);
    s = Call(*conn, req, &rep, fds, 2, &nfds);
  }
  for (int i = 0; i < nfds; ++i) SetState(fds[i], kNotOurs);  // the engine's, not the program's
  if (s.ok() && nfds != ((rep.flags & broker::kHasDirect) ? 2 : 1)) {
    s = Status::IoError(EPROTO, "broker sent " + std::to_string(nfds) + " descriptors");
  }
  if (!s.ok()) {
    for (int i = 0; i < nfds; ++i) C().close(fds[i]);
    g_counters.refused.fetch_add(1, std::memory_order_relaxed);
    dnvme::Logger().debug("dnvme run: '{}' stays on the mount: {}", path, s.ToString());
    SetState(fd, kNotOurs);
    return nullptr;
  }
  auto r = std::make_shared<Record>();
  r->conn = conn;
  r->lease = rep.lease;
  r->word = &conn->page[rep.slot];
  const int acc = flags & O_ACCMODE;
  r->can_read = acc != O_WRONLY;
  r->can_write = acc != O_RDONLY;
  const auto access = acc == O_RDONLY   ? dnvme::FileAccess::kRead
                      : acc == O_WRONLY ? dnvme::FileAccess::kWrite
                                        : dnvme::FileAccess::kReadWrite;
  auto file = engine->adopt_fds(nfds == 2 ? fds[1] : -1, fds[0], access, path);
  r->witness = C().fcntl(fd, F_DUPFD_CLOEXEC, 0);
  SetState(r->witness, kNotOurs);
  if (!file.ok() || r->witness < 0) {
    dnvme::Logger().warn("dnvme run: '{}' stays on the mount: {}", path,
                         file.ok() ? std::string(std::strerror(errno)) : file.status().ToString());
    EndLease(*r);
    SetState(fd, kNotOurs);
    return nullptr;
  }
  r->file = std::move(file).value();
  g_counters.adopted.fetch_add(1, std::memory_order_relaxed);
  std::lock_guard lock(g_mu);
  g_records[fd] = r;
  ++r->fds;
  SetState(fd, kOurs);
  return r;
}

// The record to use for a transfer on `fd`, or null for "go through the mount".
std::shared_ptr<Record> ForTransfer(int fd) {
  uint8_t s = StateOf(fd);
  if (s == kNotOurs) return nullptr;
  if (s == kUnknown) return Adopt(fd);
  auto r = Lookup(fd);
  if (!r) return nullptr;
  // Still the same open file? (fclose and close_range close behind our back.)
  if (!SameOpenFile(fd, r->witness)) {
    g_counters.stale.fetch_add(1, std::memory_order_relaxed);
    Drop(fd);
    return Adopt(fd);
  }
  return r;
}

// Before the mount serves `fd` (a small transfer, mmap, fsync...): what this process wrote
// around it must be visible to the mount first.
void BeforeMountUse(int fd) {
  if (StateOf(fd) != kOurs) return;
  auto r = Lookup(fd);
  if (r && HasPending(*r)) {
    if (Status st = Announce(*r); !st.ok()) dnvme::Logger().warn("dnvme run: {}", st.ToString());
  }
}

// Before the mount changes `fd`'s file for this process (a small write, a truncate): what was
// read ahead may be stale after it.
void BeforeMountWrite(int fd) {
  BeforeMountUse(fd);
  if (StateOf(fd) != kOurs) return;
  if (auto r = Lookup(fd)) ForgetAhead(*r);
}

// ---- transfers ----

int ErrnoOf(const Status& st) { return st.error_number() != 0 ? st.error_number() : EIO; }

// A write piece left flight (landed, failed, or was never submitted). Caller holds r.wm.
void PieceDoneLocked(Record& r) {
  --r.inflight;
  r.word->writes_inflight.fetch_sub(1, std::memory_order_seq_cst);
  r.wcv.notify_all();
}

// Counts a write's pieces until each is in the kernel (AioHandle's Submitted notice).
//
// Wait() first yields for a moment before it sleeps: the engine's worker usually submits within
// tens of microseconds, and being woken from a futex costs about as much again. For a program
// writing 128 KiB per call on the RAM ext4 that was 1.2-1.4 GiB/s sleeping at once against
// 1.8-2.5 yielding first (the write-behind before the notice: 1.8-2.9); 1 MiB writes moved
// within the noise (docs/performance-journal.md, 2026-11-25).
struct SubmitLatch {
  std::mutex mu;
  std::condition_variable cv;
  std::atomic<int> left{0};  // written under mu

  void Add() {
    std::lock_guard lock(mu);
    left.fetch_add(1, std::memory_order_relaxed);
  }
  void Done() {
    std::lock_guard lock(mu);
    if (left.fetch_sub(1, std::memory_order_release) == 1) cv.notify_all();
  }
  void Wait() {
    for (int i = 0; i < kYields; ++i) {
      if (left.load(std::memory_order_acquire) == 0) return;
      std::this_thread::yield();
    }
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return left.load(std::memory_order_acquire) == 0; });
  }
  static constexpr int kYields = 200;
};

// Copies [buf, buf + n) into staging buffers and submits it at `off`; returns 0 or an errno once
// every piece is in the kernel: its O_DIRECT requests accepted by io_submit and its unaligned edges
// in the page cache. The kernel finishes submitted requests even if this process exits or is
// killed (exit_aio waits for them), so a write that returned survives the process as on ext4
// (a piece merely queued to an engine thread would die with it); the completions still come later,
// overlapping the program's next steps.
int WriteBehind(const std::shared_ptr<Record>& rec, const char* buf, size_t n, off_t off) {
  {
    // Found by the model test: an overwrite of bytes still in flight landed first, and the older
    // write then won. A sequential writer (the common case) never waits here.
    std::unique_lock lock(rec->wm);
    const int64_t end = static_cast<int64_t>(off) + static_cast<int64_t>(n);
    if (rec->inflight > 0 && off < rec->wb_hi && end > rec->wb_lo) {
      rec->wcv.wait(lock, [&] { return rec->inflight == 0; });
    }
  }
  auto latch = std::make_shared<SubmitLatch>();
  int err = 0;
  for (size_t done = 0; done < n;) {
    const size_t piece = std::min(n - done, kChunk);
    auto lease = std::make_shared<dnvme::PinnedPool::Lease>(g_pool->Acquire());
    // The same offset in the page as in the file: the engine's requests then go O_DIRECT from
    // the staging buffer, only the partial edge pages through the page cache.
    char* dst = lease->data() + (static_cast<size_t>(off) + done) % 4096;
    std::memcpy(dst, buf + done, piece);
    {
      std::lock_guard lock(rec->wm);
      if (rec->ended) {  // (the lease went with the last descriptor meanwhile)
        err = EBADF;
        break;
      }
      const int64_t lo = static_cast<int64_t>(off + done);
      const int64_t hi = lo + static_cast<int64_t>(piece);
      rec->wb_lo = rec->inflight == 0 ? lo : std::min(rec->wb_lo, lo);
      rec->wb_hi = rec->inflight == 0 ? hi : std::max(rec->wb_hi, hi);
      ++rec->inflight;
      // Counted before DirectIo reads `shared`: the daemon waits for it before it lets anyone
      // else open, truncate or stamp the file (include/dnvme/broker.h).
      rec->word->writes_inflight.fetch_add(1, std::memory_order_seq_cst);
    }
    latch->Add();
    Status st = g_engine->submit_pwrite(
        dst, static_cast<int64_t>(piece), rec->file, off + static_cast<off_t>(done),
        [rec, lease](const dnvme::OpResult& res) {
          lease->Reset();
          std::lock_guard lock(rec->wm);
          if (!res.status.ok() && rec->first_err == 0) {
            rec->first_err = ErrnoOf(res.status);
            g_counters.errors.fetch_add(1, std::memory_order_relaxed);
            dnvme::Logger().debug("dnvme run: {}", res.status.ToString());
          }
          PieceDoneLocked(*rec);
        },
        [latch] { latch->Done(); });
    if (!st.ok()) {
      latch->Done();
      std::lock_guard lock(rec->wm);
      PieceDoneLocked(*rec);
      err = ErrnoOf(st);
      break;
    }
    done += piece;
  }
  latch->Wait();
  return err;
}

// Reads [off, off + n) of a file of `size` bytes: from the read-ahead as far as it holds it, the
// rest directly into `buf`; then, for a sequential reader, queues the next bytes.
Status ReadThrough(const std::shared_ptr<Record>& rp, char* buf, int64_t n, int64_t off,
                   int64_t size) {
  Record& r = *rp;
  std::lock_guard lock(r.rm);
  // A file someone else has open may change under read-ahead: read only what is asked, now.
  if (n >= kAheadMaxRead || r.word->shared.load(std::memory_order_seq_cst) != 0 ||
      ReadPool() == nullptr) {
    ForgetAheadLocked(r);
    return g_engine->sync_pread(buf, n, r.file, off);
  }
  const bool sequential =
      r.next_read < 0 ? off == 0 : off >= r.next_read && off - r.next_read <= kAheadSkip;
  int64_t done = 0;
  if (sequential) {
    done = FromAhead(r, buf, n, off);
    g_counters.ahead_bytes.fetch_add(static_cast<uint64_t>(done), std::memory_order_relaxed);
  } else {
    ForgetAheadLocked(r);
  }
  // The rest now, before queueing more: it is what the program waits for.
  Status st;
  if (done < n) st = g_engine->sync_pread(buf + done, n - done, r.file, off + done);
  if (!st.ok()) {
    ForgetAheadLocked(r);
    return st;
  }
  r.next_read = off + n;
  if (sequential) {
    const int64_t window = static_cast<int64_t>(ReadPool()->count()) * kAheadChunk;
    QueueAhead(rp, off + n, std::min(size, off + n + window));
  }
  return st;
}

// ---- space for extending writes ----

// fallocate of the backing file, by this process: its own quotas apply, and ext4's root-reserved
// blocks only to root. Returns 0 or an errno.
int BackingFallocate(int fd, int mode, int64_t off, int64_t len) {
  int rc;
  do {
    rc = C().fallocate(fd, mode, off, len);
  } while (rc != 0 && errno == EINTR);
  return rc == 0 ? 0 : errno;
}

// Frees the blocks reserved past the end of the file, if its size is still `size` (nobody
// changed it since the caller looked): truncating a file to its own size frees what lies past
// it (ext4, tmpfs, xfs). Caller holds r.xm.
void TrimLocked(Record& r, int fd, int64_t size) {
  struct stat sb {};
  if (fstat(fd, &sb) == 0 && sb.st_size == size) (void)C().ftruncate(fd, size);
  r.resv_lo = r.resv_hi = 0;
  r.past_eof = false;
}

// Before a write of [off, end) that extends the file: space for it, then the new size. Returns 0,
// or an errno (ENOSPC, EDQUOT...) with the file as it was: the write fails at the call, and no
// zero-filled tail is left behind it (as the ftruncate that used to extend the file left one when
// the space ran out under the write-behind).
//
// The space is reserved past the end (fallocate KEEP_SIZE) and the size then raised with
// ftruncate: the engine's O_DIRECT requests then overwrite unwritten extents inside the file,
// which ext4 runs in parallel under its shared lock (a write past the end runs alone and
// synchronously). ext4's fallocate first waits for every O_DIRECT request in flight on the inode,
// while ftruncate does not: so a writer alone on its file reserves ahead in growing steps
// (kReserveMin..kReserveMax), and extends within the reservation with ftruncate alone; what is
// left past the end is freed when the lease ends or the process exits (TrimReservation). A file
// someone else has open gets exactly its writes' ranges (their truncates would free blocks past
// the end under a reservation). Writes inside the file reserve nothing: holes there are the
// program's own, and an error filling them comes at the next write, fsync or close.
int Reserve(Record& r, int64_t off, int64_t end) {
  std::lock_guard lock(r.xm);
  const int fd = r.file.buffered_fd();
  struct stat sb {};
  if (fstat(fd, &sb) != 0) return errno;
  const int64_t size = sb.st_size;
  if (end <= size) return 0;
  if (size < r.size_set) r.resv_lo = r.resv_hi = 0;  // shrunk meanwhile: blocks past it went too
  const int64_t from = std::max(off, size);
  if (!r.no_fallocate && !(from >= r.resv_lo && end <= r.resv_hi)) {
    int64_t hi = end;
    if (r.word->shared.load(std::memory_order_seq_cst) == 0) {
      hi = std::max(end, from + std::clamp(size, kReserveMin, kReserveMax));
    }
    int err = BackingFallocate(fd, FALLOC_FL_KEEP_SIZE, from, hi - from);
    if ((err == ENOSPC || err == EDQUOT) && hi > end) {  // not that much: just this write
      TrimLocked(r, fd, size);
      hi = end;
      err = BackingFallocate(fd, FALLOC_FL_KEEP_SIZE, from, end - from);
    }
    if (err == EOPNOTSUPP || err == ENOSYS) {
      r.no_fallocate = true;  // extended as before, by ftruncate alone
    } else if (err != 0) {
      TrimLocked(r, fd, size);  // what a failed fallocate allocated before it failed
      return err;
    } else {
      r.resv_lo = from;
      r.resv_hi = hi;
      r.past_eof = r.past_eof || hi > end;
    }
  }
  int rc;
  do {
    rc = C().ftruncate(fd, end);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) return errno;
  r.size_set = end;
  return 0;
}

// Frees what Reserve left past the end of the file, once this process's writes to it are done
// (the lease ends, or the process exits). Not while someone else has the file open: a write of
// theirs could extend it between our look at the size and the truncate to it.
void TrimReservation(Record& r) {
  if (!r.file.valid()) return;
  std::lock_guard lock(r.xm);
  if (!r.past_eof || r.word->shared.load(std::memory_order_seq_cst) != 0) return;
  struct stat sb {};
  if (fstat(r.file.buffered_fd(), &sb) == 0) TrimLocked(r, r.file.buffered_fd(), sb.st_size);
}

// Direct transfer at `off`; returns bytes moved or -1 with errno. Reads stop at end of file.
ssize_t DirectIo(const std::shared_ptr<Record>& rp, bool write, void* buf, size_t n, off_t off) {
  Record& r = *rp;
  if ((write && !r.can_write) || (!write && !r.can_read)) {
    errno = EBADF;
    return -1;
  }
  // Reads see this process's writes: let its write-behind land first. An earlier write's error
  // is reported now, by the next write.
  if (!write) {
    DrainWrites(r);
  } else {
    std::lock_guard lock(r.wm);
    if (r.first_err != 0) {
      errno = r.first_err;
      r.first_err = 0;
      return -1;
    }
  }
  const bool mount_dirty = r.word->mount_dirty.load(std::memory_order_seq_cst) != 0;
  // What was read ahead may be older than the file after this write, or once someone wrote
  // through the mount.
  if (write || mount_dirty) ForgetAhead(r);
  if (mount_dirty) {
    g_counters.drains.fetch_add(1, std::memory_order_relaxed);
    if (Status st = LeaseCall(r, broker::Op::kDrain, 0, 0); !st.ok()) {
      errno = ErrnoOf(st);
      return -1;
    }
  }
  AioHandle* engine = g_engine;
  Status st;
  if (write) {
    // ext4 runs an O_DIRECT write that extends the file synchronously, one request after the
    // other (it must update the size when the data is in): reserve the space and extend the file
    // first, so the engine's requests run queue_depth deep into the new range. A reader may see
    // the new size before the bytes, as with any write still in progress.
    if (int err = Reserve(r, off, static_cast<int64_t>(off) + static_cast<int64_t>(n)); err != 0) {
      g_counters.errors.fetch_add(1, std::memory_order_relaxed);
      errno = err;
      return -1;
    }
    if (WritePool() != nullptr) {
      if (int err = WriteBehind(rp, static_cast<const char*>(buf), n, off); err != 0) {
        // Pieces submitted before the failure may still land: announce the range all the same.
        NoteWritten(r, off, static_cast<int64_t>(n));
        errno = err;
        return -1;
      }
    } else {
      st = engine->sync_pwrite(buf, static_cast<int64_t>(n), r.file, off);
    }
  } else {
    {
      std::lock_guard lock(r.mu);
      if (r.mapped) {
        // The program may have written through its mapping: those pages are the kernel's, and
        // only the mount reads them.
        return C().pread(r.witness, buf, n, off);
      }
    }
    struct stat sb {};
    if (fstat(r.file.buffered_fd(), &sb) != 0) return -1;
    if (off >= sb.st_size) return 0;
    n = static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(n), sb.st_size - off));
    st = ReadThrough(rp, static_cast<char*>(buf), static_cast<int64_t>(n), off, sb.st_size);
    if (st.code() == Status::Code::kEndOfFile) {
      // Truncated meanwhile: let the mount answer with what is there.
      return C().pread(r.witness, buf, n, off);
    }
  }
  if (!st.ok()) {
    g_counters.errors.fetch_add(1, std::memory_order_relaxed);
    dnvme::Logger().debug("dnvme run: {}", st.ToString());
    errno = ErrnoOf(st);
    return -1;
  }
  if (write) {
    g_counters.writes.fetch_add(1, std::memory_order_relaxed);
    g_counters.bytes_written.fetch_add(n, std::memory_order_relaxed);
    NoteWritten(r, off, static_cast<int64_t>(n));
    bool now;
    {
      std::lock_guard lock(r.mu);
      now = r.mapped;
    }
    if (now || r.word->shared.load(std::memory_order_seq_cst) != 0) {
      if (Status a = Announce(r); !a.ok()) {
        errno = ErrnoOf(a);
        return -1;
      }
    }
  } else {
    g_counters.reads.fetch_add(1, std::memory_order_relaxed);
    g_counters.bytes_read.fetch_add(n, std::memory_order_relaxed);
  }
  return static_cast<ssize_t>(n);
}

// read/write at the descriptor's offset: the kernel's, in the program's descriptor.
// `io(off)` (a direct pread/pwrite-like transfer) at the descriptor's offset, which it advances.
template <typename Io>
ssize_t AtOffset(int fd, Io io) {
  off_t off = lseek(fd, 0, SEEK_CUR);
  if (off < 0) return -1;
  ssize_t got = io(off);
  if (got > 0 && lseek(fd, off + got, SEEK_SET) < 0) return -1;
  return got;
}

size_t IovBytes(const iovec* iov, int cnt) {
  size_t total = 0;
  for (int i = 0; i < cnt; ++i) total += iov[i].iov_len;
  return total;
}

// Vectored: one direct transfer per element, in order; stops at the first short one.
ssize_t DirectVec(const std::shared_ptr<Record>& r, bool write, const iovec* iov, int cnt,
                  off_t off) {
  ssize_t total = 0;
  for (int i = 0; i < cnt; ++i) {
    if (iov[i].iov_len == 0) continue;
    ssize_t got = DirectIo(r, write, iov[i].iov_base, iov[i].iov_len, off + total);
    if (got < 0 && total > 0 && write) {
      // The call returns the bytes already written; the error (a write-behind error DirectIo
      // took, say) must still reach the program: keep it for the next write, fsync or close.
      std::lock_guard lock(r->wm);
      if (r->first_err == 0) r->first_err = errno;
    }
    if (got < 0) return total > 0 ? total : -1;
    total += got;
    if (static_cast<size_t>(got) < iov[i].iov_len) break;
  }
  return total;
}

bool Large(size_t n) { return static_cast<int64_t>(n) >= S().min_bytes; }

// ---- process lifetime ----

void WriteStats() {
  if (S().stats_file.empty()) return;
  auto v = [](const std::atomic<uint64_t>& a) { return std::to_string(a.load()); };
  std::string line =
      "{\"pid\": " + std::to_string(getpid()) + ", \"adopted\": " + v(g_counters.adopted) +
      ", \"refused\": " + v(g_counters.refused) + ", \"reads\": " + v(g_counters.reads) +
      ", \"writes\": " + v(g_counters.writes) + ", \"bytes_read\": " + v(g_counters.bytes_read) +
      ", \"bytes_written\": " + v(g_counters.bytes_written) +
      ", \"drains\": " + v(g_counters.drains) +
      ", \"invalidations\": " + v(g_counters.invalidations) +
      ", \"errors\": " + v(g_counters.errors) + ", \"stale\": " + v(g_counters.stale) +
      ", \"readahead_bytes\": " + v(g_counters.ahead_bytes) + "}\n";
  int fd = C().open(S().stats_file.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return;
  ssize_t n;
  do {
    n = C().write(fd, line.data(), line.size());
  } while (n < 0 && errno == EINTR);
  C().close(fd);
}

void AtExit() {
  AnnounceAll();
  std::vector<std::shared_ptr<Record>> all;
  {
    std::lock_guard lock(g_mu);
    for (auto& [fd, r] : g_records) all.push_back(r);
  }
  for (auto& r : all) {
    DrainWrites(*r);
    TrimReservation(*r);
  }
  WriteStats();
}

void ForkPrepare() {
  AnnounceAll();
  g_mu.lock();
}
void ForkParent() { g_mu.unlock(); }
void ForkChild() {
  // Only this thread survived: the engine's workers and every lock holder are gone. Forget it
  // all (leaking the engine: its destructor would wait for threads that do not exist here); the
  // parent's leases stay the parent's, and this process adopts its files again when it uses them.
  new (&g_mu) std::mutex();
  for (auto& [dev, c] : g_conns) {
    new (&c->mu) std::mutex();
    C().close(c->sock);
    c->sock = -1;
  }
  for (auto& [fd, r] : g_records) {
    if (r->witness >= 0) C().close(r->witness);
    r->witness = -1;
    SetState(fd, kUnknown);
  }
  // Leak the records' engine-side state too: their FileRefs may be referenced by the leaked
  // engine's (dead) operations.
  new (&g_records) std::unordered_map<int, std::shared_ptr<Record>>();
  new (&g_conns) std::map<dev_t, std::shared_ptr<Conn>>();
  g_engine = nullptr;
  g_engine_failed = false;
  // The pools' locks may have been held by a thread that is gone: new ones come with the engine.
  g_pool = nullptr;
  g_rpool = nullptr;
  g_pool_tried.store(false);
  g_rpool_tried.store(false);
  // This process's counters are its own (its stats line says what it did).
  for (auto* c : {&g_counters.adopted, &g_counters.refused, &g_counters.reads, &g_counters.writes,
                  &g_counters.bytes_read, &g_counters.bytes_written, &g_counters.drains,
                  &g_counters.invalidations, &g_counters.errors, &g_counters.stale,
                  &g_counters.ahead_bytes}) {
    c->store(0);
  }
}

__attribute__((constructor)) void Init() {
  (void)C();
  (void)S();
  pthread_atfork(ForkPrepare, ForkParent, ForkChild);
  atexit(AtExit);
}

// `nfd` (or -1) was just made a duplicate of `fd` (dup, dup2, dup3, F_DUPFD): the same open
// file, so the same record. Returns nfd.
int Duplicated(int fd, int nfd) {
  if (nfd < 0) return nfd;
  if (StateOf(nfd) == kOurs) Drop(nfd);  // a number freed behind our back (fclose, close_range)
  std::lock_guard lock(g_mu);
  auto it = g_records.find(fd);
  if (it != g_records.end()) {
    g_records[nfd] = it->second;
    ++it->second->fds;
    SetState(nfd, kOurs);
  } else {
    SetState(nfd, StateOf(fd) == kNotOurs ? kNotOurs : kUnknown);
  }
  return nfd;
}

// `fd`'s open file leaves the engine (it becomes O_APPEND): every descriptor of its record goes
// back to the mount once the record's writes landed and were announced. Returns the first error
// of those writes, 0 if none.
int Disown(int fd) {
  std::shared_ptr<Record> r = Lookup(fd);
  if (!r) return 0;
  std::vector<int> fds;
  {
    std::lock_guard lock(g_mu);
    for (const auto& [n, rec] : g_records) {
      if (rec == r) fds.push_back(n);
    }
  }
  int err = 0;
  for (int n : fds) {
    if (int e = Drop(n); e != 0) err = e;
    SetState(n, kNotOurs);
  }
  return err;
}

// `fd` is being closed: forgets it; returns the first write-behind error of its record when this
// was the record's last descriptor (close reports it), else 0.
int ForgetClosing(int fd) {
  if (StateOf(fd) == kOurs) return Drop(fd);
  SetState(fd, kUnknown);
  return 0;
}

// A call's result after libc's: an earlier write-behind error `err`, if any, is what it reports.
int ErrorFirst(int err, int rc) {
  if (err == 0) return rc;
  errno = err;
  return -1;
}

int OpenResult(int fd) {
  if (fd >= 0) {
    // A number reused behind our back (closed by fclose, say) is a new file.
    if (StateOf(fd) == kOurs) {
      Drop(fd);
    } else {
      SetState(fd, kUnknown);
    }
  }
  return fd;
}

mode_t ModeArg(int flags, va_list ap) {
  return (flags & (O_CREAT | __O_TMPFILE)) ? static_cast<mode_t>(va_arg(ap, int)) : 0;
}

}  // namespace

// ---- what stdio.cc uses (preload/internal.h) ----

namespace dnvme::preload {

bool IsLarge(size_t n) { return Large(n); }

bool DirectAtOffset(int fd, bool write, void* buf, size_t n, ssize_t* got) {
  auto r = ForTransfer(fd);
  if (!r) return false;
  *got = AtOffset(fd, [&](off_t off) { return DirectIo(r, write, buf, n, off); });
  return true;
}

void BeforeMountUse(int fd) { ::BeforeMountUse(fd); }
void BeforeMountWrite(int fd) { ::BeforeMountWrite(fd); }

int ForgetBeforeClose(int fd) { return ForgetClosing(fd); }

void AnnounceEverything() { AnnounceAll(); }

}  // namespace dnvme::preload

// ---- the interposed functions ----

extern "C" {

ssize_t read(int fd, void* buf, size_t n) {
  ssize_t got;
  if (Large(n) && dnvme::preload::DirectAtOffset(fd, false, buf, n, &got)) return got;
  BeforeMountUse(fd);
  return C().read(fd, buf, n);
}

ssize_t write(int fd, const void* buf, size_t n) {
  ssize_t got;
  if (Large(n) && dnvme::preload::DirectAtOffset(fd, true, const_cast<void*>(buf), n, &got)) {
    return got;
  }
  BeforeMountWrite(fd);
  return C().write(fd, buf, n);
}

ssize_t pread(int fd, void* buf, size_t n, off_t off) {
  if (Large(n) && StateOf(fd) != kNotOurs && off >= 0) {
    if (auto r = ForTransfer(fd)) return DirectIo(r, false, buf, n, off);
  }
  BeforeMountUse(fd);
  return C().pread(fd, buf, n, off);
}
ssize_t pread64(int fd, void* buf, size_t n, off_t off) { return pread(fd, buf, n, off); }

ssize_t pwrite(int fd, const void* buf, size_t n, off_t off) {
  if (Large(n) && StateOf(fd) != kNotOurs && off >= 0) {
    if (auto r = ForTransfer(fd)) return DirectIo(r, true, const_cast<void*>(buf), n, off);
  }
  BeforeMountWrite(fd);
  return C().pwrite(fd, buf, n, off);
}
ssize_t pwrite64(int fd, const void* buf, size_t n, off_t off) { return pwrite(fd, buf, n, off); }

ssize_t readv(int fd, const iovec* iov, int cnt) {
  if (cnt > 0 && Large(IovBytes(iov, cnt)) && StateOf(fd) != kNotOurs) {
    if (auto r = ForTransfer(fd)) {
      return AtOffset(fd, [&](off_t off) { return DirectVec(r, false, iov, cnt, off); });
    }
  }
  BeforeMountUse(fd);
  return C().readv(fd, iov, cnt);
}

ssize_t writev(int fd, const iovec* iov, int cnt) {
  if (cnt > 0 && Large(IovBytes(iov, cnt)) && StateOf(fd) != kNotOurs) {
    if (auto r = ForTransfer(fd)) {
      return AtOffset(fd, [&](off_t off) { return DirectVec(r, true, iov, cnt, off); });
    }
  }
  BeforeMountWrite(fd);
  return C().writev(fd, iov, cnt);
}

ssize_t preadv(int fd, const iovec* iov, int cnt, off_t off) {
  if (cnt > 0 && off >= 0 && Large(IovBytes(iov, cnt)) && StateOf(fd) != kNotOurs) {
    if (auto r = ForTransfer(fd)) return DirectVec(r, false, iov, cnt, off);
  }
  BeforeMountUse(fd);
  return C().preadv(fd, iov, cnt, off);
}
ssize_t preadv64(int fd, const iovec* iov, int cnt, off_t off) { return preadv(fd, iov, cnt, off); }

ssize_t pwritev(int fd, const iovec* iov, int cnt, off_t off) {
  if (cnt > 0 && off >= 0 && Large(IovBytes(iov, cnt)) && StateOf(fd) != kNotOurs) {
    if (auto r = ForTransfer(fd)) return DirectVec(r, true, iov, cnt, off);
  }
  BeforeMountWrite(fd);
  return C().pwritev(fd, iov, cnt, off);
}
ssize_t pwritev64(int fd, const iovec* iov, int cnt, off_t off) {
  return pwritev(fd, iov, cnt, off);
}

// The flags (RWF_*) ask for things only the kernel's path gives (RWF_APPEND, RWF_NOWAIT...):
// with any flag, or the current offset (-1), the mount serves the call.
ssize_t preadv2(int fd, const iovec* iov, int cnt, off_t off, int flags) {
  if (flags == 0 && off >= 0) return preadv(fd, iov, cnt, off);
  BeforeMountUse(fd);
  return C().preadv2(fd, iov, cnt, off, flags);
}
ssize_t preadv64v2(int fd, const iovec* iov, int cnt, off_t off, int flags) {
  return preadv2(fd, iov, cnt, off, flags);
}
ssize_t pwritev2(int fd, const iovec* iov, int cnt, off_t off, int flags) {
  if (flags == 0 && off >= 0) return pwritev(fd, iov, cnt, off);
  BeforeMountWrite(fd);
  return C().pwritev2(fd, iov, cnt, off, flags);
}
ssize_t pwritev64v2(int fd, const iovec* iov, int cnt, off_t off, int flags) {
  return pwritev2(fd, iov, cnt, off, flags);
}

int open(const char* path, int flags, ...) {
  va_list ap;
  va_start(ap, flags);
  const mode_t mode = ModeArg(flags, ap);
  va_end(ap);
  return OpenResult(C().open(path, flags, mode));
}
int open64(const char* path, int flags, ...) {
  va_list ap;
  va_start(ap, flags);
  const mode_t mode = ModeArg(flags, ap);
  va_end(ap);
  return OpenResult(C().open64(path, flags, mode));
}
int openat(int dirfd, const char* path, int flags, ...) {
  va_list ap;
  va_start(ap, flags);
  const mode_t mode = ModeArg(flags, ap);
  va_end(ap);
  return OpenResult(C().openat(dirfd, path, flags, mode));
}
int openat64(int dirfd, const char* path, int flags, ...) {
  va_list ap;
  va_start(ap, flags);
  const mode_t mode = ModeArg(flags, ap);
  va_end(ap);
  return OpenResult(C().openat64(dirfd, path, flags, mode));
}
int creat(const char* path, mode_t mode) { return OpenResult(C().creat(path, mode)); }
int creat64(const char* path, mode_t mode) { return OpenResult(C().creat64(path, mode)); }

int close(int fd) {
  const int err = ForgetClosing(fd);  // a write-behind error of the file's last descriptor
  return ErrorFirst(err, C().close(fd));
}

int dup(int fd) {
  BeforeMountUse(fd);
  return Duplicated(fd, C().dup(fd));
}

int dup2(int fd, int nfd) {
  BeforeMountUse(fd);
  if (fd != nfd && StateOf(nfd) == kOurs) Drop(nfd);  // dup2 closes nfd first
  const int rc = C().dup2(fd, nfd);
  return fd == nfd ? rc : Duplicated(fd, rc);
}

int dup3(int fd, int nfd, int flags) {
  BeforeMountUse(fd);
  if (fd != nfd && StateOf(nfd) == kOurs) Drop(nfd);
  return Duplicated(fd, C().dup3(fd, nfd, flags));
}

// fcntl's third argument is an int, a long or a pointer by command; passing it on as a pointer
// hands every one over unchanged (the x86-64 and aarch64 calling conventions carry each in a full
// register). Python's os.dup is F_DUPFD_CLOEXEC.
int fcntl(int fd, int cmd, ...) {
  va_list ap;
  va_start(ap, cmd);
  void* arg = va_arg(ap, void*);
  va_end(ap);
  switch (cmd) {
    case F_DUPFD:
    case F_DUPFD_CLOEXEC:
      BeforeMountUse(fd);
      return Duplicated(fd, C().fcntl(fd, cmd, static_cast<int>(reinterpret_cast<intptr_t>(arg))));
    case F_SETFL: {
      // Appends must stay atomic at the end of the file: the mount serves it from now on. What
      // this process wrote directly lands first; a failure of it is this call's (flags unset).
      if ((reinterpret_cast<intptr_t>(arg) & O_APPEND) && StateOf(fd) == kOurs) {
        if (int err = Disown(fd); err != 0) {
          errno = err;
          return -1;
        }
      }
      return C().fcntl(fd, cmd, static_cast<int>(reinterpret_cast<intptr_t>(arg)));
    }
    default:
      return C().fcntl(fd, cmd, arg);
  }
}
int fcntl64(int fd, int cmd, ...) {
  va_list ap;
  va_start(ap, cmd);
  void* arg = va_arg(ap, void*);
  va_end(ap);
  return fcntl(fd, cmd, arg);
}

// The kernel copies these through the mount: it must see this process's direct writes of the
// source first, and what was read ahead of the destination is stale after them.
ssize_t copy_file_range(int in, off64_t* in_off, int out, off64_t* out_off, size_t len,
                        unsigned flags) {
  BeforeMountUse(in);
  BeforeMountWrite(out);
  return C().copy_file_range(in, in_off, out, out_off, len, flags);
}
ssize_t sendfile(int out, int in, off_t* off, size_t count) {
  BeforeMountUse(in);
  BeforeMountWrite(out);
  return C().sendfile(out, in, off, count);
}
ssize_t sendfile64(int out, int in, off64_t* off, size_t count) {
  return sendfile(out, in, off, count);
}
ssize_t splice(int in, off64_t* in_off, int out, off64_t* out_off, size_t len, unsigned flags) {
  BeforeMountUse(in);
  BeforeMountWrite(out);
  return C().splice(in, in_off, out, out_off, len, flags);
}

// The write-behind's first error, once it all landed (0 when `fd` is not adopted).
static int LandWrites(int fd) {
  if (StateOf(fd) != kOurs) return 0;
  auto r = Lookup(fd);
  return r ? WaitWrites(*r) : 0;
}

int fsync(int fd) {
  const int err = LandWrites(fd);
  BeforeMountUse(fd);  // the kernel's view first; the daemon's fsync covers the direct bytes too
  return ErrorFirst(err, C().fsync(fd));
}

int fdatasync(int fd) {
  const int err = LandWrites(fd);
  BeforeMountUse(fd);
  return ErrorFirst(err, C().fdatasync(fd));
}

int ftruncate(int fd, off_t len) {
  BeforeMountWrite(fd);
  std::shared_ptr<Record> r = StateOf(fd) == kOurs ? Lookup(fd) : nullptr;
  if (!r) return C().ftruncate(fd, len);
  // A shrink frees the blocks reserved past the end: forget the reservation (what a grow leaves
  // past the new end is still trimmed at the end of the lease).
  std::lock_guard lock(r->xm);
  const int rc = C().ftruncate(fd, len);
  r->resv_lo = r->resv_hi = 0;
  r->size_set = -1;
  return rc;
}
int ftruncate64(int fd, off_t len) { return ftruncate(fd, len); }

// Every mode reaches the backing file for an adopted file: the FUSE kernel refuses all but
// KEEP_SIZE, PUNCH_HOLE and ZERO_RANGE before the daemon sees them (so COLLAPSE_RANGE and
// INSERT_RANGE would fail with EOPNOTSUPP through the mount). This process's writes land first
// (the call may move or drop their bytes), what the mount's write-behind holds is drained into
// the file, and the change is announced at once, as a write seen by others is (the kernel drops
// its cached pages and attributes of the whole file).
int fallocate(int fd, int mode, off_t off, off_t len) {
  std::shared_ptr<Record> r = StateOf(fd) == kNotOurs ? nullptr : ForTransfer(fd);
  if (!r) {
    BeforeMountWrite(fd);
    return C().fallocate(fd, mode, off, len);
  }
  if (!r->can_write) {
    errno = EBADF;
    return -1;
  }
  DrainWrites(*r);
  ForgetAhead(*r);
  if (r->word->mount_dirty.load(std::memory_order_seq_cst) != 0) {
    g_counters.drains.fetch_add(1, std::memory_order_relaxed);
    if (Status st = LeaseCall(*r, broker::Op::kDrain, 0, 0); !st.ok()) {
      errno = ErrnoOf(st);
      return -1;
    }
  }
  int err;
  {
    std::lock_guard lock(r->xm);
    err = BackingFallocate(r->file.buffered_fd(), mode, off, len);
    // Shifted, punched or grown: Reserve looks again.
    r->resv_lo = r->resv_hi = 0;
    r->size_set = -1;
  }
  if (err != 0) {
    errno = err;
    return -1;
  }
  NoteWritten(*r, off, len);
  if (Status st = Announce(*r); !st.ok()) {
    errno = ErrnoOf(st);
    return -1;
  }
  return 0;
}
int fallocate64(int fd, int mode, off_t off, off_t len) { return fallocate(fd, mode, off, len); }

void* mmap(void* addr, size_t len, int prot, int flags, int fd, off_t off) {
  if (fd >= 0 && StateOf(fd) == kOurs) {
    BeforeMountUse(fd);
    if (auto r = Lookup(fd)) {
      std::lock_guard lock(r->mu);
      r->mapped = true;  // the mapping's pages are the kernel's: announce every write now
    }
  }
  return C().mmap(addr, len, prot, flags, fd, off);
}
void* mmap64(void* addr, size_t len, int prot, int flags, int fd, off_t off) {
  return mmap(addr, len, prot, flags, fd, off);
}

int execve(const char* path, char* const argv[], char* const envp[]) {
  AnnounceAll();
  return C().execve(path, argv, envp);
}
int execv(const char* path, char* const argv[]) {
  AnnounceAll();
  return C().execv(path, argv);
}
int execvp(const char* file, char* const argv[]) {
  AnnounceAll();
  return C().execvp(file, argv);
}
int execvpe(const char* file, char* const argv[], char* const envp[]) {
  AnnounceAll();
  return C().execvpe(file, argv, envp);
}
int posix_spawn(pid_t* pid, const char* path, const posix_spawn_file_actions_t* fa,
                const posix_spawnattr_t* attr, char* const argv[], char* const envp[]) {
  AnnounceAll();
  return C().posix_spawn(pid, path, fa, attr, argv, envp);
}
int posix_spawnp(pid_t* pid, const char* file, const posix_spawn_file_actions_t* fa,
                 const posix_spawnattr_t* attr, char* const argv[], char* const envp[]) {
  AnnounceAll();
  return C().posix_spawnp(pid, file, fa, attr, argv, envp);
}

}  // extern "C"
