#include "fs/transport/write_source.h"

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <memory>
#include <utility>

namespace dnvme::fs {
namespace {

// A request buffer handed to the write-behind: back to its pool when the write completed.
class AdoptedRequest final : public datapath::AdoptedBuffer {
 public:
  explicit AdoptedRequest(RequestBuffer b) : b_(std::move(b)) {}
  const char* data() const override { return b_.payload(); }
  size_t size() const override { return b_.payload_size(); }
  size_t spare() const override { return b_.spare(); }
  char* spare_data() override { return b_.spare_data(); }
  void Grow(size_t n) override { b_.Grow(n); }

 private:
  RequestBuffer b_;
};

}  // namespace

bool WriteSource::in_pipe() const {
  if (src_->idx >= src_->count) return false;
  const fuse_buf& b = src_->buf[src_->idx];
  return (b.flags & FUSE_BUF_IS_FD) && !(b.flags & FUSE_BUF_FD_SEEK);
}

int64_t WriteSource::SpliceTo(int pipe_w, size_t n) {
  fuse_buf& b = src_->buf[src_->idx];
  n = std::min(n, b.size - src_->off);
  size_t moved = 0;
  while (moved < n) {
    ssize_t r = splice(b.fd, nullptr, pipe_w, nullptr, n - moved, SPLICE_F_NONBLOCK);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && errno == EAGAIN) break;  // the destination is full
    if (r < 0) return -errno;
    if (r == 0) return -EIO;  // the request pipe holds less than the request said
    moved += static_cast<size_t>(r);
  }
  src_->off += moved;  // keeps fuse_buf_copy's view of what is left in step
  return static_cast<int64_t>(moved);
}

const char* WriteSource::RestInMemory(size_t* n) const {
  if (src_->idx + 1 != src_->count) return nullptr;  // exactly one piece left
  const fuse_buf& b = src_->buf[src_->idx];
  if ((b.flags & FUSE_BUF_IS_FD) || b.mem == nullptr) return nullptr;
  *n = b.size - src_->off;
  return static_cast<const char*>(b.mem) + src_->off;
}

bool WriteSource::adoptable() const {
  size_t n = 0;
  const char* rest = RestInMemory(&n);
  return rest != nullptr && pool_ != nullptr &&
         reinterpret_cast<uintptr_t>(rest) % kPayloadAlign == 0 &&
         pool_->HolderOf(rest, n) != nullptr;
}

size_t WriteSource::adoptable_spare() const {
  if (!adoptable()) return 0;
  size_t n = 0;
  const char* rest = RestInMemory(&n);
  return pool_->SpareAfter(rest, n);
}

std::unique_ptr<datapath::AdoptedBuffer> WriteSource::Adopt(size_t n) {
  if (!adoptable()) return nullptr;
  size_t left = 0;
  const char* rest = RestInMemory(&left);
  if (left != n) return nullptr;
  RequestBuffer r = pool_->Adopt(rest, n);
  if (!r) return nullptr;
  src_->off += n;  // consumed, as a copy would have
  return std::make_unique<AdoptedRequest>(std::move(r));
}

const char* WriteSource::InMemory(size_t n) {
  size_t left = 0;
  const char* rest = RestInMemory(&left);
  if (rest == nullptr || left != n) return nullptr;
  src_->off += n;
  return rest;
}

bool WriteSource::CopyTo(char* dst, size_t n) {
  fuse_bufvec d = FUSE_BUFVEC_INIT(n);
  d.buf[0].mem = dst;
  ssize_t r = fuse_buf_copy(&d, src_, static_cast<fuse_buf_copy_flags>(0));
  if (r < 0) {
    errno = static_cast<int>(-r);
    return false;
  }
  if (static_cast<size_t>(r) != n) {
    errno = EIO;
    return false;
  }
  return true;
}

}  // namespace dnvme::fs
