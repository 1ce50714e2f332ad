// Transport: how FUSE requests get from /dev/fuse to the handlers (fs/fuse/), and what a handler
// may learn from it about the request it serves.
//
// Four forms, picked by the mount's options (CreateTransport):
//   kSplice   our loop; each request is spliced into the thread's pipe, so a page-cache WRITE's
//             payload reaches write_buf as page references (datapath/splice_io.h moves them to
//             the disk without a copy). The loop itself steers: it reads (read(2)) instead while
//             the large WRITEs it sees come from callers' own pages (O_DIRECT), which splice would
//             only copy (fs/transport/splice_loop.h).
//   kRead     our loop, every request read(2) into a pool buffer at an offset that page-aligns a
//             WRITE's payload; write-behind may adopt that buffer (fs/transport/request_buffer.h).
//   kLibfuse  libfuse's fuse_session_loop_mt with clone_fd: libfuse's buffers, so no adoption,
//             no splice, and no write_flags. Chosen only by -o clone_fd=1; what it turns off is
//             logged at start and reported in the stats, never silently.
//   kUring    FUSE over io_uring (fs/transport/uring_loop.h): one queue per CPU, requests served
//             on the CPU that issued them; chosen by -o io_uring=1 where the kernel enables it.
//
// A WRITE reaches its handler through the transport's own door (WriteEntry,
// fs/transport/session_io.h), which names the request by the payload libfuse handed to write_buf:
// the transport finds its own buffer or pipe from that, so ownership moves explicitly
// (payload_pool()->Adopt) and nothing passes through thread-local state.
//
// Thread contract: Run on the main thread (it blocks until the session ends and joins every
// thread it started). WriteFlags, payload_pool and StatsJson may be called from
// any handler while Run runs; kind() and Describe() any time.
#pragma once

#include <fuse_lowlevel.h>
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "dnvme/status.h"
#include "fs/options.h"
#include "fs/transport/protocol_ext.h"
#include "fs/transport/request_buffer.h"

namespace dnvme::fs {

class Transport {
 public:
  enum class Kind { kSplice, kRead, kLibfuse, kUring };
  virtual ~Transport() = default;

  // Serves requests until the session ends: 0 for a normal end (unmount, or a signal handled
  // by libfuse), -errno of a failure, or what libfuse's loop returns (kLibfuse).
  virtual int Run() = 0;
  virtual Kind kind() const = 0;
  // One line for the log: the form and what it leaves out.
  virtual std::string Describe() const = 0;
  // A JSON object for the mount's stats: kind, threads, and the requests received each way.
  virtual std::string StatsJson() const = 0;

  // For a WRITE handler: the request's fuse_write_in::write_flags, found from its payload
  // `bufv` (as libfuse handed it to write_buf). nullopt when the transport cannot know them.
  virtual std::optional<uint32_t> WriteFlags(const fuse_bufvec& bufv) const = 0;
  // The pool WRITE payloads are received into, whose buffers may change hands (Adopt); null when
  // payloads are not ours to keep.
  virtual RequestBufferPool* payload_pool() = 0;
  // Shown every request the loop receives before libfuse handles it (our loops; libfuse's own
  // shows them through the session's custom io): what INIT offers (fs/transport/protocol_ext.h).
  void set_protocol(ProtocolExtensions* p) { protocol_ = p; }
  // Offered every reply the session writes (SessionIo) before it goes to /dev/fuse: true, with
  // what writev would have returned in `*written`, when the transport delivers it itself (the
  // io_uring ring's entries).
  virtual bool TakeReply(const iovec* /*iov*/, int /*count*/, ssize_t* /*written*/) {
    return false;
  }

  // Hands a request over to run elsewhere (the uid's own threads, fs/limits/uid_lanes.h): true
  // when it was taken (it then runs `job`, which answers the request), false when it must run
  // here.
  using Overflow = std::function<bool(uid_t uid, std::function<void()> job)>;
  // No uid may occupy every loop thread: a request of a uid (not root) that already occupies
  // all but `reserve` of them is handed to `overflow` instead of being handled on the thread
  // that received it. Our own loops only (SessionLoop); libfuse's and the io_uring loop keep
  // their threads (a reply must leave the ring thread that received the request). Call before
  // Run.
  virtual void ShareLoopThreads(int /*reserve*/, Overflow /*overflow*/) {}

 protected:
  ProtocolExtensions* protocol_ = nullptr;
};

const char* TransportKindName(Transport::Kind kind);

struct TransportOptions {
  int threads = 1;        // loop threads (ignored by kLibfuse, which grows its own)
  bool splice = true;     // ask for kSplice (falls back to kRead, logged, without the pipes)
  bool clone_fd = false;  // kLibfuse
  size_t adoptable = 0;   // request buffers write-behind may hold beyond one per thread
  int64_t max_request = int64_t{1} << 20;  // the most data one READ/WRITE carries (max_write)
  int libfuse_max_threads = 64;
  ProtocolExtensions* protocol = nullptr;  // set_protocol
  bool io_uring = false;                   // ask for kUring
  int uring_threads = 4;                   // kUring: ring threads per queue (CPU)
  // kSplice steers by which WRITEs come from the page cache: the mount's direct_io policy says.
  DirectIo direct_io = DirectIo::kOff;
};

// Creates the transport for `se`. Call before the daemon drops its capabilities: the splice
// form's pipes need CAP_SYS_RESOURCE to be sized for a 1 MiB request.
Result<std::unique_ptr<Transport>> CreateTransport(fuse_session* se, const TransportOptions& o);

}  // namespace dnvme::fs
