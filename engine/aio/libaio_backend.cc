#include <string>

#include "dnvme/aio_backend.h"

namespace dnvme {
namespace {

// Owns one kernel AIO context. io_destroy blocks until every request still in flight has
// completed, so destroying the backend is always safe for the buffers those requests use.
class LibaioBackend final : public AioBackend {
 public:
  explicit LibaioBackend(io_context_t ctx) : ctx_(ctx) {}
  ~LibaioBackend() override { (void)io_destroy(ctx_); }

  int Submit(long nr, struct iocb** iocbs) override { return io_submit(ctx_, nr, iocbs); }
  int GetEvents(long min_nr, long nr, struct io_event* events, struct timespec* timeout) override {
    return io_getevents(ctx_, min_nr, nr, events, timeout);
  }

 private:
  io_context_t ctx_;
};

class LibaioFactory final : public AioBackendFactory {
 public:
  Result<std::unique_ptr<AioBackend>> Create(unsigned depth) override {
    io_context_t ctx = nullptr;
    int rc;
    do {
      rc = io_setup(static_cast<int>(depth), &ctx);  // libaio returns -errno
    } while (rc == -EINTR);
    if (rc == -EAGAIN) {
      return Status::ResourceExhausted(
          EAGAIN, "io_setup(" + std::to_string(depth) +
                      ") failed: the system-wide limit of AIO requests is reached; raise "
                      "/proc/sys/fs/aio-max-nr (sysctl fs.aio-max-nr) or lower queue_depth x "
                      "intra_op_parallelism");
    }
    if (rc < 0) return Status::FromErrno(-rc, "io_setup(" + std::to_string(depth) + ")");
    return std::unique_ptr<AioBackend>(new LibaioBackend(ctx));
  }
};

}  // namespace

std::shared_ptr<AioBackendFactory> LibaioBackendFactory() {
  static std::shared_ptr<AioBackendFactory> factory = std::make_shared<LibaioFactory>();
  return factory;
}

}  // namespace dnvme
