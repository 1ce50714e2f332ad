// Command line of the dnvmefs daemon: BACKING_DIR MOUNTPOINT [-f] [-d] [-s] [-o opt,...].
//
// Our own -o options are consumed here (engine parameters, config=FILE.json, logging, data-path
// sizes); every other -o option is passed to libfuse unchanged, so the standard FUSE options
// (allow_other, ro, fsname=, max_background=, ...) work as with any FUSE filesystem.
//
// Thread safety: plain values, parsed once at start-up; the table of options (MountOptionTable)
// is constant after its first use and may be read from any thread.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "datapath/read_policy.h"
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
  bool show_help_markdown = false;  // --help-markdown: OptionsMarkdown() (docs/tuning.md's table)
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
  // Which reads the page cache serves (datapath/read_policy.h): `auto`, what it holds and every
  // read of a file that fits in half the memory available (so a file read again, read by several
  // readers at once, or read back after it was written comes from memory, as on plain ext4); the
  // cold reads of a larger file go O_DIRECT through the engine and leave the cache alone.
  // `resident`: only what it holds; `off`: nothing (every daemon read O_DIRECT). It also decides
  // a read-only open of a file of engine_reads_from bytes or more: passthrough (the backing
  // file's page cache) or the daemon's engine, with FOPEN_DIRECT_IO (ColdReadsToEngine).
  // Measured on both reference devices: docs/performance.md, "Readers".
  datapath::ReadCache read_cache = datapath::ReadCache::kAuto;
  int64_t engine_reads_from = 64 << 20;
  // Write-behind flushes of a file that fits in half the memory available go through the page
  // cache (ReadPolicy::cache_writes): read back at once, it comes from memory. Off: measured a
  // loss (write + fsync at the kernel's writeback speed) larger than the read-back's gain.
  bool cache_writes = false;
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

// ---- The mount's own -o options, declared once ----
//
// One row per option (MountOptionTable below, beside the members it sets): ParseMountOptions
// parses with it, its range errors are worded from it, and UsageText (dnvmefs --help) and
// OptionsMarkdown (dnvmefs --help-markdown: the table in docs/tuning.md, which
// tests/fs/options_test.cc holds to it) print it. A new row needs no other code: the tests
// iterate the table. The engine's keys (include/dnvme/config.h's table) are parsed and printed
// beside these; an -o option in neither table goes to libfuse. Rules that tie two options
// together (write_chunk within write_behind, the transports that do not mix) stay in
// ParseMountOptions.

enum class OptionKind {
  kBool,    // 1/true/yes or 0/false/no; the bare option means true
  kFlag,    // the bare option sets it; a value is ignored (nonempty)
  kInt,     // a decimal integer in [min, max]
  kSize,    // bytes with K/M/G/T suffixes (powers of 1024) in [min, max], whole pages if `pages`
  kEnum,    // one of `names`
  kString,  // any non-empty text
  kConfig,  // config=FILE.json: engine keys, read before every other option so those win
};

// Where the help and the docs list an option.
enum class OptionGroup { kEngine, kMount, kLimits, kDaemon };

// A name a kEnum option takes; not `listed`: an alias, accepted but not offered.
struct OptionName {
  int value;  // the enum's value (the name's index for a string field)
  const char* name;
  bool listed = true;
};

// The MountOptions member an option sets (none for config=, which sets `engine`).
using OptionField =
    std::variant<std::monostate, bool MountOptions::*, std::optional<bool> MountOptions::*,
                 int MountOptions::*, int64_t MountOptions::*, DirectIo MountOptions::*,
                 Passthrough MountOptions::*, datapath::ReadCache MountOptions::*,
                 std::string MountOptions::*>;

// One -o option: its name, how its text is read, where it goes, and what the help says.
struct MountOptionSpec {
  const char* name;
  OptionKind kind;
  OptionField field;
  OptionGroup group;
  int64_t min = 0;  // kInt, kSize: inclusive bounds
  int64_t max = std::numeric_limits<int64_t>::max();
  bool pages = false;                      // kSize: a multiple of 4096
  std::span<const OptionName> names = {};  // kEnum
  const char* value_name = nullptr;        // kString, kConfig: in the help ("PATH")
  const char* missing = nullptr;           // kString, kConfig: "needs ..." when empty
  // The default's text where it is not MountOptions{}'s value as it stands: one that scales with
  // the machine or follows another option.
  const char* default_text = nullptr;
  const char* help = "";  // one line; the range and the default are added where printed
};

// The names of the enum options, both ways (parsing, the stats, the messages); passthrough=0 is
// an older spelling of off.
inline constexpr OptionName kPassthroughNames[] = {
    {static_cast<int>(Passthrough::kOff), "off"},
    {static_cast<int>(Passthrough::kDirect), "direct"},
    {static_cast<int>(Passthrough::kRead), "read"},
    {static_cast<int>(Passthrough::kAll), "all"},
    {static_cast<int>(Passthrough::kOff), "0", /*listed=*/false}};
