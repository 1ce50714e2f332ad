// The session's /dev/fuse I/O (session_io.h).
#include "fs/transport/session_io.h"

#include <fcntl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>

#include "fs/options.h"
#include "fs/transport/kernel_order.h"
#include "fs/transport/request_pipe.h"

namespace dnvme::fs {
namespace {

ssize_t IoRead(int fd, void* buf, size_t len, void* userdata) {
  ssize_t n = read(fd, buf, len);
  if (n > 0) {
    KernelOrderAfterRequest();
    HostOf(userdata)->session_protocol().ObserveRequest(buf, static_cast<size_t>(n));
  }
  return n;
}

// A large reply by vmsplice + splice (-o splice_reply), as writev(2) would answer (bytes, or -1
// with errno); nullopt when it was not sent that way and is still to be written.
std::optional<ssize_t> SpliceReply(SessionHost& host, int fd, const iovec* iov, int count) {
  size_t total = 0;
  for (int i = 0; i < count; ++i) total += iov[i].iov_len;
  if (total < kMinSplicedReply) return std::nullopt;
  ReplyCounters& c = host.session_reply_counters();
  datapath::PipePool::Lease pipe = host.session_reply_pipes()->TryAcquire();
  Result<std::optional<size_t>> sent = std::optional<size_t>();  // no pipe free: written
  if (pipe) sent = SpliceMessage(*pipe, fd, iov, count);
  if (!sent.ok()) {  // the device refused the reply (ENOENT: the request was interrupted)
    errno = sent.status().ErrnoOr();
    return -1;
  }
  if (!sent.value()) {
    c.replies_unspliced.fetch_add(1, std::memory_order_relaxed);
    return std::nullopt;
  }
  c.replies_spliced.fetch_add(1, std::memory_order_relaxed);
  c.bytes_replied_spliced.fetch_add(*sent.value(), std::memory_order_relaxed);
  return static_cast<ssize_t>(*sent.value());
}

ssize_t IoWritev(int fd, iovec* iov, int count, void* userdata) {
  SessionHost& host = *HostOf(userdata);
  KernelOrderBeforeReply();
  ssize_t written;
  if (Transport* t = host.session_transport(); t != nullptr && t->TakeReply(iov, count, &written)) {
    return written;
  }
  // INIT's reply goes through WriteReply, which amends it; replies after it may be spliced.
  if (host.session_reply_pipes() != nullptr && host.session_protocol().init_replied()) {
    if (std::optional<ssize_t> n = SpliceReply(host, fd, iov, count)) return *n;
  }
  return host.session_protocol().WriteReply(fd, iov, count);
}

ssize_t IoSpliceSend(int fdin, off_t* offin, int fdout, off_t* offout, size_t len,
                     unsigned int flags, void*) {
  KernelOrderBeforeReply();
  return splice(fdin, offin, fdout, offout, len, flags);
}

}  // namespace

const fuse_custom_io& SessionIo() {
  static const fuse_custom_io io = [] {
    fuse_custom_io i{};
    i.read = IoRead;
    i.writev = IoWritev;
    i.splice_send = IoSpliceSend;  // replies from pipes, as libfuse does without custom io
    return i;
  }();
  return io;
}

}  // namespace dnvme::fs
