// What the kernel offers beyond libfuse 3.14's protocol 7.38, negotiated by us on the wire.
//
// libfuse 3.14 answers INIT itself and knows nothing newer than 7.38, so features of later
// protocol versions never reach a filesystem built on it. The reply is still ours to write: the
// session's replies go through fuse_custom_io (installed by the composition root), and this class
// adds to the INIT reply what libfuse leaves out. Today that is FUSE passthrough (7.40,
// CONFIG_FUSE_PASSTHROUGH): the FUSE_PASSTHROUGH bit of flags2 and max_stack_depth. With it the
// daemon may register a backing file (FUSE_DEV_IOC_BACKING_OPEN, CAP_SYS_ADMIN) and answer an
// OPEN with FOPEN_PASSTHROUGH and its backing_id: the kernel then serves that open's read, write,
// splice and mmap from the backing file itself, with no request to the daemon and no copy through
// /dev/fuse (fs/fuse/passthrough.h decides per open).
//
// Two more additions to the reply:
//   - FUSE_DIRECT_IO_ALLOW_MMAP (7.39): opens answered FOPEN_DIRECT_IO may still be mmapped
//     (MAP_SHARED through the page cache, which the kernel then keeps coherent with the direct
//     writes). Without it such an mmap fails with ENODEV, so O_RDWR opens get direct_io only with
//     it (fs/fuse/ops_file.cc).
//   - max_pages one above max_write's pages: a writer's buffer that is not page-aligned spans
//     one page more than its length, and with exactly max_write/4 KiB pages the kernel would cut
//     every max_write-sized write from such a buffer into a long and a 16-byte request (which
//     write-behind still writes from the request buffer, datapath/write_behind.h, at one more
//     round trip each). The kernel clamps max_pages to fs.fuse.max_pages_limit (256 by
//     default): only where that was raised does this take effect.
//
// The kernel agrees to passthrough only when it offered it (the INIT request's flags2), the reply
// has max_stack_depth in 1..FILESYSTEM_MAX_STACK_DEPTH and no writeback cache. Whether it really
// did shows at the first BACKING_OPEN: EPERM there means it did not (OpenBacking then turns the
// feature off for the session, logged).
//
// Thread contract: Want and set_device_fd before the session loop starts. ObserveRequest and
// WriteReply may run on any loop thread at once (atomics; before INIT is answered the kernel sends
// nothing else). OpenBacking/CloseBacking from any handler. Accessors any time.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "dnvme/status.h"

namespace dnvme::fs {

// The parts of the 7.40 protocol Debian 12's <linux/fuse.h> (7.38) does not declare.
namespace wire {
inline constexpr uint32_t kOpInit = 26;                      // FUSE_INIT
inline constexpr uint64_t kInitExt = uint64_t{1} << 30;      // FUSE_INIT_EXT: flags2 is valid
inline constexpr uint64_t kPassthrough = uint64_t{1} << 37;  // FUSE_PASSTHROUGH (in flags2)
inline constexpr uint64_t kOverIoUring = uint64_t{1} << 41;  // FUSE_OVER_IO_URING (7.42)
inline constexpr uint64_t kWritebackCache = uint64_t{1} << 16;
inline constexpr uint64_t kMaxPages = uint64_t{1} << 22;           // FUSE_MAX_PAGES
inline constexpr uint64_t kDirectIoAllowMmap = uint64_t{1} << 36;  // 7.39, in flags2
inline constexpr uint32_t kOpenPassthrough = 1u << 7;              // FOPEN_PASSTHROUGH
inline constexpr uint32_t kOpenDirectIo = 1u << 0;                 // FOPEN_DIRECT_IO
// FUSE_NOTIFY_PRUNE (7.45): asks the kernel to drop its unused dentries of the inodes named,
// and so forget those nothing else holds. The notification: fuse_out_header with error = 9 and
// unique = 0, this, then `count` node ids (u64).
inline constexpr int32_t kNotifyPrune = 9;
inline constexpr uint32_t kPruneMinor = 45;
struct NotifyPruneOut {
  uint32_t count;
  uint32_t padding;
  uint64_t spare;
};
static_assert(sizeof(NotifyPruneOut) == 16);
// Byte offsets in fuse_init_in / fuse_init_out (7.36+ layouts; both 64 bytes from 7.36 on).
inline constexpr size_t kInitInFlags = 12, kInitInFlags2 = 16;
inline constexpr size_t kInitOutMinor = 4, kInitOutFlags = 12, kInitOutFlags2 = 32;
inline constexpr size_t kInitOutMaxStackDepth = 36, kInitOutBytes = 64;
inline constexpr size_t kInitOutMaxWrite = 20, kInitOutMaxPages = 28;  // u32, u16
// fuse_open_out from 7.40: the old padding is the backing id.
struct OpenOut {
  uint64_t fh;
  uint32_t open_flags;
  int32_t backing_id;
};
static_assert(sizeof(OpenOut) == 16);
struct BackingMap {  // FUSE_DEV_IOC_BACKING_OPEN's argument
  int32_t fd;
  uint32_t flags;
  uint64_t padding;
};
}  // namespace wire

class ProtocolExtensions {
 public:
  struct Wanted {
    bool passthrough = false;
    bool io_uring = false;        // the transport is FUSE over io_uring (fs/transport/uring_loop.h)
    bool direct_io_mmap = false;  // FUSE_DIRECT_IO_ALLOW_MMAP, where the kernel offers it
    bool spare_page = false;      // max_pages = max_write / 4 KiB + 1 (above)
    // The largest request the transport reads (max_request). libfuse 3.17 clamps the reply's
    // max_write to its own 1 MiB buffers, which the daemon's loops do not use, after init()
    // (fs/fuse_compat.h); the reply gets it back, with the pages for it. 0: libfuse's.
    uint32_t max_write = 0;
  };
  ProtocolExtensions() = default;
  // What to ask for at INIT; call before the session loop runs (the daemon knows only after its
  // capability drop whether it may use passthrough).
  void Want(Wanted wanted) { wanted_ = wanted; }

