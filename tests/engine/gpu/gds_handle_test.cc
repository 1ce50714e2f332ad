// GdsHandle without a GPU: the host copy engine stands in for device memory (every byte still
// goes through the handle's chunking, staging slots and libaio on real files) and a fake
// libcufile (tests/engine/gpu/fake_cufile.cc), loaded with dlopen like the real library, stands in
// for GPUDirect Storage. tests/engine/gpu/cuda_test.cc covers the real CUDA device where there is
// one.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "dnvme/gds_handle.h"
#include "dnvme/gpu.h"
#include "engine/gpu/copy_engine.h"
#include "engine/gpu/cufile.h"
#include "tests/engine/test_util.h"

namespace dnvme {
namespace {

using dnvme::test::FillPattern;
using dnvme::test::kKiB;
using dnvme::test::kMiB;
using dnvme::test::MatchesPattern;
using dnvme::test::ReadWholeFile;

// Sets an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    const char* old = getenv(name);
    if (old != nullptr) old_ = old;
    had_ = old != nullptr;
    setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() {
    if (had_) {
      setenv(name_, old_.c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};

class GdsHandleTest : public dnvme::test::ScratchTest {
 protected:
  // A copy of the fake library under its own name: cuFile's driver state is per library, so each
  // mode (gds, p2p, compat, failing open) gets its own load.
  std::string FakeLibrary(const std::string& tag) {
    const std::string path = ScratchRoot() + "/libfakecufile-" + tag + ".so";
    std::error_code ec;
    std::filesystem::copy_file(FakeCuFileSource(), path,
                               std::filesystem::copy_options::overwrite_existing, ec);
    EXPECT_FALSE(ec) << ec.message();
    return path;
  }
  static std::string ScratchRoot() { return dnvme::test::ScratchRoot(); }
  // The fake built beside the tests; $DNVME_FAKE_CUFILE overrides that absolute build-tree path
  // when the test binary runs from a copy on another machine (scripts/gpu-check.sh).
  static std::string FakeCuFileSource() {
    const char* env = getenv("DNVME_FAKE_CUFILE");
    return env != nullptr && env[0] != '\0' ? env : DNVME_FAKE_CUFILE;
  }

  Result<std::unique_ptr<GdsHandle>> Make(CuFilePolicy policy, const std::string& library = "",
                                          HandleConfig config = {}, int64_t chunk = 64 * kKiB,
                                          int slots = 2) {
    GdsOptions o;
    o.cufile = policy;
    o.cufile_library = library.empty() ? "/nonexistent/libcufile.so.0" : library;
    o.copy_engine = factory_;
    o.bounce_chunk_bytes = chunk;
    o.bounce_slots = slots;
    return GdsHandle::Create(config, o);
  }

  // "Device" memory of the host copy engine, filled with the pattern for `file_offset`.
  gpu::DeviceBuffer DeviceMemory(GdsHandle& h, int64_t size, int64_t file_offset = -1) {
    auto b = h.new_pinned_device_buffer(size);
    EXPECT_TRUE(b.ok()) << b.status().ToString();
    if (!b.ok()) return {};
    if (file_offset >= 0) FillPattern(b->data(), static_cast<size_t>(size), file_offset);
    return std::move(b).value();
  }

  std::shared_ptr<gpu::HostCopyEngineFactory> factory_ =
      std::make_shared<gpu::HostCopyEngineFactory>();
};

// --- the bounce path ---------------------------------------------------------------------------

TEST_F(GdsHandleTest, MissingCuFileFallsBackToBounceWithTheReason) {
  auto h = Make(CuFilePolicy::kAuto);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ((*h)->mode(), GdsMode::kBounce);
  EXPECT_NE((*h)->mode_reason().find("cuFile not available"), std::string::npos)
      << (*h)->mode_reason();
  EXPECT_NE((*h)->mode_reason().find("/nonexistent/libcufile.so.0"), std::string::npos);

  auto req = Make(CuFilePolicy::kRequire);
  ASSERT_FALSE(req.ok());
  EXPECT_EQ(req.status().code(), Status::Code::kUnsupported);
  EXPECT_NE(req.status().message().find("cuFile not available"), std::string::npos)
      << req.status().ToString();
}

TEST_F(GdsHandleTest, BounceRoundTripsEverySizeAndOffset) {
  for (int slots : {2, 3}) {
    auto h = Make(CuFilePolicy::kNever, "", {}, 64 * kKiB, slots);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    for (int64_t size : {int64_t{1}, int64_t{4095}, 64 * kKiB, 5 * 64 * kKiB + 123, kMiB + 4096}) {
      for (int64_t off : {int64_t{0}, int64_t{8192}, int64_t{4096 + 100}}) {
        SCOPED_TRACE("slots " + std::to_string(slots) + " size " + std::to_string(size) +
                     " offset " + std::to_string(off));
        const std::string path = Path("f" + std::to_string(size) + "_" + std::to_string(off));
        gpu::DeviceBuffer src = DeviceMemory(**h, size, off);
        ASSERT_FALSE(src.empty());
        DNVME_ASSERT_OK((*h)->sync_pwrite(src.data(), size, path, off));
        std::vector<uint8_t> file = ReadWholeFile(path);
        ASSERT_EQ(static_cast<int64_t>(file.size()), off + size);
        EXPECT_TRUE(MatchesPattern(file.data() + off, static_cast<size_t>(size), off));

        gpu::DeviceBuffer dst = DeviceMemory(**h, size);
        DNVME_ASSERT_OK((*h)->sync_pread(dst.data(), size, path, off));
        EXPECT_TRUE(MatchesPattern(dst.data(), static_cast<size_t>(size), off));
      }
    }
    const GdsStats s = (*h)->stats();
    EXPECT_GT(s.bytes_bounce, 0u);
    EXPECT_EQ(s.bytes_cufile, 0u);
    EXPECT_EQ(s.bytes_host, 0u);
    EXPECT_EQ(s.ops_failed, 0u);
    // Every chunk crossed the copy engine: at least one copy per 64 KiB chunk each way.
    EXPECT_GE(s.copies, 2u * 5u);
  }
  EXPECT_GT(factory_->copies(), 0u);
}

TEST_F(GdsHandleTest, HostBuffersGoStraightToLibaio) {
  auto h = Make(CuFilePolicy::kNever);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  dnvme::test::AlignedBuffer buf(kMiB + 77, 0);
  buf.Fill(0);
  const std::string path = Path("host");
  DNVME_ASSERT_OK((*h)->sync_pwrite(buf.data(), buf.size(), path, 0));
  dnvme::test::AlignedBuffer back(kMiB + 77, 0);
  DNVME_ASSERT_OK((*h)->sync_pread(back.data(), back.size(), path, 0));
  EXPECT_TRUE(MatchesPattern(back.data(), back.size(), 0));
  const GdsStats s = (*h)->stats();
  EXPECT_EQ(s.bytes_host, 2u * static_cast<uint64_t>(kMiB + 77));
  EXPECT_EQ(s.copies, 0u);
  EXPECT_EQ(s.bytes_bounce, 0u);
}

TEST_F(GdsHandleTest, AsyncOperationsAreCollectedByWaitInOrder) {
  auto h = Make(CuFilePolicy::kNever);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  constexpr int kOps = 6;
  constexpr int64_t kSize = 300 * kKiB + 5;
  std::vector<gpu::DeviceBuffer> bufs;
  std::vector<OpId> ids;
  for (int i = 0; i < kOps; ++i) {
    bufs.push_back(DeviceMemory(**h, kSize, i * kSize));
    auto id = (*h)->async_pwrite(bufs.back().data(), kSize, Path("async"), i * kSize);
    ASSERT_TRUE(id.ok()) << id.status().ToString();
    ids.push_back(id.value());
  }
  EXPECT_EQ((*h)->wait(), kOps);
  ASSERT_EQ((*h)->completed().size(), static_cast<size_t>(kOps));
  for (int i = 0; i < kOps; ++i) {
    EXPECT_EQ((*h)->completed()[static_cast<size_t>(i)].id, ids[static_cast<size_t>(i)]);
    EXPECT_TRUE((*h)->completed()[static_cast<size_t>(i)].status.ok());
    EXPECT_EQ((*h)->completed()[static_cast<size_t>(i)].bytes_done, kSize);
  }
  EXPECT_EQ((*h)->pending(), 0);
  EXPECT_EQ((*h)->wait(), 0);
  std::vector<uint8_t> file = ReadWholeFile(Path("async"));
  ASSERT_EQ(static_cast<int64_t>(file.size()), kOps * kSize);
  EXPECT_TRUE(MatchesPattern(file.data(), file.size(), 0));

  // DeepSpeed's general form, async: the outcome comes from wait().
  gpu::DeviceBuffer back = DeviceMemory(**h, kOps * kSize);
  DNVME_ASSERT_OK((*h)->pread(back.data(), kOps * kSize, Path("async"), false, true, 0));
  EXPECT_EQ((*h)->pending(), 1);
  EXPECT_EQ((*h)->wait(), 1);
  EXPECT_TRUE(MatchesPattern(back.data(), back.size(), 0));
}

TEST_F(GdsHandleTest, ErrorsAreReportedNotAsserted) {
  auto h = Make(CuFilePolicy::kNever);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  gpu::DeviceBuffer b = DeviceMemory(**h, 256 * kKiB, 0);

  // Open errors: at submission, nothing queued.
  Status missing = (*h)->sync_pread(b.data(), 4096, Path("missing"), 0);
  EXPECT_EQ(missing.code(), Status::Code::kNotFound) << missing.ToString();
  auto id = (*h)->async_pread(b.data(), 4096, Path("missing"), 0);
  EXPECT_FALSE(id.ok());
  EXPECT_EQ((*h)->pending(), 0);

  // Reading past the end of the file: kEndOfFile from the chunk that hit it.
  DNVME_ASSERT_OK((*h)->sync_pwrite(b.data(), 100 * kKiB, Path("short"), 0));
  Status eof = (*h)->sync_pread(b.data(), 256 * kKiB, Path("short"), 0);
  EXPECT_EQ(eof.code(), Status::Code::kEndOfFile) << eof.ToString();
  auto async_eof = (*h)->async_pread(b.data(), 256 * kKiB, Path("short"), 0);
  ASSERT_TRUE(async_eof.ok());
  EXPECT_EQ((*h)->wait(), 1);
  EXPECT_EQ((*h)->completed()[0].status.code(), Status::Code::kEndOfFile);
  EXPECT_GE((*h)->completed()[0].error_offset, 64 * kKiB);

  // Bad arguments.
  EXPECT_EQ((*h)->sync_pwrite(b.data(), -1, Path("x"), 0).code(), Status::Code::kInvalidArgument);
  EXPECT_EQ((*h)->sync_pwrite(nullptr, 10, Path("x"), 0).code(), Status::Code::kInvalidArgument);
  EXPECT_GE((*h)->stats().ops_failed, 2u);

  // Still usable afterwards.
  DNVME_EXPECT_OK((*h)->sync_pwrite(b.data(), 256 * kKiB, Path("after"), 0));
}

TEST_F(GdsHandleTest, ValidateComparesDeviceMemoryWithTheFile) {
  auto h = Make(CuFilePolicy::kNever);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  gpu::DeviceBuffer b = DeviceMemory(**h, 200 * kKiB + 9, 0);
  DNVME_EXPECT_OK((*h)->pwrite(b.data(), b.size(), Path("v"), true, false, 0));
  DNVME_EXPECT_OK((*h)->pread(b.data(), b.size(), Path("v"), true, false, 0));
}

TEST_F(GdsHandleTest, PinningBookkeeping) {
  auto h = Make(CuFilePolicy::kNever);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  std::vector<char> host(4096);
  EXPECT_EQ((*h)->pin_device_buffer(host.data(), 4096).code(), Status::Code::kInvalidArgument);
  EXPECT_EQ((*h)->unpin_device_buffer(host.data()).code(), Status::Code::kInvalidArgument);
  gpu::DeviceBuffer b = DeviceMemory(**h, 8192);
  EXPECT_EQ((*h)->stats().buffers_pinned, 1u);
  EXPECT_EQ((*h)->pin_device_buffer(b.data(), 8192).code(), Status::Code::kInvalidArgument);
  DNVME_EXPECT_OK((*h)->free_pinned_device_buffer(std::move(b)));
  EXPECT_EQ((*h)->stats().buffers_pinned, 0u);
  EXPECT_EQ((*h)->free_pinned_device_buffer(gpu::DeviceBuffer()).code(),
            Status::Code::kInvalidArgument);
  // A buffer may outlive its handle.
  gpu::DeviceBuffer survivor = DeviceMemory(**h, 4096);
  h->reset();
  survivor = gpu::DeviceBuffer();
}

TEST_F(GdsHandleTest, BadOptionsAreRefused) {
  EXPECT_EQ(Make(CuFilePolicy::kNever, "", {}, 1000).status().code(),
            Status::Code::kInvalidArgument);
  EXPECT_EQ(Make(CuFilePolicy::kNever, "", {}, 64 * kKiB, 1).status().code(),
            Status::Code::kInvalidArgument);
  HandleConfig bad;
  bad.block_size = 0;
  EXPECT_EQ(Make(CuFilePolicy::kNever, "", bad).status().code(), Status::Code::kInvalidArgument);
  EXPECT_EQ(ParseCuFilePolicy("sometimes").status().code(), Status::Code::kInvalidArgument);
  EXPECT_EQ(ParseCuFilePolicy("require").value(), CuFilePolicy::kRequire);
}

// --- cuFile (the fake library) -----------------------------------------------------------------

using RegisteredFn = int (*)();
using LastCallFn = void (*)(const void**, long*);

TEST_F(GdsHandleTest, CuFileGdsModeRoundTripsWithRegisteredBuffers) {
  const std::string lib = FakeLibrary("gds");
  ScopedEnv mode("FAKE_CUFILE_MODE", "gds");
  HandleConfig cfg;
  cfg.block_size = 64 * kKiB;
  cfg.intra_op_parallelism = 4;
  auto h = Make(CuFilePolicy::kRequire, lib, cfg);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ((*h)->mode(), GdsMode::kGds);
  EXPECT_NE((*h)->mode_reason().find("nvidia-fs 2.17"), std::string::npos) << (*h)->mode_reason();

  void* so = dlopen(lib.c_str(), RTLD_NOW | RTLD_NOLOAD);
  ASSERT_NE(so, nullptr) << "the handle must have loaded " << lib;
  auto registered = reinterpret_cast<RegisteredFn>(dlsym(so, "fake_cufile_registered_buffers"));
  auto last_call = reinterpret_cast<LastCallFn>(dlsym(so, "fake_cufile_last_call"));
  ASSERT_TRUE(registered != nullptr && last_call != nullptr);

  constexpr int64_t kSize = kMiB + 123;
  gpu::DeviceBuffer src = DeviceMemory(**h, kSize, 4096);
  EXPECT_EQ(registered(), 1) << "new_pinned_device_buffer registers with cuFileBufRegister";
  DNVME_ASSERT_OK((*h)->sync_pwrite(src.data(), kSize, Path("gds"), 4096));
  std::vector<uint8_t> file = ReadWholeFile(Path("gds"));
  ASSERT_EQ(static_cast<int64_t>(file.size()), 4096 + kSize);
  EXPECT_TRUE(MatchesPattern(file.data() + 4096, static_cast<size_t>(kSize), 4096));

  // A read into the middle of a registered buffer goes as (registered base, offset).
  gpu::DeviceBuffer dst = DeviceMemory(**h, kSize + 8192);
  EXPECT_EQ(registered(), 2);
  char* mid = static_cast<char*>(dst.data()) + 8192;
  DNVME_ASSERT_OK((*h)->sync_pread(mid, kSize, Path("gds"), 4096));
  EXPECT_TRUE(MatchesPattern(mid, static_cast<size_t>(kSize), 4096));
  const void* base = nullptr;
  long off = -1;
  last_call(&base, &off);
  EXPECT_EQ(base, dst.data());
  EXPECT_GE(off, 8192);

  const GdsStats s = (*h)->stats();
  EXPECT_EQ(s.bytes_cufile, 2u * static_cast<uint64_t>(kSize));
  EXPECT_EQ(s.bytes_bounce, 0u);
  // block_size pieces over 4 slices: at least ceil(kSize / 64 KiB) calls per operation.
  EXPECT_GE(s.cufile_calls, 2u * static_cast<uint64_t>((kSize + 64 * kKiB - 1) / (64 * kKiB)));

  dst = gpu::DeviceBuffer();
  EXPECT_EQ(registered(), 1) << "freeing a pinned buffer deregisters it";
  h->reset();
  EXPECT_EQ(registered(), 0) << "destroying the handle deregisters what it pinned";
}

TEST_F(GdsHandleTest, CuFileShortTransfersAreContinued) {
  const std::string lib = FakeLibrary("short");
  ScopedEnv mode("FAKE_CUFILE_MODE", "gds");
  auto h = Make(CuFilePolicy::kRequire, lib);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  ScopedEnv shrt("FAKE_CUFILE_SHORT", "1");
  constexpr int64_t kSize = 3 * kMiB + 17;
  gpu::DeviceBuffer src = DeviceMemory(**h, kSize, 0);
  DNVME_ASSERT_OK((*h)->sync_pwrite(src.data(), kSize, Path("short"), 0));
  gpu::DeviceBuffer dst = DeviceMemory(**h, kSize);
  DNVME_ASSERT_OK((*h)->sync_pread(dst.data(), kSize, Path("short"), 0));
  EXPECT_TRUE(MatchesPattern(dst.data(), static_cast<size_t>(kSize), 0));
  EXPECT_GT((*h)->stats().cufile_calls, 2u * 4u);
}

TEST_F(GdsHandleTest, CuFileErrorsAreDecodedWithTheirNames) {
  const std::string lib = FakeLibrary("errors");
  ScopedEnv mode("FAKE_CUFILE_MODE", "gds");
  HandleConfig cfg;
  cfg.block_size = 64 * kKiB;
  auto h = Make(CuFilePolicy::kRequire, lib, cfg);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  gpu::DeviceBuffer src = DeviceMemory(**h, kMiB, 0);
  {
    ScopedEnv fail("FAKE_CUFILE_FAIL_AT", std::to_string(300 * kKiB));
    auto id = (*h)->async_pwrite(src.data(), kMiB, Path("err"), 0);
    ASSERT_TRUE(id.ok()) << id.status().ToString();
    EXPECT_EQ((*h)->wait(), 1);
    const OpResult& r = (*h)->completed()[0];
    EXPECT_FALSE(r.status.ok());
    EXPECT_NE(r.status.message().find("CU_FILE_IO_NOT_SUPPORTED (5008)"), std::string::npos)
        << r.status.ToString();
    EXPECT_EQ(r.status.error_number(), EOPNOTSUPP);
    EXPECT_EQ(r.error_offset, 256 * kKiB) << "the block containing the failing offset";
    EXPECT_LT(r.bytes_done, kMiB);
  }
  // Reading past the end of the file through cuFile.
  DNVME_ASSERT_OK((*h)->sync_pwrite(src.data(), 4096, Path("tiny"), 0));
  EXPECT_EQ((*h)->sync_pread(src.data(), 8192, Path("tiny"), 0).code(), Status::Code::kEndOfFile);

  EXPECT_EQ(gpu::CuFileErrorName(5001), "CU_FILE_DRIVER_NOT_INITIALIZED (5001)");
  EXPECT_EQ(gpu::CuFileErrorName(4242), "cuFile error 4242");
  Status cuda = gpu::CuFileStatus({5011, 700}, "x");
  EXPECT_NE(cuda.message().find("CUresult 700"), std::string::npos) << cuda.ToString();
  EXPECT_TRUE(gpu::CuFileStatus({0, 0}, "x").ok());
  EXPECT_EQ(gpu::CuFileIoStatus(-1, ENOSPC, "w").code(), Status::Code::kNoSpace);
  EXPECT_NE(gpu::CuFileIoStatus(-5012, 0, "w").message().find("CU_FILE_CUDA_POINTER_INVALID"),
            std::string::npos);
}

TEST_F(GdsHandleTest, CuFileModesFollowTheDriverProperties) {
  {
    const std::string lib = FakeLibrary("p2p");
    ScopedEnv mode("FAKE_CUFILE_MODE", "p2p");
    auto h = Make(CuFilePolicy::kAuto, lib);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    EXPECT_EQ((*h)->mode(), GdsMode::kP2pDma) << (*h)->mode_reason();
    gpu::DeviceBuffer b = DeviceMemory(**h, 12345, 0);
    DNVME_ASSERT_OK((*h)->sync_pwrite(b.data(), 12345, Path("p2p"), 0));
    EXPECT_EQ((*h)->stats().bytes_cufile, 12345u);
  }
  {
    const std::string lib = FakeLibrary("compat");
    ScopedEnv mode("FAKE_CUFILE_MODE", "compat");
    auto h = Make(CuFilePolicy::kAuto, lib);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    EXPECT_EQ((*h)->mode(), GdsMode::kBounce);
    EXPECT_NE((*h)->mode_reason().find("only compat mode"), std::string::npos)
        << (*h)->mode_reason();
    EXPECT_FALSE(Make(CuFilePolicy::kRequire, lib).ok());
    GdsOptions o;
    o.cufile_library = lib;
    o.cufile_compat = true;
    o.copy_engine = factory_;
    auto c = GdsHandle::Create({}, o);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_EQ((*c)->mode(), GdsMode::kCompat);
  }
  {
    const std::string lib = FakeLibrary("noinit");
    ScopedEnv err("FAKE_CUFILE_OPEN_ERROR", "5001");
    auto h = Make(CuFilePolicy::kAuto, lib);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    EXPECT_EQ((*h)->mode(), GdsMode::kBounce);
    EXPECT_NE((*h)->mode_reason().find("CU_FILE_DRIVER_NOT_INITIALIZED (5001)"), std::string::npos)
        << (*h)->mode_reason();
  }
}

// --- process-wide rules ------------------------------------------------------------------------

TEST_F(GdsHandleTest, DeferredCudaInitIsRefusedWithTheReason) {
  gpu::DeferCudaInit("the daemon has not forked yet");
  auto drv = gpu::CuFileDriver::Get(FakeLibrary("deferred"));
  auto n = gpu::DeviceCount();
  gpu::AllowCudaInit();
  ASSERT_FALSE(drv.ok());
  EXPECT_NE(drv.status().message().find("the daemon has not forked yet"), std::string::npos)
      << drv.status().ToString();
  if (gpu::BuiltWithCuda()) {
    ASSERT_FALSE(n.ok());
    EXPECT_NE(n.status().message().find("may not be initialised"), std::string::npos);
  }
  // Allowed again: the refusal was not remembered as the library's outcome.
  ScopedEnv mode("FAKE_CUFILE_MODE", "gds");
  EXPECT_TRUE(gpu::CuFileDriver::Get(ScratchRoot() + "/libfakecufile-deferred.so").ok());
}

TEST(GpuIpcHex, DecodesExactly128HexDigits) {
  std::string hex(128, 'a');
  hex[0] = 'F';
  hex[1] = '0';
  auto raw = gpu::DecodeIpcHandleHex(hex);
  ASSERT_TRUE(raw.ok()) << raw.status().ToString();
  ASSERT_EQ(raw->size(), gpu::kIpcHandleBytes);
  EXPECT_EQ(static_cast<unsigned char>((*raw)[0]), 0xF0);
  EXPECT_EQ(static_cast<unsigned char>((*raw)[1]), 0xAA);
  EXPECT_EQ(gpu::DecodeIpcHandleHex(hex.substr(1)).status().code(), Status::Code::kInvalidArgument);
  hex[77] = 'g';
  auto bad = gpu::DecodeIpcHandleHex(hex);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("position 77"), std::string::npos);
}

}  // namespace
}  // namespace dnvme
