// The session's own I/O with /dev/fuse, and the door a WRITE comes in by: both the transport's.
//
// SessionIo() is the fuse_custom_io the composition root installs (fuse_session_custom_io): a
// request read from /dev/fuse is shown to the protocol extensions (what INIT offers,
// fs/transport/protocol_ext.h); a reply is offered to the transport first (the io_uring ring
// delivers its own), then sent by splice from a reply pipe when it is large (-o splice_reply),
// else written by the protocol extensions (which amend INIT's reply).
//
// WriteEntry<op> is the write_buf handler of the FUSE ops table: it takes from the transport, once,
// everything the op needs of a WRITE -- its payload as a ready ExtentSource (a copy, a splice or
// the whole request buffer adopted: fs/transport/write_source.h) and its write flags -- and hands
// them to `op`, which never calls the transport back. So a buffered WRITE walks down the rooms
// once: transport (here) -> fs/fuse (the op) -> fs/core -> datapath -> the engine
// (docs/architecture.md, "A buffered WRITE, file by file").
//
// The session's userdata is a SessionHost (the mount's Fs implements it): the only way the
// transport's code reaches what the session belongs to, so this room includes nothing of fs/core.
//
// Thread contract: SessionIo's callbacks and WriteEntry run on the thread serving the request or
// sending the reply (loop, lane, engine completion); SessionHost's accessors must be callable from
// any of them while the session runs.
#pragma once

#include <fuse_lowlevel.h>
#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <optional>

#include "datapath/pipe.h"
#include "fs/transport/protocol_ext.h"
#include "fs/transport/transport.h"
#include "fs/transport/write_source.h"

namespace dnvme::fs {

// Replies sent by splice (-o splice_reply) and their bytes; large replies that found no free reply
// pipe (or did not fit one) were written instead. Relaxed atomics.
struct ReplyCounters {
  std::atomic<uint64_t> replies_spliced{0}, bytes_replied_spliced{0}, replies_unspliced{0};
};

// What the session's I/O needs from the program that owns the session.
class SessionHost {
 public:
  virtual ProtocolExtensions& session_protocol() = 0;
  virtual Transport* session_transport() = 0;  // null before the transport is made
  // Pipes for spliced replies (-o splice_reply); null: every reply is written.
  virtual datapath::PipePool* session_reply_pipes() = 0;
  virtual ReplyCounters& session_reply_counters() = 0;

 protected:
  ~SessionHost() = default;
};

// fuse_session_new's userdata, as the session's I/O and every op read it back.
inline SessionHost* HostOf(void* userdata) { return static_cast<SessionHost*>(userdata); }

const fuse_custom_io& SessionIo();

// What a WRITE handler is handed: the payload as the data path consumes it, and the request's
// write flags when it asks.
class IncomingWrite {
 public:
  IncomingWrite(fuse_bufvec* bufv, Transport* transport)
      : source_(bufv, transport != nullptr ? transport->payload_pool() : nullptr),
        bufv_(bufv),
        transport_(transport) {}
  WriteSource& source() { return source_; }
  // The payload as libfuse handed it over (the control file reads its requests from it).
  fuse_bufvec& payload() { return *bufv_; }
  size_t size() const { return fuse_buf_size(bufv_); }
  // fuse_write_in::write_flags (FUSE_WRITE_KILL_SUIDGID, ...), which libfuse 3.14 reads but does
  // not hand to write_buf; nullopt when the transport cannot know them. Found on demand: it costs
  // a search of the transport's buffers, and a page-cache write's are not looked at.
  std::optional<uint32_t> write_flags() const {
    return transport_ != nullptr ? transport_->WriteFlags(*bufv_) : std::nullopt;
  }

 private:
  WriteSource source_;
  fuse_bufvec* bufv_;
  Transport* transport_;
};

using WriteOp = void (*)(fuse_req_t req, fuse_ino_t ino, IncomingWrite& write, off_t off,
                         fuse_file_info* fi);

// fuse_lowlevel_ops::write_buf for `op`.
template <WriteOp op>
void WriteEntry(fuse_req_t req, fuse_ino_t ino, fuse_bufvec* bufv, off_t off, fuse_file_info* fi) {
  IncomingWrite write(bufv, HostOf(fuse_req_userdata(req))->session_transport());
  op(req, ino, write, off, fi);
}

}  // namespace dnvme::fs
