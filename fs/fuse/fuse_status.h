// The FUSE edge's one conversion of the daemon's Status into an errno for a reply: inside the
// daemon errors are Status/Result (with the errno they came from, when there was one); only a
// FUSE reply speaks errno.
//
// Thread safety: pure functions.
#pragma once

#include <cerrno>

#include "dnvme/status.h"

namespace dnvme::fs {

// 0 for OK; the Status's errno, or EIO when it carries none (an internal error is still an I/O
// error to the caller, never success).
inline int ErrnoOf(const Status& st) {
  if (st.ok()) return 0;
  return st.error_number() != 0 ? st.error_number() : EIO;
}

}  // namespace dnvme::fs