  // The /dev/fuse descriptor the backing-file ioctls go to (after the mount).
  void set_device_fd(int fd) { device_fd_ = fd; }

  // Looks at a request before libfuse does; remembers what the kernel offers at INIT. Cheap for
  // every other request (one compare).
  void ObserveRequest(const void* mem, size_t size);
  // Writes one reply or notification to /dev/fuse (fuse_custom_io::writev): writev(2) after
  // adding our extensions to the INIT reply. Returns what writev returns (errno set on -1).
  ssize_t WriteReply(int fd, iovec* iov, int count);

  // Registers the file `fd` refers to (an O_PATH descriptor is enough) as a backing file;
  // returns its id. Needs CAP_SYS_ADMIN in the calling thread's effective set. EPERM from a
  // kernel that did not agree to passthrough turns passthrough() off for good.
  Result<int32_t> OpenBacking(int fd);
  Status CloseBacking(int32_t id);

  // Sends FUSE_NOTIFY_PRUNE for `nodeids` (InodeTable's pruner). Unsupported before INIT or from
  // a kernel older than protocol 7.45. The kernel may evict inodes, which can wait for their
  // pages' writeback: never call it on a loop thread.
  Status NotifyPrune(const std::vector<uint64_t>& nodeids);
  bool prune_supported() const { return kernel_minor_.load() >= wire::kPruneMinor; }

  bool passthrough_wanted() const { return wanted_.passthrough; }
  // The kernel offered it at INIT.
  bool passthrough_offered() const { return offered_.load() & wire::kPassthrough; }
  // Asked for in the INIT reply, and not refused since.
  bool passthrough() const { return passthrough_.load(); }
  // INIT has been answered (with or without our extensions).
  bool init_replied() const { return init_done_.load(); }
  // FUSE_OVER_IO_URING was in our INIT reply: ring entries may be registered.
  bool uring() const { return uring_.load(); }
  uint32_t kernel_minor() const { return kernel_minor_.load(); }
  // FUSE_DIRECT_IO_ALLOW_MMAP is in effect: a FOPEN_DIRECT_IO open may be mmapped.
  bool direct_io_mmap() const { return direct_io_mmap_.load(); }
  // The max_pages our INIT reply asked for (0 before INIT); the kernel clamps it to
  // fs.fuse.max_pages_limit.
  uint32_t max_pages_asked() const { return max_pages_asked_.load(); }
  // {"kernel_protocol": "7.N", "passthrough": {"wanted","offered","on"}}
  std::string StatsJson() const;

 private:
  Wanted wanted_;
  int device_fd_ = -1;
  std::atomic<uint64_t> offered_{0};
  std::atomic<uint32_t> kernel_minor_{0};
  std::atomic<bool> init_seen_{false};
  std::atomic<bool> init_replied_{false};
  std::atomic<bool> passthrough_{false};
  std::atomic<bool> uring_{false};
  std::atomic<bool> direct_io_mmap_{false};
  std::atomic<uint32_t> max_pages_asked_{0};
  std::atomic<bool> init_done_{false};
};

}  // namespace dnvme::fs
