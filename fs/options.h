// Command line of the dnvmefs daemon: BACKING_DIR MOUNTPOINT [-f] [-d] [-s] [-o opt,...].
//
// Our own -o options are consumed here (engine parameters, config=FILE.json, logging, data-path
// sizes); every other -o option is passed to libfuse unchanged, so the standard FUSE options
// (allow_other, ro, fsname=, max_background=, ...) work as with any FUSE filesystem.
//
// Thread safety: plain values, parsed once at start-up.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dnvme/config.h"
#include "dnvme/status.h"

namespace dnvme::fs {

// FUSE worker threads at most (multi-threaded loop).
inline constexpr int kMaxFuseThreads = 64;
// The read-ahead pool holds this many readers' windows; more readers share what is free.
inline constexpr int kReadAheadWindows = 4;
// The window a sequential reader starts with (it grows to read_ahead as the reader goes on).
inline constexpr int64_t kReadAheadFirstWindow = 4 << 20;
// The largest FUSE read/write request by default (max_write, 256 pages: libfuse 3.14's own
// limit): the size of each async-reply buffer. -o max_request raises the mount's.
inline constexpr int64_t kMaxFuseRequestBytes = int64_t{1} << 20;
// -o max_request at most: 4096 pages, far above what the kernel allows by default
// (fs.fuse.max_pages_limit 256).
inline constexpr int64_t kMaxRequestLimit = int64_t{16} << 20;
// async_reply: one 1 MiB buffer per read an O_DIRECT client can have in flight at the kernel's
// limit.
inline constexpr int kAsyncReplyBuffers = 64;
// Threads for spliced write-behind flushes (datapath/splice_io.h): each keeps one extent in flight
// (splice blocks until its transfer is done).
inline constexpr size_t kSpliceThreads = 16;
// Smallest pipe worth holding an extent in (a small write_chunk gets pipes of its own size).
inline constexpr int64_t kMinSplicePipeBytes = 64 << 10;
// -o splice_reply: pipes for replies in flight at once, and the smallest reply worth splicing
// (below it, pinning the few pages costs less than the two extra system calls).
inline constexpr int64_t kReplyPipes = 8;
inline constexpr size_t kMinSplicedReply = 64 << 10;

// Which opens the kernel serves from the backing file itself (FUSE passthrough,
// fs/fuse/passthrough.h): none, read-only O_DIRECT ones, read-only ones, or all.
enum class Passthrough { kOff, kDirect, kRead, kAll };
const char* PassthroughName(Passthrough p);

// Which opens the kernel sends writes from the writer's own pages (FOPEN_DIRECT_IO) instead of
// copying them into the FUSE inode's page cache first: none, write-only ones, or every open for
// writing (O_RDWR ones too, where the kernel lets such opens be mmapped:
// FUSE_DIRECT_IO_ALLOW_MMAP, protocol 7.39).
enum class DirectIo { kOff, kWriteOnly, kWritable };
const char* DirectIoName(DirectIo d);
// Whether an open with `open_flags` gets direct_io under `d`; `mmap_ok`: the kernel took
// FUSE_DIRECT_IO_ALLOW_MMAP (fs/transport/protocol_ext.h). The open handler and the splice
// transport's steering (which sees only a WRITE's flags) both decide with it.
bool OpenGetsDirectIo(DirectIo d, int open_flags, bool mmap_ok);

// The machine's RAM (sysconf: physical pages x page size); 1 GiB when it cannot be read.
int64_t MachineRamBytes();
// Defaults of the per-uid limits that scale with the machine: registered client memory a quarter
// of RAM; pinned memory of control handles min(RAM/16, 4 GiB); files max(1024, RLIMIT_NOFILE's
// hard limit / 16), the hard limit being what the daemon raises its own soft limit to at start.
int64_t DefaultCtlMaxBytes();
int64_t DefaultCtlMaxPinned();
int64_t DefaultMaxFilesPerUid();
// max_inodes_per_uid's default: four times max_files_per_uid's (a lookup pins one O_PATH
// descriptor; a user lists far more files than it opens).
int64_t DefaultMaxInodesPerUid();

struct MountOptions {
  std::string backing;     // absolute path
  std::string mountpoint;  // absolute path
  bool foreground = false;
  bool debug = false;
  bool single_thread = false;
  bool nonempty = false;
  bool show_help = false;
  bool show_version = false;

