// The transport's request buffers and their explicit hand-over to write-behind
// (fs/transport/request_buffer.h): pool limits and reuse, the page-aligned payload offset, which
// payloads may be adopted, and buffers that outlive their pool's owner; the splice transport's
// steering and header parsing (fs/transport/splice_loop.h). No mount needed (the mount
// tests in test_ctl.py, AdoptTest, show the same path end to end).
#include "fs/transport/request_buffer.h"

#include <fcntl.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "fs/transport/session_loop.h"
#include "fs/transport/splice_loop.h"

namespace dnvme::fs {
namespace {

constexpr size_t kBytes = (1 << 20) + 8192;

bool PageAligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % 4096 == 0; }

// A loop thread's Receiver with its first buffer lent, as SessionLoop::Worker starts.
std::unique_ptr<Receiver> LentReceiver(RequestBufferPool& pool) {
  auto r = std::make_unique<Receiver>();
  EXPECT_TRUE(pool.Lend(r.get()));
  return r;
}

TEST(RequestBufferTest, WritePayloadLandsOnAPageBoundary) {
  EXPECT_EQ(kWriteHeaderBytes, 80u);  // fuse_in_header + fuse_write_in, protocol >= 7.9
  EXPECT_EQ((kRequestReadOffset + kWriteHeaderBytes) % kPayloadAlign, 0u);
}

TEST(RequestBufferTest, PoolAllocatesLazilyUpToItsLimitAndReuses) {
  auto pool = RequestBufferPool::Create(kBytes - 100, 3);
  EXPECT_EQ(pool->buffer_bytes(), kBytes);  // rounded up to whole pages
  EXPECT_EQ(pool->allocated(), 0u);
  std::vector<RequestBuffer> held;
  for (int i = 0; i < 3; ++i) {
    RequestBuffer b = pool->TryAcquire();
    ASSERT_TRUE(b);
    EXPECT_TRUE(PageAligned(b.data()));
    EXPECT_EQ(b.size(), kBytes);
    EXPECT_EQ(b.payload(), nullptr);
    std::memset(b.data(), i, b.size());  // the whole buffer is ours (ASan checks the bounds)
    held.push_back(std::move(b));
  }
  EXPECT_EQ(pool->allocated(), 3u);
  EXPECT_FALSE(pool->TryAcquire()) << "a fourth buffer beyond the limit";
  char* const first = held[0].data();
  held[0].Reset();
  EXPECT_FALSE(held[0]);
  RequestBuffer again = pool->TryAcquire();
  ASSERT_TRUE(again);
  EXPECT_EQ(again.data(), first) << "a returned buffer is reused, not reallocated";
  EXPECT_EQ(pool->allocated(), 3u);
}

TEST(RequestBufferTest, ABufferNobodyReceivesIntoIsNotAdopted) {
  auto pool = RequestBufferPool::Create(kBytes, 4);
  RequestBuffer b = pool->TryAcquire();  // acquired, not lent to a Receiver
  ASSERT_TRUE(b);
  const char* payload = b.data() + 4096;
  EXPECT_EQ(pool->HolderOf(payload, 4096), nullptr);
  EXPECT_FALSE(pool->Adopt(payload, 4096));
}

TEST(RequestBufferTest, AdoptTakesTheBufferAndLendsTheReceiverAReplacement) {
  auto pool = RequestBufferPool::Create(kBytes, 2);
  auto r = LentReceiver(*pool);
  char* const received = r->buffer.data();
  const char* payload = received + kRequestReadOffset + kWriteHeaderBytes;
  ASSERT_TRUE(PageAligned(payload));
  ASSERT_EQ(pool->HolderOf(payload, 1 << 20), r.get());

  RequestBuffer adopted = pool->Adopt(payload, 1 << 20);
  ASSERT_TRUE(adopted);
  EXPECT_EQ(adopted.data(), received);
  EXPECT_EQ(adopted.payload(), payload);
  EXPECT_EQ(adopted.payload_size(), size_t{1} << 20);
  ASSERT_TRUE(r->buffer);
  EXPECT_NE(r->buffer.data(), received) << "the loop receives into a new buffer";
  EXPECT_EQ(pool->HolderOf(payload, 1 << 20), nullptr) << "no longer a receive buffer";
  EXPECT_EQ(pool->HolderOf(r->buffer.data() + 4096, 4096), r.get()) << "the replacement is";

  // Both buffers are out: the next adoption has no replacement and leaves the Receiver alone.
  char* const now = r->buffer.data();
  EXPECT_FALSE(pool->Adopt(now + 4096, 4096));
  EXPECT_EQ(r->buffer.data(), now);

  // Once the write-behind flush drops the adopted buffer, adoption works again.
  adopted.Reset();
  RequestBuffer next = pool->Adopt(now + 4096, 4096);
  ASSERT_TRUE(next);
  EXPECT_EQ(next.data(), now);
  EXPECT_EQ(r->buffer.data(), received);
}

TEST(RequestBufferTest, OnlyRangesInsideALentBufferAreAdopted) {
  auto pool = RequestBufferPool::Create(kBytes, 4);
  auto r = LentReceiver(*pool);
  char* const base = r->buffer.data();
  EXPECT_EQ(pool->HolderOf(base, kBytes), r.get());
  EXPECT_EQ(pool->HolderOf(base + 4096, kBytes), nullptr) << "runs past the end";
  EXPECT_EQ(pool->HolderOf(base - 4096, 4096), nullptr) << "starts before";
  EXPECT_EQ(pool->HolderOf(base, kBytes + 1), nullptr);
  std::vector<char> elsewhere(8192);
  EXPECT_EQ(pool->HolderOf(elsewhere.data(), 4096), nullptr);
  EXPECT_FALSE(pool->Adopt(elsewhere.data(), 4096)) << "libfuse's buffer, or a copy";
  EXPECT_EQ(r->buffer.data(), base);
}

TEST(RequestBufferTest, EachReceiverIsFoundByItsOwnBuffer) {
  auto pool = RequestBufferPool::Create(kBytes, 4);
  auto a = LentReceiver(*pool);
  auto b = LentReceiver(*pool);
  a->write_flags = 1;
  b->write_flags = 2;
  EXPECT_EQ(pool->HolderOf(a->buffer.data() + 4096, 4096), a.get());
  EXPECT_EQ(pool->HolderOf(b->buffer.data() + 4096, 4096), b.get());
}

TEST(RequestBufferTest, HandOverIsExplicitNotPerThread) {
  // Ownership follows the payload's address, not the calling thread: a handler that finishes a
  // request on another thread adopts the same way.
  auto pool = RequestBufferPool::Create(kBytes, 4);
  auto r = LentReceiver(*pool);
  const char* payload = r->buffer.data() + 4096;
  RequestBuffer adopted;
  std::thread([&] { adopted = pool->Adopt(payload, 4096); }).join();
  ASSERT_TRUE(adopted);
  EXPECT_EQ(adopted.payload(), payload);
  EXPECT_NE(r->buffer.data() + 4096, payload);
}

TEST(RequestBufferTest, ReturnedBuffersAreNoLongerLent) {
  auto pool = RequestBufferPool::Create(kBytes, 2);
  auto r = LentReceiver(*pool);
  char* const first = r->buffer.data();
  r->buffer.Reset();  // a loop thread that ends gives its buffer back
  EXPECT_EQ(pool->HolderOf(first + 4096, 4096), nullptr);
  RequestBuffer again = pool->TryAcquire();
  EXPECT_EQ(again.data(), first);
  EXPECT_EQ(pool->HolderOf(first + 4096, 4096), nullptr) << "acquired, not lent";
}

TEST(RequestBufferTest, AdoptedBuffersOutliveThePoolsOwner) {
  RequestBuffer adopted;
  {
    auto pool = RequestBufferPool::Create(kBytes, 2);
    auto r = LentReceiver(*pool);
    adopted = pool->Adopt(r->buffer.data() + 4096, 4096);
    ASSERT_TRUE(adopted);
  }  // the loop (Receiver and pool owner) is gone; a flush may still hold its buffer
  std::memset(adopted.data(), 7, adopted.size());
  EXPECT_EQ(adopted.payload()[0], 7);
  adopted.Reset();  // returns to the pool, which is then unmapped (LeakSanitizer checks)
}

// The splice transport steers itself from the WRITE headers it receives
// (fs/transport/splice_loop.h).
fuse_write_in Write(uint32_t size, bool o_direct) {
  fuse_write_in w{};
  w.size = size;
  w.flags = O_WRONLY | (o_direct ? O_DIRECT : 0);
  return w;
}

TEST(SpliceSteeringTest, StartsSplicingAndFollowsTheLargeWritesItSees) {
  SpliceSteering s(DirectIo::kOff, nullptr);
  EXPECT_TRUE(s.splice_next());
  s.Note(Write(1 << 20, /*o_direct=*/true));
  EXPECT_FALSE(s.splice_next()) << "one O_DIRECT writer's request flips a fresh loop to read(2)";
  for (int i = 0; i < 100; ++i) s.Note(Write(1 << 20, true));
  // Bounded: from -kLimit, kLimit + 1 page-cache requests bring splicing back, not a hundred.
  for (int i = 0; i <= SpliceSteering::kLimit; ++i) {
    EXPECT_FALSE(s.splice_next());
    s.Note(Write(1 << 20, false));
  }
  EXPECT_TRUE(s.splice_next());
}

// Under direct_io the kernel sends a write-only open's WRITEs from the caller's pages too (no
// O_DIRECT in the flags): the policy, not the flag, tells the loop. An mmap's dirty pages
// (FUSE_WRITE_CACHE) come from the page cache whatever the open.
TEST(SpliceSteeringTest, DirectIoOpensCountAsCallersPages) {
  SpliceSteering s(DirectIo::kWriteOnly, nullptr);
  s.Note(Write(1 << 20, /*o_direct=*/false));  // O_WRONLY: direct_io under kWriteOnly
  EXPECT_FALSE(s.splice_next());
  fuse_write_in rdwr = Write(1 << 20, false);
  rdwr.flags = O_RDWR;  // not direct_io under kWriteOnly: page cache
  for (int i = 0; i < 2; ++i) s.Note(rdwr);
  EXPECT_TRUE(s.splice_next());
  SpliceSteering w(DirectIo::kWritable, nullptr);  // no protocol: O_RDWR cannot be direct_io
  for (int i = 0; i < 3; ++i) w.Note(rdwr);
  EXPECT_TRUE(w.splice_next());
  w.Note(Write(1 << 20, false));
  w.Note(Write(1 << 20, false));
  w.Note(Write(1 << 20, false));
  w.Note(Write(1 << 20, false));
  EXPECT_FALSE(w.splice_next());
  fuse_write_in mmap_page = Write(1 << 20, false);
  mmap_page.write_flags = FUSE_WRITE_CACHE;
  for (int i = 0; i < 2; ++i) w.Note(mmap_page);
  EXPECT_TRUE(w.splice_next());
}

TEST(SpliceSteeringTest, SmallWritesSayNothing) {
  SpliceSteering s(DirectIo::kOff, nullptr);
  for (int i = 0; i < 100; ++i) s.Note(Write(SpliceSteering::kMinBytes - 1, true));
  EXPECT_TRUE(s.splice_next());
}

TEST(SessionLoopTest, WriteHeaderIsFoundOnlyInAWrite) {
  char req[kWriteHeaderBytes] = {};
  fuse_in_header in{};
  in.opcode = FUSE_WRITE;
  fuse_write_in w = Write(4096, false);
  w.write_flags = FUSE_WRITE_KILL_SUIDGID;
  std::memcpy(req, &in, sizeof(in));
  std::memcpy(req + sizeof(in), &w, sizeof(w));
  auto got = WriteHeaderOf(req, sizeof(req));
  ASSERT_TRUE(got);
  EXPECT_EQ(got->write_flags, uint32_t{FUSE_WRITE_KILL_SUIDGID});
  EXPECT_EQ(got->size, 4096u);
  EXPECT_FALSE(WriteHeaderOf(req, sizeof(req) - 1)) << "too short to hold the headers";
  in.opcode = FUSE_READ;
  std::memcpy(req, &in, sizeof(in));
  EXPECT_FALSE(WriteHeaderOf(req, sizeof(req)));
}

}  // namespace
}  // namespace dnvme::fs
