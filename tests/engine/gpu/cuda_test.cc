// The GPU path on a real CUDA device: device buffers, copies, IPC export and GdsHandle with the
// CUDA copy engine (and cuFile, when the machine has it). Every case needs a device and skips
// with the reason printed when there is none; NoDeviceIsExplainedClearly checks that reason on
// machines without one.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "dnvme/gds_handle.h"
#include "dnvme/gpu.h"
#include "tests/engine/test_util.h"

namespace dnvme {
namespace {

using dnvme::test::FillPattern;
using dnvme::test::kMiB;
using dnvme::test::MatchesPattern;
using dnvme::test::ReadWholeFile;

#define DNVME_REQUIRE_DEVICE()                                                 \
  do {                                                                         \
    auto _n = gpu::DeviceCount();                                              \
    if (!_n.ok()) GTEST_SKIP() << "no CUDA device: " << _n.status().message(); \
  } while (0)

TEST(CudaTest, BuildFlagMatchesTheLibrary) {
  EXPECT_EQ(gpu::BuiltWithCuda(), DNVME_HAVE_CUDA != 0);
  if (gpu::BuiltWithCuda()) {
    EXPECT_GE(gpu::RuntimeVersion(), 11000);
  } else {
    EXPECT_EQ(gpu::RuntimeVersion(), 0);
  }
}

TEST(CudaTest, NoDeviceIsExplainedClearly) {
  auto n = gpu::DeviceCount();
  if (n.ok()) GTEST_SKIP() << n.value() << " CUDA device(s) present: nothing to explain";
  EXPECT_NE(n.status().error_number(), 0);
  EXPECT_FALSE(n.status().message().empty());
  if (gpu::BuiltWithCuda()) {
    // e.g. "no usable CUDA device: cudaGetDeviceCount: cudaErrorInsufficientDriver: ..."
    EXPECT_NE(n.status().message().find("cuda"), std::string::npos) << n.status().ToString();
  } else {
    EXPECT_NE(n.status().message().find("without CUDA"), std::string::npos);
  }
  EXPECT_EQ(gpu::UnavailableReason(), n.status().message());
  // Everything that needs the device says the same instead of failing obscurely.
  auto h = GdsHandle::Create();
  ASSERT_FALSE(h.ok());
  EXPECT_NE(h.status().message().find(n.status().message()), std::string::npos)
      << h.status().ToString();
  EXPECT_FALSE(gpu::DeviceBuffer::Allocate(4096).ok());
  EXPECT_FALSE(gpu::MeasureCopyRate(kMiB, true, 1, 0).ok());
  std::string hex(128, '0');
  EXPECT_FALSE(gpu::IpcMapping::Open(hex, 0).ok());
}

TEST(CudaTest, DeviceBufferCopiesAndPointerKinds) {
  DNVME_REQUIRE_DEVICE();
  auto info = gpu::GetDeviceInfo(0);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_FALSE(info->name.empty());
  auto b = gpu::DeviceBuffer::Allocate(3 * kMiB + 5, 0);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  std::vector<char> host(3 * kMiB + 5), back(3 * kMiB + 5, 1);
  FillPattern(host.data(), host.size(), 0);
  DNVME_ASSERT_OK(gpu::CopyToDevice(b->data(), host.data(), host.size()));
  DNVME_ASSERT_OK(gpu::CopyToHost(back.data(), b->data(), back.size()));
  EXPECT_EQ(std::memcmp(host.data(), back.data(), host.size()), 0);
  EXPECT_TRUE(gpu::IsDevicePointer(b->data()).value());
  EXPECT_FALSE(gpu::IsDevicePointer(host.data()).value());
  auto rate = gpu::MeasureCopyRate(64 * kMiB, true, 3, 0);
  ASSERT_TRUE(rate.ok()) << rate.status().ToString();
  EXPECT_GT(rate.value(), 0.0);
}

TEST(CudaTest, IpcExportNamesTheAllocationAndOffset) {
  DNVME_REQUIRE_DEVICE();
  auto b = gpu::DeviceBuffer::Allocate(8 * kMiB, 0);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  auto whole = gpu::ExportIpc(b->data());
  ASSERT_TRUE(whole.ok()) << whole.status().ToString();
  EXPECT_EQ(whole->handle_hex.size(), 2 * gpu::kIpcHandleBytes);
  EXPECT_EQ(whole->offset, 0);
  EXPECT_GE(whole->allocation_size, 8 * kMiB);
  auto inner = gpu::ExportIpc(static_cast<char*>(b->data()) + 3 * kMiB);
  ASSERT_TRUE(inner.ok()) << inner.status().ToString();
  EXPECT_EQ(inner->offset, 3 * kMiB);
  EXPECT_EQ(inner->handle_hex, whole->handle_hex);
}

class CudaGdsTest : public dnvme::test::ScratchTest {};

TEST_F(CudaGdsTest, BounceAndCuFileRoundTrips) {
  DNVME_REQUIRE_DEVICE();
  for (CuFilePolicy policy : {CuFilePolicy::kNever, CuFilePolicy::kAuto}) {
    GdsOptions o;
    o.cufile = policy;
    HandleConfig cfg;
    cfg.intra_op_parallelism = 2;
    auto h = GdsHandle::Create(cfg, o);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    SCOPED_TRACE(std::string("mode ") + GdsModeName((*h)->mode()) + ": " + (*h)->mode_reason());
    constexpr int64_t kSize = 40 * kMiB + 123;
    std::vector<char> host(kSize), back(kSize);
    FillPattern(host.data(), host.size(), 4096);
    auto dev = (*h)->new_pinned_device_buffer(kSize);
    ASSERT_TRUE(dev.ok()) << dev.status().ToString();
    DNVME_ASSERT_OK(gpu::CopyToDevice(dev->data(), host.data(), host.size()));
    const std::string path = Path(std::string("cuda_") + CuFilePolicyName(policy));
    DNVME_ASSERT_OK((*h)->sync_pwrite(dev->data(), kSize, path, 4096));
    std::vector<uint8_t> file = ReadWholeFile(path);
    ASSERT_EQ(static_cast<int64_t>(file.size()), 4096 + kSize);
    EXPECT_TRUE(MatchesPattern(file.data() + 4096, static_cast<size_t>(kSize), 4096));
    DNVME_ASSERT_OK(gpu::MemsetDevice(dev->data(), 0, kSize));
    auto id = (*h)->async_pread(dev->data(), kSize, path, 4096);
    ASSERT_TRUE(id.ok()) << id.status().ToString();
    EXPECT_EQ((*h)->wait(), 1);
    DNVME_ASSERT_OK((*h)->completed()[0].status);
    DNVME_ASSERT_OK(gpu::CopyToHost(back.data(), dev->data(), back.size()));
    EXPECT_TRUE(MatchesPattern(back.data(), back.size(), 4096));
    DNVME_EXPECT_OK((*h)->pwrite(dev->data(), kSize, path, true, false, 4096));
  }
}

}  // namespace
}  // namespace dnvme