  HandleConfig engine;              // defaults, then config=FILE, then explicit keys
  int64_t write_behind = 64 << 20;  // pinned bytes for write-behind chunks (0 disables)
  int64_t write_chunk = 8 << 20;    // bytes per write-behind flush
  int64_t read_ahead = 16 << 20;    // bytes read ahead per sequential reader (0 disables)
  // O_DIRECT clients' reads: submit to the engine and answer from its completion callback, so a
  // FUSE thread is free for the next request at once. Off by default: measured 2x slower here
  // (docs/performance-journal.md), because the 1 MiB reply copies then run on the engine worker's
  // thread, one after another, instead of on many FUSE threads in parallel.
  bool async_reply = false;
  // Receive requests with splice (fs/transport/session_loop.h) and write page-cache-backed writers'
  // data to disk from the kernel's own pages (datapath/splice_io.h): no copy in the daemon. Needs
  // the daemon's own loop (not clone_fd) and pipes sized before the capability drop. Unset: splice
  // exactly when writers go through the page cache (direct_io below is not `writable`), the only
  // requests splicing saves a copy for (SpliceRequests()).
  std::optional<bool> splice_read;
  // How writers' data reaches the daemon. `writable` (the default): the kernel hands every
  // writer's own pages to the request, so a buffered write(2) is copied once, by the kernel into
  // the daemon's reused request buffer, which write-behind adopts as it is; through the page
  // cache it is copied into fresh page-cache pages first. Measured with the VM's freed memory
  // held, 5 alternated rounds on the RAM ext4: buffered write + fsync 2.74 GiB/s against 2.35
  // through the page cache (1.18x and 1.08x raw fio), machine CPU per GiB 1.26x raw against 1.34x;
  // level on the virtio disk (docs/performance.md, "Writers' own pages, current"). Readers are
  // unaffected (read-only opens are passthrough, or cached as before); an O_RDWR open reads
  // uncached through the daemon's read-ahead.
  DirectIo direct_io = DirectIo::kWritable;
  // Large replies (READ data) sent with vmsplice + splice from a pipe instead of writev(2): the
  // kernel then takes the daemon's pages from the pipe instead of pinning them one at a time as
  // it copies (fs/transport/request_pipe.h, SpliceMessage). Pipes sized before the capability drop;
  // not with io_uring (replies go through the ring).
  bool splice_reply = false;
  // The descriptor broker for `dnvme run` (fs/broker/broker.h, docs/preload.md): processes under
  // libdnvme_preload.so get descriptors of backing files, opened as themselves, and move their
  // large transfers around the FUSE copy. Off: `.dnvme/broker` is empty and clients go through
  // the mount.
  bool preload = true;
  // libfuse's multi-threaded loop with one /dev/fuse fd per worker thread (clone_fd), instead of
  // ours (fs/transport/session_loop.h): no spliced requests then. Off by default: on the 2-core
  // reference VM, 7 alternated rounds of bench/mount_knobs.sh gave writes 0.74-0.82 of raw fio
  // without it and 0.61-0.70 with it; reads within noise (docs/performance-journal.md). Worth
  // re-measuring on many-core machines.
  bool clone_fd = false;
  // Threads of the request loop (fs/transport/session_loop.h), each blocked in /dev/fuse when idle.
  // A fixed pool (libfuse's loop grows to 64 on demand): enough for the kernel's background
  // requests, which are answered without blocking, and for handlers that wait (fsync, a full
  // write-behind, long control-file transfers). 4, 16 and 64 measured the same here
  // (docs/performance-journal.md); each thread that reads or writes synchronously pins a 1 MiB
  // buffer.
  int loop_threads = 32;
  // The largest READ/WRITE request the kernel may send (max_write, and max_pages in INIT). Above
  // 1 MiB it needs fs.fuse.max_pages_limit raised (the kernel clamps to it) and our own loop:
  // libfuse's (clone_fd) reads requests into 1 MiB buffers. Fewer, larger requests mean fewer
  // round trips per GiB (docs/performance-journal.md).
  int64_t max_request = kMaxFuseRequestBytes;
  // The largest READ the kernel may send: the `max_read` mount option fs/main.cc always passes,
  // and conn->max_read at INIT, which libfuse requires to agree. -o max_read=SIZE, else
  // max_request (set by the parser), so the spare page in max_pages (fs/transport/protocol_ext.h)
  // never makes a READ larger.
  int64_t max_read = 0;
  // FUSE passthrough (fs/fuse/passthrough.h) for read-only opens by default: the kernel reads
  // the backing file itself, with no reply copy through /dev/fuse. Measured the fastest for
  // readers on both reference devices, buffered and O_DIRECT alike: cold buffered reads 1.36x raw
  // fio on the RAM ext4 against 0.46x through the daemon (docs/performance.md, "The mount on a
  // fast device: the read policies", with the VM's freed-memory reporting held, bench/lib.sh).
  // Not `all`: passthrough writes run with the daemon's CAP_FSETID and keep set-gid bits ext4
  // clears (docs/tuning.md). Needs kernel 6.9+ and CAP_SYS_ADMIN (kept dormant only then);
  // where either is missing the mount logs it and serves every open.
  Passthrough passthrough = Passthrough::kRead;
  // FUSE over io_uring (fs/transport/uring_loop.h), when the kernel has it enabled
  // (/sys/module/fuse/parameters/enable_uring); otherwise logged and /dev/fuse is used.
  bool io_uring = false;
  int uring_threads = 4;  // ring threads per queue (one queue per possible CPU)
  // Per-uid limits (docs/security.md, "Per-uid limits"; fs/limits/uid_limits.h): what one user
  // may make the daemon hold through the control file and the broker. The defaults that scale
  // with the machine are computed when MountOptions is made (the Default* functions below).
  int64_t ctl_max_handles = 8;                          // engines (control handles) open
  int64_t ctl_max_bytes = DefaultCtlMaxBytes();         // client memory registered: RAM/4
  int64_t ctl_max_buffers = 256;                        // client buffers (mappings) registered
  int64_t ctl_max_pinned = DefaultCtlMaxPinned();       // handles' bounce pools: min(RAM/16, 4G)
  int64_t ctl_max_pending = 1024;                       // async transfers not yet collected
  int ctl_threads_per_uid = 4;                          // control requests running at once
  int64_t max_files_per_uid = DefaultMaxFilesPerUid();  // files the daemon holds for the uid
  int64_t broker_max_conns_per_uid = 128;               // broker connections (a thread each)
  // Inodes the kernel holds through a uid's lookups: the daemon keeps an O_PATH descriptor for
  // each until the kernel forgets it (fs/core/inode_table.h).
  int64_t max_inodes_per_uid = DefaultMaxInodesPerUid();
  // Open files of .dnvme/: each holds a ctl session (its queue, its answer) or a stats/config
  // snapshot in the daemon's memory, not a descriptor, so they are not max_files_per_uid's
  // (which scales with RLIMIT_NOFILE, 65536 under the systemd unit: as many sessions would be
  // hundreds of MiB). A client keeps one session per process; tools open stats and close it.
  int64_t ctl_max_opens = 1024;
  // Engine threads of a uid's control handles (each with an eventfd and a libaio context):
  // 64 is the handles' default (8, ctl_max_handles) times 8 workers each, more than a DeepSpeed
  // job's handles use (intra_op_parallelism 1-8), a fraction of a thread limit of a few
  // thousand, and it stops one user from making 2048 threads with 8 handles of 256 workers.
  int64_t ctl_max_workers = 64;
  // libaio events of those workers (each io_setup(queue_depth) takes queue_depth of the
  // machine-wide fs.aio-max-nr): 8192 is ctl_max_workers at the default queue_depth (128), an
  // eighth of the kernel's default aio-max-nr (65536), so no one user exhausts it.
  int64_t ctl_max_aio_events = 8192;
  std::string log_level = "info";
  std::string log_file;

