// CreateTransport, and the kLibfuse transport: libfuse's own multi-threaded loop.
#include "fs/transport/transport.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "dnvme/log.h"
#include "fs/transport/session_loop.h"
#include "fs/transport/splice_loop.h"
#include "fs/transport/uring_loop.h"

namespace dnvme::fs {
namespace {

// libfuse's fuse_session_loop_mt with one /dev/fuse fd per thread (-o clone_fd=1). Its buffers
// are libfuse's: write-behind cannot adopt a payload, requests are never spliced, and libfuse
// 3.14 does not pass fuse_write_in::write_flags on, so a write's set-uid clearing falls back to
// "unprivileged unless root" (fs/fuse/ops_common.cc).
class LibfuseTransport final : public Transport {
 public:
  LibfuseTransport(fuse_session* se, int max_threads) : se_(se), max_threads_(max_threads) {}
  int Run() override {
    fuse_loop_config* cfg = fuse_loop_cfg_create();
    if (cfg == nullptr) return -ENOMEM;
    fuse_loop_cfg_set_clone_fd(cfg, 1);
    fuse_loop_cfg_set_idle_threads(cfg, 16);
    fuse_loop_cfg_set_max_threads(cfg, static_cast<unsigned>(max_threads_));
    const int rc = fuse_session_loop_mt(se_, cfg);
    fuse_loop_cfg_destroy(cfg);
    return rc;
  }
  Kind kind() const override { return Kind::kLibfuse; }
  std::string Describe() const override {
    return "libfuse's loop with clone_fd: requests read into libfuse's buffers; no spliced "
           "requests, no request-buffer adoption (write payloads are copied), no write_flags";
  }
  std::string StatsJson() const override {
    return nlohmann::json{{"kind", TransportKindName(kind())}, {"threads", max_threads_}}.dump();
  }
  std::optional<uint32_t> WriteFlags(const fuse_bufvec&) const override { return std::nullopt; }
  RequestBufferPool* payload_pool() override { return nullptr; }

 private:
  fuse_session* const se_;
  const int max_threads_;
};

Result<std::unique_ptr<Transport>> CreateTransportKind(fuse_session* se,
                                                       const TransportOptions& o) {
  if (o.clone_fd) {
    auto t = std::make_unique<LibfuseTransport>(se, o.libfuse_max_threads);
    Logger().warn("-o clone_fd=1: {}", t->Describe());
    return std::unique_ptr<Transport>(std::move(t));
  }
  if (o.io_uring) {
    auto u = UringLoop::Create(se, o.uring_threads, std::max(4, o.threads / 8), o.max_request);
    if (u.ok()) return std::unique_ptr<Transport>(std::move(u).value());
    Logger().warn("-o io_uring=1: {}; requests go through /dev/fuse", u.status().ToString());
  }
  if (o.splice) {
    auto s = SpliceLoop::Create(se, o.threads, o.adoptable, o.max_request, o.direct_io, o.protocol);
    if (s.ok()) return std::unique_ptr<Transport>(std::move(s).value());
    Logger().warn(
        "receiving FUSE requests with read(2), not splice: {}. Page-cache writes are then "
        "copied once more; give the daemon CAP_SYS_RESOURCE or raise fs.pipe-max-size to "
        "{} (docs/tuning.md)",
        s.status().ToString(), RequestPipeBytes(o.max_request));
  }
  DNVME_ASSIGN_OR_RETURN(auto r, ReadLoop::Create(se, o.threads, o.adoptable, o.max_request));
  return std::unique_ptr<Transport>(std::move(r));
}

}  // namespace

const char* TransportKindName(Transport::Kind kind) {
  switch (kind) {
    case Transport::Kind::kSplice:
      return "splice";
    case Transport::Kind::kRead:
      return "read";
    case Transport::Kind::kLibfuse:
      return "libfuse";
    case Transport::Kind::kUring:
      return "uring";
  }
  return "?";
}

Result<std::unique_ptr<Transport>> CreateTransport(fuse_session* se, const TransportOptions& o) {
  DNVME_ASSIGN_OR_RETURN(auto t, CreateTransportKind(se, o));
  t->set_protocol(o.protocol);
  return t;
}

}  // namespace dnvme::fs
