// Write-behind and read-ahead through pinned staging buffers (staging.h).
#include "preload/staging.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <new>
#include <thread>

#include "dnvme/config.h"
#include "engine/common/log.h"
#include "preload/counters.h"
#include "preload/errors.h"
#include "preload/settings.h"

namespace dnvme::preload {
namespace {

constexpr size_t kChunk = 8 << 20;  // a write-behind staging buffer (plus a page)
constexpr size_t kChunks = 6;
constexpr int64_t kAheadChunk = 4 << 20;  // a read-ahead buffer (plus a page)
// A read this far past where the last one ended still counts as sequential (a zip reader such as
// torch.load skips each record's local header with a small read through the mount).
constexpr int64_t kAheadSkip = 1 << 20;
// Reads this large are not read ahead: one such call keeps the disk busy by itself (torch.load
// reads a tensor per call), and on two cores the copy out of read-ahead buffers measured slower.
constexpr int64_t kAheadMaxRead = 8 << 20;

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
};
EngineState g_engine;

// The pools are made at their first use (pinning fresh memory costs): a program that only reads
// pins no write-behind buffers, one that only writes or reads in large calls no read-ahead ones.
// Null when they cannot be pinned (RLIMIT_MEMLOCK): the caller then does without.
// Every transfer asks, so after the first the answer costs one atomic load, not the lock.
PinnedPool* PoolOnce(PinnedPool** pool, std::atomic<bool>* tried, size_t size, size_t count,
                     const char* without) {
  if (tried->load(std::memory_order_acquire)) return *pool;
  std::lock_guard lock(g_engine.mu);
  if (!tried->load(std::memory_order_relaxed)) {
    auto made = PinnedPool::Create(size, count);
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

// A write piece left flight (landed, failed, or was never submitted). Caller holds f.wm.
void PieceDoneLocked(AdoptedFile& f) {
  --f.inflight;
  f.word->writes_inflight.fetch_sub(1, std::memory_order_seq_cst);
  f.wcv.notify_all();
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

void WaitReadAheadPiece(AdoptedFile& f, const ReadAheadPiece& a) {
  std::unique_lock lock(f.am);
  f.acv.wait(lock, [&] { return a.done; });
}

// Queues reads of the file from the end of the read-ahead (or `from` when there is none) up to
// `until`, as far as free buffers go. Caller holds f.rm.
void QueueReadAhead(const std::shared_ptr<AdoptedFile>& fp, int64_t from, int64_t until) {
  AdoptedFile& f = *fp;
  int64_t pos = f.ahead.empty() ? from : f.ahead.back()->off + f.ahead.back()->len;
  while (pos < until) {
    PinnedPool::Lease lease = g_engine.read_pool->TryAcquire();
    if (!lease) break;  // all out: what is not read ahead is read when asked for
    auto a = std::make_shared<ReadAheadPiece>();
    a->buf = std::move(lease);
    a->off = pos;
    // Pieces end on a page boundary of the file, so only the first can start unaligned.
    a->len = std::min(kAheadChunk - pos % 4096, until - pos);
    // The completion holds the file, so its `file` outlives the request.
    Status st = g_engine.engine->submit_pread(const_cast<char*>(a->data()), a->len, f.file, pos,
                                              [fp, a](const OpResult& res) {
                                                std::lock_guard lock(fp->am);
                                                a->ok = res.status.ok();
                                                a->done = true;
                                                fp->acv.notify_all();
                                              });
    if (!st.ok()) break;
    f.ahead.push_back(std::move(a));
    pos += f.ahead.back()->len;
  }
}

// Copies what the read-ahead holds of [off, off + n) from its start into `buf`; returns the bytes
// copied. A failed piece drops the read-ahead: the caller reads the rest itself and so reports
// the error. Caller holds f.rm.
int64_t CopyFromReadAhead(AdoptedFile& f, char* buf, int64_t n, int64_t off) {
  int64_t done = 0;
  while (!f.ahead.empty() && done < n) {
    const ReadAheadPiece& a = *f.ahead.front();
    const int64_t pos = off + done;
    if (a.off > pos) break;  // the reader is behind the read-ahead
    WaitReadAheadPiece(f, a);
    if (!a.ok) {
      ForgetReadAheadLocked(f);
      break;
    }
    if (a.off + a.len <= pos) {  // behind the reader (it skipped past)
      f.ahead.pop_front();
      continue;
    }
    const int64_t take = std::min(n - done, a.off + a.len - pos);
    std::memcpy(buf + done, a.data() + (pos - a.off), static_cast<size_t>(take));
    done += take;
    if (pos + take == a.off + a.len) f.ahead.pop_front();
  }
  return done;
}

}  // namespace

// ---- the engine and the pools ----

AioHandle* Engine() {
  std::lock_guard lock(g_engine.mu);
  if (g_engine.engine || g_engine.engine_failed) return g_engine.engine;
  HandleConfig cfg;
  cfg.queue_depth = 32;
  cfg.bounce_bytes_per_worker = 8 << 20;
  const Settings& settings = PreloadSettings();
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
  return g_engine.engine;
}

AioHandle* EngineIfMade() { return g_engine.engine; }

PinnedPool* WritePool() {
  return PoolOnce(&g_engine.write_pool, &g_engine.write_pool_tried, kChunk + 4096, kChunks,
                  "writes are synchronous");
}

PinnedPool* ReadPool() {
  const int64_t bytes = PreloadSettings().readahead;
  if (bytes <= 0) return nullptr;
  const auto count = static_cast<size_t>(std::max<int64_t>(2, bytes / kAheadChunk));
  return PoolOnce(&g_engine.read_pool, &g_engine.read_pool_tried, kAheadChunk + 4096, count,
                  "no read-ahead");
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
  g_engine.write_pool_tried.store(false);
  g_engine.read_pool_tried.store(false);
}

// ---- write-behind ----

int WaitWrites(AdoptedFile& f) {
  std::unique_lock lock(f.wm);
  f.wcv.wait(lock, [&] { return f.inflight == 0; });
  const int err = f.first_err;
  f.first_err = 0;
  return err;
}

void DrainWrites(AdoptedFile& f) {
  std::unique_lock lock(f.wm);
  f.wcv.wait(lock, [&] { return f.inflight == 0; });
}

void EndWrites(AdoptedFile& f) {
  std::unique_lock lock(f.wm);
  f.wcv.wait(lock, [&] { return f.inflight == 0; });
  f.ended = true;
}

void KeepFirstError(AdoptedFile& f, int err) {
  std::lock_guard lock(f.wm);
  if (f.first_err == 0) f.first_err = err;
}

void SetFirstError(AdoptedFile& f, int err) {
  std::lock_guard lock(f.wm);
  f.first_err = err;
}

int TakeFirstError(AdoptedFile& f) {
  std::lock_guard lock(f.wm);
  const int err = f.first_err;
  f.first_err = 0;
  return err;
}

int SubmitWrite(const std::shared_ptr<AdoptedFile>& f, const char* buf, size_t n, off_t off) {
  {
    // Found by the model test: an overwrite of bytes still in flight landed first, and the older
    // write then won. A sequential writer (the common case) never waits here.
    std::unique_lock lock(f->wm);
    const int64_t end = static_cast<int64_t>(off) + static_cast<int64_t>(n);
    if (f->inflight > 0 && off < f->wb_hi && end > f->wb_lo) {
      f->wcv.wait(lock, [&] { return f->inflight == 0; });
    }
  }
  auto latch = std::make_shared<SubmitLatch>();
  int err = 0;
  for (size_t done = 0; done < n;) {
    const size_t piece = std::min(n - done, kChunk);
    auto lease = std::make_shared<PinnedPool::Lease>(g_engine.write_pool->Acquire());
    // The same offset in the page as in the file: the engine's requests then go O_DIRECT from
    // the staging buffer, only the partial edge pages through the page cache.
    char* dst = lease->data() + (static_cast<size_t>(off) + done) % 4096;
    std::memcpy(dst, buf + done, piece);
    {
      std::lock_guard lock(f->wm);
      if (f->ended) {  // (the lease went with the last descriptor meanwhile)
        err = EBADF;
        break;
      }
      const int64_t lo = static_cast<int64_t>(off + done);
      const int64_t hi = lo + static_cast<int64_t>(piece);
      f->wb_lo = f->inflight == 0 ? lo : std::min(f->wb_lo, lo);
      f->wb_hi = f->inflight == 0 ? hi : std::max(f->wb_hi, hi);
      ++f->inflight;
      // Counted before DirectIo reads `shared`: the daemon waits for it before it lets anyone
      // else open, truncate or stamp the file (include/dnvme/broker.h).
      f->word->writes_inflight.fetch_add(1, std::memory_order_seq_cst);
    }
    latch->Add();
    Status st = g_engine.engine->submit_pwrite(
        dst, static_cast<int64_t>(piece), f->file, off + static_cast<off_t>(done),
        [f, lease](const OpResult& res) {
          lease->Reset();
          std::lock_guard lock(f->wm);
          if (!res.status.ok() && f->first_err == 0) {
            f->first_err = ErrnoOf(res.status);
            ProcessCounters().errors.fetch_add(1, std::memory_order_relaxed);
            dnvme::Logger().debug("dnvme run: {}", res.status.ToString());
          }
          PieceDoneLocked(*f);
        },
        [latch] { latch->Done(); });
    if (!st.ok()) {
      latch->Done();
      std::lock_guard lock(f->wm);
      PieceDoneLocked(*f);
      err = ErrnoOf(st);
      break;
    }
    done += piece;
  }
  latch->Wait();
  return err;
}

// ---- read-ahead ----

void ForgetReadAheadLocked(AdoptedFile& f) {
  for (const auto& a : f.ahead) WaitReadAheadPiece(f, *a);
  f.ahead.clear();
  f.next_read = -1;
}

void ForgetReadAhead(AdoptedFile& f) {
  std::lock_guard lock(f.rm);
  ForgetReadAheadLocked(f);
}

Status ReadThrough(const std::shared_ptr<AdoptedFile>& fp, char* buf, int64_t n, int64_t off,
                   int64_t size) {
  AdoptedFile& f = *fp;
  std::lock_guard lock(f.rm);
  // A file someone else has open may change under read-ahead: read only what is asked, now.
  if (n >= kAheadMaxRead || f.word->shared.load(std::memory_order_seq_cst) != 0 ||
      ReadPool() == nullptr) {
    ForgetReadAheadLocked(f);
    return g_engine.engine->sync_pread(buf, n, f.file, off);
  }
  const bool sequential =
      f.next_read < 0 ? off == 0 : off >= f.next_read && off - f.next_read <= kAheadSkip;
  int64_t done = 0;
  if (sequential) {
    done = CopyFromReadAhead(f, buf, n, off);
    ProcessCounters().ahead_bytes.fetch_add(static_cast<uint64_t>(done), std::memory_order_relaxed);
  } else {
    ForgetReadAheadLocked(f);
  }
  // The rest now, before queueing more: it is what the program waits for.
  Status st;
  if (done < n) st = g_engine.engine->sync_pread(buf + done, n - done, f.file, off + done);
  if (!st.ok()) {
    ForgetReadAheadLocked(f);
    return st;
  }
  f.next_read = off + n;
  if (sequential) {
    const int64_t window = static_cast<int64_t>(ReadPool()->count()) * kAheadChunk;
    QueueReadAhead(fp, off + n, std::min(size, off + n + window));
  }
  return st;
}

}  // namespace dnvme::preload
