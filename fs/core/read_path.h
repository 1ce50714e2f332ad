// A READ of a regular file: the inode's data path (datapath/file_data.h: the write-behind drained,
// the read-ahead window, the engine for the rest) with the mount's buffers and counters. Errors
// leave as Status; the FUSE ops turn them into errno replies.
//
// Thread contract: from any FUSE thread, for a FileHandle whose release cannot come meanwhile.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>

#include "dnvme/status.h"
#include "fs/core/inode.h"
#include "fs/core/mount.h"

namespace dnvme::fs {

// For an O_DIRECT client: drains write-behind, then submits the read to the engine. `done` runs
// once, on an engine worker (or on this thread when the read fails or ends before it is
// submitted), with the bytes read -- valid only during the call -- or the error; it replies.
// Returns false, without calling `done`, when no reply buffer is free: read synchronously.
using ReadDone = std::function<void(Result<std::span<const char>>)>;
bool ReadAsync(Mount& mount, FileHandle& fh, size_t size, off_t off, ReadDone done);
// Reads up to `size` bytes at `off`; `scratch` (at least `size` bytes, pinned and aligned) takes
// what is read on demand. Returns the bytes read (the iovecs in `reply` add up to it). `reader`:
// the READ's caller, whose memory budget decides whether a cold run may fill the page cache.
Result<int64_t> Read(Mount& mount, FileHandle& fh, char* scratch, size_t size, off_t off,
                     datapath::ReadReply* reply, pid_t reader);

}  // namespace dnvme::fs
