// What differs between the libfuse versions dnvmefs builds on, in one place: Debian 12's libfuse
// 3.14 and Debian 13's 3.17 (the torch 2.6 lane, scripts/torch2-lane.sh, builds and tests there).
// Code that depends on the version uses the helpers below or names this file.
//
// Every file of dnvme_fs is compiled with FUSE_USE_VERSION=312 (fs/CMakeLists.txt): the 3.12 API,
// which both versions keep. What changes under it, and where it shows:
//
//   fuse_custom_io (3.17 adds clone_fd)
//     A brace list that names every member of 3.14's struct misses one on 3.17
//     (-Werror=missing-field-initializers). MakeCustomIo builds one for either. libfuse's own loop
//     with -o clone_fd=1 (fs/transport/transport.cc) opens a device fd per thread itself on 3.14,
//     but on 3.17, once custom io is installed, only through io->clone_fd: without it 3.17 logs
//     "trying to continue without -o clone_fd" and every thread shares one fd. MakeCustomIo fills
//     clone_fd with what 3.17 does without custom io (CloneDeviceFd), and SetCustomIo installs
//     it: below FUSE_USE_VERSION 317, 3.17's fuse_session_custom_io copies the struct only up to
//     clone_fd.
//
//   INIT's capability flags (3.17 adds the 64-bit conn->want_ext)
//     init() may still change conn->want: 3.17 folds it into want_ext after init() returns. But
//     fuse_apply_conn_info_opts (-o sync_read, no_splice_write, ...) of upstream 3.17.1 and 3.17.2
//     changes want_ext only, and then refuses INIT (EPROTO, "both 'want' and 'want_ext' are set")
//     for an init() that changed want too (Debian 13's 3.17.2-3 carries 3.17.3's fix).
//     ApplyConnInfoOpts keeps the two in step on every version.
//     FUSE_PARALLEL_DIROPS: 3.14 wants it by default but never sends it to the kernel; 3.17 sends
//     it when init() wants it (fs/fuse/ops_table.cc OpInit does), so there lookups and readdirs
//     of one directory really run in parallel.
//
//   INIT's request size
//     Both size the session's buffer for 256 pages (1 MiB of payload). 3.14 clamps conn->max_write
//     to it before init(), so the max_request init() sets reaches the kernel whole; 3.17 clamps
//     after init() (but for its own loop, clone_fd=1, whose buffers then grow), so -o max_request
//     above 1 MiB would reach the kernel as 1 MiB. The daemon's own loops read into their own
//     buffers: ProtocolExtensions puts max_request and its pages back into the reply
//     (fs/transport/protocol_ext.h, Wanted::max_write). fs/options.cc refuses max_request above
//     1 MiB with clone_fd=1 for both.
//     The protocol minor of INIT's reply: Debian 12's 3.14 answers with the kernel's, 3.17 with
//     its own (7.40); the kernel takes the lower of the two.
//
//   What 3.17 knows and 3.14 does not, done by dnvmefs itself on both
//     FUSE passthrough (FUSE_CAP_PASSTHROUGH, fuse_passthrough_open, fuse_file_info::backing_id),
//     FUSE_DIRECT_IO_ALLOW_MMAP and max_pages are negotiated on the wire by
//     fs/transport/protocol_ext.h, and open replies with FOPEN_* flags are built by
//     fs/fuse/passthrough.h; dnvmefs never sets FUSE_CAP_PASSTHROUGH, so 3.17 adds nothing of its
//     own to either. fuse_write_in::write_flags reach write_buf on neither version (the transport
//     reads them: fs/transport/request_buffer.h).
//
//   Signatures dnvmefs does not use: fuse_lowlevel_notify_expire_entry lost its flags argument in
//   3.17, fuse_session_new became a macro (same call), fuse_reply_open sends backing_id.
#pragma once

#include <fcntl.h>
#include <fuse_lowlevel.h>
#include <stdint.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <cerrno>

#if !defined(FUSE_USE_VERSION) || FUSE_USE_VERSION != 312
#error "dnvme_fs builds with FUSE_USE_VERSION=312 (fs/CMakeLists.txt); see fs/fuse_compat.h"
#endif

namespace dnvme::fs {

// A new /dev/fuse fd reading the same connection as `master_fd` (FUSE_DEV_IOC_CLONE), as libfuse
// opens one per loop thread for -o clone_fd=1. The fd, or -1 with errno set.
inline int CloneDeviceFd(int master_fd) {
  const int fd = open("/dev/fuse", O_RDWR | O_CLOEXEC);
  if (fd < 0) return -1;
  uint32_t master = static_cast<uint32_t>(master_fd);
  if (ioctl(fd, _IOR(229, 0, uint32_t), &master) != 0) {  // FUSE_DEV_IOC_CLONE
    const int err = errno;
    close(fd);
    errno = err;
    return -1;
  }
  return fd;
}

// A fuse_custom_io with these callbacks, every other member zero, and on 3.17 clone_fd set to
// CloneDeviceFd (what libfuse does for -o clone_fd=1 without custom io).
inline fuse_custom_io MakeCustomIo(decltype(fuse_custom_io::writev) writev,
                                   decltype(fuse_custom_io::read) read,
                                   decltype(fuse_custom_io::splice_send) splice_send = nullptr) {
  fuse_custom_io io{};
  io.writev = writev;
  io.read = read;
  io.splice_send = splice_send;
#if FUSE_VERSION >= FUSE_MAKE_VERSION(3, 17)
  io.clone_fd = CloneDeviceFd;
#endif
  return io;
}

// fuse_session_custom_io with every member of `io`: on 3.17 the three-argument form copies `io`
// only up to clone_fd, so the sized form is called. 0 or -errno.
inline int SetCustomIo(fuse_session* se, const fuse_custom_io& io, int fd) {
#if FUSE_VERSION >= FUSE_MAKE_VERSION(3, 17)
  return fuse_session_custom_io_317(se, &io, sizeof(io), fd);
#else
  return fuse_session_custom_io(se, &io, fd);
#endif
}

// fuse_apply_conn_info_opts for init(), which may have changed conn->want already: on 3.17 the
// options land in want_ext (3.17.1, 3.17.2) or in both, so want and want_ext are made equal before
// and after, and libfuse's conversion after init() finds nothing to refuse.
inline void ApplyConnInfoOpts(fuse_conn_info_opts* opts, fuse_conn_info* conn) {
#if FUSE_VERSION >= FUSE_MAKE_VERSION(3, 17)
  conn->want_ext = (conn->want_ext & ~uint64_t{0xffffffff}) | conn->want;
  fuse_apply_conn_info_opts(opts, conn);
  conn->want = static_cast<uint32_t>(conn->want_ext);
#else
  fuse_apply_conn_info_opts(opts, conn);
#endif
}

}  // namespace dnvme::fs
