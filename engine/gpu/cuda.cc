// dnvme/gpu.h over the CUDA runtime, or its refusals in a build without CUDA.
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>

#include "dnvme/gpu.h"
#include "dnvme/log.h"
#include "engine/gpu/cuda_util.h"

namespace dnvme::gpu {
namespace {

std::mutex g_gate_mu;
std::string g_deferred_why;  // non-empty while CUDA init is deferred; guarded by g_gate_mu

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

void DeferCudaInit(const char* why) {
  std::lock_guard lock(g_gate_mu);
  g_deferred_why = why != nullptr && *why != '\0' ? why : "deferred";
}

void AllowCudaInit() {
  std::lock_guard lock(g_gate_mu);
  g_deferred_why.clear();
}

Status CheckCudaInitAllowed() {
  std::lock_guard lock(g_gate_mu);
  if (g_deferred_why.empty()) return Status::Ok();
  return Status::Unsupported(EAGAIN, "CUDA may not be initialised yet: " + g_deferred_why);
}

void LogCudaFailure(const Status& st) { Logger().warn("{}", st.ToString()); }

Result<std::string> DecodeIpcHandleHex(const std::string& hex) {
  if (hex.size() != 2 * kIpcHandleBytes) {
    return Status::InvalidArgument("a CUDA IPC handle is " + std::to_string(2 * kIpcHandleBytes) +
                                   " hex digits, not " + std::to_string(hex.size()));
  }
  std::string out(kIpcHandleBytes, '\0');
  for (size_t i = 0; i < kIpcHandleBytes; ++i) {
    const int hi = HexValue(hex[2 * i]), lo = HexValue(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) {
      return Status::InvalidArgument("a CUDA IPC handle must be hex digits only (position " +
                                     std::to_string(hi < 0 ? 2 * i : 2 * i + 1) + ")");
    }
    out[i] = static_cast<char>(hi * 16 + lo);
  }
  return out;
}

DeviceBuffer::~DeviceBuffer() { Release(); }

DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)),
      size_(std::exchange(o.size_, 0)),
      device_(o.device_),
      on_free_(std::exchange(o.on_free_, nullptr)),
      deleter_(std::exchange(o.deleter_, nullptr)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    Release();
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    device_ = o.device_;
    on_free_ = std::exchange(o.on_free_, nullptr);
    deleter_ = std::exchange(o.deleter_, nullptr);
  }
  return *this;
}

void DeviceBuffer::Release() {
  if (data_ == nullptr) return;
  if (on_free_) on_free_(data_);
  if (deleter_) deleter_(data_);
  on_free_ = nullptr;
  deleter_ = nullptr;
  data_ = nullptr;
  size_ = 0;
}

DeviceBuffer DeviceBuffer::Adopt(void* data, size_t size, int device,
                                 std::function<void(void*)> deleter) {
  DeviceBuffer b;
  b.data_ = data;
  b.size_ = size;
  b.device_ = device;
  b.deleter_ = std::move(deleter);
  return b;
}

std::string UnavailableReason() {
  auto n = DeviceCount();
  return n.ok() ? std::string() : n.status().message();
}

#if DNVME_HAVE_CUDA

bool BuiltWithCuda() { return true; }

Status CudaCheck(cudaError_t err, const std::string& context) {
  if (err == cudaSuccess) return Status::Ok();
  cudaGetLastError();  // reset the sticky error of a non-fatal failure
  std::string msg = context + ": " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err);
  switch (err) {
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidDevice:
      return Status::InvalidArgument(msg);
    case cudaErrorMemoryAllocation:
      return Status::ResourceExhausted(ENOMEM, msg);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorStubLibrary:
    case cudaErrorNotSupported:
    case cudaErrorDevicesUnavailable:
      return Status::Unsupported(ENODEV, msg);
    default:
      return Status::IoError(EIO, msg);
  }
}

int RuntimeVersion() { return CUDART_VERSION; }

Result<int> DeviceCount() {
  DNVME_RETURN_IF_ERROR(CheckCudaInitAllowed());
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) return CudaCheck(err, "no usable CUDA device: cudaGetDeviceCount");
  if (n <= 0) return Status::Unsupported(ENODEV, "no CUDA device present");
  return n;
}

Result<DeviceInfo> GetDeviceInfo(int device) {
  DNVME_RETURN_IF_ERROR(DeviceCount().status());
  cudaDeviceProp p{};
  DNVME_RETURN_IF_ERROR(CudaCheck(cudaGetDeviceProperties(&p, device), "cudaGetDeviceProperties"));
  DeviceInfo info;
  info.index = device;
  info.name = p.name;
  char bus[64] = {};
  if (cudaDeviceGetPCIBusId(bus, sizeof(bus), device) == cudaSuccess) info.pci_bus_id = bus;
  info.total_memory = static_cast<int64_t>(p.totalGlobalMem);
  info.compute_major = p.major;
  info.compute_minor = p.minor;
  cudaDriverGetVersion(&info.driver_version);
  cudaRuntimeGetVersion(&info.runtime_version);
  return info;
}

