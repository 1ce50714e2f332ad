// Write-behind and read-ahead through pinned staging buffers (staging.h).
#include "preload/staging.h"

#include <algorithm>
#include <atomic>
#include <functional>
#include <mutex>
#include <new>
#include <utility>

#include "datapath/extent_source.h"
#include "dnvme/config.h"
#include "dnvme/log.h"
#include "preload/counters.h"
#include "preload/libc.h"
#include "preload/settings.h"

namespace dnvme::preload {
namespace {

constexpr size_t kChunk = 8 << 20;  // a write-behind extent (its buffer has a page more)
constexpr size_t kChunks = 6;
constexpr int64_t kAheadChunk = 4 << 20;  // a read-ahead buffer
// A read this far past where the last one ended still counts as sequential (a zip reader such as
// torch.load skips each record's local header with a small read through the mount).
constexpr int64_t kAheadSkip = 1 << 20;
// Reads this large are not read ahead: one such call keeps the disk busy by itself (torch.load
// reads a tensor per call), and on two cores the copy out of read-ahead buffers measured slower.
constexpr int64_t kAheadMaxRead = 8 << 20;
// Engine workers (intra_op_parallelism) by default: one per CPU the program may use, up to this.
// A large read into a program's buffer that O_DIRECT cannot reach (its address and file offset
// disagree modulo the device's alignment: np.load, torch.load) is bounced, and each worker copies
// the requests it completes into the buffer, faulting the program's fresh pages in as it goes:
// that copy, not the device, bounds such a read, and one worker per CPU shares it out (torch.load
// of 2 GiB on the RAM ext4, two CPUs, three alternations: 0.77-1.82 GiB/s with one worker,
// 1.96-2.29 with two; docs/performance-journal.md, "Issue 36, second session").
constexpr int kMaxDefaultWorkers = 4;
// The bounce buffers of all workers together: what one worker had before there were more. Each
// worker pins its own pool at its first bounced request, and RLIMIT_MEMLOCK is commonly 8 MiB:
// a pool that cannot be pinned fails the read (the engine reports it rather than going slower
// unasked), so more workers must not pin more than one did.
constexpr int64_t kBounceBytes = 8 << 20;
constexpr int64_t kMinBouncePerWorker = 2 << 20;  // two 1 MiB requests: one in flight, one copied

// The engine and the pools, made at their first use and never freed (a forked child leaks the
// parent's: ForgetEngineInChild).
struct EngineState {
  std::mutex mu;  // guards making the engine and the pools (the fields below are written under it)
  AioHandle* engine = nullptr;  // read without mu by transfers of files adopted after it was made
  bool engine_failed = false;
  // Staging buffers of write-behind (null: writes are synchronous, e.g. RLIMIT_MEMLOCK too low).
  PinnedPool* write_pool = nullptr;           // written once, under mu, before write_pool_tried
  std::atomic<bool> write_pool_tried{false};  // set (under mu) once write_pool is final
  // Read-ahead buffers (null: no read-ahead).
  PinnedPool* read_pool = nullptr;           // written once, under mu, before read_pool_tried
  std::atomic<bool> read_pool_tried{false};  // set (under mu) once read_pool is final
  // What every adopted file's data path shares (datapath/file_data.h): the pools are filled in
  // when they are made (under mu, before the *_tried flag that publishes them).
  datapath::FileDataShared data;
};
EngineState g_engine;
// For file systems without fallocate (datapath/space.h); never freed, like the engine.
datapath::SpaceBudget g_budget;

// The engine as the data path asks for it: this process's, never freed (no owner to share).
std::shared_ptr<AioHandle> ProcessEngine() {
  return std::shared_ptr<AioHandle>(std::shared_ptr<void>(), g_engine.engine);
}

// The pools are made at their first use (pinning fresh memory costs): a program that only reads
// pins no write-behind buffers, one that only writes or reads in large calls no read-ahead ones.
// Null when they cannot be pinned (RLIMIT_MEMLOCK): the caller then does without.
// Every transfer asks, so after the first the answer costs one atomic load, not the lock.
PinnedPool* PoolOnce(PinnedPool** pool, datapath::PublishedPtr<PinnedPool>* user,
                     std::atomic<bool>* tried, size_t size, size_t count, const char* without,
                     const std::function<void()>& made_hook = {}) {
  if (tried->load(std::memory_order_acquire)) return *pool;
  std::lock_guard lock(g_engine.mu);
  if (!tried->load(std::memory_order_relaxed)) {
    auto made = PinnedPool::Create(size, count);
    if (made.ok()) {
      *pool = std::move(made).value().release();
      if (made_hook) made_hook();  // before the pool is published
      user->store(*pool);
    } else {
      dnvme::Logger().info("dnvme run: no pinned buffers ({}); {}", made.status().ToString(),
                           without);
    }
    tried->store(true, std::memory_order_release);
  }
  return *pool;
}

}  // namespace

AioHandle* Engine() {
  std::lock_guard lock(g_engine.mu);
  if (g_engine.engine || g_engine.engine_failed) return g_engine.engine;
  HandleConfig cfg;
  cfg.queue_depth = 32;
  const Settings& settings = PreloadSettings();
  cfg.intra_op_parallelism = std::min(kMaxDefaultWorkers, settings.cpus);
  cfg.bounce_bytes_per_worker =
      std::max(kMinBouncePerWorker, kBounceBytes / cfg.intra_op_parallelism);
  if (!settings.config_file.empty()) {
    auto c = HandleConfig::FromJsonFile(settings.config_file);
    if (!c.ok()) {
      dnvme::Logger().warn("dnvme run: {}: {}; the mount serves every transfer",
                           settings.config_file, c.status().ToString());
      g_engine.engine_failed = true;
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
    g_engine.engine_failed = true;
    return nullptr;
  }
  g_engine.engine = std::move(h).value().release();
  // What differs from the mount's data path is `dnvme run`'s (set before the first adoption,
  // which needs the engine; the pools are filled in as they are made).
  datapath::WriteBehindShared& w = g_engine.data.writes;
  w.write_chunk = kChunk;
  // The write-behind lives in the program's process: a write returns once it is in the kernel,
  // so it survives the program's exit (datapath/write_behind.h).
  w.ack = datapath::Ack::kSubmitted;
  // A program's write may start anywhere (torch.save's zip records do).
  w.unaligned_extents = true;
  w.engine = ProcessEngine;
  w.counters = &ProcessCounters().data;
  // Space before acknowledgement (datapath/space.h): a write returns once its requests are in
  // the kernel, before they land, so its blocks come first; the file is extended at once too.
  g_engine.data.space.reserve = true;
  g_engine.data.space.extend = true;
  g_engine.data.space.unlanded_max = static_cast<int64_t>(kChunks * (kChunk + 4096));
  g_engine.data.budget = &g_budget;
  datapath::ReadAheadShared& r = g_engine.data.reads;
  // The rest of a read that found the file shrunk is the mount's to answer, past our pread.
  g_engine.data.pread = Libc().pread;
  r.max_skip = kAheadSkip;
  r.max_read = kAheadMaxRead;
  // A sequence starts with one buffer and doubles as the program consumes it
  // (datapath/read_ahead.h): a header read fetches 4 MiB, a loader soon gets the whole window.
  r.initial_window = kAheadChunk;
  r.engine = ProcessEngine;
  r.counters = &ProcessCounters().data;
  r.make_chunks = [] { (void)ReadPool(); };  // at the first read the page cache does not serve
  // The page cache serves what it holds, and every read of a file that fits in memory (so the
  // next reader, this process or another, finds it there): datapath/read_policy.h.
  g_engine.data.policy.mode = settings.read_cache;
  g_engine.data.policy.cache_writes = settings.cache_writes;
  w.policy = &g_engine.data.policy;
  return g_engine.engine;
}

AioHandle* EngineIfMade() { return g_engine.engine; }

PinnedPool* WritePool() {
  return PoolOnce(&g_engine.write_pool, &g_engine.data.writes.chunks, &g_engine.write_pool_tried,
                  kChunk + 4096, kChunks, "writes are synchronous");
}

PinnedPool* ReadPool() {
  const int64_t bytes = PreloadSettings().readahead;
  if (bytes <= 0) return nullptr;
  const auto count = static_cast<size_t>(std::max<int64_t>(2, bytes / kAheadChunk));
  // The window is set once, before the pool is published: readers read it without a lock.
  return PoolOnce(&g_engine.read_pool, &g_engine.data.reads.chunks, &g_engine.read_pool_tried,
                  kAheadChunk, count, "no read-ahead", [count] {
                    g_engine.data.reads.window = static_cast<int64_t>(count) * kAheadChunk;
                  });
}

void LockEngineForFork() { g_engine.mu.lock(); }
void UnlockEngineAfterFork() { g_engine.mu.unlock(); }

void ForgetEngineInChild() {
  // Leaked, not destroyed: the engine's destructor would wait for threads that do not exist
  // here, and the pools' locks may have been held by a thread that is gone.
  new (&g_engine.mu) std::mutex();
  g_engine.engine = nullptr;
  g_engine.engine_failed = false;
  g_engine.write_pool = nullptr;
  g_engine.read_pool = nullptr;
  g_engine.data.writes.chunks = nullptr;
  g_engine.data.reads.chunks = nullptr;
  g_engine.write_pool_tried.store(false);
  g_engine.read_pool_tried.store(false);
}

// ---- the data path's shared state ----

// The reservation reaches ahead past the end only while nobody else has the file open: their
// truncates would free it under us (datapath/space.h).
AdoptedFile::AdoptedFile()
    : data(&g_engine.data, LeaseWordHooks(this),
           [this] { return word->shared.load(std::memory_order_seq_cst) == 0; }) {}

datapath::FlushHooks LeaseWordHooks(AdoptedFile* f) {
  datapath::FlushHooks hooks;
  // Counted before DirectIo reads `shared`: the daemon waits for it before it lets anyone else
  // open, truncate or stamp the file (include/dnvme/broker.h). The word is set before the file
  // is in the table, so before its first write.
  hooks.started = [f] { f->word->writes_inflight.fetch_add(1, std::memory_order_seq_cst); };
  hooks.finished = [f] { f->word->writes_inflight.fetch_sub(1, std::memory_order_seq_cst); };
  return hooks;
}

// ---- write-behind ----

Status WaitWrites(AdoptedFile& f) {
  Status st = f.data.Sync(f.open);
  Status kept = TakeKeptError(f);
  return kept.ok() ? st : kept;
}

void KeepFirstError(AdoptedFile& f, Status err) {
  std::lock_guard lock(f.em);
  if (f.kept.ok()) f.kept = std::move(err);
}

Status TakeKeptError(AdoptedFile& f) {
  std::lock_guard lock(f.em);
  return std::exchange(f.kept, Status::Ok());
}

Status TakeFirstError(AdoptedFile& f) {
  if (Status kept = TakeKeptError(f); !kept.ok()) return kept;
  return f.data.Report(f.open);
}

Result<int64_t> SubmitWrite(AdoptedFile& f, const char* buf, size_t n, off_t off) {
  datapath::MemorySource src(buf, n);
  Result<size_t> done = f.data.Write(f.open, f.file, /*page_cache_writes=*/false, src, n, off,
                                     /*scratch=*/nullptr);
  if (!done.ok()) {
    dnvme::Logger().debug("dnvme run: {}", done.status().ToString());
    return done.status();
  }
  return static_cast<int64_t>(*done);
}

// ---- reads ----

Result<int64_t> ReadThrough(AdoptedFile& f, char* buf, int64_t n, int64_t off) {
  datapath::FileRead r;
  r.off = off;
  r.size = n;
  // A file someone else has open may change under read-ahead: read only what is asked, now. The
  // window's pinned buffers are made by the first read that goes to the device (make_chunks).
  const bool use_window = f.word->shared.load(std::memory_order_seq_cst) == 0;
  r.window = use_window ? datapath::Window::kUse : datapath::Window::kDrop;
  r.buf = buf;
  r.shrunk_fd = f.witness;  // truncated meanwhile: the mount answers with what is there
  return f.data.Read(f.open, f.file, r);
}

}  // namespace dnvme::preload
