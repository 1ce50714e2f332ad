// The libaio seam: the only place the engine calls io_submit / io_getevents.
//
// Workers talk to an AioBackend, never to libaio directly, so tests can wrap the real backend and
// inject what real disks rarely do on demand: io_submit answering EAGAIN or EINTR or accepting only
// part of a batch, completions with a short byte count, completions with -EIO. (LevelDB's Env plays
// the same role for its fault-injection tests, and is public for the same reason.) It is public
// because HandleOptions::backend (dnvme/handle.h) takes a factory: the unit tests of the engine,
// of datapath/ and of fs/transport/ pass one; production code passes none (the real libaio).
//
// Thread contract: one AioBackend belongs to one worker thread and is only called from it. A
// factory may be called from several threads (one Create per worker at handle start-up).
#pragma once

#include <libaio.h>

#include <memory>

#include "dnvme/status.h"

namespace dnvme {

class AioBackend {
 public:
  virtual ~AioBackend() = default;
  // io_submit semantics: the number of requests accepted (possibly fewer than nr), or -errno.
  virtual int Submit(long nr, struct iocb** iocbs) = 0;
  // io_getevents semantics: events reaped (>= min_nr unless timeout or signal), or -errno.
  virtual int GetEvents(long min_nr, long nr, struct io_event* events,
                        struct timespec* timeout) = 0;
};

class AioBackendFactory {
 public:
  virtual ~AioBackendFactory() = default;
  // A backend able to hold `depth` requests in flight.
  virtual Result<std::unique_ptr<AioBackend>> Create(unsigned depth) = 0;
};

// The real thing: one io_setup context per backend, io_destroy on destruction (which waits for any
// request still in flight, so buffers are never freed under the kernel).
std::shared_ptr<AioBackendFactory> LibaioBackendFactory();

}  // namespace dnvme