  std::vector<std::string> fuse_opts;  // "-o" arguments passed to libfuse, e.g. "allow_other"

  // Whether requests are spliced (splice_read, or its default for direct_io).
  bool SpliceRequests() const { return splice_read.value_or(direct_io != DirectIo::kWritable); }

  // Pinned memory the mount allocates when it starts (write-behind, read-ahead and async-reply
  // pools), and at most once every FUSE thread has its request buffer and every engine worker
  // its bounce buffers. `dnvme report` compares these with RLIMIT_MEMLOCK.
  int64_t PinnedAtStart() const {
    return write_behind + (read_ahead > 0 ? kReadAheadWindows * read_ahead : 0) +
           (async_reply ? kAsyncReplyBuffers * kMaxFuseRequestBytes : 0);
  }
  // Request buffers (1 MiB each, not pinned) write-behind may hold instead of copying their
  // WRITE payloads into chunks (fs/transport/request_buffer.h): as many as the write-behind budget
  // has bytes, on top of one per loop thread.
  size_t AdoptableRequestBuffers() const { return static_cast<size_t>(write_behind / max_request); }
  int64_t PinnedPeak() const {
    return PinnedAtStart() + (clone_fd ? kMaxFuseThreads : loop_threads) * max_request +
           engine.bounce_bytes_per_worker * engine.intra_op_parallelism;
  }
};

// Parses argv (without touching the filesystem beyond checking the two directories). An error
// means a usage error: the daemon prints it and exits with code 2.
Result<MountOptions> ParseMountOptions(int argc, char** argv);

// Checks BACKING_DIR and MOUNTPOINT exist and are directories, and that MOUNTPOINT is empty
// unless -o nonempty was given or it is BACKING_DIR itself (a mount over its own backing).
Status CheckDirectories(const MountOptions& opts);
// Whether two paths name the same directory (stat: device and inode).
bool SameDirectory(const std::string& a, const std::string& b);

std::string UsageText();

}  // namespace dnvme::fs
