// The descriptor table: which of the program's descriptors map to which AdoptedFile, and the
// broker connection of each mount (by device) met so far.
//
// Thread contract: every function is thread-safe. One lock (the table's) guards the map of
// descriptors, each AdoptedFile's `fds` count and the map of connections; it is held across
// kcmp only, never across I/O, a broker round trip or the engine, and never while taking
// another lock (adopted_file.h), except by fork()'s prepare handler (lifetime.cc).
#ifndef DNVME_PRELOAD_DESCRIPTOR_TABLE_H_
#define DNVME_PRELOAD_DESCRIPTOR_TABLE_H_

#include <sys/types.h>

#include <memory>
#include <vector>

#include "dnvme/status.h"
#include "preload/adopted_file.h"
#include "preload/broker_client.h"

namespace dnvme::preload {

// Whether descriptors `a` and `b` of this process name the same open file (dup, fcntl, fork).
bool SameOpenFile(int a, int b);

// The file `fd` maps to, or null.
std::shared_ptr<AdoptedFile> LookupAdopted(int fd);
// Every adopted file (at exit, fork and exec).
std::vector<std::shared_ptr<AdoptedFile>> AllAdopted();

// Adopt's steps that touch the table:
// The file adopted for another descriptor of `fd`'s open file (a duplicate made before the file
// was adopted, or the open file inherited twice); maps `fd` to it too. Null if none.
std::shared_ptr<AdoptedFile> ShareWithDuplicate(int fd);
// The connection to the broker of the mount with device `dev`, or null.
std::shared_ptr<BrokerConnection> ConnectionOf(dev_t dev);
// Keeps `conn` for device `dev` unless another thread kept one first; returns the one kept
// (the caller closes its own when it lost).
std::shared_ptr<BrokerConnection> KeepConnection(dev_t dev, std::shared_ptr<BrokerConnection> conn);
// Maps `fd` to the freshly adopted `f`.
void AddAdopted(int fd, std::shared_ptr<AdoptedFile> f);

// Forgets `fd`; returns the first write-behind error of its file when this was the file's last
// descriptor (the lease then ends: EndLease), else Ok (the error stays for the next fsync or
// close).
Status DropDescriptor(int fd);
// `nfd` (or -1) was just made a duplicate of `fd` (dup, dup2, dup3, F_DUPFD): the same open
// file, so the same AdoptedFile. Returns nfd.
int Duplicated(int fd, int nfd);
// `fd`'s open file leaves the engine (it becomes O_APPEND): every descriptor of its file goes back
// to the mount once the file's writes landed and were announced. Returns an error of those
// writes (the last descriptor's to report one), Ok if none.
Status Disown(int fd);
// `fd` was just returned by an open: a number reused behind our back (closed by fclose, say) is
// a new file. Returns fd.
int OpenedDescriptor(int fd);
// The write-behind's first error, once it all landed (Ok when `fd` is not adopted): fsync.
Status LandWrites(int fd);
// Before mmap of `fd`: what was written around the mount is announced, and every later write
// of the file is announced at once.
void BeforeMap(int fd);

// fork(): the prepare handler holds the table's lock across the fork; the child forgets every
// file and connection (closing their sockets and witnesses, leaking the rest: the dead engine's
// operations may still reference them) and adopts again on demand.
void LockTableForFork();
void UnlockTableAfterFork();
void ForgetTableInChild();

}  // namespace dnvme::preload

#endif  // DNVME_PRELOAD_DESCRIPTOR_TABLE_H_
