// CUDA device memory for the engine: availability, device buffers, host<->device copies and CUDA
// IPC. Everything here is a thin, checked layer over the CUDA runtime (cudart, linked statically
// when the build found the CUDA toolkit; see BuiltWithCuda()). In a build without CUDA every call
// answers Status::Unsupported naming the reason, so callers need no #ifdefs.
//
// CUDA is initialised lazily, by the first call that needs a device. A process that forks after
// that (the mount daemon daemonizes by forking, and cuFile forbids fork after its init) calls
// DeferCudaInit() first: until AllowCudaInit(), every call that would initialise CUDA fails with
// a Status that says so instead of creating a context that the child would inherit broken.
//
// Thread safety: all functions are thread-safe. DeviceBuffer and IpcMapping are movable owners;
// one object is used by one thread at a time, the memory it owns by anyone.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "dnvme/status.h"

namespace dnvme::gpu {

// True when this build has the CUDA runtime compiled in.
bool BuiltWithCuda();

// Refuse (DeferCudaInit) / permit (AllowCudaInit) CUDA initialisation in this process. `why` is
// quoted in the refusal. Permitted by default.
void DeferCudaInit(const char* why);
void AllowCudaInit();

// The number of usable CUDA devices (at least 1), or a non-OK Status whose message is the reason
// there is none ("built without CUDA", "no CUDA driver: cudaErrorInsufficientDriver ...",
// "cudaErrorNoDevice ..."). Initialises CUDA.
Result<int> DeviceCount();
// "" when a device is usable, else the reason (DeviceCount's message).
std::string UnavailableReason();

struct DeviceInfo {
  int index = 0;
  std::string name;
  std::string pci_bus_id;
  int64_t total_memory = 0;
  int compute_major = 0, compute_minor = 0;
  int driver_version = 0;   // cudaDriverGetVersion, e.g. 13000
  int runtime_version = 0;  // cudaRuntimeGetVersion
};
Result<DeviceInfo> GetDeviceInfo(int device);
// The runtime version this build links (no device needed); 0 without CUDA.
int RuntimeVersion();

// Whether `ptr` is device (or managed) memory that the CUDA runtime knows; false for host memory,
// pinned or not. Initialises CUDA.
Result<bool> IsDevicePointer(const void* ptr);
// The device that owns `ptr` (IsDevicePointer must be true).
Result<int> DeviceOfPointer(const void* ptr);

// Device memory from cudaMalloc on `device`, freed by the destructor. `on_free` (optional) runs
// before cudaFree, with the pointer: GdsHandle uses it to deregister the buffer from cuFile.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // Zero-filled (cudaMemset) so a fresh buffer never shows old data.
  static Result<DeviceBuffer> Allocate(size_t size, int device = 0);
  // Takes ownership of memory some other allocator made; `deleter` frees it.
  static DeviceBuffer Adopt(void* data, size_t size, int device,
                            std::function<void(void*)> deleter);

  void* data() const { return data_; }
  size_t size() const { return size_; }
  int device() const { return device_; }
  bool empty() const { return data_ == nullptr; }
  // Runs with data() just before the memory is freed (replaces any earlier hook).
  void set_on_free(std::function<void(void*)> hook) { on_free_ = std::move(hook); }

 private:
  void Release();
  void* data_ = nullptr;
  size_t size_ = 0;
  int device_ = 0;
  std::function<void(void*)> on_free_;
  std::function<void(void*)> deleter_;
};

// Synchronous copies (cudaMemcpy, any direction the pointers imply) and memset, for tools and
// tests; the bounce path uses its own asynchronous, double-buffered copies.
Status CopyToDevice(void* device_dst, const void* host_src, size_t size);
Status CopyToHost(void* host_dst, const void* device_src, size_t size);
Status MemsetDevice(void* device_dst, int value, size_t size);

// The raw host<->device copy rate over pinned host memory (cudaHostAlloc): bytes per second for
// `size` bytes, best of `repeats` timed copies. `to_device` picks the direction.
Result<double> MeasureCopyRate(size_t size, bool to_device, int repeats, int device = 0);

// CUDA IPC: a cudaIpcMemHandle_t is 64 opaque bytes; on the wire they travel as 128 hex digits.
constexpr size_t kIpcHandleBytes = 64;

// The IPC handle of the allocation containing `device_ptr`, as hex, and the offset of
// `device_ptr` inside that allocation (cudaIpcGetMemHandle names whole allocations).
struct IpcExport {
  std::string handle_hex;
  int64_t offset = 0;
  int64_t allocation_size = 0;
  int device = 0;
};
Result<IpcExport> ExportIpc(const void* device_ptr);

// Another process's device memory, opened from its IPC handle (cudaIpcOpenMemHandle) on `device`
// and closed by the destructor. data() is the start of the exported allocation.
class IpcMapping {
 public:
  static Result<std::unique_ptr<IpcMapping>> Open(const std::string& handle_hex, int device);
  ~IpcMapping();
  IpcMapping(const IpcMapping&) = delete;
  IpcMapping& operator=(const IpcMapping&) = delete;

  char* data() const { return static_cast<char*>(data_); }
  int device() const { return device_; }
  // The size of the allocation behind the handle (cuMemGetAddressRange), so requests past its
  // end are refused instead of faulting the GPU.
  int64_t allocation_size() const { return allocation_size_; }

 private:
  IpcMapping() = default;
  void* data_ = nullptr;
  int device_ = 0;
  int64_t allocation_size_ = 0;
};

// Parses 128 hex digits into the 64 handle bytes (exposed for the control-protocol parser and
// its tests; needs no CUDA).
Result<std::string> DecodeIpcHandleHex(const std::string& hex);

}  // namespace dnvme::gpu
