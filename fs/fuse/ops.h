// The FUSE low-level operations of dnvmefs, one function per op, in the files of fs/fuse/
// (ops_table.cc puts them into the table libfuse calls; Operations() below hands it out).
// A passthrough of BACKING_DIR in which file data goes through the engine (datapath/). Every
// request gets exactly one reply, through the Reply* helpers (ops_common.h), where a Status
// becomes an errno.
//
// Thread contract: called by the loop threads, any number at once; each op's state lives in the
// inode (fs/core/inode.h) and its locks.
#pragma once

#include <fuse_lowlevel.h>

#include "fs/transport/session_io.h"

namespace dnvme::fs::ops {

// ops_table.cc
void OpInit(void* userdata, fuse_conn_info* conn);
void OpDestroy(void* userdata);

// ops_entry.cc
void OpLookup(fuse_req_t req, fuse_ino_t parent, const char* name);
void OpForget(fuse_req_t req, fuse_ino_t ino, uint64_t nlookup);
void OpForgetMulti(fuse_req_t req, size_t count, fuse_forget_data* forgets);
void OpGetattr(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi);
void OpSetattr(fuse_req_t req, fuse_ino_t ino, struct stat* attr, int valid, fuse_file_info* fi);
void OpReadlink(fuse_req_t req, fuse_ino_t ino);
void OpMknod(fuse_req_t req, fuse_ino_t parent, const char* name, mode_t mode, dev_t rdev);
void OpMkdir(fuse_req_t req, fuse_ino_t parent, const char* name, mode_t mode);
void OpSymlink(fuse_req_t req, const char* link, fuse_ino_t parent, const char* name);
void OpLink(fuse_req_t req, fuse_ino_t ino, fuse_ino_t newparent, const char* newname);
void OpUnlink(fuse_req_t req, fuse_ino_t parent, const char* name);
void OpRmdir(fuse_req_t req, fuse_ino_t parent, const char* name);
void OpRename(fuse_req_t req, fuse_ino_t parent, const char* name, fuse_ino_t newparent,
              const char* newname, unsigned int flags);
void OpStatfs(fuse_req_t req, fuse_ino_t ino);
void OpSetxattr(fuse_req_t req, fuse_ino_t ino, const char* name, const char* value, size_t size,
                int flags);
void OpGetxattr(fuse_req_t req, fuse_ino_t ino, const char* name, size_t size);
void OpListxattr(fuse_req_t req, fuse_ino_t ino, size_t size);
void OpRemovexattr(fuse_req_t req, fuse_ino_t ino, const char* name);

// ops_file.cc
void OpOpen(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi);
void OpCreate(fuse_req_t req, fuse_ino_t parent, const char* name, mode_t mode, fuse_file_info* fi);
void OpRead(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, fuse_file_info* fi);
void OpWrite(fuse_req_t req, fuse_ino_t ino, IncomingWrite& write, off_t off, fuse_file_info* fi);
void OpFlush(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi);
void OpRelease(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi);
void OpFsync(fuse_req_t req, fuse_ino_t ino, int datasync, fuse_file_info* fi);
void OpFallocate(fuse_req_t req, fuse_ino_t ino, int mode, off_t offset, off_t length,
                 fuse_file_info* fi);
void OpLseek(fuse_req_t req, fuse_ino_t ino, off_t off, int whence, fuse_file_info* fi);

// ops_dir.cc
void OpOpendir(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi);
void OpReaddir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, fuse_file_info* fi);
void OpReaddirplus(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, fuse_file_info* fi);
void OpReleasedir(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi);
void OpFsyncdir(fuse_req_t req, fuse_ino_t ino, int datasync, fuse_file_info* fi);

fuse_lowlevel_ops MakeOps();

}  // namespace dnvme::fs::ops

namespace dnvme::fs {

// The FUSE low-level operations table (fs/fuse/ops_table.cc; the ops in fs/fuse/ops_*.cc). The
// session's userdata is the Fs as a SessionHost (SessionUserdata); its I/O is the transport's
// SessionIo (fs/transport/session_io.h).
const fuse_lowlevel_ops& Operations();

}  // namespace dnvme::fs
