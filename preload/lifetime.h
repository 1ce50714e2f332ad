// The process's lifetime around the library: exit and fork.
//
// At exit every adopted file's pending announcement is sent, its write-behind drained and its
// reservation trimmed, and the stats line written (DNVME_PRELOAD_STATS). fork() keeps working:
// prepare announces and takes the table's and the engine's locks; the child forgets every file,
// connection and the engine (their threads did not survive) and adopts again on demand.
//
// Thread contract: InstallProcessHooks runs once, from the library's constructor (one thread).
#ifndef DNVME_PRELOAD_LIFETIME_H_
#define DNVME_PRELOAD_LIFETIME_H_

namespace dnvme::preload {

// Registers the fork handlers (pthread_atfork) and the exit handler (atexit).
void InstallProcessHooks();

}  // namespace dnvme::preload

#endif  // DNVME_PRELOAD_LIFETIME_H_
