// Client of a dnvmefs mount's control file `<mount>/.dnvme/ctl` (docs/control-protocol.md).
//
// A CtlClient is one ctl session: handles and registered buffers it creates belong to it and are
// released by the daemon when it is destroyed (the file is closed). Transfers move bytes between
// the client's shared memory (a SharedBuffer, or any /dev/shm object) and files of the mount
// through the daemon's engine, without the FUSE data copies.
//
// Errors: an answer with "ok": false becomes a Status whose error_number() is the answer's errno
// (EACCES, EBADF, EINVAL, ...) and whose message is "<op>: <the daemon's message>"; an answer
// that breaks the protocol (not JSON, a field missing, a size other than asked) is EPROTO.
//
// This is the one client of the protocol: the dnvme tool's `ctl` and the Python package's
// deepnvme.Mount (python/ctl_client.cc) both go through it.
//
// Thread contract: a CtlClient is used by one thread at a time (the session answers one request
// at a time; a second thread's request would take the first one's answer). Use one client per
// thread for parallel requests. SharedBuffer is a plain owned mapping: not synchronised.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dnvme/config.h"
#include "dnvme/status.h"

namespace dnvme {

// Shared memory to register with the daemon: a new /dev/shm object (mode 0600, unique name)
// mapped read-write here. Moves; unmaps, closes and unlinks on destruction (a registered buffer
// stays mapped in the daemon until unregistered). /dev/shm rather than a memfd because the kernel
// lets the daemon, which runs with few capabilities, open /proc/PID/fd/N only of processes that
// hold no more capabilities than it does; a root client with a full set would be refused.
class SharedBuffer {
 public:
  static Result<SharedBuffer> Create(size_t size, const std::string& name = "dnvme-client");
  SharedBuffer() = default;
  SharedBuffer(SharedBuffer&& o) noexcept { *this = std::move(o); }
  SharedBuffer& operator=(SharedBuffer&& o) noexcept;
  ~SharedBuffer();

  char* data() const { return data_; }
  size_t size() const { return size_; }
  // What buffer.register's "source" names: /dev/shm/<name>.
  std::string source() const;

 private:
  int fd_ = -1;
  char* data_ = nullptr;
  size_t size_ = 0;
  std::string name_;  // in /dev/shm
};

// What buffer.register answered for lent CUDA memory.
struct CtlBuffer {
  int64_t buffer = 0;     // the id transfers name
  int64_t size = 0;       // bytes registered
  bool writable = false;  // false: the daemon refuses a pread into it (EACCES)
};

// The outcome of one asynchronous transfer, from wait.
struct CtlOpOutcome {
  uint64_t op_id = 0;
  bool write = false;
  std::string path;
  int64_t file_offset = 0;
  int64_t length = 0;
  int64_t bytes = 0;
  Status status;
};

class CtlClient {
 public:
  // Opens MOUNTPOINT/.dnvme/ctl (ENOENT, saying "not a dnvmefs mount", when there is none).
  static Result<CtlClient> Open(const std::string& mountpoint);
  // Takes FD as the session and closes it on destruction: a ctl file opened elsewhere (passed
  // over a socket, say) or, in tests, a SOCK_SEQPACKET socket whose peer stands in for the
  // daemon by ending each answer with an empty message (where the file's read returns 0).
  static CtlClient Adopt(int fd);
  CtlClient() = default;
  CtlClient(CtlClient&& o) noexcept { *this = std::move(o); }
  CtlClient& operator=(CtlClient&& o) noexcept;
  ~CtlClient();

  // One raw request (a JSON object) and its answer's JSON text; ok=false answers become errors.
  Result<std::string> Call(const std::string& request_json);

  // The protocol this client speaks (hello's "protocol").
  static constexpr int kProtocol = 1;
  // The hello answer (JSON: protocol, version, mountpoint, limits); EPROTO when the daemon
  // speaks another protocol.
  Result<std::string> Hello();

  Result<HandleConfig> ConfigGet();
  // Applies a JSON object of HandleConfig keys to the mount's live configuration.
  Result<HandleConfig> ConfigSet(const std::string& config_json);
  Result<std::string> Stats();  // the stats document (JSON)

  // handle.open with these parameters; returns the handle id.
  Result<int64_t> OpenHandle(const HandleConfig& config);
  // handle.open with a JSON object of HandleConfig keys; the daemon takes the keys it does not
  // name from the mount's live configuration ("{}": the live configuration as it is).
  Result<int64_t> OpenHandle(const std::string& config_json);
  // Returns how many asynchronous outcomes were never collected by Wait (the daemon waited for
  // those transfers before closing).
  Result<int64_t> CloseHandle(int64_t handle);
  // buffer.register of /dev/shm/NAME (`shm`) or /proc/PID/fd/N (`source`), whole object or a
  // page-aligned part of it; returns the buffer id.
  Result<int64_t> RegisterShm(const std::string& shm_name, int64_t offset = 0, int64_t size = 0);
  Result<int64_t> RegisterSource(const std::string& source, int64_t offset = 0, int64_t size = 0);
  Result<int64_t> Register(const SharedBuffer& buffer) { return RegisterSource(buffer.source()); }
  // buffer.register of CUDA memory lent through CUDA IPC: IPC_HANDLE_HEX is the allocation's
  // cudaIpcMemHandle_t in hex (128 digits), OFFSET the memory's offset in the allocation, SIZE
  // its bytes (above 0), DEVICE the CUDA device the daemon opens it on. EPROTO when the daemon
  // registered another size than asked.
  Result<CtlBuffer> RegisterCudaIpc(const std::string& ipc_handle_hex, int device, int64_t offset,
                                    int64_t size);
  Status Unregister(int64_t buffer);

  // Synchronous transfers return the bytes moved; asynchronous ones the op id (see Wait).
  // `path` is relative to the mount root, or absolute inside the mount.
  Result<int64_t> Pread(int64_t handle, int64_t buffer, int64_t buffer_offset, int64_t length,
                        const std::string& path, int64_t file_offset, bool async = false);
  Result<int64_t> Pwrite(int64_t handle, int64_t buffer, int64_t buffer_offset, int64_t length,
                         const std::string& path, int64_t file_offset, bool async = false);
  // Waits for every asynchronous transfer of `handle` and returns their outcomes.
  Result<std::vector<CtlOpOutcome>> Wait(int64_t handle);
  Status Fsync(const std::string& path);

 private:
  // One exchange: REQUEST out in one write(), the whole answer's text back (I/O errors only; the
  // answer is judged by the caller).
  Result<std::string> Send(const std::string& request);
  Result<int64_t> Transfer(const char* op, int64_t handle, int64_t buffer, int64_t buffer_offset,
                           int64_t length, const std::string& path, int64_t file_offset,
                           bool async);
  // buffer.register naming the object by `key` ("shm" or "source").
  Result<int64_t> RegisterAs(const char* key, const std::string& name, int64_t offset,
                             int64_t size);
  int fd_ = -1;
};

}  // namespace dnvme
