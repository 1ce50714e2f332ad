#include "fs/transport/request_buffer.h"

#include <sys/mman.h>

#include <utility>

namespace dnvme::fs {

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
  if (rounded == 0 || limit == 0) return nullptr;
  // One reservation for every buffer, so that a payload's buffer is found by its address alone.
  void* base = mmap(nullptr, rounded * limit, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) return nullptr;
  return std::shared_ptr<RequestBufferPool>(
      new RequestBufferPool(static_cast<char*>(base), rounded, limit));
}

RequestBufferPool::RequestBufferPool(char* base, size_t bytes, size_t limit)
    : base_(base), bytes_(bytes), limit_(limit), holders_(new std::atomic<Receiver*>[limit]) {
  for (size_t i = 0; i < limit_; ++i) holders_[i].store(nullptr, std::memory_order_relaxed);
}

RequestBufferPool::~RequestBufferPool() {
  // Every buffer is back: each one held a reference to the pool.
  munmap(base_, bytes_ * limit_);
}

RequestBuffer RequestBufferPool::TryAcquire() {
  size_t index;
  {
    std::lock_guard lock(mu_);
    if (!free_.empty()) {
      index = free_.back();
      free_.pop_back();
    } else if (carved_ < limit_) {
      index = carved_++;
    } else {
      return {};
    }
  }
  RequestBuffer b;
  b.pool_ = shared_from_this();
  b.data_ = base_ + index * bytes_;
  b.size_ = bytes_;
  return b;
}

bool RequestBufferPool::Lend(Receiver* r) {
  RequestBuffer b = TryAcquire();
  if (!b) return false;
  const int64_t index = IndexOf(b.data(), b.size());
  r->buffer = std::move(b);  // returns the Receiver's previous buffer, if any, first
  holders_[index].store(r, std::memory_order_release);
  return true;
}

int64_t RequestBufferPool::IndexOf(const char* p, size_t n) const {
  // Compared as integers: pointers into different objects have no order in C++.
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const uintptr_t lo = reinterpret_cast<uintptr_t>(base_);
  if (a < lo || a - lo >= bytes_ * limit_) return -1;
  const size_t index = (a - lo) / bytes_;
  const size_t within = (a - lo) % bytes_;
  if (n > bytes_ - within) return -1;  // runs past the end of its buffer
  return static_cast<int64_t>(index);
}

size_t RequestBufferPool::SpareAfter(const char* p, size_t n) const {
  const int64_t index = IndexOf(p, n);
  if (index < 0) return 0;
  const uintptr_t end =
      reinterpret_cast<uintptr_t>(base_) + (static_cast<uintptr_t>(index) + 1) * bytes_;
  return static_cast<size_t>(end - reinterpret_cast<uintptr_t>(p + n));
}

Receiver* RequestBufferPool::HolderOf(const char* p, size_t n) const {
  const int64_t index = IndexOf(p, n);
  return index < 0 ? nullptr : holders_[index].load(std::memory_order_acquire);
}

RequestBuffer RequestBufferPool::Adopt(const char* p, size_t n) {
  const int64_t index = IndexOf(p, n);
  if (index < 0) return {};
  Receiver* const r = holders_[index].load(std::memory_order_acquire);
  if (r == nullptr) return {};
  RequestBuffer next = TryAcquire();
  if (!next) return {};
  // The Receiver's buffer changes hands: it is no longer lent to anyone.
  holders_[index].store(nullptr, std::memory_order_release);
  holders_[IndexOf(next.data(), next.size())].store(r, std::memory_order_release);
  std::swap(r->buffer, next);
  next.payload_ = p;
  next.payload_size_ = n;
  return next;
}

size_t RequestBufferPool::allocated() const {
  std::lock_guard lock(mu_);
  return carved_;
}

void RequestBufferPool::Return(char* p) {
  const size_t index = static_cast<size_t>(p - base_) / bytes_;
  holders_[index].store(nullptr, std::memory_order_release);
  std::lock_guard lock(mu_);
  free_.push_back(index);
}

}  // namespace dnvme::fs
