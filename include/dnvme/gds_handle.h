// GdsHandle: DeepNVMe's gds_handle. The AioHandle API, for buffers in GPU memory (host buffers
// are accepted too and go straight to the libaio engine).
//
// Two data paths, chosen once when the handle is created and reported by mode():
//   - cuFile (GPUDirect Storage). libcufile.so.0 is loaded at run time with dlopen (no build or
//     link dependency; our own declarations of its ABI in engine/gpu/cufile.h). Each operation is
//     cut into intra_op_parallelism slices run on the handle's threads, each a loop of
//     cuFileRead/cuFileWrite calls of at most block_size bytes with the file offset and the
//     offset inside the buffer (a buffer registered by pin_device_buffer is passed as its base
//     plus an offset, so cuFile uses the registration). Every cuFile error becomes a Status that
//     names it (CU_FILE_IO_NOT_SUPPORTED, ...). Modes: kGds (nvidia-fs loaded), kP2pDma (the
//     driver reports NVMe P2PDMA support, no nvidia-fs), kCompat (cuFile's own POSIX fallback:
//     only when GdsOptions::cufile_compat asks for it).
//   - kBounce: without cuFile, without nvidia-fs/P2PDMA, or when asked. Device memory moves
//     through pinned host staging buffers (cudaHostAlloc) in chunks, double-buffered so that
//     cudaMemcpyAsync of one chunk overlaps the parallel O_DIRECT libaio I/O of the other; the
//     libaio side is an AioHandle with this handle's HandleConfig (unaligned tails and all).
//     cuFile's compat mode does the same with one thread; ours keeps the engine's parallelism,
//     which is why compat is not the default fallback.
//
// Errors are reported, never asserted, as in AioHandle: OpResult carries the path, the failing
// offset and the cuFile/CUDA/errno reason.
//
// Thread contract: as AioHandle, a GdsHandle is driven by one thread at a time (submission, wait,
// fsync, pin/unpin), except submit_pread/submit_pwrite and the fd-based sync calls, which are
// thread-safe (the mount's control file uses them from several FUSE threads). Operations run on
// the handle's own threads, one operation at a time in submission order, each internally
// parallel. Buffers must stay valid until the operation completes. Destroying the handle waits
// for pending operations, then deregisters every buffer still pinned through it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dnvme/config.h"
#include "dnvme/gpu.h"
#include "dnvme/handle.h"
#include "dnvme/identity.h"
#include "dnvme/status.h"

namespace dnvme {

enum class GdsMode { kGds, kP2pDma, kCompat, kBounce };
const char* GdsModeName(GdsMode mode);  // "gds", "p2pdma", "compat", "bounce"

// Whether to use cuFile at all.
enum class CuFilePolicy {
  kAuto,     // cuFile when it loads and runs in GDS or P2PDMA mode, else the bounce path
  kRequire,  // cuFile in GDS or P2PDMA mode (or compat, if cufile_compat), else Create fails
  kNever,    // always the bounce path
};
const char* CuFilePolicyName(CuFilePolicy policy);
Result<CuFilePolicy> ParseCuFilePolicy(std::string_view name);

namespace gpu {
class CopyEngine;         // engine/gpu/copy_engine.h: how the bounce path copies
class CopyEngineFactory;  // tests inject a host-memory copy engine through it
}  // namespace gpu

// What loading cuFile the way a GdsHandle does (dlopen, then cuFileDriverOpen; once per library
// name per process) found: for `dnvme report`.
struct CuFileProbe {
  std::string library;  // as given to dlopen
  bool found = false;   // dlopen succeeded (the driver may still have refused to open)
  bool loaded = false;  // the driver opened: GdsHandle can use it
  std::string error;    // why not, when !loaded (dlerror, a missing symbol, the driver's error)
  int version = 0;      // cuFileGetVersion, 0 when unknown
  bool nvfs_loaded = false;
  int nvfs_major = 0, nvfs_minor = 0;  // nvidia-fs driver version the driver reports (0: none)
  bool p2pdma = false;                 // the driver reports NVMe P2PDMA support
};
CuFileProbe ProbeCuFile(const std::string& library);

struct GdsOptions {
  CuFilePolicy cufile = CuFilePolicy::kAuto;
  // Use cuFile even when it only offers compat mode (no nvidia-fs, no P2PDMA).
  bool cufile_compat = false;
  // The library dlopen'ed for cuFile (a path, or a name searched like any dlopen name).
  std::string cufile_library = "libcufile.so.0";
  // The CUDA device the handle's staging buffers and streams belong to.
  int device = 0;
  // Bounce path: bytes per chunk (a multiple of 4096; 0 = block_size * queue_depth, at most
  // 64 MiB and at least 4 MiB) and chunks in flight (2 = double buffering; 2..8).
  int64_t bounce_chunk_bytes = 0;
  int bounce_slots = 2;
  // Null means the CUDA runtime. Tests pass a factory whose "device memory" is host memory, so
  // the pipeline, the cuFile bookkeeping and the error paths run without a GPU.
  std::shared_ptr<gpu::CopyEngineFactory> copy_engine;
  // A root process writing for a user (the daemon's control file): writes to descriptors go to
  // the kernel under this identity (include/dnvme/identity.h), as AioHandle::adopt_fd's.
  std::shared_ptr<const FsIdentity> write_as;
};

struct GdsStats {
  uint64_t ops_read = 0, ops_written = 0, ops_failed = 0;
  uint64_t bytes_read = 0, bytes_written = 0;
  uint64_t bytes_cufile = 0;  // moved by cuFileRead/cuFileWrite
  uint64_t bytes_bounce = 0;  // moved through the staging buffers
  uint64_t bytes_host = 0;    // host buffers handed to the libaio engine directly
  uint64_t cufile_calls = 0;
  uint64_t copies = 0;          // host<->device copies issued by the bounce path
  uint64_t buffers_pinned = 0;  // registered now (gauge)
  HandleStats engine;           // the libaio engine under the bounce path and host buffers
  std::string ToJson() const;
};

class GdsHandle {
 public:
  static Result<std::unique_ptr<GdsHandle>> Create(const HandleConfig& config = {},
                                                   GdsOptions options = {});
  ~GdsHandle();
  GdsHandle(const GdsHandle&) = delete;
  GdsHandle& operator=(const GdsHandle&) = delete;

