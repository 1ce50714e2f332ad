// Status to errno, at the library's edge (the interposers return -1 with errno set).
//
// Thread contract: a pure function.
#ifndef DNVME_PRELOAD_ERRORS_H_
#define DNVME_PRELOAD_ERRORS_H_

#include <cerrno>

#include "dnvme/status.h"

namespace dnvme::preload {

// The errno a failed call reports for `st`: its own, or EIO when it carries none.
inline int ErrnoOf(const Status& st) { return st.error_number() != 0 ? st.error_number() : EIO; }

}  // namespace dnvme::preload

#endif  // DNVME_PRELOAD_ERRORS_H_
