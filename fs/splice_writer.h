// Writes write-behind extents held in pipes to their backing files with splice(2).
//
// The pipe holds references to the FUSE inode's page-cache pages (see fs/pipe.h); splicing it
// into the backing file's O_DIRECT descriptor makes the kernel build the direct write from those
// very pages, so the bytes are never copied by the daemon. splice blocks until the write is
// done, so parallelism comes from threads: each thread has one extent (up to write_chunk bytes,
// which the block layer splits into many requests) in flight.
//
// This is the one part of the mount's data path that does not go through the libaio engine:
// libaio can only write from the daemon's own memory, and getting the pages there is exactly the
// copy this path exists to avoid. Extents the kernel refuses to write directly from the pipe
// (EINVAL: pages not aligned for O_DIRECT) are read out of the pipe and written through the
// engine by the caller-supplied fallback, so nothing depends on the kernel accepting the splice.
//
// Thread contract: Submit from any thread. Completion callbacks run on a writer thread, one at a
// time per thread, and must not block for long. The destructor waits for every submitted job and
// its callback.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "dnvme/status.h"
#include "fs/pipe.h"

namespace dnvme::fs {

class SpliceWriter {
 public:
  // Writes `len` bytes at `offset` of the file the caller writes through; used for what splice
  // could not write. Called on a writer thread.
  using Fallback = std::function<Status(const char* data, int64_t len, int64_t offset)>;

  struct Job {
    PipePool::Lease pipe;  // holds exactly `len` bytes
    int fd = -1;           // O_DIRECT descriptor of the backing file; kept open by the caller
    int64_t offset = 0;
    int64_t len = 0;
    Fallback fallback;
    // Called once, with the outcome, after the pipe has been emptied and returned.
    std::function<void(const Status&)> done;
  };

  struct Counters {
    int64_t bytes_spliced = 0;   // written straight from the pipe
    int64_t bytes_fallback = 0;  // read out and written by the fallback
  };

  explicit SpliceWriter(int threads);
  ~SpliceWriter();
  SpliceWriter(const SpliceWriter&) = delete;
  SpliceWriter& operator=(const SpliceWriter&) = delete;

  void Submit(Job job);
  Counters counters();

 private:
  void Run();
  Status Write(Job& job);

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> queue_;  // guarded by mu_
  bool stopping_ = false;  // guarded by mu_
  Counters counters_;      // guarded by mu_
  std::vector<std::thread> threads_;
};

}  // namespace dnvme::fs
