// The session loop's request buffers and their adoption by write-behind
// (fs/transport/request_buffer.h): pool limits and reuse, the page-aligned payload offset, which
// payloads may be adopted, and buffers that outlive their pool's owner. No mount needed (the mount
// tests in test_ctl.py, AdoptTest, show the same path end to end).
#include "fs/transport/request_buffer.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

namespace dnvme::fs {
namespace {

constexpr size_t kBytes = (1 << 20) + 8192;

bool PageAligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % 4096 == 0; }

// Installs a slot for the calling thread for the scope, as a loop thread does.
class ScopedSlot {
 public:
  explicit ScopedSlot(RequestBuffer b) : slot_(std::move(b)) { RequestSlot::Install(&slot_); }
  ~ScopedSlot() { RequestSlot::Install(nullptr); }
  RequestSlot& slot() { return slot_; }

 private:
  RequestSlot slot_;
};

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

TEST(RequestBufferTest, AdoptOutsideALoopThreadFindsNothing) {
  auto pool = RequestBufferPool::Create(kBytes, 4);
  RequestBuffer b = pool->TryAcquire();
  ASSERT_TRUE(b);
  const char* payload = b.data() + 4096;
  EXPECT_FALSE(InRequestBuffer(payload, 4096));
  EXPECT_FALSE(AdoptRequestBuffer(payload, 4096));
}

TEST(RequestBufferTest, AdoptTakesTheBufferAndLeavesAReplacement) {
  auto pool = RequestBufferPool::Create(kBytes, 2);
  ScopedSlot scoped(pool->TryAcquire());
  RequestBuffer& cur = scoped.slot().buffer();
  char* const received = cur.data();
  const char* payload = received + kRequestReadOffset + kWriteHeaderBytes;
  ASSERT_TRUE(PageAligned(payload));
  ASSERT_TRUE(InRequestBuffer(payload, 1 << 20));

  RequestBuffer adopted = AdoptRequestBuffer(payload, 1 << 20);
  ASSERT_TRUE(adopted);
  EXPECT_EQ(adopted.data(), received);
  EXPECT_EQ(adopted.payload(), payload);
  EXPECT_EQ(adopted.payload_size(), size_t{1} << 20);
  ASSERT_TRUE(scoped.slot().buffer());
  EXPECT_NE(scoped.slot().buffer().data(), received) << "the loop receives into a new buffer";
  EXPECT_FALSE(InRequestBuffer(payload, 1 << 20)) << "no longer this thread's buffer";

  // Both buffers are out: the next adoption has no replacement and leaves the slot alone.
  char* const now = scoped.slot().buffer().data();
  EXPECT_FALSE(AdoptRequestBuffer(now + 4096, 4096));
  EXPECT_EQ(scoped.slot().buffer().data(), now);

  // Once the write-behind flush drops the adopted buffer, adoption works again.
  adopted.Reset();
  RequestBuffer next = AdoptRequestBuffer(now + 4096, 4096);
  ASSERT_TRUE(next);
  EXPECT_EQ(next.data(), now);
  EXPECT_EQ(scoped.slot().buffer().data(), received);
}

TEST(RequestBufferTest, OnlyRangesInsideTheCurrentBufferAreAdopted) {
  auto pool = RequestBufferPool::Create(kBytes, 4);
  ScopedSlot scoped(pool->TryAcquire());
  char* const base = scoped.slot().buffer().data();
  EXPECT_TRUE(InRequestBuffer(base, kBytes));
  EXPECT_FALSE(InRequestBuffer(base + 4096, kBytes)) << "runs past the end";
  EXPECT_FALSE(InRequestBuffer(base - 4096, 4096)) << "starts before";
  EXPECT_FALSE(InRequestBuffer(base, kBytes + 1));
  std::vector<char> elsewhere(8192);
  EXPECT_FALSE(AdoptRequestBuffer(elsewhere.data(), 4096)) << "libfuse's buffer, or a copy";
  EXPECT_EQ(scoped.slot().buffer().data(), base);
}

TEST(RequestBufferTest, SlotsArePerThread) {
  auto pool = RequestBufferPool::Create(kBytes, 4);
  ScopedSlot scoped(pool->TryAcquire());
  const char* payload = scoped.slot().buffer().data() + 4096;
  bool seen_elsewhere = true;
  std::thread([&] { seen_elsewhere = InRequestBuffer(payload, 4096); }).join();
  EXPECT_FALSE(seen_elsewhere) << "another thread's handler cannot adopt this buffer";
  EXPECT_TRUE(InRequestBuffer(payload, 4096));
}

TEST(RequestBufferTest, AdoptedBuffersOutliveThePoolsOwner) {
  RequestBuffer adopted;
  {
    auto pool = RequestBufferPool::Create(kBytes, 2);
    ScopedSlot scoped(pool->TryAcquire());
    adopted = AdoptRequestBuffer(scoped.slot().buffer().data() + 4096, 4096);
    ASSERT_TRUE(adopted);
  }  // the loop (slot and pool owner) is gone; a flush may still hold its buffer
  std::memset(adopted.data(), 7, adopted.size());
  EXPECT_EQ(adopted.payload()[0], 7);
  adopted.Reset();  // returns to the pool, which is then freed (LeakSanitizer checks)
}

}  // namespace
}  // namespace dnvme::fs
