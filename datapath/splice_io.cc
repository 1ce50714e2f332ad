#include "datapath/splice_io.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <memory>
#include <string>

namespace dnvme::datapath {
SpliceWriteResult SpliceToFile(Pipe& pipe, int fd, int64_t offset, int64_t len,
                               const SpliceFallback& fallback) {
  SpliceWriteResult res;
  int64_t off = offset;
  int64_t left = len;
  while (left > 0) {
    loff_t pos = off;
    ssize_t n = splice(pipe.read_fd(), nullptr, fd, &pos, static_cast<size_t>(left), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n > 0) {
      off += n;
      left -= n;
      res.spliced += n;
      continue;
    }
    if (n == 0) {
      res.status = Status::Internal("write-behind pipe ran dry with " + std::to_string(left) +
                                    " bytes still owed at offset " + std::to_string(off));
      return res;
    }
    if (errno != EINVAL || !fallback) {
      res.status =
          Status::FromErrno(errno, "splice of write-behind data at offset " + std::to_string(off));
      return res;
    }
    // The kernel would not build a direct write from these pages (not aligned for O_DIRECT):
    // read them out and let the engine write them, unaligned edges included.
    std::unique_ptr<char, decltype(&std::free)> buf(
        static_cast<char*>(std::aligned_alloc(4096, (left + 4095) / 4096 * 4096)), &std::free);
    if (!buf) {
      res.status = Status::ResourceExhausted(ENOMEM, "fallback buffer for a spliced extent");
      return res;
    }
    res.status = pipe.ReadExactly(buf.get(), static_cast<size_t>(left));
    if (!res.status.ok()) {
      res.status = res.status.WithContext("write-behind data read back from its pipe");
      return res;
    }
    res.status = fallback(buf.get(), left, off);
    if (res.status.ok()) res.fell_back = left;
    return res;
  }
  return res;
}

SpliceWorkers::SpliceWorkers(int threads) {
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Run(); });
}

SpliceWorkers::~SpliceWorkers() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void SpliceWorkers::Submit(std::function<void()> task) {
  {
    std::lock_guard lock(mu_);
    queue_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void SpliceWorkers::Run() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and every task has run
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

}  // namespace dnvme::datapath
