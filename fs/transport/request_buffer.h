// Request buffers of the transport's read(2) receive path, and the hand-over of a WRITE's
// payload to write-behind without copying it.
//
// Why: a WRITE that is read(2) from /dev/fuse (every WRITE of an O_DIRECT client, and every
// WRITE when requests are not spliced) is copied by the kernel into the loop thread's buffer.
// Copying it once more into a write-behind chunk was a third of the daemon's CPU for O_DIRECT
// writers (perf: docs/performance-journal.md). The loop therefore reads every request at
// kRequestReadOffset into an aligned buffer, which puts a WRITE's payload (after its 80 bytes of
// headers) on a page boundary: the payload can itself be the source of an O_DIRECT write. The
// data path adopts the whole buffer (RequestBufferPool::Adopt) and the loop thread receives its
// next request into a replacement from the same pool.
//
// Ownership is explicit: every buffer a loop thread receives into is lent to that thread's
// Receiver, and the pool records which Receiver holds which buffer. A handler names the request
// by its payload (the memory libfuse handed it), so the pool finds the buffer by address -- the
// pool's buffers are one contiguous reservation -- and moves it from the Receiver to the handler.
// No thread-local state: the same call works from any thread, and memory that is not the pool's
// (libfuse's own buffers, a copy) is simply not adoptable.
//
// Thread contract: RequestBufferPool is thread-safe. A RequestBuffer has one owner at a time and
// may move between threads (the adopting handler, then the engine's completion thread). A
// Receiver belongs to one loop thread; HolderOf and Adopt may touch it only while the request
// received into its buffer is being handled (the loop thread waits in fuse_session_process_buf).
#pragma once

#include <linux/fuse.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

namespace dnvme::fs {

// Where the loop reads a request into its buffer: a WRITE's payload then starts at kPayloadAlign.
inline constexpr size_t kPayloadAlign = 4096;
inline constexpr size_t kWriteHeaderBytes = sizeof(fuse_in_header) + sizeof(fuse_write_in);
inline constexpr size_t kRequestReadOffset = kPayloadAlign - kWriteHeaderBytes;
static_assert(kWriteHeaderBytes < kPayloadAlign && kRequestReadOffset % 8 == 0,
              "the headers must stay naturally aligned");

class RequestBufferPool;

// One pool buffer, returned to the pool when destroyed (the pool lives as long as any of its
// buffers). After adoption it also names the payload it carries.
class RequestBuffer {
 public:
  RequestBuffer() = default;
  ~RequestBuffer() { Reset(); }
  RequestBuffer(RequestBuffer&& o) noexcept { *this = std::move(o); }
  RequestBuffer& operator=(RequestBuffer&& o) noexcept;
  RequestBuffer(const RequestBuffer&) = delete;
  RequestBuffer& operator=(const RequestBuffer&) = delete;

  explicit operator bool() const { return data_ != nullptr; }
  char* data() const { return data_; }
  size_t size() const { return size_; }
  // The adopted payload inside the buffer (null before adoption).
  const char* payload() const { return payload_; }
  size_t payload_size() const { return payload_size_; }
  // Bytes of the buffer after the adopted payload (0 before adoption).
  size_t spare() const {
    return payload_ == nullptr ? 0 : size_ - static_cast<size_t>(payload_ - data_) - payload_size_;
  }
  // Where the spare bytes start, and the payload's growth into them once written: a payload the
  // kernel cut short inside a page is completed by the next request's bytes. Only the owner, while
  // the buffer is not in flight.
  char* spare_data() { return data_ + (payload_ - data_) + payload_size_; }
  void Grow(size_t n) { payload_size_ += n; }
  void Reset();

 private:
  friend class RequestBufferPool;
  std::shared_ptr<RequestBufferPool> pool_;
  char* data_ = nullptr;
  size_t size_ = 0;
  const char* payload_ = nullptr;
  size_t payload_size_ = 0;
};

// Where a transport's loop thread receives its current request: the buffer lent to it, and what
// the transport read in the request's headers before dispatching it.
struct Receiver {
  RequestBuffer buffer;
  // The WRITE's fuse_write_in::write_flags (FUSE_WRITE_KILL_SUIDGID, ...), which libfuse 3.14
  // reads but does not hand to write_buf; nullopt for any other request or when unknown.
  std::optional<uint32_t> write_flags;
  // The sender's uid of a request whose header is not in `buffer` (a large WRITE left in a
  // splice pipe), for the loop's per-uid share of its threads: set with each such request (nullopt
  // when unknown) and read only for one.
  std::optional<uid_t> piped_uid;
};

// Page-aligned buffers of one size, carved on first use out of one address range reserved up
// front (MAP_NORESERVE: untouched buffers cost no memory), up to `limit` at a time, reused after
// that. Not pinned: the kernel pins an O_DIRECT source for the duration of the I/O anyway, and
// these are not DMA targets of a GPU.
class RequestBufferPool : public std::enable_shared_from_this<RequestBufferPool> {
 public:
  // Null when the address range cannot be reserved.
  static std::shared_ptr<RequestBufferPool> Create(size_t buffer_bytes, size_t limit);
  ~RequestBufferPool();

  // A buffer nobody receives into, or an empty one when `limit` are out.
  RequestBuffer TryAcquire();
  // Gives `r` a buffer to receive into (its first, or after its last one was adopted) and
  // records `r` as the buffer's holder. False, leaving `r` as it was, when none is free.
  bool Lend(Receiver* r);
  // The Receiver whose buffer holds [p, p + n) whole; null when none does: memory that is not
  // the pool's, a buffer nobody receives into (adopted, idle), a range crossing its end.
  Receiver* HolderOf(const char* p, size_t n) const;
  // Bytes of the buffer holding [p, p + n) after that range; 0 when no pool buffer holds it.
  size_t SpareAfter(const char* p, size_t n) const;
  // Hands the buffer that holds the payload [p, p + n) from its Receiver to the caller (the
  // buffer then names the payload) and lends the Receiver a replacement. Empty, and nothing
  // changes, when no Receiver holds such a buffer or no replacement is free.
  RequestBuffer Adopt(const char* p, size_t n);

  size_t buffer_bytes() const { return bytes_; }
  size_t limit() const { return limit_; }
  size_t allocated() const;

 private:
  RequestBufferPool(char* base, size_t bytes, size_t limit);
  friend class RequestBuffer;
  void Return(char* p);
  // Index of the buffer holding [p, p + n) whole, or -1.
  int64_t IndexOf(const char* p, size_t n) const;

  char* const base_;  // limit_ * bytes_ reserved bytes, unmapped by the destructor
  const size_t bytes_;
  const size_t limit_;
  // Per buffer: the Receiver it is lent to, or null. Written by the lending loop thread and by
  // Return; read by the handler of the request in that buffer.
  std::unique_ptr<std::atomic<Receiver*>[]> holders_;
  mutable std::mutex mu_;
  std::vector<size_t> free_;  // indices of returned buffers; guarded by mu_
  size_t carved_ = 0;         // buffers handed out at least once; guarded by mu_
};

}  // namespace dnvme::fs
