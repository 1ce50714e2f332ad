#include "fs/splice_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <memory>
#include <string>

#include "engine/common/log.h"

namespace dnvme::fs {

SpliceWriter::SpliceWriter(int threads) {
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Run(); });
}

SpliceWriter::~SpliceWriter() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void SpliceWriter::Submit(Job job) {
  {
    std::lock_guard lock(mu_);
    queue_.push_back(std::move(job));
  }
  cv_.notify_one();
}

SpliceWriter::Counters SpliceWriter::counters() {
  std::lock_guard lock(mu_);
  return counters_;
}

void SpliceWriter::Run() {
  for (;;) {
    Job job;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and every job is done
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    Status st = Write(job);
    job.pipe.Reset();  // emptied (or discarded) and back in the pool before anyone waits on it
    if (job.done) job.done(st);
  }
}

Status SpliceWriter::Write(Job& job) {
  int64_t off = job.offset;
  int64_t left = job.len;
  int64_t spliced = 0;
  Status st;
  while (left > 0) {
    loff_t pos = off;
    ssize_t n = splice(job.pipe->read_fd(), nullptr, job.fd, &pos, static_cast<size_t>(left), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n > 0) {
      off += n;
      left -= n;
      spliced += n;
      continue;
    }
    if (n == 0) {
      st = Status::Internal("write-behind pipe ran dry with " + std::to_string(left) +
                            " bytes still owed at offset " + std::to_string(off));
      break;
    }
    if (errno != EINVAL || !job.fallback) {
      st = Status::FromErrno(errno, "splice of write-behind data at offset " + std::to_string(off));
      break;
    }
    // The kernel would not build a direct write from these pages (not aligned for O_DIRECT):
    // read them out and let the engine write them, unaligned edges included.
    std::unique_ptr<char, decltype(&std::free)> buf(
        static_cast<char*>(std::aligned_alloc(4096, (left + 4095) / 4096 * 4096)), &std::free);
    if (!buf) {
      st = Status::ResourceExhausted(ENOMEM, "fallback buffer for a spliced extent");
      break;
    }
    int64_t got = 0;
    while (got < left) {
      ssize_t r = read(job.pipe->read_fd(), buf.get() + got, static_cast<size_t>(left - got));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        st = r < 0 ? Status::FromErrno(errno, "reading write-behind data back from its pipe")
                   : Status::Internal("write-behind pipe ran dry");
        break;
      }
      got += r;
    }
    if (st.ok()) st = job.fallback(buf.get(), left, off);
    if (st.ok()) {
      std::lock_guard lock(mu_);
      counters_.bytes_fallback += left;
    }
    left = 0;
    break;
  }
  std::lock_guard lock(mu_);
  counters_.bytes_spliced += spliced;
  return st;
}

}  // namespace dnvme::fs
