#include "engine/gpu/copy_engine.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include "engine/gpu/cuda_util.h"

namespace dnvme::gpu {

// --- host engine (tests) -----------------------------------------------------------------------

struct HostDeviceRanges {
  std::mutex mu;
  std::map<uintptr_t, size_t> ranges;  // start -> size
  std::atomic<uint64_t> copies{0};

  bool Contains(const void* p) {
    const auto a = reinterpret_cast<uintptr_t>(p);
    std::lock_guard lock(mu);
    auto it = ranges.upper_bound(a);
    if (it == ranges.begin()) return false;
    --it;
    return a < it->first + it->second;
  }
};

namespace {

class HostCopyEngine : public CopyEngine {
 public:
  explicit HostCopyEngine(std::shared_ptr<HostDeviceRanges> r) : r_(std::move(r)) {}
  const char* name() const override { return "host"; }
  Result<void*> AllocStaging(size_t size) override {
    void* p = nullptr;
    const size_t rounded = (size + 4095) / 4096 * 4096;
    if (posix_memalign(&p, 4096, rounded == 0 ? 4096 : rounded) != 0) {
      return Status::ResourceExhausted(ENOMEM, "staging buffer of " + std::to_string(size));
    }
    return p;
  }
  void FreeStaging(void* p) override { free(p); }
  Status Start(int, void* dst, const void* src, size_t size, bool) override {
    std::memcpy(dst, src, size);
    r_->copies.fetch_add(1, std::memory_order_relaxed);
    return Status::Ok();
  }
  Status Finish(int) override { return Status::Ok(); }
  Status CopySync(void* dst, const void* src, size_t size) override {
    std::memcpy(dst, src, size);
    return Status::Ok();
  }
  Result<bool> IsDevice(const void* p) override { return r_->Contains(p); }
  Status BindThread() override { return Status::Ok(); }
  Result<DeviceBuffer> AllocDevice(size_t size) override {
    DNVME_ASSIGN_OR_RETURN(void* p, AllocStaging(size));
    std::memset(p, 0, size);
    {
      std::lock_guard lock(r_->mu);
      r_->ranges[reinterpret_cast<uintptr_t>(p)] = size == 0 ? 1 : size;
    }
    return DeviceBuffer::Adopt(p, size, 0, [r = r_](void* q) {
      {
        std::lock_guard lock(r->mu);
        r->ranges.erase(reinterpret_cast<uintptr_t>(q));
      }
      free(q);
    });
  }

 private:
  std::shared_ptr<HostDeviceRanges> r_;
};

}  // namespace

HostCopyEngineFactory::HostCopyEngineFactory() : ranges_(std::make_shared<HostDeviceRanges>()) {}
HostCopyEngineFactory::~HostCopyEngineFactory() = default;

Result<std::unique_ptr<CopyEngine>> HostCopyEngineFactory::Create(int, int) {
  return std::unique_ptr<CopyEngine>(new HostCopyEngine(ranges_));
}

void HostCopyEngineFactory::MarkDevice(const void* p, size_t size) {
  std::lock_guard lock(ranges_->mu);
  ranges_->ranges[reinterpret_cast<uintptr_t>(p)] = size;
}

void HostCopyEngineFactory::UnmarkDevice(const void* p) {
  std::lock_guard lock(ranges_->mu);
  ranges_->ranges.erase(reinterpret_cast<uintptr_t>(p));
}

uint64_t HostCopyEngineFactory::copies() const {
  return ranges_->copies.load(std::memory_order_relaxed);
}

// --- CUDA engine -------------------------------------------------------------------------------
#if DNVME_HAVE_CUDA

namespace {

class CudaCopyEngine : public CopyEngine {
 public:
  CudaCopyEngine(int device) : device_(device) {}
  ~CudaCopyEngine() override {
    // Best effort: a failure here has nowhere to go but the log.
    cudaSetDevice(device_);
    for (auto& s : slots_) {
      if (s.stream != nullptr) {
        cudaStreamSynchronize(s.stream);
        cudaStreamDestroy(s.stream);
      }
    }
  }

  Status Init(int slots) {
    DNVME_RETURN_IF_ERROR(CudaCheck(cudaSetDevice(device_), "cudaSetDevice"));
    slots_.resize(static_cast<size_t>(slots));
    for (auto& s : slots_) {
      // Blocking streams on purpose: a copy then waits for work the caller queued on the legacy
      // default stream (a kernel producing the tensor, the zero-fill of a fresh buffer).
      DNVME_RETURN_IF_ERROR(CudaCheck(cudaStreamCreate(&s.stream), "cudaStreamCreate"));
    }
    return Status::Ok();
  }

  const char* name() const override { return "cuda"; }
  Result<void*> AllocStaging(size_t size) override {
    DNVME_RETURN_IF_ERROR(CudaCheck(cudaSetDevice(device_), "cudaSetDevice"));
    void* p = nullptr;
    // Portable: usable with every context; page-aligned by construction.
    DNVME_RETURN_IF_ERROR(
        CudaCheck(cudaHostAlloc(&p, size == 0 ? 4096 : size, cudaHostAllocPortable),
                  "cudaHostAlloc(" + std::to_string(size) + ")"));
    return p;
  }
  void FreeStaging(void* p) override {
    Status st = CudaCheck(cudaFreeHost(p), "cudaFreeHost");
    if (!st.ok()) LogCudaFailure(st);
  }
  Status Start(int slot, void* dst, const void* src, size_t size, bool to_device) override {
    return CudaCheck(
        cudaMemcpyAsync(dst, src, size, to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost,
                        slots_.at(static_cast<size_t>(slot)).stream),
        to_device ? "cudaMemcpyAsync(host to device)" : "cudaMemcpyAsync(device to host)");
  }
  Status Finish(int slot) override {
    return CudaCheck(cudaStreamSynchronize(slots_.at(static_cast<size_t>(slot)).stream),
                     "cudaStreamSynchronize");
  }
  Status CopySync(void* dst, const void* src, size_t size) override {
    DNVME_RETURN_IF_ERROR(CudaCheck(cudaSetDevice(device_), "cudaSetDevice"));
    return CudaCheck(cudaMemcpy(dst, src, size, cudaMemcpyDefault), "cudaMemcpy");
  }
  Result<bool> IsDevice(const void* p) override { return IsDevicePointer(p); }
  Status BindThread() override { return CudaCheck(cudaSetDevice(device_), "cudaSetDevice"); }
  Result<DeviceBuffer> AllocDevice(size_t size) override {
    return DeviceBuffer::Allocate(size, device_);
  }

 private:
  struct Slot {
    cudaStream_t stream = nullptr;
  };
  int device_;
  std::vector<Slot> slots_;
};

}  // namespace

Result<std::unique_ptr<CopyEngine>> MakeCudaCopyEngine(int device, int slots) {
  DNVME_ASSIGN_OR_RETURN(int count, DeviceCount());
  if (device < 0 || device >= count) {
    return Status::InvalidArgument("CUDA device " + std::to_string(device) + " does not exist (" +
                                   std::to_string(count) + " present)");
  }
  auto e = std::make_unique<CudaCopyEngine>(device);
  DNVME_RETURN_IF_ERROR(e->Init(slots));
  return std::unique_ptr<CopyEngine>(std::move(e));
}

#else

Result<std::unique_ptr<CopyEngine>> MakeCudaCopyEngine(int, int) {
  return Status::Unsupported(ENODEV, "dnvme was built without CUDA");
}

#endif

}  // namespace dnvme::gpu
