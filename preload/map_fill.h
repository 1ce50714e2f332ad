// Filling a large read-only private mapping of a file on the mount in parallel pieces.
//
// Why: a program that maps a file and touches it (np.load(mmap_mode='r'), a safetensors-style
// loader; not torch.load(mmap=True), whose mapping is writable and so the kernel's) gets every page
// through a page fault and the kernel's read-around of that one spot: one piece of the file at a
// time, each waited for. Filling the mapping in large pieces from several threads keeps more of a
// device busy.
//
// Measured (docs/performance-journal.md, "Issue 36"): on this VM's memory as the host hands it
// back, a 2 GiB mapping touched page by page filled at 0.5-1.2 GiB/s and the fill ran 3-4 GiB/s;
// but with the free memory warmed first (as on a real machine) the kernel's own faults run
// 5-6 GiB/s on the RAM-backed ext4 and 2.2 on the disk (its read-around already at the
// device's limit there), and the fill 3.3 and 1.1-1.6: MADV_POPULATE_READ maps page by page,
// where a fault maps 16 around it. So the fill is off by default, for devices with more
// latency than these (a real NVMe at queue depth one) to try.
//
// What: after mmap(2) of a regular file on an allowed dnvmefs mount, read-only (PROT_READ
// without PROT_WRITE) and at least DNVME_PRELOAD_MAP_FILL bytes (off by default), the
// mapping is populated before mmap returns: the part inside the file, in 8 MiB pieces, from up
// to kFillThreads threads (the caller's among them). The mapping itself stays the kernel's,
// private or shared (madvise, mincore, mprotect, fork and munmap behave as without dnvme run):
// only its pages arrive early, so a read-only MAP_SHARED mapping (np.load(mmap_mode='r'),
// Python's mmap with ACCESS_READ, safetensors) is filled as safely as a private one. What it
// holds: the file's bytes as of the map, this process's earlier writes included (each adopted
// file's write-behind lands and is announced first, lease.h); whether later changes of the file
// show in a private mapping's pages POSIX leaves unspecified, as ever. Writable mappings are
// left to the kernel (a private one's write fault copies the page anyway, a shared one is the
// program's window onto the file). Mappings larger than half the machine's memory are left to
// the kernel too: filled at once, they would push out what the program needs.
//
// Thread contract: thread-safe; a fill uses its own threads and returns when they are done.
// Failures (an old kernel without MADV_POPULATE_READ, an I/O error) end the fill quietly: the
// pages not filled are faulted in as usual, where the program then meets the error itself.
#ifndef DNVME_PRELOAD_MAP_FILL_H_
#define DNVME_PRELOAD_MAP_FILL_H_

#include <sys/types.h>

#include <cstddef>

namespace dnvme::preload {

// After a successful mmap(`addr`, `len`, `prot`, flags, `fd`, `off`) (private or shared alike):
// fills the mapping when the rules above say so.
void AfterMap(void* addr, size_t len, int prot, int fd, off_t off);

}  // namespace dnvme::preload

#endif  // DNVME_PRELOAD_MAP_FILL_H_
