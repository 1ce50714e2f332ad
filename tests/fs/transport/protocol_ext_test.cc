// ProtocolExtensions (fs/transport/protocol_ext.h): what the INIT reply gains on the wire, and
// when it must not. The "device" is a pipe: WriteReply's bytes are read back as the kernel would.
#include "fs/transport/protocol_ext.h"

#include <linux/fuse.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include <gtest/gtest.h>

namespace dnvme::fs {
namespace {

class PipeDevice {
 public:
  PipeDevice() { EXPECT_EQ(pipe(fds_), 0); }
  ~PipeDevice() {
    close(fds_[0]);
    close(fds_[1]);
  }
  int write_fd() const { return fds_[1]; }
  std::vector<char> ReadAll(size_t n) {
    std::vector<char> out(n);
    size_t got = 0;
    while (got < n) {
      ssize_t r = read(fds_[0], out.data() + got, n - got);
      if (r <= 0) break;
      got += static_cast<size_t>(r);
    }
    out.resize(got);
    return out;
  }

 private:
  int fds_[2] = {-1, -1};
};

// An INIT request as the kernel sends it: header, then fuse_init_in (7.36+: flags2 at 16).
std::vector<char> InitRequest(uint32_t minor, uint64_t flags) {
  std::vector<char> req(sizeof(fuse_in_header) + 64, 0);
  fuse_in_header h{};
  h.len = static_cast<uint32_t>(req.size());
  h.opcode = FUSE_INIT;
  h.unique = 2;
  std::memcpy(req.data(), &h, sizeof(h));
  char* in = req.data() + sizeof(h);
  const uint32_t major = 7, lo = static_cast<uint32_t>(flags),
                 hi = static_cast<uint32_t>(flags >> 32);
  std::memcpy(in, &major, 4);
  std::memcpy(in + 4, &minor, 4);
  std::memcpy(in + 12, &lo, 4);
  std::memcpy(in + 16, &hi, 4);
  return req;
}

struct Reply {
  fuse_out_header h{};
  char out[wire::kInitOutBytes] = {};
};

uint32_t At(const std::vector<char>& bytes, size_t off) {
  uint32_t v;
  std::memcpy(&v, bytes.data() + sizeof(fuse_out_header) + off, 4);
  return v;
}

uint16_t At16(const std::vector<char>& bytes, size_t off) {
  uint16_t v;
  std::memcpy(&v, bytes.data() + sizeof(fuse_out_header) + off, 2);
  return v;
}

// Sends libfuse's INIT reply (flags `our_flags`, max_write and max_pages as libfuse 3.14 sets them
// for 1 MiB) through `ext`, returns what reached the device.
std::vector<char> SendInitReply(ProtocolExtensions& ext, uint32_t our_flags, int32_t error = 0) {
  PipeDevice dev;
  Reply r;
  r.h.len = sizeof(r);
  r.h.error = error;
  r.h.unique = 2;
  std::memcpy(r.out + wire::kInitOutFlags, &our_flags, 4);
  const uint32_t max_write = 1 << 20;
  const uint16_t max_pages = 256;
  std::memcpy(r.out + wire::kInitOutMaxWrite, &max_write, 4);
  std::memcpy(r.out + wire::kInitOutMaxPages, &max_pages, 2);
  iovec iov[2] = {{&r.h, sizeof(r.h)}, {r.out, sizeof(r.out)}};
  EXPECT_EQ(ext.WriteReply(dev.write_fd(), iov, 2), static_cast<ssize_t>(sizeof(r)));
  return dev.ReadAll(sizeof(r));
}

constexpr uint64_t kOffered = wire::kInitExt | wire::kPassthrough;

TEST(ProtocolExtensionsTest, AddsPassthroughToTheInitReplyWhenOfferedAndWanted) {
  ProtocolExtensions ext;
  ext.Want({.passthrough = true});
  auto req = InitRequest(45, kOffered);
  ext.ObserveRequest(req.data(), req.size());
  EXPECT_EQ(ext.kernel_minor(), 45u);
  EXPECT_TRUE(ext.passthrough_offered());
  auto sent = SendInitReply(ext, 0);
  ASSERT_EQ(sent.size(), sizeof(Reply));
  EXPECT_TRUE(At(sent, wire::kInitOutFlags) & wire::kInitExt);
  EXPECT_TRUE(At(sent, wire::kInitOutFlags2) & (wire::kPassthrough >> 32));
  EXPECT_EQ(At(sent, wire::kInitOutMaxStackDepth), 1u);
  EXPECT_TRUE(ext.passthrough());
}

TEST(ProtocolExtensionsTest, LeavesTheReplyAloneWhenNotWantedNotOfferedOrWithWritebackCache) {
  {
    ProtocolExtensions ext;  // not wanted (passthrough=off, or no CAP_SYS_ADMIN)
    auto req = InitRequest(45, kOffered);
    ext.ObserveRequest(req.data(), req.size());
    auto sent = SendInitReply(ext, 0);
    EXPECT_EQ(At(sent, wire::kInitOutFlags2), 0u);
    EXPECT_EQ(At(sent, wire::kInitOutMaxStackDepth), 0u);
    EXPECT_FALSE(ext.passthrough());
  }
  {
    ProtocolExtensions ext;  // a kernel before 6.9
    ext.Want({.passthrough = true});
    auto req = InitRequest(38, wire::kInitExt);
    ext.ObserveRequest(req.data(), req.size());
    auto sent = SendInitReply(ext, 0);
    EXPECT_EQ(At(sent, wire::kInitOutMaxStackDepth), 0u);
    EXPECT_FALSE(ext.passthrough());
  }
  {
    ProtocolExtensions ext;  // the kernel refuses passthrough beside the writeback cache
    ext.Want({.passthrough = true});
    auto req = InitRequest(45, kOffered);
    ext.ObserveRequest(req.data(), req.size());
    auto sent = SendInitReply(ext, static_cast<uint32_t>(wire::kWritebackCache));
    EXPECT_EQ(At(sent, wire::kInitOutFlags2), 0u);
    EXPECT_FALSE(ext.passthrough());
  }
  {
    ProtocolExtensions ext;  // an INIT answered with an error
    ext.Want({.passthrough = true});
    auto req = InitRequest(45, kOffered);
    ext.ObserveRequest(req.data(), req.size());
    auto sent = SendInitReply(ext, 0, -EPROTO);
    EXPECT_EQ(At(sent, wire::kInitOutMaxStackDepth), 0u);
    EXPECT_FALSE(ext.passthrough());
  }
}

TEST(ProtocolExtensionsTest, OnlyTheFirstReplyIsTouchedAndOtherRequestsAreIgnored) {
  ProtocolExtensions ext;
  ext.Want({.passthrough = true});
  auto other = InitRequest(45, kOffered);
  reinterpret_cast<fuse_in_header*>(other.data())->opcode = FUSE_GETATTR;
  ext.ObserveRequest(other.data(), other.size());
  EXPECT_EQ(ext.kernel_minor(), 0u) << "a GETATTR was taken for INIT";
  auto req = InitRequest(45, kOffered);
  ext.ObserveRequest(req.data(), req.size());
  (void)SendInitReply(ext, 0);
  // A later 64-byte reply (any other op) goes out byte for byte.
  auto sent = SendInitReply(ext, 0);
  EXPECT_EQ(At(sent, wire::kInitOutFlags2), 0u);
  EXPECT_EQ(At(sent, wire::kInitOutMaxStackDepth), 0u);
}

// libfuse 3.17 clamps max_write to its own 1 MiB buffers after init(), 3.14 does not
// (fs/fuse_compat.h): the reply gets the transport's request size back, with its pages.
TEST(ProtocolExtensionsTest, RestoresTheMaxWriteLibfuseClampedToItsBuffers) {
  const uint64_t offered = wire::kInitExt | wire::kMaxPages;
  {
    ProtocolExtensions ext;
    ext.Want({.spare_page = true, .max_write = 4 << 20});
    auto req = InitRequest(45, offered);
    ext.ObserveRequest(req.data(), req.size());
    auto sent = SendInitReply(ext, static_cast<uint32_t>(wire::kMaxPages));
    EXPECT_EQ(At(sent, wire::kInitOutMaxWrite), 4u << 20);
    EXPECT_TRUE(At(sent, wire::kInitOutFlags) & wire::kMaxPages);
    EXPECT_EQ(At16(sent, wire::kInitOutMaxPages), 1025u) << "4 MiB's pages and the spare one";
    EXPECT_EQ(ext.max_pages_asked(), 1025u);
  }
  {
    ProtocolExtensions ext;  // no spare page: max_write's own pages
    ext.Want({.max_write = 2 << 20});
    auto req = InitRequest(45, offered);
    ext.ObserveRequest(req.data(), req.size());
    auto sent = SendInitReply(ext, 0);
    EXPECT_EQ(At(sent, wire::kInitOutMaxWrite), 2u << 20);
    EXPECT_TRUE(At(sent, wire::kInitOutFlags) & wire::kMaxPages);
    EXPECT_EQ(At16(sent, wire::kInitOutMaxPages), 512u);
  }
  {
    ProtocolExtensions ext;  // what libfuse sent already: nothing changes
    ext.Want({.max_write = 1 << 20});
    auto req = InitRequest(45, offered);
    ext.ObserveRequest(req.data(), req.size());
    auto sent = SendInitReply(ext, 0);
    EXPECT_EQ(At(sent, wire::kInitOutMaxWrite), 1u << 20);
    EXPECT_EQ(At(sent, wire::kInitOutFlags), 0u);
    EXPECT_EQ(At16(sent, wire::kInitOutMaxPages), 256u);
  }
}

// direct_io opens that may be mmapped (7.39) and one page above max_write's for unaligned
// buffers: each only where the kernel offered it, and nothing else of the reply changes.
TEST(ProtocolExtensionsTest, AddsDirectIoMmapAndASparePageWhereOffered) {
  {
    ProtocolExtensions ext;
    ext.Want({.direct_io_mmap = true, .spare_page = true});
    auto req = InitRequest(45, wire::kInitExt | wire::kMaxPages | wire::kDirectIoAllowMmap);
    ext.ObserveRequest(req.data(), req.size());
    auto sent = SendInitReply(ext, static_cast<uint32_t>(wire::kMaxPages));
    EXPECT_TRUE(At(sent, wire::kInitOutFlags) & wire::kInitExt);
    EXPECT_TRUE(At(sent, wire::kInitOutFlags) & wire::kMaxPages);
    EXPECT_EQ(At(sent, wire::kInitOutFlags2),
              static_cast<uint32_t>(wire::kDirectIoAllowMmap >> 32));
    EXPECT_EQ(At16(sent, wire::kInitOutMaxPages), 257u);
    EXPECT_EQ(At(sent, wire::kInitOutMaxWrite), 1u << 20) << "max_write is libfuse's";
    EXPECT_EQ(At(sent, wire::kInitOutMaxStackDepth), 0u) << "no passthrough was asked for";
    EXPECT_TRUE(ext.direct_io_mmap());
    EXPECT_EQ(ext.max_pages_asked(), 257u);
  }
  {
    ProtocolExtensions ext;  // a kernel before 6.6 offers neither FUSE_DIRECT_IO_ALLOW_MMAP ...
    ext.Want({.direct_io_mmap = true, .spare_page = true});
    auto req = InitRequest(38, wire::kInitExt);  // ... nor (here) FUSE_MAX_PAGES
    ext.ObserveRequest(req.data(), req.size());
    auto sent = SendInitReply(ext, 0);
    EXPECT_EQ(At(sent, wire::kInitOutFlags), 0u);
    EXPECT_EQ(At(sent, wire::kInitOutFlags2), 0u);
    EXPECT_EQ(At16(sent, wire::kInitOutMaxPages), 256u);
    EXPECT_FALSE(ext.direct_io_mmap());
  }
  {
    ProtocolExtensions ext;  // offered but not wanted (direct_io=off)
    auto req = InitRequest(45, wire::kInitExt | wire::kMaxPages | wire::kDirectIoAllowMmap);
    ext.ObserveRequest(req.data(), req.size());
    auto sent = SendInitReply(ext, static_cast<uint32_t>(wire::kMaxPages));
    EXPECT_EQ(At(sent, wire::kInitOutFlags2), 0u);
    EXPECT_EQ(At16(sent, wire::kInitOutMaxPages), 256u);
    EXPECT_FALSE(ext.direct_io_mmap());
  }
}

TEST(ProtocolExtensionsTest, BackingOpenWithoutPassthroughIsRefusedWithoutAnIoctl) {
  ProtocolExtensions ext;
  auto id = ext.OpenBacking(0);
  ASSERT_FALSE(id.ok());
  EXPECT_EQ(id.status().error_number(), EOPNOTSUPP);
}

}  // namespace
}  // namespace dnvme::fs