inline constexpr OptionName kDirectIoNames[] = {
    {static_cast<int>(DirectIo::kOff), "off"},
    {static_cast<int>(DirectIo::kWriteOnly), "wronly"},
    {static_cast<int>(DirectIo::kWritable), "writable"}};
inline constexpr OptionName kReadCacheNames[] = {
    {static_cast<int>(datapath::ReadCache::kAuto),
     datapath::ReadCacheName(datapath::ReadCache::kAuto)},
    {static_cast<int>(datapath::ReadCache::kResident),
     datapath::ReadCacheName(datapath::ReadCache::kResident)},
    {static_cast<int>(datapath::ReadCache::kOff),
     datapath::ReadCacheName(datapath::ReadCache::kOff)}};
// spdlog's level names, which SetLogLevel takes.
inline constexpr OptionName kLogLevelNames[] = {{0, "trace"}, {1, "debug"}, {2, "info"},
                                                {3, "warn"},  {4, "error"}, {5, "critical"},
                                                {6, "off"}};

// Builds a row: OptionRow(name, kind, member, group, help), then what its kind needs.
struct OptionRow : MountOptionSpec {
  OptionRow(const char* n, OptionKind k, OptionField f, OptionGroup g, const char* h)
      : MountOptionSpec{.name = n, .kind = k, .field = f, .group = g, .help = h} {}
  OptionRow& Range(int64_t lo, int64_t hi) {
    min = lo;
    max = hi;
    return *this;
  }
  OptionRow& Pages() {
    pages = true;
    return *this;
  }
  OptionRow& Names(std::span<const OptionName> n) {
    names = n;
    return *this;
  }
  OptionRow& Value(const char* value, const char* needs) {
    value_name = value;
    missing = needs;
    return *this;
  }
  OptionRow& Default(const char* text) {
    default_text = text;
    return *this;
  }
};

