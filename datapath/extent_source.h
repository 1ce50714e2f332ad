// ExtentSource: the bytes of one write, as the write-behind takes them (datapath/write_behind.h).
//
// Why an interface: the write-behind is shared by the mount and by `dnvme run`, whose writes
// arrive in different forms. A FUSE WRITE's payload may sit in a buffer the transport received it
// in (which the write-behind can keep instead of copying: Adopt), or in a pipe holding references
// to the kernel's page-cache pages (which a splice moves to the disk with no copy: SpliceTo). A
// program's write() under `dnvme run` is plain memory of the program's (MemorySource). The
// write-behind asks the source for the cheapest form it can use; every source can at least copy.
//
// Thread contract: one source per write, used by the thread making that write (the write-behind
// uses it only inside WriteBehind::Write).
#pragma once

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>

namespace dnvme::datapath {

// Memory a source hands over with its bytes instead of copying them: the write-behind writes the
// data from it and destroys it (giving the memory back to its owner) when that write completed.
// The data starts page-aligned (the engine writes it O_DIRECT as it is).
//
// Thread contract: owned by one extent; touched by the writer's thread while the extent is being
// gathered, then only by the completion of its disk write.
class AdoptedBuffer {
 public:
  virtual ~AdoptedBuffer() = default;
  virtual const char* data() const = 0;
  virtual size_t size() const = 0;
  // Room after the data in the same memory: a later write continuing the data inside a page is
  // copied there (Grow), so the extent goes on at an aligned offset.
  virtual size_t spare() const = 0;
  virtual char* spare_data() = 0;
  virtual void Grow(size_t n) = 0;  // `n` bytes written at spare_data() are now data
};

class ExtentSource {
 public:
  virtual ~ExtentSource() = default;
  // Moves the next `n` bytes into `dst`; false (errno set) on failure.
  virtual bool CopyTo(char* dst, size_t n) = 0;
  // The rest of the write (exactly `n` bytes) when it is one piece of memory, marked consumed;
  // null otherwise. Valid until Write returns.
  virtual const char* InMemory(size_t n) = 0;
  // True when the bytes are references to page-cache pages in a pipe (SpliceTo can move them).
  virtual bool in_pipe() const { return false; }
  // Moves up to `n` of the next bytes, as page references, into the pipe `pipe_w` without
  // blocking. Returns the bytes moved (fewer when that pipe is full) or -errno.
  virtual int64_t SpliceTo(int /*pipe_w*/, size_t /*n*/) { return -EOPNOTSUPP; }
  // True when the rest of the write is one page-aligned piece of memory Adopt can hand over.
  virtual bool adoptable() const { return false; }
  // The spare bytes the buffer Adopt would hand over has after the data (0: not adoptable).
  virtual size_t adoptable_spare() const { return 0; }
  // Hands over the memory holding the rest of the write (exactly `n` bytes); null when it cannot
  // (not adoptable, or its owner has nothing to replace it with).
  virtual std::unique_ptr<AdoptedBuffer> Adopt(size_t /*n*/) { return nullptr; }
};

// The caller's own memory (a program's write() under `dnvme run`): copied, never kept.
class MemorySource final : public ExtentSource {
 public:
  MemorySource(const char* data, size_t size) : data_(data), left_(size) {}
  bool CopyTo(char* dst, size_t n) override {
    if (n > left_) {
      errno = EINVAL;
      return false;
    }
    std::memcpy(dst, data_, n);
    data_ += n;
    left_ -= n;
    return true;
  }
  const char* InMemory(size_t n) override {
    if (n != left_) return nullptr;
    const char* rest = data_;
    data_ += n;
    left_ = 0;
    return rest;
  }

 private:
  const char* data_;
  size_t left_;
};

}  // namespace dnvme::datapath
