#include "dnvme/fast_writer.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "dnvme/log.h"

namespace dnvme {
namespace {
constexpr int64_t kAlign = 4096;
}  // namespace

Status FastWriterOptions::Validate() const {
  if (external != nullptr) {
    if (buffer_bytes == 0) return Status::InvalidArgument("buffer_bytes must be positive");
    if (pool != nullptr) {
      return Status::InvalidArgument("a FastWriter takes external buffers or a pool, not both");
    }
  } else if (buffer_bytes == 0 || buffer_bytes % kAlign != 0) {
    return Status::InvalidArgument("buffer_bytes must be a positive multiple of 4096, not " +
                                   std::to_string(buffer_bytes));
  }
  // Own buffers: two at least, so copying overlaps writing. The caller's memory may be one.
  const int min_buffers = external != nullptr ? 1 : 2;
  if (num_buffers < min_buffers || num_buffers > 64) {
    return Status::InvalidArgument("num_buffers must be in [" + std::to_string(min_buffers) +
                                   ", 64], not " + std::to_string(num_buffers));
  }
  if (stripe_bytes < 0 || stripe_bytes % kAlign != 0) {
    return Status::InvalidArgument("stripe_bytes must be 0 or a positive multiple of 4096, not " +
                                   std::to_string(stripe_bytes));
  }
  if (stripe_count < 1 || stripe_index < 0 || stripe_index >= stripe_count) {
    return Status::InvalidArgument("stripe_index " + std::to_string(stripe_index) +
                                   " is not in [0, stripe_count=" + std::to_string(stripe_count) +
                                   ")");
  }
  if (pool != nullptr && pool->buffer_size() != buffer_bytes) {
    return Status::InvalidArgument("the pool's buffers are " + std::to_string(pool->buffer_size()) +
                                   " bytes, buffer_bytes is " + std::to_string(buffer_bytes));
  }
  if (stripe_count > 1 && stripe_bytes == 0) {
    return Status::InvalidArgument("stripe_count > 1 needs stripe_bytes");
  }
  return Status::Ok();
}

Result<std::unique_ptr<FastWriter>> FastWriter::Open(AioHandle* handle, const std::string& path,
                                                     const FastWriterOptions& options) {
  if (handle == nullptr) return Status::InvalidArgument("FastWriter needs an AioHandle");
  DNVME_RETURN_IF_ERROR(options.Validate());
  DNVME_ASSIGN_OR_RETURN(FileRef file, handle->open_file(path, FileAccess::kWrite));
  if (options.truncate) {
    int rc;
    do {
      rc = ftruncate(file.buffered_fd(), 0);
    } while (rc != 0 && errno == EINTR);
    if (rc != 0) return Status::FromErrno(errno, "truncate '" + path + "'");
  }
  std::vector<Slot> slots(static_cast<size_t>(options.num_buffers));
  if (options.external != nullptr) {
    for (size_t i = 0; i < slots.size(); ++i)
      slots[i].data = options.external + i * options.buffer_bytes;
  } else if (options.pool != nullptr) {
    for (Slot& slot : slots) {
      slot.lease = options.pool->TryAcquire();
      if (!slot.lease) break;
      slot.data = slot.lease.data();
    }
    if (!slots.back().lease) {
      for (Slot& slot : slots) slot = Slot();  // all or none: the leases go back
    }
  }
  for (Slot& slot : slots) {
    if (slot.data != nullptr) continue;
    auto buffer = PinnedBuffer::Allocate(options.buffer_bytes, kAlign);
    if (!buffer.ok()) return buffer.status().WithContext("FastWriter buffers for '" + path + "'");
    slot.own = std::move(buffer).value();
    slot.data = slot.own.bytes();
  }
  return std::unique_ptr<FastWriter>(
      new FastWriter(handle, path, options, std::move(file), std::move(slots)));
}

FastWriter::FastWriter(AioHandle* handle, std::string path, FastWriterOptions options, FileRef file,
                       std::vector<Slot> slots)
    : handle_(handle),
      path_(std::move(path)),
      options_(options),
      file_(std::move(file)),
      slots_(std::move(slots)) {}

FastWriter::~FastWriter() {
  if (!closed_) {
    // Abandoned (an exception in the serializer, say): the completions still point at this
    // object, so wait for them; the file is left as far as it got, without fsync.
    WaitAll();
    Logger().warn(
        "FastWriter for '{}' destroyed without Close(); {} bytes of the stream not "
        "made durable",
        path_, position_);
  }
}

Status FastWriter::FirstError() {
  std::lock_guard<std::mutex> lock(mu_);
  return first_error_;
}

void FastWriter::WaitAll() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] {
    return std::none_of(slots_.begin(), slots_.end(), [](const Slot& s) { return s.in_flight; });
  });
}

