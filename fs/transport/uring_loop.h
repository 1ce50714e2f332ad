// FUSE over io_uring (protocol 7.42, CONFIG_FUSE_IO_URING, module parameter enable_uring): the
// kUring transport (fs/transport/transport.h).
//
// Why: with /dev/fuse every request costs the daemon a read(2) and a writev(2), and the kernel
// wakes whichever loop thread sleeps in read(2), on any CPU. Over io_uring the kernel keeps one
// queue per possible CPU and hands a request to an entry the daemon registered on the queue of
// the CPU that issued it; the daemon answers and fetches the next request in one SQE
// (FUSE_IO_URING_CMD_COMMIT_AND_FETCH).
//
// How, on libfuse 3.14 (which knows nothing of it):
//   - INIT: ProtocolExtensions adds FUSE_OVER_IO_URING to libfuse's reply (protocol_ext.h).
//   - Requests the kernel still sends through /dev/fuse (INIT, FORGET, INTERRUPT, and everything
//     until every queue has an entry) are served by an embedded ReadLoop.
//   - Each ring thread owns one io_uring (SQE128) and one entry: a 288-byte header buffer
//     (fuse_uring_req_header: the fuse_in_header, the op's own header, the payload size) and a
//     payload buffer with room in front of it, so the daemon rebuilds the request libfuse
//     expects -- header, op header, payload -- contiguously without copying the payload, and
//     hands it to fuse_session_process_buf.
//   - Replies: the session's writev (fuse_custom_io, SessionIo) offers every reply to
//     TakeReply first. The reply of a request an entry is serving (found by its unique) goes
//     into that entry
//     (fuse_out_header into the header buffer, the rest into the payload); the thread then
//     commits it and fetches the next request with one SQE. Every other write (notifications,
//     replies to /dev/fuse requests) goes to /dev/fuse as before. A reply that comes after its
//     handler returned (async_reply) would find the entry committed with EIO already: that
//     option is refused with io_uring.
//   - Threads are pinned to their queue's CPU.
//
// Thread contract: Run on the main thread, as for every Transport; TakeReply and WriteFlags from
// the handler of the request (any thread).
#pragma once

#include <fuse_lowlevel.h>
#include <sys/uio.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "dnvme/status.h"
#include "fs/transport/session_loop.h"
#include "fs/transport/transport.h"

namespace dnvme::fs {

// "Y" in /sys/module/fuse/parameters/enable_uring (root may write it; off by default).
bool KernelUringEnabled();
// The kernel's number of FUSE ring queues: one per possible CPU (/sys/devices/system/cpu/possible).
int PossibleCpus();

class UringLoop final : public Transport {
 public:
  // `threads_per_queue` ring threads on each queue; `dev_threads` for the /dev/fuse requests.
  static Result<std::unique_ptr<UringLoop>> Create(fuse_session* se, int threads_per_queue,
                                                   int dev_threads, int64_t max_request);
  ~UringLoop() override;

  int Run() override;
  Kind kind() const override { return Kind::kUring; }
  std::string Describe() const override;
  std::string StatsJson() const override;
  std::optional<uint32_t> WriteFlags(const fuse_bufvec& bufv) const override;
  RequestBufferPool* payload_pool() override { return nullptr; }  // payloads are the ring's
  bool TakeReply(const iovec* iov, int count, ssize_t* written) override;

  struct Entry;

 private:
  UringLoop(fuse_session* se, int threads_per_queue, int64_t max_request);
  void RingThread(int qid, int index);
  // Serves one request delivered into `e`; false when the ring must stop.
  bool Serve(Entry& e);
  // The entry serving the request `unique`, if one does.
  Entry* EntryServing(uint64_t unique) const;

  fuse_session* const se_;
  const int threads_per_queue_;
  const int queues_;
  const size_t payload_bytes_;
  // One slot per ring thread (queue * threads_per_queue + index): its entry while it runs. A
  // reply names its entry by the request's unique, a WRITE's payload by its address.
  std::unique_ptr<std::atomic<Entry*>[]> entries_;
  std::unique_ptr<ReadLoop> dev_loop_;
  std::vector<std::thread> threads_;
  std::atomic<bool> stop_{false};
  std::atomic<int> registered_{0};
  std::atomic<uint64_t> requests_ring_{0};
  std::atomic<int> ring_errors_{0};
};

}  // namespace dnvme::fs
