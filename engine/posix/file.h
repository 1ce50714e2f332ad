// POSIX plumbing for the engine: a file opened the way the engine needs it (the owning fd and the
// lease-safe reopen it is built on are public: include/dnvme/fd.h).
//
// An IoFile holds up to three descriptors of one file: an O_DIRECT one for the aligned body of an
// operation, a buffered one for unaligned edges (and for the whole operation when O_DIRECT is
// refused), and, when validate is asked for, a read-only one for reading the data back. It also
// records the direct-I/O alignment of the file (statx STATX_DIOALIGN, else the device's logical
// block size from sysfs, else 4096).
//
// Thread contract: an IoFile is immutable after Open/Adopt and shared (shared_ptr) by the workers
// that run slices of one operation; pread/pwrite on its fds from several threads is safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "dnvme/config.h"
#include "dnvme/fd.h"
#include "dnvme/handle.h"
#include "dnvme/identity.h"
#include "dnvme/status.h"

namespace dnvme {

struct IoFile {
  std::string label;  // the path, or "fd:N"
  bool can_read = false;
  bool can_write = false;
  int direct_fd = -1;         // -1 when direct I/O is not used for this file
  int buffered_fd = -1;       // always valid
  int read_fd = -1;           // for validate; -1 unless asked for
  uint32_t mem_align = 0;     // required buffer alignment for direct requests
  uint32_t offset_align = 0;  // required offset/length alignment reported by the kernel
  // Granularity of the direct part of an operation: max(offset_align, page size). Keeping every
  // partially covered page on the buffered path means a page is never written both through the
  // page cache and around it at once.
  uint32_t edge_align = 4096;
  bool fell_back = false;  // O_DIRECT was refused and policy allowed the buffered path
  // Whose identity the engine's threads take before they write this file (null: their own).
  std::shared_ptr<const FsIdentity> write_as;

  UniqueFd owned_direct, owned_buffered, owned_read;
};

// Opens `path` for `access` (writing implies O_CREAT, mode 0644 before umask; never O_TRUNC)
// following `policy`. O_DIRECT refused (EINVAL at open, or statx says the file has no direct-I/O
// support) is a fallback under kAuto and Status::Unsupported under kRequired.
Result<std::shared_ptr<IoFile>> OpenIoFile(const std::string& path, FileAccess access,
                                           DirectPolicy policy, bool want_read_fd);

// The same for a caller's fd: the fd is reopened through /proc/self/fd (new open file descriptions,
// so the caller's flags such as O_APPEND or its lack of O_DIRECT do not matter); the caller keeps
// ownership of `fd` and must keep it open until the operation completes. The reopens never wait
// for a file lease on the file (ReopenNoWait).
Result<std::shared_ptr<IoFile>> AdoptIoFd(int fd, FileAccess access, DirectPolicy policy,
                                          bool want_read_fd);

// The same for descriptors opened elsewhere (the preload library gets them from the daemon, which
// opened them as the caller): takes ownership of both. `direct` may be invalid (O_DIRECT refused);
// `buffered` must be valid and open for `access`.
Result<std::shared_ptr<IoFile>> AdoptIoFds(UniqueFd direct, UniqueFd buffered, FileAccess access,
                                           DirectPolicy policy, const std::string& label);

// Buffered, complete transfer with EINTR retried and short transfers continued. A read that hits
// end of file returns kEndOfFile; `done` receives the bytes moved either way.
Status PreadFull(int fd, char* buf, int64_t len, int64_t offset, const std::string& label,
                 int64_t* done);
Status PwriteFull(int fd, const char* buf, int64_t len, int64_t offset, const std::string& label,
                  int64_t* done);

// "read past end of file ..." with the file's current size when it can be had.
Status EndOfFileStatus(int fd, const std::string& label, int64_t offset, int64_t len);

}  // namespace dnvme