  const HandleConfig& config() const;
  int64_t get_block_size() const { return config().block_size; }
  int get_queue_depth() const { return config().queue_depth; }
  bool get_single_submit() const { return config().single_submit; }
  bool get_overlap_events() const { return config().overlap_events; }
  int get_intra_op_parallelism() const { return config().intra_op_parallelism; }

  GdsMode mode() const;
  // Why this mode: e.g. "libcufile.so.0: cannot open shared object file" or "cuFile driver
  // open: CU_FILE_DRIVER_NOT_INITIALIZED (5001)" or "nvidia-fs 2.17 loaded".
  const std::string& mode_reason() const;

  // Same contracts as AioHandle's (see dnvme/handle.h). `buffer` may be device or host memory.
  Status sync_pread(void* buffer, int64_t num_bytes, const std::string& path,
                    int64_t file_offset = 0);
  Status sync_pwrite(const void* buffer, int64_t num_bytes, const std::string& path,
                     int64_t file_offset = 0);
  Result<OpId> async_pread(void* buffer, int64_t num_bytes, const std::string& path,
                           int64_t file_offset = 0);
  Result<OpId> async_pwrite(const void* buffer, int64_t num_bytes, const std::string& path,
                            int64_t file_offset = 0);
  Status pread(void* buffer, int64_t num_bytes, const std::string& path, bool validate,
               bool async_op, int64_t file_offset = 0);
  Status pwrite(const void* buffer, int64_t num_bytes, const std::string& path, bool validate,
                bool async_op, int64_t file_offset = 0);
  // The same on a caller's open fd (DeepSpeed's async_pwrite(buffer, fd, file_offset)).
  Status pread(void* buffer, int64_t num_bytes, int fd, bool validate, bool async_op,
               int64_t file_offset = 0);
  Status pwrite(const void* buffer, int64_t num_bytes, int fd, bool validate, bool async_op,
                int64_t file_offset = 0);
  int wait();
  const std::vector<OpResult>& completed() const;
  int pending() const;
  Status fsync(const std::string& path);

  // On a caller's open fd (reopened through /proc/self/fd, so the caller may close it): the
  // synchronous forms and a completion-callback form (error return: nothing queued, `done` not
  // called). Thread-safe.
  Status sync_pread(void* buffer, int64_t num_bytes, int fd, int64_t file_offset);
  Status sync_pwrite(const void* buffer, int64_t num_bytes, int fd, int64_t file_offset);
  Status submit_pread(void* buffer, int64_t num_bytes, int fd, int64_t file_offset,
                      Completion done);
  Status submit_pwrite(const void* buffer, int64_t num_bytes, int fd, int64_t file_offset,
                       Completion done);

  // cuFileBufRegister / cuFileBufDeregister of a device range (DeepSpeed's pin_device_tensor).
  // In bounce mode the range is only recorded: there is nothing to register.
  Status pin_device_buffer(void* buffer, int64_t num_bytes);
  Status unpin_device_buffer(void* buffer);
  // Device memory on options.device, zeroed and pinned; freeing (or destroying) the
  // DeviceBuffer unpins it first, so it may outlive this handle.
  Result<gpu::DeviceBuffer> new_pinned_device_buffer(int64_t num_bytes);
  Status free_pinned_device_buffer(gpu::DeviceBuffer buffer);

  GdsStats stats() const;

 private:
  class Impl;
  explicit GdsHandle(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace dnvme
