// What the FUSE op files (fs/fuse/ops_*.cc) share: the request's Fs, FileHandle and Caller, the
// replies made from a Status or a Result (with Status::ErrnoOr, the one place an error becomes an
// errno), the control directory's refusals, the caller's umask for creates, handing a new object
// to its caller, the set-user-ID rules of writes and truncates, and each loop thread's pinned
// scratch buffer.
//
// Thread contract: called on FUSE loop threads, inside a request's handler.
#pragma once

#include <fuse_lowlevel.h>
#include <sched.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "dnvme/identity.h"
#include "dnvme/status.h"
#include "fs/control/control.h"
#include "fs/core/fs.h"
#include "fs/fuse/passthrough.h"

namespace dnvme::fs::ops {

// attr/entry cache: the backing dir changes only through us (the InodeTable's lookups use it too).
inline constexpr double kTimeout = kEntryTimeout;

// The session's userdata is the Fs as a SessionHost (fs/transport/session_io.h): back to the Fs.
inline Fs& FsOfSession(void* userdata) { return *static_cast<Fs*>(HostOf(userdata)); }
inline Fs& FsOf(fuse_req_t req) { return FsOfSession(fuse_req_userdata(req)); }

inline std::string ProcPath(int fd) { return "/proc/self/fd/" + std::to_string(fd); }

inline FileHandle& Fh(fuse_file_info* fi) { return *reinterpret_cast<FileHandle*>(fi->fh); }

// A syscall's outcome as a Status: Ok when it returned 0, else its errno (read at once: pass the
// call itself, `SyscallStatus(unlinkat(...), "unlink")`, with nothing in between).
inline Status SyscallStatus(int rc, const char* what) {
  return rc == 0 ? Status::Ok() : Status::FromErrno(errno, what);
}

// Who sent `req`: uid, gid, pid (fuse_req_ctx) and the supplementary groups, which libfuse reads
// from /proc/PID/task/TID/status -- a file read, so only for requests that need them (ctl).
Caller CallerOf(fuse_req_t req);

// The replies, made from a Status or a Result: the only callers of fuse_reply_* (the rule
// tests/layering_test.sh keeps). An error is answered by ReplyStatus with status.ErrnoOr() (EIO
// when it carries no errno) -- the one place a Status becomes the errno the kernel sees -- a
// value with the matching fuse_reply_*. A success that carries nothing (unlink, fsync...) is
// ReplyStatus(req, Status::Ok()).
void ReplyStatus(fuse_req_t req, const Status& st);
void ReplyEntry(fuse_req_t req, const Result<fuse_entry_param>& e);
void ReplyAttr(fuse_req_t req, const Result<struct stat>& st, double timeout);
void ReplyBuf(fuse_req_t req, const Result<std::string>& bytes);
// Bytes that live elsewhere (a read's buffer, a directory listing), sent as they are.
void ReplyData(fuse_req_t req, const Result<std::span<const char>>& bytes);
// A read's answer: `st`'s error, else the pieces `iov` points at (datapath::ReadReply).
void ReplyIov(fuse_req_t req, const Status& st, std::span<const struct iovec> iov);
void ReplyWritten(fuse_req_t req, const Result<size_t>& written);
void ReplyLseek(fuse_req_t req, const Result<off_t>& off);
void ReplyReadlink(fuse_req_t req, const Result<std::string>& target);
void ReplyStatfs(fuse_req_t req, const Result<struct statvfs>& sv);
// getxattr and listxattr: `size` 0 asked for the length (`got` is it), otherwise for the bytes
// (`got` of them at `bytes`).
void ReplyXattr(fuse_req_t req, size_t size, const Result<size_t>& got, const char* bytes);
// forget and forget_multi, which the kernel expects no answer to.
void ReplyNone(fuse_req_t req);
// The answer to an open or opendir (ReplyOpen) or a create (ReplyCreate, with the new entry):
// `fi` as libfuse sends it, through the backing file when `how.passthrough`
// (fs/fuse/passthrough.h), with `extra` FOPEN_* flags fuse_file_info cannot carry (libfuse 3.14;
// VirtualOpenFlags). An error is ReplyStatus's. Returns false when the opener was interrupted
// meanwhile (the reply failed with ENOENT): the kernel never releases that handle, so the caller
// does.
bool ReplyOpen(fuse_req_t req, const fuse_file_info& fi, const OpenMode& how = {},
               uint32_t extra = 0);
bool ReplyCreate(fuse_req_t req, const fuse_entry_param& e, const fuse_file_info& fi,
                 const OpenMode& how = {});
// Answers an open or opendir of a control node with the `fi` VirtualOpen/VirtualOpendir filled
// in. When the opener was interrupted meanwhile (ReplyOpen) the handle is released here.
void ReplyVirtualOpen(fuse_req_t req, fuse_ino_t ino, const Status& st, fuse_file_info* fi);

// Answers `err` (ReplyStatus) when `ino` is a control node (fs/fuse/control_dir.h); false
// otherwise.
bool RefuseVirtual(fuse_req_t req, fuse_ino_t ino, int err);
// Answers `err` when (parent, name) names the control dir or an entry inside it.
bool RefuseVirtualName(fuse_req_t req, fuse_ino_t parent, const char* name, int err);

// A `dnvme run` client's direct writes that returned to its program may still be in flight
// (its write-behind, include/dnvme/broker.h writes_inflight). Before the mount lets someone else
// open the file, or truncates it or sets its times, they must land, as they would have on ext4
// (found by the model test: an in-flight write re-extended a file an O_TRUNC open had emptied).
// Runs `op` at once when no `dnvme run` client holds a lease on `in`; otherwise once the holders'
// writes in flight landed, or after PreloadLeases::kWriteWait (a stopped or lying client: logged
// with `before`, the holder never waited for again), on the OffLoop notifier thread
// (fs/core/off_loop.h): the counter -- the client's to write, honest or not -- delays only the
// request that must see its writes, never a loop thread, and never behind other waits
// (docs/security.md). `op` runs after the wait, so it never waits again, and it may notify the
// kernel (it is not on a loop thread). `op` must own copies of what the request handed in.
// Where a reply cannot leave the thread that received the request (FUSE over io_uring), waits
// and runs here. `share_if_busy`: see PreloadLeases::WaitForWrites (an open marks the leases
// shared itself, before).
void AfterLeaseWrites(Fs& fs, Inode& in, bool share_if_busy, const char* before,
                      std::function<void()> op);

// FUSE_CAP_DONT_MASK (asked for in init) makes the kernel send create/mkdir/mknod modes without
// the caller's umask and the umask beside them (fuse_ctx::umask). The backing create then runs
// under the caller's umask, so ext4 applies it exactly as for the caller -- or, where the parent
// has a default ACL, ignores it and applies the ACL, as it does for a local process. The umask is
// set on this thread alone: each FUSE thread gets its own fs_struct (unshare(CLONE_FS)) the first
// time it creates something. Restored when the scope ends.
class CallerUmask {
 public:
  explicit CallerUmask(fuse_req_t req) {
    thread_local const int unshared = unshare(CLONE_FS) == 0 ? 0 : errno;
    err_ = unshared;
    if (err_ == 0) saved_ = umask(fuse_req_ctx(req)->umask);
  }
  ~CallerUmask() {
    if (err_ == 0) umask(saved_);
  }
  CallerUmask(const CallerUmask&) = delete;
  CallerUmask& operator=(const CallerUmask&) = delete;
  // Ok, or why this thread could not get a umask of its own: the create must then fail rather
  // than run under the daemon's umask, which is not the caller's.
  Status status() const {
    return err_ == 0 ? Status::Ok() : Status::FromErrno(err_, "unshare(CLONE_FS) for the umask");
  }

