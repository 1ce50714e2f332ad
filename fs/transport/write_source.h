// WriteSource: a WRITE request's payload as the data path consumes it.
//
// libfuse hands a WRITE's bytes over as a buffer vector: plain memory (the request was read(2)
// into a transport buffer, or into libfuse's own) or, when the transport spliced the request, a
// pipe holding references to the request's pages. The data path takes them in order, in
// whichever way costs least: a copy into a pinned chunk, page references spliced into a
// write-behind pipe, or the whole request buffer adopted from the pool the transport received
// it into (fs/transport/request_buffer.h). The pool is handed over with the payload: memory
// outside it is never adopted.
//
// Thread contract: one WriteSource per request, used by the thread handling it.
#pragma once

#include <fuse_lowlevel.h>

#include <cstddef>
#include <cstdint>

#include "fs/transport/request_buffer.h"

namespace dnvme::fs {

class WriteSource {
 public:
  // `pool`: where the transport received the request (Transport::payload_pool); null when the
  // payload is not the daemon's to keep.
  WriteSource(fuse_bufvec* src, RequestBufferPool* pool) : src_(src), pool_(pool) {}
  // Moves the next `n` bytes into `dst`; false (errno set) on failure.
  bool CopyTo(char* dst, size_t n);
  // True when the bytes are still in the request pipe (the session loop spliced the request).
  bool in_pipe() const;
  // Moves up to `n` of the next bytes, as page references, into the pipe `pipe_w` without
  // blocking. Returns the bytes moved (fewer when that pipe is full) or -errno.
  int64_t SpliceTo(int pipe_w, size_t n);
  // True when the rest of the request is one page-aligned piece of a buffer the transport
  // received it in: Adopt can take it.
  bool adoptable() const;
  // Bytes after the rest of the request in the buffer Adopt would take (0 when not adoptable):
  // room for the next request to complete a payload the kernel cut inside a page.
  size_t adoptable_spare() const;
  // The rest of the request (exactly `n` bytes) when it is one piece of memory, marked consumed;
  // null otherwise. Valid until the handler returns.
  const char* InMemory(size_t n);
  // Takes the buffer holding the rest of the request (exactly `n` bytes) from the transport
  // instead of copying out of it; empty when it is not adoptable or the pool has no buffer to
  // replace it with.
  RequestBuffer Adopt(size_t n);

 private:
  // The rest of the request when it is one piece of memory, its size in `n`; null otherwise.
  const char* RestInMemory(size_t* n) const;
  fuse_bufvec* src_;
  RequestBufferPool* pool_;
};

}  // namespace dnvme::fs
