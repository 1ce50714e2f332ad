// The pipes of the FUSE transport: how large a pipe one request needs, and sending a reply through
// a pipe with no copy in user space. The pipes themselves (Pipe, PipePool) are the data path's
// (datapath/pipe.h): write-behind holds spliced extents in them too.
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <optional>

#include "datapath/pipe.h"
#include "dnvme/status.h"

namespace dnvme::fs {

using datapath::Pipe;
using datapath::PipePool;

// Bytes a pipe must hold for one FUSE request of up to `max_request` bytes of data: with its
// headers it can span max_request / 4 KiB + 2 pages, and a pipe has a power of two of slots
// (1 MiB: 258 pages, so 512 slots, 2 MiB).
constexpr int64_t RequestPipeBytes(int64_t max_request) {
  int64_t pages = max_request / 4096 + 2;
  int64_t slots = 1;
  while (slots < pages) slots *= 2;
  return slots * 4096;
}
// Sends one message (a FUSE reply: header, then data) to `fd` without copying its bytes in user
// space: vmsplice(2) puts references to the caller's pages into `pipe` (empty), and one splice(2)
// hands them to `fd`, which must take a message whole from one call, as /dev/fuse does. The
// kernel copies the pages out before splice returns (no SPLICE_F_MOVE or GIFT), so the caller's
// memory is free again on return. Result:
//   - a value: the bytes sent (all of them);
//   - nullopt: nothing was sent and the pipe is empty again, because the message spans more
//     pages than the pipe has slots or vmsplice took only part of it: send it another way;
//   - an error: splice to `fd` failed (its errno); the message was not delivered.
Result<std::optional<size_t>> SpliceMessage(Pipe& pipe, int fd, const struct iovec* iov, int count);

// For the default 1 MiB requests.
inline constexpr int64_t kRequestPipeBytes = RequestPipeBytes(int64_t{1} << 20);
static_assert(kRequestPipeBytes == int64_t{2} << 20);

}  // namespace dnvme::fs