 private:
  int err_ = 0;
  mode_t saved_ = 0;
};
// Runs the rest of a request's handler as its caller: fsuid, fsgid and supplementary groups
// (ScopedFsIdentity, dnvme/identity.h) and umask (CallerUmask). Every operation that
// creates, removes, renames or opens a *name* in BACKING_DIR runs inside one, so the backing file
// system decides and creates exactly as for the caller -- a new object belongs to the caller from
// its first moment (no create-as-root-then-chown window), and a name another user swapped for a
// symlink or a hard link to a file of root is never acted on with root's rights
// (docs/security.md). A daemon not running as root acts as itself: it serves its own files only.
class ActAsCaller {
 public:
  explicit ActAsCaller(fuse_req_t req);
  ActAsCaller(const ActAsCaller&) = delete;
  ActAsCaller& operator=(const ActAsCaller&) = delete;
  // Ok, or why the request cannot be served as its caller (its answer).
  Status status() const { return st_.ok() ? mask_.status() : st_; }

 private:
  CallerUmask mask_;
  std::optional<ScopedFsIdentity> id_;
  Status st_;
};

// What an open makes the daemon hold, charged to its caller until the handle goes.
struct OpenCharge {
  UidCharge files;  // one of max_files_per_uid (none for root)
  UidCharge fds;    // the descriptors (UidLimits::ChargeFds; root's too)
};
// The descriptors an open of a regular file holds: its own and the engine's two reopens of it
// (O_DIRECT and buffered: engine/posix/file.h, AdoptIoFd). A directory's: its stream's one.
inline constexpr int64_t kFileOpenFds = 3, kDirOpenFds = 1;

// Charges one open file to the request's caller (UidResource::kFiles, max_files_per_uid) and the
// `fds` descriptors it will hold: the descriptors an open makes the daemon hold are the opener's
// share. Returns the charges (root's open takes no file of a share, only descriptors), or the
// refusal to answer (EMFILE or ENFILE, the reason logged).
Result<OpenCharge> ChargeOpen(fuse_req_t req, int64_t fds);

// The identity a non-root writer's data is written under (FileRef's write_as), or null for root
// and for a daemon that does not run as root (its writes are its own).
std::shared_ptr<const FsIdentity> WriterIdentity(fuse_req_t req);

// Looks `name` up under `parent` for the request's caller (InodeTable::Lookup) and answers with
// the entry.
void ReplyEntry(fuse_req_t req, fuse_ino_t parent, const char* name);

// The inode's attributes, with the data write-behind accepted and the backing file has not seen
// yet.
Result<struct stat> StatInode(Inode& in);

// What a write or truncate by a process without CAP_FSETID clears on ext4
// (setattr_should_drop_suidgid): set-user-ID always; set-group-ID when group execute is set, or
// when the writer is not in the file's group. Applies it to the inode.
//
// The FUSE kernel does part of this itself -- set-user-ID, and set-group-ID with group execute,
// as a SETATTR before a page-cache write or with a truncate -- but never the third case, and
// leaves all of it to us for a direct write (which only carries FUSE_WRITE_KILL_SUIDGID).
// `killed` (optional) says whether the mode changed: the kernel's cached mode is then stale (a
// direct write updates none of its own), and a WRITE drops it (Mount::ForgetCachedAttributes).
Status KillPrivs(fuse_req_t req, Inode& in, bool* killed = nullptr);

// Whether a WRITE comes from a process without CAP_FSETID. A direct write (an O_DIRECT client, a
// direct_io open) says so exactly with FUSE_WRITE_KILL_SUIDGID. A page-cache write never carries
// it (the kernel sets it only with FUSE_HANDLE_KILLPRIV_V2, which libfuse 3.14 cannot ask for),
// and under libfuse's own loop (clone_fd=1, which does not pass the flags on) `write_flags` is
// unknown (nullopt): there the caller counts as privileged exactly when it is root.
bool WriterUnprivileged(fuse_req_t req, const FileHandle& fh, std::optional<uint32_t> write_flags);

// Logs whether the kernel will send requests of `request` bytes (fs.fuse.max_pages_limit).
void WarnIfKernelClampsRequests(int64_t request);

// The kernel reads ahead at most the FUSE bdi's read_ahead_kb (128 KiB by default, whatever
// max_readahead says), in requests of at most 1 MiB. Raising it lets a sequential reader's
// requests reach us many at a time. Found through /proc/self/mountinfo, not stat(): a stat of
// our own mountpoint from inside init would wait for ourselves.
void RaiseKernelReadAhead(const std::string& mountpoint, int64_t bytes);

// One pinned, aligned buffer per FUSE thread (grown on demand): reads into it and writes from it
// are plain O_DIRECT requests, no bounce copy. Null when it cannot be pinned.
char* ThreadScratch(size_t size);

}  // namespace dnvme::fs::ops
