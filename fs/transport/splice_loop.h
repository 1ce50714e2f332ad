// The kSplice transport (fs/transport/transport.h): requests spliced out of /dev/fuse into one
// pipe per loop thread, so that a page-cache WRITE's payload reaches write_buf as references to
// the kernel's pages and the splice writer (datapath/splice_io.h) moves them to the disk with no
// copy in the daemon. libfuse gets the pipe as a FUSE_BUF_IS_FD buffer.
//
// Splicing pays only for WRITEs from the kernel's page cache. A caller's own pages (an O_DIRECT
// client) are copied into fresh pipe pages by the kernel and read out again, which costs more
// than one read(2). The loop steers itself from the headers of the WRITEs it receives
// (SpliceSteering): no feedback from the data path.
//
// Thread contract: as SessionLoop. SpliceSteering is lock-free and shared by the loop threads.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "fs/transport/request_pipe.h"
#include "fs/transport/session_loop.h"

namespace dnvme::fs {

// Whether to splice the next request, learnt from the large WRITEs received so far: +1 for one
// whose data comes from the kernel's page cache, -1 for one of a caller's own pages (O_DIRECT in
// the file's flags), kept within [-kLimit, kLimit] so that a few requests of the other kind flip
// the mode. Small WRITEs are read whole either way and say nothing.
class SpliceSteering {
 public:
  static constexpr int kLimit = 8;
  static constexpr uint32_t kMinBytes = 64 << 10;

  // `direct_io`: the mount's policy, which says from the file's flags whether the kernel sent a
  // WRITE from the caller's pages; `protocol`: whether O_RDWR opens may be direct_io (null: no).
  SpliceSteering(DirectIo direct_io, const ProtocolExtensions* protocol)
      : direct_io_(direct_io), protocol_(protocol) {}
  void Note(const fuse_write_in& w);
  bool splice_next() const { return score_.load(std::memory_order_relaxed) > 0; }

 private:
  const DirectIo direct_io_;
  const ProtocolExtensions* const protocol_;
  std::atomic<int> score_{1};
};

class SpliceLoop final : public SessionLoop {
 public:
  // EPERM (and friends) when the pipes cannot be sized: the caller falls back to ReadLoop.
  static Result<std::unique_ptr<SpliceLoop>> Create(fuse_session* se, int threads, size_t adoptable,
                                                    int64_t max_request, DirectIo direct_io,
                                                    const ProtocolExtensions* protocol);
  Kind kind() const override { return Kind::kSplice; }
  std::string Describe() const override;
  std::string StatsJson() const override;
  std::optional<uint32_t> WriteFlags(const fuse_bufvec& bufv) const override;

 private:
  SpliceLoop(fuse_session* se, int threads, size_t adoptable, int64_t max_request,
             DirectIo direct_io, const ProtocolExtensions* protocol)
      : SessionLoop(se, threads, adoptable, max_request), steering_(direct_io, protocol) {}
  Result<Received> Receive(size_t index, Receiver& r, fuse_buf* buf) override;
  Status AfterDispatch(size_t index, const fuse_buf& buf) override;
  bool ToMemory(size_t index, Receiver& r, fuse_buf* buf) override;

  std::vector<std::unique_ptr<Pipe>> pipes_;  // one per thread
  // One small pipe per thread beside each of pipes_: a large spliced request's headers are
  // read through it (Pipe::Peek) while libfuse still finds them in the request pipe.
  std::vector<std::unique_ptr<Pipe>> peeks_;
  SpliceSteering steering_;
  std::atomic<uint64_t> requests_spliced_{0};
};

}  // namespace dnvme::fs
