// Writing write-behind extents held in pipes to the backing files with splice(2), without the
// daemon touching the bytes: the pipe holds references to the FUSE inode's page-cache pages (see
// datapath/pipe.h), and splicing it into the backing file's O_DIRECT descriptor makes the
// kernel build the direct write from those very pages.
//
// splice blocks until the write is done, so parallelism comes from threads (SpliceWorkers): each
// has one extent in flight, which the block layer splits into many requests. This is the one part
// of the mount's data path that does not use libaio: libaio can only write from the daemon's own
// memory, and getting the pages there is exactly the copy this path exists to avoid. Where the
// kernel refuses a direct write from the pipe (EINVAL: pages not aligned for O_DIRECT) the rest is
// read out and written through the engine by the caller's fallback.
//
// (The read side was tried the same way, and measured no better here: docs/performance-journal.md.)
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "datapath/pipe.h"
#include "dnvme/status.h"

namespace dnvme::datapath {

// Writes `len` bytes at `offset` of the file the caller writes through; used for what splice
// could not write.
using SpliceFallback = std::function<Status(const char* data, int64_t len, int64_t offset)>;

struct SpliceWriteResult {
  Status status;
  int64_t spliced = 0;    // written straight from the pipe
  int64_t fell_back = 0;  // read out of the pipe and written by the fallback
};

// Empties `pipe` (holding exactly `len` bytes) into `fd` (O_DIRECT) at `offset`. On EINVAL the
// rest is read out and handed to `fallback`. On any other error the pipe may keep bytes: the
// caller's pool discards them when the lease returns.
SpliceWriteResult SpliceToFile(Pipe& pipe, int fd, int64_t offset, int64_t len,
                               const SpliceFallback& fallback);

// A fixed pool of threads that run blocking splice tasks.
// Thread contract: Submit from any thread. Tasks run on a pool thread, several at once, and must
// not wait for one another. The destructor runs every submitted task, then joins the threads.
class SpliceWorkers {
 public:
  explicit SpliceWorkers(int threads);
  ~SpliceWorkers();
  SpliceWorkers(const SpliceWorkers&) = delete;
  SpliceWorkers& operator=(const SpliceWorkers&) = delete;

  void Submit(std::function<void()> task);

 private:
  void Run();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;  // guarded by mu_
  bool stopping_ = false;                    // guarded by mu_
  std::vector<std::thread> threads_;
};

}  // namespace dnvme::datapath
