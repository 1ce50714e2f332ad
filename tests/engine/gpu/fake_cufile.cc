// A stand-in for libcufile.so.0, for tests on machines without a GPU or GPUDirect Storage.
//
// It exports the entry points dnvme's loader resolves (engine/gpu/cufile.h), with the same C ABI,
// and moves bytes with pread/pwrite between the file and host memory that the tests treat as
// "device memory" (the host copy engine). It is loaded through dlopen exactly like the real
// library, so the loader, the mode detection, handle and buffer registration, the (base, offset)
// addressing, short transfers and error decoding all run for real. Knobs, read at each call:
//   FAKE_CUFILE_OPEN_ERROR=N   cuFileDriverOpen fails with CUfileOpError N
//   FAKE_CUFILE_MODE=gds|p2p|compat   what cuFileDriverGetProperties reports (default gds)
//   FAKE_CUFILE_FAIL_AT=OFF    a read/write whose range covers file offset OFF fails with
//                              -CU_FILE_IO_NOT_SUPPORTED (5008)
//   FAKE_CUFILE_SHORT=1        every read/write moves at most half of what was asked (>= 1 byte)
// Test-only introspection: fake_cufile_registered_buffers(), fake_cufile_last_call().
#include <fcntl.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include "engine/gpu/cufile.h"

namespace {

// The ABI as dnvme declares it (engine/gpu/cufile.h): the fake must match what the loader
// expects, and a real libcufile matches the same declarations.
using Error = dnvme::gpu::cufile_abi::Error;
using Descr = dnvme::gpu::cufile_abi::Descr;
using DrvProps = dnvme::gpu::cufile_abi::DrvProps;
struct FakeHandle {
  int fd;  // a buffered reopen of the caller's fd
};

std::mutex g_mu;
std::map<const void*, size_t> g_buffers;  // registered ranges
bool g_open = false;
const void* g_last_base = nullptr;
long g_last_offset = -1;

long EnvLong(const char* name, long fallback) {
  const char* v = getenv(name);
  return v != nullptr && *v != '\0' ? strtol(v, nullptr, 10) : fallback;
}

ssize_t Transfer(void* fh, char* base, size_t size, off_t file_offset, off_t buf_offset,
                 bool write) {
  if (fh == nullptr) return -5027;  // CU_FILE_HANDLE_NOT_REGISTERED
  {
    std::lock_guard lock(g_mu);
    g_last_base = base;
    g_last_offset = static_cast<long>(buf_offset);
  }
  const long fail_at = EnvLong("FAKE_CUFILE_FAIL_AT", -1);
  if (fail_at >= 0 && fail_at >= file_offset && fail_at < file_offset + static_cast<off_t>(size)) {
    return -5008;  // CU_FILE_IO_NOT_SUPPORTED
  }
  if (EnvLong("FAKE_CUFILE_SHORT", 0) != 0 && size > 1) size /= 2;
  const int fd = static_cast<FakeHandle*>(fh)->fd;
  ssize_t r;
  do {
    r = write ? pwrite(fd, base + buf_offset, size, file_offset)
              : pread(fd, base + buf_offset, size, file_offset);
  } while (r < 0 && errno == EINTR);
  return r;  // -1 with errno set, as cuFile does for system errors
}

}  // namespace

extern "C" {

Error cuFileDriverOpen() {
  const long err = EnvLong("FAKE_CUFILE_OPEN_ERROR", 0);
  if (err != 0) return {static_cast<int>(err), 0};
  g_open = true;
  return {0, 0};
}

Error cuFileGetVersion(int* version) {
  *version = 1234;
  return {0, 0};
}

Error cuFileDriverGetProperties(DrvProps* props) {
  if (!g_open) return {5001, 0};
  std::memset(props, 0, sizeof(*props));
  const char* mode = getenv("FAKE_CUFILE_MODE");
  const std::string m = mode != nullptr ? mode : "gds";
  if (m == "gds") {
    props->nvfs.major_version = 2;
    props->nvfs.minor_version = 17;
  } else if (m == "p2p") {
    props->nvfs.dstatusflags = 1u << 11;
  }
  return {0, 0};
}

Error cuFileHandleRegister(void** fh, Descr* descr) {
  if (descr == nullptr || descr->type != 1) return {5018, 0};  // CU_FILE_INVALID_FILE_TYPE
  const std::string proc = "/proc/self/fd/" + std::to_string(descr->handle.fd);
  const int flags = fcntl(descr->handle.fd, F_GETFL);
  if (flags < 0) return {5022, 0};  // CU_FILE_INVALID_VALUE
  const int fd = open(proc.c_str(), (flags & O_ACCMODE) | O_CLOEXEC);
  if (fd < 0) return {5022, 0};
  *fh = new FakeHandle{fd};
  return {0, 0};
}

void cuFileHandleDeregister(void* fh) {
  auto* h = static_cast<FakeHandle*>(fh);
  if (h == nullptr) return;
  close(h->fd);
  delete h;
}

Error cuFileBufRegister(const void* base, size_t length, int) {
  std::lock_guard lock(g_mu);
  if (g_buffers.count(base) != 0) return {5023, 0};  // CU_FILE_MEMORY_ALREADY_REGISTERED
  g_buffers[base] = length;
  return {0, 0};
}

Error cuFileBufDeregister(const void* base) {
  std::lock_guard lock(g_mu);
  if (g_buffers.erase(base) == 0) return {5024, 0};  // CU_FILE_MEMORY_NOT_REGISTERED
  return {0, 0};
}

ssize_t cuFileRead(void* fh, void* base, size_t size, off_t file_offset, off_t buf_offset) {
  return Transfer(fh, static_cast<char*>(base), size, file_offset, buf_offset, false);
}

ssize_t cuFileWrite(void* fh, const void* base, size_t size, off_t file_offset, off_t buf_offset) {
  return Transfer(fh, static_cast<char*>(const_cast<void*>(base)), size, file_offset, buf_offset,
                  true);
}

int fake_cufile_registered_buffers() {
  std::lock_guard lock(g_mu);
  return static_cast<int>(g_buffers.size());
}

void fake_cufile_last_call(const void** base, long* offset) {
  std::lock_guard lock(g_mu);
  *base = g_last_base;
  *offset = g_last_offset;
}

}  // extern "C"