Result<bool> IsDevicePointer(const void* ptr) {
  DNVME_RETURN_IF_ERROR(CheckCudaInitAllowed());
  cudaPointerAttributes a{};
  cudaError_t err = cudaPointerGetAttributes(&a, ptr);
  if (err == cudaErrorInvalidValue) {  // an address CUDA has never heard of: plain host memory
    cudaGetLastError();
    return false;
  }
  DNVME_RETURN_IF_ERROR(CudaCheck(err, "cudaPointerGetAttributes"));
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

Result<int> DeviceOfPointer(const void* ptr) {
  DNVME_RETURN_IF_ERROR(CheckCudaInitAllowed());
  cudaPointerAttributes a{};
  DNVME_RETURN_IF_ERROR(CudaCheck(cudaPointerGetAttributes(&a, ptr), "cudaPointerGetAttributes"));
  return a.device;
}

Result<DeviceBuffer> DeviceBuffer::Allocate(size_t size, int device) {
  DNVME_RETURN_IF_ERROR(DeviceCount().status());
  DNVME_RETURN_IF_ERROR(CudaCheck(cudaSetDevice(device), "cudaSetDevice"));
  DeviceBuffer b;
  DNVME_RETURN_IF_ERROR(CudaCheck(cudaMalloc(&b.data_, size == 0 ? 1 : size),
                                  "cudaMalloc(" + std::to_string(size) + ")"));
  b.size_ = size;
  b.device_ = device;
  b.deleter_ = [](void* p) {
    Status st = CudaCheck(cudaFree(p), "cudaFree");
    if (!st.ok()) LogCudaFailure(st);
  };
  DNVME_RETURN_IF_ERROR(CudaCheck(cudaMemset(b.data_, 0, size), "cudaMemset"));
  // cudaMemset may return before it has run: finish it before the memory is handed out.
  DNVME_RETURN_IF_ERROR(CudaCheck(cudaDeviceSynchronize(), "cudaDeviceSynchronize"));
  return b;
}

Status CopyToDevice(void* dst, const void* src, size_t size) {
  DNVME_RETURN_IF_ERROR(CheckCudaInitAllowed());
  return CudaCheck(cudaMemcpy(dst, src, size, cudaMemcpyHostToDevice), "cudaMemcpy(to device)");
}
Status CopyToHost(void* dst, const void* src, size_t size) {
  DNVME_RETURN_IF_ERROR(CheckCudaInitAllowed());
  return CudaCheck(cudaMemcpy(dst, src, size, cudaMemcpyDeviceToHost), "cudaMemcpy(to host)");
}
Status MemsetDevice(void* dst, int value, size_t size) {
  DNVME_RETURN_IF_ERROR(CheckCudaInitAllowed());
  return CudaCheck(cudaMemset(dst, value, size), "cudaMemset");
}

Result<double> MeasureCopyRate(size_t size, bool to_device, int repeats, int device) {
  DNVME_ASSIGN_OR_RETURN(DeviceBuffer dev, DeviceBuffer::Allocate(size, device));
  void* host = nullptr;
  DNVME_RETURN_IF_ERROR(CudaCheck(cudaHostAlloc(&host, size, cudaHostAllocPortable),
                                  "cudaHostAlloc(" + std::to_string(size) + ")"));
  std::memset(host, 0x5a, size);
  double best = 0;
  Status st;
  for (int i = 0; i < std::max(1, repeats) && st.ok(); ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    st = to_device ? CudaCheck(cudaMemcpy(dev.data(), host, size, cudaMemcpyHostToDevice), "copy")
                   : CudaCheck(cudaMemcpy(host, dev.data(), size, cudaMemcpyDeviceToHost), "copy");
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (st.ok() && s > 0) best = std::max(best, static_cast<double>(size) / s);
  }
  Status freed = CudaCheck(cudaFreeHost(host), "cudaFreeHost");
  DNVME_RETURN_IF_ERROR(st);
  DNVME_RETURN_IF_ERROR(freed);
  return best;
}

namespace {

struct AddressRange {
  uintptr_t base = 0;
  int64_t size = 0;
};

// The cudaMalloc allocation containing `p` (cuMemGetAddressRange, reached through the runtime's
// driver entry points so nothing links libcuda directly).
Result<AddressRange> AllocationOf(const void* p) {
  using AddressRangeFn = int (*)(unsigned long long*, size_t*, unsigned long long);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q{};
  DNVME_RETURN_IF_ERROR(CudaCheck(
      cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &q),
      "cudaGetDriverEntryPointByVersion(cuMemGetAddressRange)"));
  if (fn == nullptr || q != cudaDriverEntryPointSuccess) {
    return Status::Unsupported(ENOSYS, "the CUDA driver has no cuMemGetAddressRange");
  }
  unsigned long long base = 0;
  size_t size = 0;
  const int r =
      reinterpret_cast<AddressRangeFn>(fn)(&base, &size, reinterpret_cast<unsigned long long>(p));
  if (r != 0) return Status::IoError(EIO, "cuMemGetAddressRange: CUresult " + std::to_string(r));
  return AddressRange{static_cast<uintptr_t>(base), static_cast<int64_t>(size)};
}

}  // namespace