Status FastWriter::SubmitCurrent() {
  const size_t index = current_;
  Slot& slot = slots_[index];
  if (slot.fill > 0) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      slot.in_flight = true;
    }
    Status st = handle_->submit_pwrite(slot.data, static_cast<int64_t>(slot.fill), file_,
                                       slot.file_offset, [this, index](const OpResult& result) {
                                         std::lock_guard<std::mutex> lock(mu_);
                                         if (!result.status.ok() && first_error_.ok())
                                           first_error_ = result.status;
                                         slots_[index].in_flight = false;
                                         slots_[index].fill = 0;
                                         cv_.notify_all();
                                       });
    if (!st.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      slot.in_flight = false;
      slot.fill = 0;
      if (first_error_.ok()) first_error_ = st.WithContext("write '" + path_ + "'");
    }
  }
  current_ = (current_ + 1) % slots_.size();
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return !slots_[current_].in_flight; });
  return first_error_;
}

Status FastWriter::Write(const void* data, size_t n) {
  if (closed_) return Status::InvalidArgument("write to closed FastWriter '" + path_ + "'");
  DNVME_RETURN_IF_ERROR(FirstError());
  const char* p = static_cast<const char*>(data);
  const int64_t stripe = options_.stripe_bytes;
  while (n > 0) {
    int64_t limit = static_cast<int64_t>(n);
    if (stripe > 0) {
      const int64_t s = position_ / stripe;
      const int64_t to_stripe_end = (s + 1) * stripe - position_;
      if (s % options_.stripe_count != options_.stripe_index) {
        const size_t skip = static_cast<size_t>(std::min(limit, to_stripe_end));
        p += skip;
        n -= skip;
        position_ += static_cast<int64_t>(skip);
        continue;
      }
      limit = std::min(limit, to_stripe_end);
    }
    Slot& slot = slots_[current_];
    if (slot.fill == 0) {
      slot.file_offset = position_;
    } else if (slot.file_offset + static_cast<int64_t>(slot.fill) != position_) {
      // Slots are submitted at every stripe end, so a filled slot always continues at position_.
      return Status::Internal("FastWriter slot does not continue the stream");
    }
    const size_t take = std::min(static_cast<size_t>(limit), options_.buffer_bytes - slot.fill);
    std::memcpy(slot.data + slot.fill, p, take);
    slot.fill += take;
    p += take;
    n -= take;
    position_ += static_cast<int64_t>(take);
    stored_ += static_cast<int64_t>(take);
    if (slot.fill == options_.buffer_bytes || (stripe > 0 && position_ % stripe == 0)) {
      DNVME_RETURN_IF_ERROR(SubmitCurrent());
    }
  }
  return Status::Ok();
}

Status FastWriter::Close() {
  if (closed_) return close_status_;
  closed_ = true;
  Status st = FirstError();
  if (st.ok()) st = SubmitCurrent();
  WaitAll();
  if (st.ok()) st = FirstError();
  if (st.ok() && options_.fsync_on_close) {
    int rc;
    do {
      rc = fsync(file_.buffered_fd());
    } while (rc != 0 && errno == EINTR);
    if (rc != 0) st = Status::FromErrno(errno, "fsync '" + path_ + "'");
  }
  file_ = FileRef();                        // closes the file (last reference)
  for (Slot& slot : slots_) slot = Slot();  // buffers back to the pool (or freed) at once
  close_status_ = st;
  return st;
}

}  // namespace dnvme
