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
// The write-behind takes it as a datapath::ExtentSource (datapath/extent_source.h).
//
// Thread contract: one WriteSource per request, used by the thread handling it.
#pragma once

#include <fuse_lowlevel.h>

#include <cstddef>
#include <cstdint>

#include "datapath/extent_source.h"
#include "fs/transport/request_buffer.h"

namespace dnvme::fs {

class WriteSource final : public datapath::ExtentSource {
 public:
  // `pool`: where the transport received the request (Transport::payload_pool); null when the
  // payload is not the daemon's to keep.
  WriteSource(fuse_bufvec* src, RequestBufferPool* pool) : src_(src), pool_(pool) {}
  bool CopyTo(char* dst, size_t n) override;
  // True when the session loop spliced the request: its bytes are still in the request pipe.
  bool in_pipe() const override;
  int64_t SpliceTo(int pipe_w, size_t n) override;
  // Adoptable: the rest of the request is one page-aligned piece of a buffer the transport
  // received it in (fs/transport/request_buffer.h); Adopt takes that buffer and gives the pool
  // another, or nothing when the pool has none to spare.
  bool adoptable() const override;
  size_t adoptable_spare() const override;
  const char* InMemory(size_t n) override;
  std::unique_ptr<datapath::AdoptedBuffer> Adopt(size_t n) override;

 private:
  // The rest of the request when it is one piece of memory, its size in `n`; null otherwise.
  const char* RestInMemory(size_t* n) const;
  fuse_bufvec* src_;
  RequestBufferPool* pool_;
};

}  // namespace dnvme::fs