// Every row, in the order the help lists them. Defaults are MountOptions' initializers (Default()
// only where one scales with the machine or follows another option); bounds and units are here.
inline std::span<const MountOptionSpec> MountOptionTable() {
  using MO = MountOptions;
  using K = OptionKind;
  using G = OptionGroup;
  using Opt = OptionRow;
  static const MountOptionSpec kRows[] = {
      Opt("config", K::kConfig, {}, G::kEngine, "the same JSON as `dnvme io --config`")
          .Value("FILE.json", "a file name")
          .Default("none"),
      Opt("write_behind", K::kSize, &MO::write_behind, G::kMount,
          "pinned memory for write-behind (0 disables)"),
      // Whole pages, and two chunks in write_behind: checked once write_behind is known.
      Opt("write_chunk", K::kSize, &MO::write_chunk, G::kMount,
          "bytes per write-behind flush, whole 4 KiB pages; a write_behind under two chunks "
          "without it gets two of half its size"),
      Opt("read_ahead", K::kSize, &MO::read_ahead, G::kMount,
          "read-ahead per sequential reader (0 disables)")
          .Pages(),
      Opt("direct_io", K::kEnum, &MO::direct_io, G::kMount,
          "opens whose writes come from the writer's pages, not the page cache: none, write-only, "
          "all for writing")
          .Names(kDirectIoNames),
      Opt("splice_read", K::kBool, &MO::splice_read, G::kMount,
          "splice requests; page-cache writes go to disk uncopied")
          .Default("1 unless direct_io=writable"),
      Opt("preload", K::kBool, &MO::preload, G::kMount,
          "serve `dnvme run` clients backing-file descriptors"),
      Opt("splice_reply", K::kBool, &MO::splice_reply, G::kMount,
          "send READ replies by vmsplice + splice, not writev"),
      Opt("async_reply", K::kBool, &MO::async_reply, G::kMount,
          "answer O_DIRECT reads from the engine's completion"),
      Opt("clone_fd", K::kBool, &MO::clone_fd, G::kMount,
          "libfuse's loop, one /dev/fuse fd per thread, no splice"),
      Opt("loop_threads", K::kInt, &MO::loop_threads, G::kMount, "request-loop threads")
          .Range(1, kMaxFuseThreads),
      Opt("io_uring", K::kBool, &MO::io_uring, G::kMount,
          "FUSE over io_uring where the kernel enables it"),
      Opt("uring_threads", K::kInt, &MO::uring_threads, G::kMount,
          "io_uring: threads per queue (CPU)")
          .Range(1, 64),
      Opt("max_request", K::kSize, &MO::max_request, G::kMount,
          "largest READ/WRITE request (above 1M raise fs.fuse.max_pages_limit)")
          .Range(4096, kMaxRequestLimit)
          .Pages(),
      Opt("max_read", K::kSize, &MO::max_read, G::kMount, "largest READ request")
          .Range(4096, UINT32_MAX)
          .Default("max_request"),
      Opt("passthrough", K::kEnum, &MO::passthrough, G::kMount,
          "opens the kernel serves from the backing file itself: none, read-only O_DIRECT, "
          "read-only, all (0: off); kernel 6.9+, root")
          .Names(kPassthroughNames),
      Opt("read_cache", K::kEnum, &MO::read_cache, G::kMount,
          "reads the page cache serves: what it holds and files that fit half the free memory, "
          "only what it holds, none (then O_DIRECT)")
          .Names(kReadCacheNames),
      Opt("cache_writes", K::kBool, &MO::cache_writes, G::kMount,
          "flush writes of files that fit half the free memory through the page cache"),
      Opt("engine_reads_from", K::kSize, &MO::engine_reads_from, G::kMount,
          "read-only opens of files this large whose cold reads read_cache sends to the engine "
          "are served by the daemon, not passthrough")
          .Pages(),

      Opt("ctl_max_handles", K::kInt, &MO::ctl_max_handles, G::kLimits, "control-file handles")
          .Range(0, 4096),
      Opt("ctl_max_bytes", K::kSize, &MO::ctl_max_bytes, G::kLimits, "client memory registered")
          .Default("RAM/4"),
      // The daemon's table of client mappings has 16384 slots (fs/control/client_memory.h).
      Opt("ctl_max_buffers", K::kInt, &MO::ctl_max_buffers, G::kLimits, "client buffers registered")
          .Range(0, 16384),
      Opt("ctl_max_pinned", K::kSize, &MO::ctl_max_pinned, G::kLimits,
          "pinned bounce memory of control handles")
          .Default("min(RAM/16, 4G)"),
      Opt("ctl_max_pending", K::kInt, &MO::ctl_max_pending, G::kLimits,
          "async control transfers not yet collected")
          .Range(0, int64_t{1} << 20),
      Opt("ctl_threads_per_uid", K::kInt, &MO::ctl_threads_per_uid, G::kLimits,
          "control requests running at once")
          .Range(1, 64),
      Opt("max_files_per_uid", K::kInt, &MO::max_files_per_uid, G::kLimits,
          "files the daemon holds open for a uid")
          .Range(1, int64_t{1} << 30)
          .Default("max(1024, RLIMIT_NOFILE hard limit/16)"),
      Opt("broker_max_conns_per_uid", K::kInt, &MO::broker_max_conns_per_uid, G::kLimits,
          "`dnvme run` broker connections")
          .Range(0, 4096),
      Opt("max_inodes_per_uid", K::kInt, &MO::max_inodes_per_uid, G::kLimits,
          "inodes a uid's lookups make the daemon hold (an O_PATH fd each)")
          .Range(1, int64_t{1} << 30)
          .Default("4 x max_files_per_uid"),
      // At least one: root must always be able to open config and stats.
      Opt("ctl_max_opens", K::kInt, &MO::ctl_max_opens, G::kLimits,
          "open files of .dnvme (ctl, stats, config)")
          .Range(1, int64_t{1} << 20),
      Opt("ctl_max_workers", K::kInt, &MO::ctl_max_workers, G::kLimits,
          "engine threads of control handles")
          .Range(0, 65536),
      Opt("ctl_max_aio_events", K::kInt, &MO::ctl_max_aio_events, G::kLimits,
          "libaio events of control handles (workers x queue_depth)")
          .Range(0, int64_t{1} << 30),

      Opt("log_level", K::kEnum, &MO::log_level, G::kDaemon, "the log's threshold (-d: debug)")
          .Names(kLogLevelNames),
      Opt("log_file", K::kString, &MO::log_file, G::kDaemon, "append the log to this file")
          .Value("PATH", "a path")
          .Default("stderr"),
      Opt("nonempty", K::kFlag, &MO::nonempty, G::kDaemon,
          "mount over a MOUNTPOINT that is not empty")
          .Default("unset"),
  };
  return kRows;
}

// The row named `name`; null when there is none (an engine key, or an option for libfuse).
const MountOptionSpec* FindMountOption(std::string_view name);
// "1..64", "whole 4 KiB pages from 4K to 16M", "a multiple of 4096"; empty when any value of the
// kind is taken. Range errors say "option 'NAME' must be RANGE (got VALUE)".
std::string OptionRangeText(const MountOptionSpec& spec);
// The value `opts` holds for the option, in the text form -o takes (sizes with a suffix where
// exact, enums by name, booleans 0/1); empty for an unset value.
std::string OptionValueText(const MountOptionSpec& spec, const MountOptions& opts);
// What the help and the docs give as the default.
std::string OptionDefaultText(const MountOptionSpec& spec);

// Parses argv (without touching the filesystem beyond checking the two directories). An error
// means a usage error: the daemon prints it and exits with code 2.
Result<MountOptions> ParseMountOptions(int argc, char** argv);

// Checks BACKING_DIR and MOUNTPOINT exist and are directories, and that MOUNTPOINT is empty
// unless -o nonempty was given or it is BACKING_DIR itself (a mount over its own backing).
Status CheckDirectories(const MountOptions& opts);
// Whether two paths name the same directory (stat: device and inode).
bool SameDirectory(const std::string& a, const std::string& b);

// dnvmefs --help: the flags, then every -o option of both tables with its range and default.
std::string UsageText();
// The same rows as a markdown table: `dnvmefs --help-markdown`, pasted into docs/tuning.md.
std::string OptionsMarkdown();

}  // namespace dnvme::fs
