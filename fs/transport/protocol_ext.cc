#include "fs/transport/protocol_ext.h"

#include <linux/fuse.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <nlohmann/json.hpp>

#include "dnvme/log.h"

namespace dnvme::fs {
namespace {

// FUSE_DEV_IOC_MAGIC is 229; numbers 1 and 2 are BACKING_OPEN and BACKING_CLOSE (7.40).
constexpr unsigned long kIocBackingOpen = _IOW(229, 1, wire::BackingMap);
constexpr unsigned long kIocBackingClose = _IOW(229, 2, uint32_t);

uint32_t Load32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

void Store32(char* p, uint32_t v) { std::memcpy(p, &v, sizeof(v)); }

uint16_t Load16(const char* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

void Store16(char* p, uint16_t v) { std::memcpy(p, &v, sizeof(v)); }

}  // namespace

void ProtocolExtensions::ObserveRequest(const void* mem, size_t size) {
  if (init_seen_.load(std::memory_order_relaxed)) return;
  const char* p = static_cast<const char*>(mem);
  if (size < sizeof(fuse_in_header) + wire::kInitInFlags2 + 4) return;
  fuse_in_header h;
  std::memcpy(&h, p, sizeof(h));
  if (h.opcode != wire::kOpInit) return;
  const char* in = p + sizeof(fuse_in_header);
  kernel_minor_.store(Load32(in + 4));
  uint64_t flags = Load32(in + wire::kInitInFlags);
  if (flags & wire::kInitExt) flags |= uint64_t{Load32(in + wire::kInitInFlags2)} << 32;
  offered_.store(flags);
  init_seen_.store(true);
}

ssize_t ProtocolExtensions::WriteReply(int fd, iovec* iov, int count) {
  // The first reply of a session answers INIT: the kernel sends nothing else before it.
  if (!init_replied_.load(std::memory_order_relaxed) && !init_replied_.exchange(true)) {
    fuse_out_header h{};
    if (count == 2 && iov[0].iov_len == sizeof(h) && iov[1].iov_len == wire::kInitOutBytes) {
      std::memcpy(&h, iov[0].iov_base, sizeof(h));
      char* out = static_cast<char*>(iov[1].iov_base);
      const uint64_t offered = offered_.load();
      const uint32_t our_flags = Load32(out + wire::kInitOutFlags);
      const bool writeback = our_flags & wire::kWritebackCache;
      uint64_t add = 0;  // our flags2 bits (FUSE_INIT_EXT in flags makes the kernel read flags2)
      if (h.error == 0 && wanted_.passthrough && (offered & wire::kPassthrough) && !writeback) {
        add |= wire::kPassthrough;
        // One filesystem below us (the backing ext4/xfs): files on a stacked backing
        // filesystem (overlayfs, another FUSE mount) are refused by BACKING_OPEN (ELOOP).
        Store32(out + wire::kInitOutMaxStackDepth, 1);
        passthrough_.store(true);
      } else if (wanted_.passthrough) {
        Logger().info("passthrough not asked for: the kernel {} (protocol 7.{}){}",
                      (offered & wire::kPassthrough) ? "offers it" : "does not offer it",
                      kernel_minor_.load(), writeback ? ", and the writeback cache is on" : "");
      }
      if (h.error == 0 && wanted_.io_uring && (offered & wire::kOverIoUring)) {
        add |= wire::kOverIoUring;
        uring_.store(true);
      } else if (wanted_.io_uring) {
        Logger().warn(
            "FUSE over io_uring not asked for: the kernel does not offer it "
            "(protocol 7.{}; enable_uring off?); requests go through /dev/fuse",
            kernel_minor_.load());
      }
      if (h.error == 0 && wanted_.direct_io_mmap && (offered & wire::kDirectIoAllowMmap)) {
        add |= wire::kDirectIoAllowMmap;
        direct_io_mmap_.store(true);
      } else if (wanted_.direct_io_mmap) {
        Logger().info(
            "the kernel (protocol 7.{}) cannot mmap direct_io opens: O_RDWR opens write through "
            "the page cache, write-only ones from the writer's pages",
            kernel_minor_.load());
      }
      uint32_t flags = our_flags;
      if (h.error == 0 && wanted_.max_write > Load32(out + wire::kInitOutMaxWrite)) {
        Store32(out + wire::kInitOutMaxWrite, wanted_.max_write);
        const uint32_t pages = (wanted_.max_write - 1) / 4096 + 1;
        if ((offered & wire::kMaxPages) && pages <= UINT16_MAX) {
          Store16(out + wire::kInitOutMaxPages, static_cast<uint16_t>(pages));
          flags |= static_cast<uint32_t>(wire::kMaxPages);
        }
      }
      if (h.error == 0 && wanted_.spare_page && (offered & wire::kMaxPages)) {
        // libfuse wrote max_write's own page count (or none); one more lets an unaligned buffer
        // of max_write bytes through whole. The kernel clamps it to its limit.
        const uint32_t pages = Load32(out + wire::kInitOutMaxWrite) / 4096 + 1;
        if (pages <= UINT16_MAX && pages > Load16(out + wire::kInitOutMaxPages)) {
          Store16(out + wire::kInitOutMaxPages, static_cast<uint16_t>(pages));
          flags |= static_cast<uint32_t>(wire::kMaxPages);
        }
      }
      if (h.error == 0) max_pages_asked_.store(Load16(out + wire::kInitOutMaxPages));
      if (add != 0) flags |= static_cast<uint32_t>(wire::kInitExt);
      Store32(out + wire::kInitOutFlags, flags);
      if (add != 0) {  // every bit we add lives in flags2, which the kernel offered them in
        Store32(out + wire::kInitOutFlags2,
                Load32(out + wire::kInitOutFlags2) | static_cast<uint32_t>(add >> 32));
      }
    }
    const ssize_t n = writev(fd, iov, count);
    init_done_.store(true);
    return n;
  }
  return writev(fd, iov, count);
}

Status ProtocolExtensions::NotifyPrune(const std::vector<uint64_t>& nodeids) {
  if (device_fd_ < 0 || !init_done_.load() || !prune_supported()) {
    return Status::Unsupported(EOPNOTSUPP,
                               "FUSE_NOTIFY_PRUNE needs protocol 7.45 (the kernel speaks 7." +
                                   std::to_string(kernel_minor_.load()) + ")");
  }
  // In pieces of at most 1024 ids: one write stays small, and a piece the kernel refuses
  // (EINVAL from one that does not know the code after all) says so at once.
  constexpr size_t kPiece = 1024;
  for (size_t at = 0; at < nodeids.size(); at += kPiece) {
    const size_t n = std::min(kPiece, nodeids.size() - at);
    wire::NotifyPruneOut out{};
    out.count = static_cast<uint32_t>(n);
    fuse_out_header h{};
    h.len = static_cast<uint32_t>(sizeof(h) + sizeof(out) + n * sizeof(uint64_t));
    h.error = wire::kNotifyPrune;
    h.unique = 0;
    iovec iov[3] = {{&h, sizeof(h)},
                    {&out, sizeof(out)},
                    {const_cast<uint64_t*>(nodeids.data() + at), n * sizeof(uint64_t)}};
    ssize_t w;
    do {
      w = writev(device_fd_, iov, 3);
    } while (w < 0 && errno == EINTR);
    if (w < 0) return Status::FromErrno(errno, "FUSE_NOTIFY_PRUNE");
    if (static_cast<size_t>(w) != h.len) {
      return Status::IoError(EIO, "FUSE_NOTIFY_PRUNE written short");
    }
  }
  return Status::Ok();
}

Result<int32_t> ProtocolExtensions::OpenBacking(int fd) {
  if (!passthrough_.load()) return Status::FromErrno(EOPNOTSUPP, "passthrough is off");
  wire::BackingMap map{};
  map.fd = fd;
  int id;
  do {
    id = ioctl(device_fd_, kIocBackingOpen, &map);
  } while (id < 0 && errno == EINTR);
  if (id < 0) {
    const int err = errno;
    // EPERM: no CAP_SYS_ADMIN, or the kernel did not take FUSE_PASSTHROUGH from our INIT reply;
    // ENOTTY: a kernel older than 6.9. Either way no open of this session can use it.
    if (err == EPERM || err == ENOTTY) {
      if (passthrough_.exchange(false)) {
        Logger().warn("passthrough turned off for this mount: FUSE_DEV_IOC_BACKING_OPEN: {}",
                      std::strerror(err));
      }
    }
    return Status::FromErrno(err, "FUSE_DEV_IOC_BACKING_OPEN");
  }
  return id;
}

Status ProtocolExtensions::CloseBacking(int32_t id) {
  uint32_t arg = static_cast<uint32_t>(id);
  int rc;
  do {
    rc = ioctl(device_fd_, kIocBackingClose, &arg);
  } while (rc < 0 && errno == EINTR);
  if (rc < 0) return Status::FromErrno(errno, "FUSE_DEV_IOC_BACKING_CLOSE");
  return Status::Ok();
}

std::string ProtocolExtensions::StatsJson() const {
  const uint32_t minor = kernel_minor_.load();
  return nlohmann::json{{"kernel_protocol", minor ? "7." + std::to_string(minor) : std::string()},
                        {"passthrough",
                         {{"wanted", wanted_.passthrough},
                          {"offered", passthrough_offered()},
                          {"on", passthrough()}}},
                        {"io_uring",
                         {{"wanted", wanted_.io_uring},
                          {"offered", (offered_.load() & wire::kOverIoUring) != 0},
                          {"on", uring()}}},
                        {"direct_io_allow_mmap",
                         {{"wanted", wanted_.direct_io_mmap},
                          {"offered", (offered_.load() & wire::kDirectIoAllowMmap) != 0},
                          {"on", direct_io_mmap()}}},
                        {"max_pages_asked", max_pages_asked()}}
      .dump();
}

}  // namespace dnvme::fs
