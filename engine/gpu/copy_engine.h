// How the bounce path of GdsHandle moves bytes between device memory and host staging buffers.
//
// The real engine (CUDA) gives each slot its own stream and event: Start() queues a
// cudaMemcpyAsync on the slot's stream, Finish() waits for it. Staging memory comes from
// cudaHostAlloc, which is page-locked and registered with the driver (so the copies are true DMA)
// and page-aligned (so libaio can use it with O_DIRECT).
//
// The host engine is for tests on machines without a GPU: "device memory" is host memory, copies
// are memcpy, staging is page-aligned host memory. With it the whole GdsHandle pipeline (chunks,
// slots, tails, errors, cuFile bookkeeping against a fake libcufile) runs for real on real files.
//
// Thread contract: one CopyEngine belongs to one GdsHandle operation at a time; slots are used by
// the thread running that operation. Staging buffers are freed by FreeStaging on the same engine.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "dnvme/gpu.h"
#include "dnvme/status.h"

namespace dnvme::gpu {

class CopyEngine {
 public:
  virtual ~CopyEngine() = default;
  virtual const char* name() const = 0;  // "cuda" or "host"
  // Page-aligned, DMA-capable host memory of `size` bytes.
  virtual Result<void*> AllocStaging(size_t size) = 0;
  virtual void FreeStaging(void* p) = 0;
  // Queues a copy on `slot` (0 .. slots-1); Finish(slot) waits for everything queued on it.
  virtual Status Start(int slot, void* dst, const void* src, size_t size, bool to_device) = 0;
  virtual Status Finish(int slot) = 0;
  // A synchronous copy; the direction follows from the pointers (validate, tools).
  virtual Status CopySync(void* dst, const void* src, size_t size) = 0;
  // Whether `p` is memory of this engine's device (host buffers go to libaio directly).
  virtual Result<bool> IsDevice(const void* p) = 0;
  // Makes the engine's device current on the calling thread (cudaSetDevice), so cuFile and the
  // runtime calls of a fresh thread act on the right device's primary context.
  virtual Status BindThread() = 0;
  // Zeroed device memory for new_pinned_device_buffer. The DeviceBuffer frees itself and does
  // not depend on this engine (it may outlive the handle).
  virtual Result<DeviceBuffer> AllocDevice(size_t size) = 0;
};

class CopyEngineFactory {
 public:
  virtual ~CopyEngineFactory() = default;
  virtual Result<std::unique_ptr<CopyEngine>> Create(int device, int slots) = 0;
};

// CUDA streams and events on `device`; Unsupported (with the reason) without CUDA or a device.
Result<std::unique_ptr<CopyEngine>> MakeCudaCopyEngine(int device, int slots);

struct HostDeviceRanges;

// The test engine. Which host pointers count as "device memory": every block its engines'
// AllocDevice handed out, plus any range given to MarkDevice. Thread-safe.
class HostCopyEngineFactory : public CopyEngineFactory {
 public:
  HostCopyEngineFactory();
  ~HostCopyEngineFactory() override;
  Result<std::unique_ptr<CopyEngine>> Create(int device, int slots) override;
  void MarkDevice(const void* p, size_t size);
  void UnmarkDevice(const void* p);
  // Host<->"device" copies made so far by this factory's engines (tests check the pipeline ran).
  uint64_t copies() const;

 private:
  std::shared_ptr<HostDeviceRanges> ranges_;
};

}  // namespace dnvme::gpu