Result<IpcExport> ExportIpc(const void* device_ptr) {
  DNVME_RETURN_IF_ERROR(CheckCudaInitAllowed());
  cudaPointerAttributes a{};
  DNVME_RETURN_IF_ERROR(
      CudaCheck(cudaPointerGetAttributes(&a, device_ptr), "cudaPointerGetAttributes"));
  if (a.type != cudaMemoryTypeDevice) {
    return Status::InvalidArgument("CUDA IPC needs memory from cudaMalloc (device memory)");
  }
  DNVME_ASSIGN_OR_RETURN(AddressRange range, AllocationOf(device_ptr));
  cudaIpcMemHandle_t h{};
  DNVME_RETURN_IF_ERROR(CudaCheck(cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(range.base)),
                                  "cudaIpcGetMemHandle"));
  static_assert(sizeof(h) == kIpcHandleBytes);
  IpcExport out;
  static const char* kHex = "0123456789abcdef";
  const auto* bytes = reinterpret_cast<const unsigned char*>(&h);
  for (size_t i = 0; i < sizeof(h); ++i) {
    out.handle_hex.push_back(kHex[bytes[i] >> 4]);
    out.handle_hex.push_back(kHex[bytes[i] & 15]);
  }
  out.offset = static_cast<int64_t>(reinterpret_cast<uintptr_t>(device_ptr) - range.base);
  out.allocation_size = range.size;
  out.device = a.device;
  return out;
}

Result<std::unique_ptr<IpcMapping>> IpcMapping::Open(const std::string& handle_hex, int device) {
  DNVME_ASSIGN_OR_RETURN(std::string raw, DecodeIpcHandleHex(handle_hex));
  DNVME_ASSIGN_OR_RETURN(int count, DeviceCount());
  if (device < 0 || device >= count) {
    return Status::InvalidArgument("CUDA device " + std::to_string(device) + " does not exist (" +
                                   std::to_string(count) + " present)");
  }
  DNVME_RETURN_IF_ERROR(CudaCheck(cudaSetDevice(device), "cudaSetDevice"));
  cudaIpcMemHandle_t h{};
  std::memcpy(&h, raw.data(), sizeof(h));
  std::unique_ptr<IpcMapping> m(new IpcMapping());
  DNVME_RETURN_IF_ERROR(CudaCheck(
      cudaIpcOpenMemHandle(&m->data_, h, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle"));
  m->device_ = device;
  auto range = AllocationOf(m->data_);
  if (!range.ok()) return range.status().WithContext("the size of the CUDA IPC allocation");
  m->allocation_size_ = range->size;
  return m;
}

IpcMapping::~IpcMapping() {
  if (data_ == nullptr) return;
  cudaSetDevice(device_);
  Status st = CudaCheck(cudaIpcCloseMemHandle(data_), "cudaIpcCloseMemHandle");
  if (!st.ok()) LogCudaFailure(st);
}

#else  // !DNVME_HAVE_CUDA

namespace {
Status NoCuda() { return Status::Unsupported(ENODEV, "dnvme was built without CUDA"); }
}  // namespace

bool BuiltWithCuda() { return false; }
int RuntimeVersion() { return 0; }
Result<int> DeviceCount() { return NoCuda(); }
Result<DeviceInfo> GetDeviceInfo(int) { return NoCuda(); }
Result<bool> IsDevicePointer(const void*) { return false; }
Result<int> DeviceOfPointer(const void*) { return NoCuda(); }
Result<DeviceBuffer> DeviceBuffer::Allocate(size_t, int) { return NoCuda(); }
Status CopyToDevice(void*, const void*, size_t) { return NoCuda(); }
Status CopyToHost(void*, const void*, size_t) { return NoCuda(); }
Status MemsetDevice(void*, int, size_t) { return NoCuda(); }
Result<double> MeasureCopyRate(size_t, bool, int, int) { return NoCuda(); }
Result<IpcExport> ExportIpc(const void*) { return NoCuda(); }
Result<std::unique_ptr<IpcMapping>> IpcMapping::Open(const std::string& hex, int) {
  DNVME_RETURN_IF_ERROR(DecodeIpcHandleHex(hex).status());  // a bad handle is still EINVAL
  return NoCuda();
}
IpcMapping::~IpcMapping() = default;

#endif

}  // namespace dnvme::gpu
