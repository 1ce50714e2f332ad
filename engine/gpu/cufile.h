// cuFile (GPUDirect Storage), loaded at run time.
//
// Our own declarations of the parts of libcufile's C ABI that dnvme calls, written from NVIDIA's
// cuFile API reference (no NVIDIA header is used or committed): the error struct, the file
// descriptor description, the driver properties, and nine entry points. The library is opened
// with dlopen, so a build never depends on it and a machine without it gets a clear reason.
//
// cuFile's driver is process-wide: cuFileDriverOpen is called once per library (the first
// CuFileDriver::Get for it) and the driver stays open for the life of the process (closing it
// while another handle still uses it would break that handle; the process exit closes it).
//
// Thread safety: CuFileDriver::Get is thread-safe; the returned driver is immutable and its entry
// points are thread-safe (cuFile's own contract).
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "dnvme/status.h"

namespace dnvme::gpu {

// --- the ABI ----------------------------------------------------------------------------------
namespace cufile_abi {

// CUfileOpError: 0 success, 5001.. errors (CUFILEOP_BASE_ERR = 5000).
constexpr int kBaseErr = 5000;
constexpr int kCudaDriverError = 5011;  // CU_FILE_CUDA_DRIVER_ERROR: cu_err holds the CUresult

struct Error {  // CUfileError_t
  int err;      // CUfileOpError
  int cu_err;   // CUresult
};

constexpr int kHandleTypeOpaqueFd = 1;  // CU_FILE_HANDLE_TYPE_OPAQUE_FD

struct Descr {  // CUfileDescr_t
  int type;
  union {
    int fd;
    void* handle;
  } handle;
  const void* fs_ops;
};

struct DrvProps {  // CUfileDrvProps_t
  struct {
    unsigned int major_version;
    unsigned int minor_version;
    size_t poll_thresh_size;
    size_t max_direct_io_size;
    unsigned int dstatusflags;
    unsigned int dcontrolflags;
  } nvfs;
  unsigned int fflags;
  unsigned int max_device_cache_size;
  unsigned int per_buffer_cache_size;
  unsigned int max_device_pinned_mem_size;
  unsigned int max_batch_io_size;
  unsigned int max_batch_io_timeout_msecs;
};

// Bit numbers in DrvProps::nvfs.dstatusflags (CUfileDriverStatusFlags).
constexpr unsigned kNvmeSupported = 4;      // CU_FILE_NVME_SUPPORTED
constexpr unsigned kNvmeP2pSupported = 11;  // CU_FILE_NVME_P2P_SUPPORTED

using DriverOpenFn = Error (*)();
using DriverGetPropertiesFn = Error (*)(DrvProps*);
using HandleRegisterFn = Error (*)(void** handle, Descr* descr);
using HandleDeregisterFn = void (*)(void* handle);
using BufRegisterFn = Error (*)(const void* base, size_t length, int flags);
using BufDeregisterFn = Error (*)(const void* base);
using ReadFn = ssize_t (*)(void* handle, void* base, size_t size, off_t file_offset,
                           off_t buf_offset);
using WriteFn = ssize_t (*)(void* handle, const void* base, size_t size, off_t file_offset,
                            off_t buf_offset);
using GetVersionFn = Error (*)(int* version);

}  // namespace cufile_abi

// "CU_FILE_IO_NOT_SUPPORTED (5008)" for a CUfileOpError value; "cuFile error N" when unknown.
std::string CuFileErrorName(int err);
// A Status for a failed cuFile call: the error's name (and the CUresult for driver errors).
// Success (err 0) gives OK.
Status CuFileStatus(cufile_abi::Error e, const std::string& context);
// A Status for a negative cuFileRead/cuFileWrite result: -1 means errno is set; other negative
// values are -CUfileOpError.
Status CuFileIoStatus(ssize_t ret, int saved_errno, const std::string& context);

struct CuFileDriver {
  std::string library;  // as given to dlopen
  int version = 0;      // cuFileGetVersion, 0 when the library lacks it
  cufile_abi::DrvProps props{};
  bool nvfs_loaded = false;  // nvidia-fs reported (major version > 0) or /proc/driver/nvidia-fs
  bool p2pdma = false;       // the driver reports NVMe P2PDMA support

  cufile_abi::HandleRegisterFn handle_register = nullptr;
  cufile_abi::HandleDeregisterFn handle_deregister = nullptr;
  cufile_abi::BufRegisterFn buf_register = nullptr;
  cufile_abi::BufDeregisterFn buf_deregister = nullptr;
  cufile_abi::ReadFn read = nullptr;
  cufile_abi::WriteFn write = nullptr;

  // Loads `library` and opens the driver, once per library name for the process; a failure is
  // remembered and returned again (the reason: dlerror's text, a missing symbol, or the decoded
  // cuFileDriverOpen error).
  static Result<const CuFileDriver*> Get(const std::string& library);
};

}  // namespace dnvme::gpu
