#include "fs/transport/splice_loop.h"

#include <fcntl.h>
#include <linux/fuse.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

#include "dnvme/log.h"
#include "fs/options.h"

namespace dnvme::fs {
namespace {

// Below this a request goes into memory whole: libfuse wants every request but a large WRITE in
// memory, and copying a few KiB costs less than the extra syscalls of leaving it in the pipe.
constexpr size_t kInlineBytes = sizeof(fuse_in_header) + sizeof(fuse_write_in) + 4096;

}  // namespace

void SpliceSteering::Note(const fuse_write_in& w) {
  if (w.size < kMinBytes) return;
  // The kernel sends a WRITE of an O_DIRECT file or a direct_io open (fuse_write_in::flags are
  // the file's flags; the mount's policy maps them to direct_io exactly as the open did) from the
  // caller's pages, and any other from its page cache -- as it does an mmap's dirty pages
  // (FUSE_WRITE_CACHE) of any open.
  const bool mmap_ok = protocol_ != nullptr && protocol_->direct_io_mmap();
  const bool page_cache = (w.flags & O_DIRECT) == 0 &&
                          ((w.write_flags & FUSE_WRITE_CACHE) != 0 ||
                           !OpenGetsDirectIo(direct_io_, static_cast<int>(w.flags), mmap_ok));
  int s = score_.load(std::memory_order_relaxed);
  const int next = page_cache ? std::min(s + 1, kLimit) : std::max(s - 1, -kLimit);
  // A lost race only delays the switch by a request: no retry loop needed.
  if (next != s) score_.compare_exchange_weak(s, next, std::memory_order_relaxed);
}

Result<std::unique_ptr<SpliceLoop>> SpliceLoop::Create(fuse_session* se, int threads,
                                                       size_t adoptable, int64_t max_request,
                                                       DirectIo direct_io,
                                                       const ProtocolExtensions* protocol) {
  std::unique_ptr<SpliceLoop> loop(
      new SpliceLoop(se, threads, adoptable, max_request, direct_io, protocol));
  DNVME_RETURN_IF_ERROR(loop->Init());
  // Pipes that take any request of max_request bytes (RequestPipeBytes: 512 slots for 1 MiB).
  // Smaller pipes would need a smaller max_write, which splits 1 MiB client writes in two and
  // costs O_DIRECT clients far more than splicing saves (measured:
  // docs/performance-journal.md), so without them the caller reads requests instead.
  for (int i = 0; i < threads; ++i) {
    DNVME_ASSIGN_OR_RETURN(auto p, Pipe::Create(RequestPipeBytes(max_request)));
    DNVME_ASSIGN_OR_RETURN(auto peek, Pipe::Create(static_cast<int64_t>(kWriteHeaderBytes)));
    loop->pipes_.push_back(std::move(p));
    loop->peeks_.push_back(std::move(peek));
  }
  return loop;
}

std::string SpliceLoop::Describe() const {
  return std::to_string(threads_) +
         " loop threads, requests spliced into pipes (read(2) while O_DIRECT writers dominate)";
}

std::string SpliceLoop::StatsJson() const {
  auto j = nlohmann::json::parse(SessionLoop::StatsJson());
  j["requests_spliced"] = requests_spliced_.load(std::memory_order_relaxed);
  j["splicing_now"] = steering_.splice_next();
  return j.dump();
}

std::optional<uint32_t> SpliceLoop::WriteFlags(const fuse_bufvec& bufv) const {
  if (bufv.count == 0 || !(bufv.buf[0].flags & FUSE_BUF_IS_FD)) {
    return SessionLoop::WriteFlags(bufv);
  }
  // The payload is still in the pipe the request was spliced into: that names the thread.
  for (size_t i = 0; i < pipes_.size(); ++i) {
    if (pipes_[i]->read_fd() == bufv.buf[0].fd) return receivers_[i]->write_flags;
  }
  return std::nullopt;
}

Result<SessionLoop::Received> SpliceLoop::Receive(size_t index, Receiver& r, fuse_buf* buf) {
  if (!steering_.splice_next()) {
    DNVME_ASSIGN_OR_RETURN(Received got, ReadRequest(r, buf));
    if (got == Received::kRequest) {
      if (auto w = WriteHeaderOf(static_cast<const char*>(buf->mem), buf->size)) {
        steering_.Note(*w);
      }
    }
    return got;
  }
  Pipe& pipe = *pipes_[index];
  ssize_t n = splice(fuse_session_fd(se_), nullptr, pipe.write_fd(), nullptr, receive_bytes_, 0);
  if (auto no = NoRequest(n)) return *no;
  requests_spliced_.fetch_add(1, std::memory_order_relaxed);
  buf->size = static_cast<size_t>(n);
  std::optional<fuse_write_in> w;
  if (static_cast<size_t>(n) >= kInlineBytes) {
    // Large: the payload stays in the pipe for write_buf; only the headers are looked at.
    buf->flags = FUSE_BUF_IS_FD;
    buf->fd = pipe.read_fd();
    char head[kWriteHeaderBytes];
    auto got = pipe.Peek(*peeks_[index], head, sizeof(head));
    r.piped_uid.reset();
    if (got.ok()) {
      w = WriteHeaderOf(head, got.value());
      if (got.value() >= sizeof(fuse_in_header)) {
        fuse_in_header in;
        std::memcpy(&in, head, sizeof(in));
        r.piped_uid = in.uid;
      }
    } else {
      // The handler then decides without the flags (Transport::WriteFlags): logged, not fatal.
      Logger().error("reading a spliced request's headers: {}", got.status().ToString());
      (void)peeks_[index]->Discard();
    }
  } else {
    // Small requests go to libfuse in memory whole.
    char* const mem = r.buffer.data() + kRequestReadOffset;
    Status st = pipe.ReadExactly(mem, static_cast<size_t>(n));
    if (!st.ok())
      return Status::IoError(EIO, "reading a request back from its pipe: " + st.ToString());
    buf->mem = mem;
    w = WriteHeaderOf(mem, static_cast<size_t>(n));
  }
  r.write_flags = w ? std::optional<uint32_t>(w->write_flags) : std::nullopt;
  if (w) steering_.Note(*w);
  return Received::kRequest;
}

bool SpliceLoop::ToMemory(size_t index, Receiver& r, fuse_buf* buf) {
  if (!(buf->flags & FUSE_BUF_IS_FD)) return true;
  // The whole request is still in the pipe (Peek read the headers through a tee): read it out
  // where a read(2) receive would have put it, so the payload lands page-aligned.
  char* const mem = r.buffer.data() + kRequestReadOffset;
  if (!pipes_[index]->ReadExactly(mem, buf->size).ok()) return false;
  buf->flags = static_cast<fuse_buf_flags>(0);
  buf->fd = -1;
  buf->mem = mem;
  return true;
}

Status SpliceLoop::AfterDispatch(size_t index, const fuse_buf& buf) {
  // A handler that answered without consuming its payload (an error reply) leaves bytes that
  // would otherwise be taken for the next request. A request read out whole left nothing.
  if (!(buf.flags & FUSE_BUF_IS_FD)) return Status::Ok();
  Pipe& pipe = *pipes_[index];
  if (pipe.Pending() == 0) return Status::Ok();
  auto dropped = pipe.Discard();
  if (!dropped.ok()) return Status::IoError(EIO, "request pipe: " + dropped.status().ToString());
  return Status::Ok();
}

}  // namespace dnvme::fs
