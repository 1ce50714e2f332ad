// Who besides the daemon can reach BACKING_DIR. The daemon assumes a user may change BACKING_DIR
// behind its back (it never follows a name as root, docs/security.md), but a set-up where other
// users cannot reach it at all is the one to run: a user who can reach it can bypass the mount's
// rules for every file whose name it controls. Checked once at start, logged as a warning.
//
// Thread contract: a pure function of the file system's state; call from any thread.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

namespace dnvme::fs {

// Reasons another user (not root, not `self`) can reach or write BACKING_DIR `backing`, empty
// when none: (1) every directory from / down to it is searchable by others and the mount does
// not hide it (`mountpoint` is `backing` itself); (2) it is writable by others or owned by
// another user. Paths are made absolute (realpath) first; an unreadable path gives a reason.
std::vector<std::string> BackingExposure(const std::string& backing, const std::string& mountpoint,
                                         uid_t self);

}  // namespace dnvme::fs
