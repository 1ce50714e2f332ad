#include "fs/transport/request_pipe.h"

#include <fcntl.h>
#include <sys/uio.h>

#include <cerrno>
#include <cstdint>
#include <string>

namespace dnvme::fs {

Result<std::optional<size_t>> SpliceMessage(Pipe& pipe, int fd, const iovec* iov, int count) {
  constexpr uintptr_t kPage = 4096;
  size_t total = 0, slots = 0;
  for (int i = 0; i < count; ++i) {
    if (iov[i].iov_len == 0) continue;
    const auto base = reinterpret_cast<uintptr_t>(iov[i].iov_base);
    total += iov[i].iov_len;
    slots += (base + iov[i].iov_len + kPage - 1) / kPage - base / kPage;  // one per page touched
  }
  // A message that does not fit would block vmsplice on a pipe nobody reads.
  if (slots * kPage > static_cast<size_t>(pipe.capacity())) return std::optional<size_t>();
  ssize_t in;
  do {
    in = vmsplice(pipe.write_fd(), iov, static_cast<unsigned long>(count), SPLICE_F_NONBLOCK);
  } while (in < 0 && errno == EINTR);
  if (in != static_cast<ssize_t>(total)) {
    // Part of it (or nothing) is in the pipe: empty it so no stale page reference is sent.
    // One that cannot be emptied is retired when its lease returns it (PipePool::Return).
    if (in > 0 || pipe.Pending() != 0) (void)pipe.Discard();
    return std::optional<size_t>();
  }
  ssize_t out;
  do {
    out = splice(pipe.read_fd(), nullptr, fd, nullptr, total, 0);
  } while (out < 0 && errno == EINTR && pipe.Pending() == static_cast<int64_t>(total));
  if (out < 0) {
    const int err = errno;
    (void)pipe.Discard();  // whatever the device left in the pipe; the lease's return checks too
    return Status::FromErrno(err, "splice of a reply");
  }
  if (static_cast<size_t>(out) != total) {
    (void)pipe.Discard();
    return Status::FromErrno(EIO, "splice of a reply took " + std::to_string(out) + " of " +
                                      std::to_string(total) + " bytes");
  }
  return std::optional<size_t>(total);
}

}  // namespace dnvme::fs
