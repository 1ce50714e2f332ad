#include "engine/gpu/cufile.h"

#include <dlfcn.h>
#include <unistd.h>

#include <map>
#include <memory>
#include <mutex>

#include "dnvme/log.h"
#include "engine/gpu/cuda_guard.h"

namespace dnvme::gpu {
namespace {

struct NamedError {
  int code;
  const char* name;
};

// CUfileOpError values and names, from the cuFile API reference.
constexpr NamedError kErrors[] = {
    {0, "CU_FILE_SUCCESS"},
    {5001, "CU_FILE_DRIVER_NOT_INITIALIZED"},
    {5002, "CU_FILE_DRIVER_INVALID_PROPS"},
    {5003, "CU_FILE_DRIVER_UNSUPPORTED_LIMIT"},
    {5004, "CU_FILE_DRIVER_VERSION_MISMATCH"},
    {5005, "CU_FILE_DRIVER_VERSION_READ_ERROR"},
    {5006, "CU_FILE_DRIVER_CLOSING"},
    {5007, "CU_FILE_PLATFORM_NOT_SUPPORTED"},
    {5008, "CU_FILE_IO_NOT_SUPPORTED"},
    {5009, "CU_FILE_DEVICE_NOT_SUPPORTED"},
    {5010, "CU_FILE_NVFS_DRIVER_ERROR"},
    {5011, "CU_FILE_CUDA_DRIVER_ERROR"},
    {5012, "CU_FILE_CUDA_POINTER_INVALID"},
    {5013, "CU_FILE_CUDA_MEMORY_TYPE_INVALID"},
    {5014, "CU_FILE_CUDA_POINTER_RANGE_ERROR"},
    {5015, "CU_FILE_CUDA_CONTEXT_MISMATCH"},
    {5016, "CU_FILE_INVALID_MAPPING_SIZE"},
    {5017, "CU_FILE_INVALID_MAPPING_RANGE"},
    {5018, "CU_FILE_INVALID_FILE_TYPE"},
    {5019, "CU_FILE_INVALID_FILE_OPEN_FLAG"},
    {5020, "CU_FILE_DIO_NOT_SET"},
    {5022, "CU_FILE_INVALID_VALUE"},
    {5023, "CU_FILE_MEMORY_ALREADY_REGISTERED"},
    {5024, "CU_FILE_MEMORY_NOT_REGISTERED"},
    {5025, "CU_FILE_PERMISSION_DENIED"},
    {5026, "CU_FILE_DRIVER_ALREADY_OPEN"},
    {5027, "CU_FILE_HANDLE_NOT_REGISTERED"},
    {5028, "CU_FILE_HANDLE_ALREADY_REGISTERED"},
    {5029, "CU_FILE_DEVICE_NOT_FOUND"},
    {5030, "CU_FILE_INTERNAL_ERROR"},
    {5031, "CU_FILE_GETNEWFD_FAILED"},
    {5033, "CU_FILE_NVFS_SETUP_ERROR"},
    {5034, "CU_FILE_IO_DISABLED"},
    {5035, "CU_FILE_BATCH_SUBMIT_FAILED"},
    {5036, "CU_FILE_GPU_MEMORY_PINNING_FAILED"},
    {5037, "CU_FILE_BATCH_FULL"},
    {5038, "CU_FILE_ASYNC_NOT_SUPPORTED"},
    {5039, "CU_FILE_IO_MAX_ERROR"},
};

// The errno closest to a cuFile error, so the FUSE edge and Python get a meaningful one.
int ErrnoFor(int err) {
  switch (err) {
    case 5007:  // platform
    case 5008:  // io not supported
    case 5009:  // device not supported
    case 5018:  // file type
    case 5034:  // io disabled
    case 5038:
      return EOPNOTSUPP;
    case 5012:
    case 5013:
    case 5014:
    case 5016:
    case 5017:
      return EFAULT;
    case 5019:
    case 5020:
    case 5022:
      return EINVAL;
    case 5025:
      return EACCES;
    case 5036:
      return ENOMEM;
    case 5001:
    case 5010:
    case 5029:
    case 5033:
      return ENODEV;
    default:
      return EIO;
  }
}

std::string Dlerror() {
  const char* e = dlerror();
  return e != nullptr ? e : "unknown dlopen error";
}

// Loads and opens one library; the returned driver lives for the process.
Result<std::unique_ptr<CuFileDriver>> Load(const std::string& library) {
  // RTLD_NODELETE: the driver stays usable even if something dlcloses it; we never do.
  void* lib = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
  if (lib == nullptr) return Status::NotFound("cuFile not available: " + Dlerror());
  auto d = std::make_unique<CuFileDriver>();
  d->library = library;
  Status missing;
  auto sym = [&](const char* name) -> void* {
    dlerror();
    void* p = dlsym(lib, name);
    if (p == nullptr && missing.ok()) {
      missing = Status::Unsupported(ENOSYS, "cuFile library '" + library + "' lacks " + name);
    }
    return p;
  };
  auto driver_open = reinterpret_cast<cufile_abi::DriverOpenFn>(sym("cuFileDriverOpen"));
  auto get_props =
      reinterpret_cast<cufile_abi::DriverGetPropertiesFn>(sym("cuFileDriverGetProperties"));
  d->handle_register = reinterpret_cast<cufile_abi::HandleRegisterFn>(sym("cuFileHandleRegister"));
  d->handle_deregister =
      reinterpret_cast<cufile_abi::HandleDeregisterFn>(sym("cuFileHandleDeregister"));
  d->buf_register = reinterpret_cast<cufile_abi::BufRegisterFn>(sym("cuFileBufRegister"));
  d->buf_deregister = reinterpret_cast<cufile_abi::BufDeregisterFn>(sym("cuFileBufDeregister"));
  d->read = reinterpret_cast<cufile_abi::ReadFn>(sym("cuFileRead"));
  d->write = reinterpret_cast<cufile_abi::WriteFn>(sym("cuFileWrite"));
  DNVME_RETURN_IF_ERROR(missing);
  // Optional: older libraries have no cuFileGetVersion.
  dlerror();
  auto get_version = reinterpret_cast<cufile_abi::GetVersionFn>(dlsym(lib, "cuFileGetVersion"));

  DNVME_RETURN_IF_ERROR(CuFileStatus(driver_open(), "cuFileDriverOpen"));
  if (get_version != nullptr) {
    int v = 0;
    if (get_version(&v).err == 0) d->version = v;
  }
  DNVME_RETURN_IF_ERROR(CuFileStatus(get_props(&d->props), "cuFileDriverGetProperties"));
  d->nvfs_loaded =
      d->props.nvfs.major_version > 0 || access("/proc/driver/nvidia-fs/version", R_OK) == 0;
  d->p2pdma = (d->props.nvfs.dstatusflags & (1u << cufile_abi::kNvmeP2pSupported)) != 0;
  Logger().info("cuFile: {} opened (version {}, nvidia-fs {}.{}{}, p2pdma {})", library, d->version,
                d->props.nvfs.major_version, d->props.nvfs.minor_version,
                d->nvfs_loaded ? "" : " (not loaded)", d->p2pdma ? "yes" : "no");
  return d;
}

}  // namespace

std::string CuFileErrorName(int err) {
  for (const NamedError& e : kErrors) {
    if (e.code == err) return std::string(e.name) + " (" + std::to_string(err) + ")";
  }
  return "cuFile error " + std::to_string(err);
}

Status CuFileStatus(cufile_abi::Error e, const std::string& context) {
  if (e.err == 0) return Status::Ok();
  std::string msg = context + ": " + CuFileErrorName(e.err);
  if (e.err == cufile_abi::kCudaDriverError) msg += ", CUresult " + std::to_string(e.cu_err);
  const int err = ErrnoFor(e.err);
  if (err == EOPNOTSUPP || err == ENODEV) return Status::Unsupported(err, msg);
  if (err == EINVAL) return Status::InvalidArgument(msg);
  return Status::IoError(err, msg);
}

Status CuFileIoStatus(ssize_t ret, int saved_errno, const std::string& context) {
  if (ret >= 0) return Status::Ok();
  if (ret == -1) return Status::FromErrno(saved_errno, context);
  const int code = static_cast<int>(-ret);
  if (code > cufile_abi::kBaseErr) return CuFileStatus({code, 0}, context);
  // Some versions return -errno.
  return Status::FromErrno(code, context);
}

Result<const CuFileDriver*> CuFileDriver::Get(const std::string& library) {
  static std::mutex mu;
  static std::map<std::string, Result<std::unique_ptr<CuFileDriver>>>* loaded =
      new std::map<std::string, Result<std::unique_ptr<CuFileDriver>>>();  // never destroyed
  std::lock_guard lock(mu);
  auto it = loaded->find(library);
  if (it == loaded->end()) {
    // cuFileDriverOpen initialises CUDA: not before the daemon has forked.
    DNVME_RETURN_IF_ERROR(CheckCudaInitAllowed());
    it = loaded->emplace(library, Load(library)).first;
  }
  if (!it->second.ok()) return it->second.status();
  return static_cast<const CuFileDriver*>(it->second.value().get());
}

}  // namespace dnvme::gpu
