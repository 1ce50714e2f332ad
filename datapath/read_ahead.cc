#include "datapath/read_ahead.h"

#include <algorithm>
#include <cstring>

namespace dnvme::datapath {
namespace {

constexpr int64_t kFetchAlign = 4096;  // O_DIRECT's alignment on every device we meet

}  // namespace

size_t ReadReply::CopyTo(char* dst) const {
  size_t at = 0;
  for (const struct iovec& v : iov) {
    // A piece Read put in the caller's buffer is already in place.
    if (v.iov_base != dst + at) std::memcpy(dst + at, v.iov_base, v.iov_len);
    at += v.iov_len;
  }
  return at;
}

int64_t ReadReply::bytes() const {
  int64_t n = 0;
  for (const struct iovec& v : iov) n += static_cast<int64_t>(v.iov_len);
  return n;
}

int64_t ReadAhead::Read(const FileRef& file, const WindowRead& r, ReadReply* reply) {
  if (r.copy_to == nullptr) return Serve(file, r, reply);
  int64_t served;
  {
    ReadReply pieces;
    served = Serve(file, r, &pieces);
    pieces.CopyTo(r.copy_to);
  }  // the pieces' pins go: the chunks they emptied are free for the window now
  // Refilled at once only when the window held the whole read: otherwise the caller reads the
  // rest on demand next, and fetches queued now would run ahead of that read it waits for (the
  // next read refills the window anyway).
  if (shared_->chunks != nullptr && served == r.n) {
    std::lock_guard lock(m_);
    if (r.generation == generation_ && next_ == r.off + r.n) {
      DropBehindLocked(r.off + r.n);
      StartLocked(file, r.off + r.n, r.file_size);
    }
  }
  return served;
}

int ReadAhead::inflight() {
  std::lock_guard g(m_);
  return inflight_;
}

int64_t ReadAhead::window() {
  std::lock_guard g(m_);
  return window_;
}

uint64_t ReadAhead::Generation() {
  std::lock_guard lock(m_);
  return generation_;
}

void ReadAhead::Invalidate() {
  std::lock_guard lock(m_);
  chunks_.clear();
  next_ = -1;
  window_ = 0;
  ++generation_;
}

void ReadAhead::Quiesce() {
  std::unique_lock lock(m_);
  cv_.wait(lock, [&] { return inflight_ == 0; });
  chunks_.clear();
  next_ = -1;
  window_ = 0;
}

void ReadAhead::PaceLocked(bool start, int64_t n) {
  const auto chunk_bytes = static_cast<int64_t>(shared_->chunks->buffer_size());
  const int64_t most = std::max(shared_->window, chunk_bytes);
  if (start || window_ == 0) {  // (a seek, then a read where it ended: a sequence found mid-file)
    const int64_t first = shared_->initial_window > 0 ? shared_->initial_window : most;
    window_ = std::min(most, (first + chunk_bytes - 1) / chunk_bytes * chunk_bytes);
    consumed_ = 0;
    return;
  }
  consumed_ += n;
  if (consumed_ >= window_ && window_ < most) {
    window_ = std::min(most, 2 * window_);
    consumed_ = 0;
  }
}

std::shared_ptr<RaChunk> ReadAhead::ChunkAtLocked(int64_t pos) const {
  for (const auto& c : chunks_) {
    if (c->offset <= pos && pos < c->offset + c->length) return c;
  }
  return nullptr;
}

void ReadAhead::DropBehindLocked(int64_t pos) {
  std::erase_if(chunks_, [&](const std::shared_ptr<RaChunk>& c) {
    return c->ready && c->offset + c->length <= pos;
  });
}

void ReadAhead::StartLocked(const FileRef& file, int64_t from, int64_t file_size) {
  if (window_ <= 0) return;  // no sequence: nothing to fetch
  const auto chunk_bytes = static_cast<int64_t>(shared_->chunks->buffer_size());
  const int64_t window_end = std::min(file_size, from + window_);
  // From the page the reader is in, not the chunk's multiple: a sequence that starts mid-file
  // (the first read of a read-only open) fetches nothing behind the reader.
  int64_t next = from / kFetchAlign * kFetchAlign;
  std::shared_ptr<AioHandle> engine;
  while (next < window_end) {
    if (const std::shared_ptr<RaChunk> have = ChunkAtLocked(next)) {
      next = have->offset + have->length;
      continue;
    }
    PinnedPool::Lease lease = shared_->chunks->TryAcquire();
    if (!lease) return;  // the pool is shared by all readers; try again on the next read
    auto chunk = std::make_shared<RaChunk>();
    chunk->offset = next;
    chunk->length = std::min(chunk_bytes, file_size - next);
    chunk->buf = std::make_shared<PinnedPool::Lease>(std::move(lease));
    if (!engine) engine = shared_->engine();
    ++inflight_;
    shared_->counters->read_ahead_fetches.fetch_add(1, std::memory_order_relaxed);
    Status st = engine->submit_pread(chunk->buf->data(), chunk->length, file, chunk->offset,
                                     [this, chunk](const OpResult& r) {
                                       // Notified under the mutex: Quiesce may return once
                                       // inflight_ is 0, and the object go with it.
                                       std::lock_guard g(m_);
                                       chunk->status = r.status;
                                       chunk->ready = true;
                                       --inflight_;
                                       cv_.notify_all();
                                     });
    if (!st.ok()) {
      --inflight_;
      return;  // nothing fetched ahead; the reader's own read reports any real error
    }
    chunks_.push_back(chunk);
    next += chunk->length;
  }
}

int64_t ReadAhead::Serve(const FileRef& file, const WindowRead& r, ReadReply* reply) {
  if (shared_->chunks == nullptr) return 0;
  const int64_t off = r.off, n = r.n;
  std::unique_lock lock(m_);
  // The file changed after this reader drained: what it would fetch may predate the change.
  if (r.generation != generation_) return 0;
  if (shared_->max_read > 0 && n >= shared_->max_read) {
    chunks_.clear();  // chunks in flight live on in their completions
    next_ = -1;
    window_ = 0;
    return 0;
  }
  // A read inside the window continues the sequence too: FUSE's worker threads may hand the
  // kernel's requests over out of order, and readers sharing a file (the mount's window is the
  // inode's) interleave.
  const bool inside = ChunkAtLocked(off) != nullptr;
  const bool continues = inside || (next_ >= 0 && off >= next_ && off - next_ <= shared_->max_skip);
  const bool starts = !continues && (off == 0 || r.starts_sequence);
  next_ = off + n;
  if (!continues) {
    // A seek, or a sequence somewhere new: keep only what lies in reach of here (another reader
    // of the file may still use it), and what failed nowhere (a new start fetches it again).
    const int64_t reach = off + std::max(shared_->window, shared_->initial_window);
    std::erase_if(chunks_, [&](const std::shared_ptr<RaChunk>& c) {
      return c->offset + c->length <= off || c->offset >= reach || (c->ready && !c->status.ok());
    });
    if (!starts) window_ = 0;
  }
  DropBehindLocked(off);
  if (continues || starts) {
    PaceLocked(starts, n);
    StartLocked(file, off, r.file_size);
  }
  int64_t copied = 0;
  while (copied < n) {
    const int64_t pos = off + copied;
    std::shared_ptr<RaChunk> c = ChunkAtLocked(pos);
    if (!c) break;
    cv_.wait(lock, [&] { return c->ready; });
    if (!c->status.ok()) break;
    const int64_t k = std::min(n - copied, c->offset + c->length - pos);
    // No copy here: the reply points into the chunk, which the reply keeps alive.
    reply->iov.push_back({c->buf->data() + (pos - c->offset), static_cast<size_t>(k)});
    reply->pins.push_back(c);
    copied += k;
  }
  shared_->counters->bytes_read_ahead_hit.fetch_add(static_cast<uint64_t>(copied),
                                                    std::memory_order_relaxed);
  return copied;
}

}  // namespace dnvme::datapath
