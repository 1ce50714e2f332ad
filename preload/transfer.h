// Direct transfers of adopted files: what a large read or write (and fallocate) of an adopted
// descriptor does instead of going through the mount.
//
// A transfer first settles coherence with the mount (the lease word's mount_dirty: drain the
// mount's write-behind; an earlier write-behind error is this call's), then reads through the
// read-ahead or writes behind (staging.h), reserving space for a write that extends the file
// (reserve.h), and finally notes or announces what it wrote (lease.h).
//
// Thread contract: every function is thread-safe (lock order: adopted_file.h). The transfers'
// failures return -1 with errno set, as the read or write they stand for; FallocateAdopted returns
// a Status (the interposed fallocate turns it into errno).
#ifndef DNVME_PRELOAD_TRANSFER_H_
#define DNVME_PRELOAD_TRANSFER_H_

#include <sys/types.h>
#include <sys/uio.h>

#include <memory>

#include "dnvme/status.h"
#include "preload/adopted_file.h"

namespace dnvme::preload {

// Transfer of [buf, buf + n) at `off`; returns the bytes moved or the error. Reads stop at end of
// file.
Result<int64_t> DirectIo(const std::shared_ptr<AdoptedFile>& f, bool write, void* buf, size_t n,
                         off_t off);

// Vectored: one direct transfer per element, in order, from `off`; stops at the first short one.
// An error after some bytes moved returns those bytes (a write's error is kept for the next call).
Result<int64_t> DirectVec(const std::shared_ptr<AdoptedFile>& f, bool write, const iovec* iov,
                          int cnt, off_t off);
// The same at `fd`'s file offset, which it advances (readv/writev).
Result<int64_t> DirectVecAtOffset(int fd, const std::shared_ptr<AdoptedFile>& f, bool write,
                                  const iovec* iov, int cnt);

// The bytes of an iovec array.
size_t IovBytes(const iovec* iov, int cnt);

// fallocate(2) of an adopted file, in any mode, on the backing file: this process's writes land
// first, the mount's write-behind is drained into the file, and the change is announced at once.
// EBADF for a file not open for writing, ENOTCONN once the daemon is gone.
Status FallocateAdopted(const std::shared_ptr<AdoptedFile>& f, int mode, off_t off, off_t len);

}  // namespace dnvme::preload

#endif  // DNVME_PRELOAD_TRANSFER_H_
