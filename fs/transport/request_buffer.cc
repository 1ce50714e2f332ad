#include "fs/transport/request_buffer.h"

#include <cstdlib>
#include <utility>

namespace dnvme::fs {
namespace {

thread_local RequestSlot* tls_slot = nullptr;

}  // namespace

RequestBuffer& RequestBuffer::operator=(RequestBuffer&& o) noexcept {
  if (this != &o) {
    Reset();
    pool_ = std::move(o.pool_);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    payload_ = std::exchange(o.payload_, nullptr);
    payload_size_ = std::exchange(o.payload_size_, 0);
  }
  return *this;
}

void RequestBuffer::Reset() {
  if (data_ != nullptr) pool_->Return(data_);
  pool_.reset();
  data_ = nullptr;
  size_ = 0;
  payload_ = nullptr;
  payload_size_ = 0;
}

std::shared_ptr<RequestBufferPool> RequestBufferPool::Create(size_t buffer_bytes, size_t limit) {
  const size_t rounded = (buffer_bytes + kPayloadAlign - 1) / kPayloadAlign * kPayloadAlign;
  return std::shared_ptr<RequestBufferPool>(new RequestBufferPool(rounded, limit));
}

RequestBufferPool::~RequestBufferPool() {
  // Every buffer is back: each one held a reference to the pool.
  for (char* p : all_) std::free(p);
}

RequestBuffer RequestBufferPool::TryAcquire() {
  char* p = nullptr;
  {
    std::lock_guard lock(mu_);
    if (!free_.empty()) {
      p = free_.back();
      free_.pop_back();
    } else if (all_.size() < limit_) {
      p = static_cast<char*>(std::aligned_alloc(kPayloadAlign, bytes_));
      if (p != nullptr) all_.push_back(p);
    }
  }
  RequestBuffer b;
  if (p == nullptr) return b;
  b.pool_ = shared_from_this();
  b.data_ = p;
  b.size_ = bytes_;
  return b;
}

size_t RequestBufferPool::allocated() const {
  std::lock_guard lock(mu_);
  return all_.size();
}

void RequestBufferPool::Return(char* p) {
  std::lock_guard lock(mu_);
  free_.push_back(p);
}

void RequestSlot::Install(RequestSlot* slot) { tls_slot = slot; }

std::optional<uint32_t> CurrentWriteFlags() {
  RequestSlot* const slot = tls_slot;
  return slot != nullptr ? slot->write_flags_ : std::nullopt;
}

bool InRequestBuffer(const char* payload, size_t size) {
  RequestSlot* const slot = tls_slot;
  if (slot == nullptr || !slot->buf_) return false;
  const RequestBuffer& cur = slot->buf_;
  return payload >= cur.data() && size <= cur.size() &&
         payload - cur.data() <= static_cast<ptrdiff_t>(cur.size() - size);
}

RequestBuffer AdoptRequestBuffer(const char* payload, size_t size) {
  // Not this thread's request buffer: libfuse's own (clone_fd), or a copy.
  if (!InRequestBuffer(payload, size)) return {};
  RequestBuffer& cur = tls_slot->buf_;
  RequestBuffer next = cur.pool_->TryAcquire();
  if (!next) return {};
  std::swap(cur, next);
  next.payload_ = payload;
  next.payload_size_ = size;
  return next;
}

}  // namespace dnvme::fs
