// Client shared memory mapped into the daemon for control-file transfers (buffer.register).
//
// The danger of mapping another process's memory: if the client shrinks the object (ftruncate of a
// /dev/shm file, or of a memfd without F_SEAL_SHRINK) the daemon's next touch of the lost pages
// raises SIGBUS and would kill the daemon and every mount user. Two defences:
//   - memfds that allow sealing get F_SEAL_SHRINK at registration, so they cannot shrink at all;
//   - every mapping is listed in a fixed, lock-free table read by a SIGBUS handler. A fault inside
//     a listed mapping is repaired by mapping anonymous zero pages over the lost range (the same
//     thing Wayland compositors do for client shm pools; the whole mapping when the pages alone
//     cannot be replaced) and marking the mapping revoked; the transfer then completes harmlessly
//     and is reported as failed (EFAULT). A fault in a listed mapping never kills the daemon; a
//     fault anywhere else is re-raised with the default action: a real bug still crashes with a
//     core.
// hugetlbfs objects (MFD_HUGETLB) are refused: they cannot be sealed, 4 KiB zero pages cannot
// patch a huge page mapping, and their faults raise SIGBUS whenever the huge page pool is empty.
// Kernel-side accesses (O_DIRECT requests, pread/pwrite into the mapping) fail with EFAULT on
// their own and never raise a signal.
//
// Thread safety: ClientMapping is immutable after Map() except for the revoked flag, which the
// signal handler sets and any thread may read. The table is updated with atomics only.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>

#include "dnvme/status.h"

namespace dnvme::fs {

class ClientMapping {
 public:
  // Maps [offset, offset + size) of the open object `fd` (size 0: to the end of the object).
  // `writable` maps it read-write (a pread target) as well as readable. `for_root`: the mapping
  // may take one of the slots kept for root. Installs the SIGBUS handler on first use. The fd
  // may be closed afterwards. Only tmpfs objects (EINVAL for anything else, hugetlbfs included).
  // The pages are faulted in at once (MADV_POPULATE) only when the registered range has no hole
  // (SEEK_HOLE): populating a hole would allocate it in the daemon, on the daemon's account, for
  // a client that may never touch it (and a transfer over a hole is refused: CheckAllocated).
  static Result<std::unique_ptr<ClientMapping>> Map(int fd, int64_t offset, int64_t size,
                                                    bool writable, const std::string& label,
                                                    bool for_root);
  ~ClientMapping();
  ClientMapping(const ClientMapping&) = delete;
  ClientMapping& operator=(const ClientMapping&) = delete;

  char* data() const { return base_; }
  int64_t size() const { return size_; }
  bool writable() const { return writable_; }
  bool sealed() const { return sealed_; }
  const std::string& label() const { return label_; }
  // True once the owner shrank the object under us and the SIGBUS handler patched the mapping.
  bool revoked() const;
  // Ok when every page of [offset, offset + length) of the buffer is allocated in the client's
  // object (mincore: resident); EFAULT naming the first page that is not (a hole the client left
  // or punched, a page swapped out, or one only fallocated: shmem leaves those not up to date,
  // which mincore reports as absent). A transfer checks first: the daemon faulting a hole in
  // would allocate it on the daemon's own memory account, and the client could keep those pages
  // after unregistering, again and again. A hole punched after the check is filled only where the
  // transfer lands (bounded by its length).
  Status CheckAllocated(int64_t offset, int64_t length) const;

  // Tests only: the SIGBUS handler's first repair (zero pages from the faulting page on) fails,
  // as it does at vm.max_map_count, so the fallback over the whole mapping is what runs.
  static void FailPageRepairForTesting(bool fail);

  // How many mappings the daemon-wide table holds, and how many of them only root may take: the
  // per-uid limit (ctl_max_buffers) keeps one user from most of the table, and the reserve
  // keeps every user together from root's (docs/security.md).
  static constexpr int kMaxMappings = 16384;
  static constexpr int kRootReserve = 1024;

 private:
  ClientMapping() = default;
  char* base_ = nullptr;
  int64_t size_ = 0;  // bytes the client asked for
  size_t map_len_ = 0;
  bool writable_ = false;
  bool sealed_ = false;
  int slot_ = -1;
  std::string label_;
};

}  // namespace dnvme::fs
