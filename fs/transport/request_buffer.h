// Request buffers of the session loop's read(2) receive path, and the hand-over of a WRITE's
// payload to write-behind without copying it.
//
// Why: a WRITE that is read(2) from /dev/fuse (every WRITE of an O_DIRECT client, and every
// WRITE when requests are not spliced) is copied by the kernel into the loop thread's buffer.
// Copying it once more into a write-behind chunk was a third of the daemon's CPU for O_DIRECT
// writers (perf: docs/performance-journal.md). The loop therefore reads every request at
// kRequestReadOffset into an aligned buffer, which puts a WRITE's payload (after its 80 bytes of
// headers) on a page boundary: the payload can itself be the source of an O_DIRECT write. The
// data path adopts the whole buffer (AdoptRequestBuffer) and the loop thread receives its next
// request into a replacement from the same pool.
//
// Thread contract: RequestBufferPool is thread-safe. A RequestBuffer has one owner at a time and
// may move between threads (the adopting handler, then the engine's completion thread).
// AdoptRequestBuffer works only on a session-loop thread, inside the handler of the request that
// thread received (the loop publishes its current buffer in a thread-local RequestSlot).
#pragma once

#include <linux/fuse.h>

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
  void Reset();

 private:
  friend class RequestBufferPool;
  friend RequestBuffer AdoptRequestBuffer(const char* payload, size_t size);
  std::shared_ptr<RequestBufferPool> pool_;
  char* data_ = nullptr;
  size_t size_ = 0;
  const char* payload_ = nullptr;
  size_t payload_size_ = 0;
};

// Page-aligned buffers of one size, allocated on first use up to `limit` at a time and reused
// after that (never freed before the pool). Not pinned: the kernel pins an O_DIRECT source for
// the duration of the I/O anyway, and these are not DMA targets of a GPU.
class RequestBufferPool : public std::enable_shared_from_this<RequestBufferPool> {
 public:
  static std::shared_ptr<RequestBufferPool> Create(size_t buffer_bytes, size_t limit);
  ~RequestBufferPool();

  // A buffer, or an empty one when `limit` are out (or memory ran out).
  RequestBuffer TryAcquire();
  size_t buffer_bytes() const { return bytes_; }
  size_t limit() const { return limit_; }
  size_t allocated() const;

 private:
  RequestBufferPool(size_t bytes, size_t limit) : bytes_(bytes), limit_(limit) {}
  friend class RequestBuffer;
  void Return(char* p);

  const size_t bytes_;
  const size_t limit_;
  mutable std::mutex mu_;
  std::vector<char*> free_;  // guarded by mu_
  std::vector<char*> all_;   // guarded by mu_; freed by the destructor
};

// The buffer a session-loop thread receives its current request into. The loop installs one per
// thread (Install) for the thread's lifetime.
class RequestSlot {
 public:
  explicit RequestSlot(RequestBuffer buf) : buf_(std::move(buf)) {}
  RequestBuffer& buffer() { return buf_; }
  // Makes `slot` this thread's slot (null: none) for AdoptRequestBuffer and CurrentWriteFlags.
  static void Install(RequestSlot* slot);
  // Set by the loop before it dispatches each request: the WRITE's fuse_write_in::write_flags,
  // or nullopt for any other request.
  void set_write_flags(std::optional<uint32_t> flags) { write_flags_ = flags; }

 private:
  friend RequestBuffer AdoptRequestBuffer(const char* payload, size_t size);
  friend bool InRequestBuffer(const char* payload, size_t size);
  friend std::optional<uint32_t> CurrentWriteFlags();
  RequestBuffer buf_;
  std::optional<uint32_t> write_flags_;
};

// From a WRITE handler: the request's write_flags (FUSE_WRITE_KILL_SUIDGID, FUSE_WRITE_CACHE, ...),
// which libfuse 3.14 reads but does not pass to write_buf. nullopt when this thread is not a
// session-loop thread (libfuse's own loop, clone_fd=1): the caller must then decide without them.
std::optional<uint32_t> CurrentWriteFlags();

// True when [payload, payload + size) lies in the buffer this thread received its current
// request into (a session-loop thread inside a handler).
bool InRequestBuffer(const char* payload, size_t size);

// From a WRITE handler: when [payload, payload + size) lies in the buffer this thread received the
// request into and the pool can hand the thread a replacement, the buffer changes hands (the
// loop receives its next request into the replacement) and is returned, naming the payload.
// Otherwise an empty RequestBuffer: copy the payload as before.
RequestBuffer AdoptRequestBuffer(const char* payload, size_t size);

}  // namespace dnvme::fs
