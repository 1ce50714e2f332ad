// Adoption: the first large transfer on a descriptor decides whether this process's engine
// serves its file (docs/preload.md, "How a file is adopted").
//
// fstatfs says FUSE, /proc/self/mountinfo says which dnvmefs mount (mounts.h), /proc/self/fd
// says the path, and the mount's broker opens that path as this process and checks it is the
// same inode; it hands over the backing file's descriptors and a lease. O_APPEND and O_PATH
// descriptors, files elsewhere or of mounts DNVME_PRELOAD_MOUNTS leaves out, and files the
// broker refuses stay on the mount (kNotOurs) until the descriptor number is reused.
//
// Thread contract: thread-safe. Adopt runs without the table's lock across its broker round
// trip, so first transfers racing on one descriptor may each adopt it: the last one is kept in
// the table (a race as old as the library, noted here and left as it was).
#ifndef DNVME_PRELOAD_ADOPTION_H_
#define DNVME_PRELOAD_ADOPTION_H_

#include <memory>

#include "preload/adopted_file.h"

namespace dnvme::preload {

// Classifies the unknown descriptor `fd`: its AdoptedFile when the engine is to serve it (the
// descriptor then maps to it in the table), else null (fd is marked kNotOurs).
std::shared_ptr<AdoptedFile> Adopt(int fd);

// The file to use for a transfer on `fd`, or null for "go through the mount": adopts an unknown
// descriptor, and one whose number now names another open file (fclose and close_range close
// behind our back; kcmp with the witness tells).
std::shared_ptr<AdoptedFile> AdoptedForTransfer(int fd);

}  // namespace dnvme::preload

#endif  // DNVME_PRELOAD_ADOPTION_H_
