// The preload's side of the space its writes need (reserve.h).
#include "preload/reserve.h"

#include <fcntl.h>

#include <atomic>
#include <cerrno>

#include "dnvme/log.h"
#include "preload/libc.h"

namespace dnvme::preload {

Status BackingFallocate(int fd, int mode, int64_t off, int64_t len) {
  int rc;
  do {
    rc = Libc().fallocate(fd, mode, off, len);
  } while (rc != 0 && errno == EINTR);
  return rc == 0 ? Status::Ok() : Status::FromErrno(errno, "fallocate of the backing file");
}

void TrimReservation(AdoptedFile& f) {
  if (!f.file.valid() || !f.can_write) return;
  if (f.word->shared.load(std::memory_order_seq_cst) != 0) return;
  if (Status st = f.data.Trim(f.file.buffered_fd()); !st.ok()) {
    dnvme::Logger().debug("dnvme run: {}", st.ToString());
  }
}

Status TruncateAdopted(int fd, off_t len) {
  int rc;
  do {
    rc = Libc().ftruncate(fd, len);
  } while (rc != 0 && errno == EINTR);
  return rc == 0 ? Status::Ok() : Status::FromErrno(errno, "ftruncate");
}

Status FallocateBacking(AdoptedFile& f, int mode, off_t off, off_t len) {
  return BackingFallocate(f.file.buffered_fd(), mode, off, len);
}

}  // namespace dnvme::preload
