// An adopted file: a file of a dnvmefs mount whose large transfers this process's engine does
// on descriptors of the backing file the mount's broker handed over (docs/preload.md).
//
// One AdoptedFile per open file of the program (its file offset is the kernel's, in the
// program's own descriptor); every descriptor of that open file (dup, fcntl, an inherited one)
// maps to it in the descriptor table (descriptor_table.h). It holds one lease of the broker
// (`lease`, `word`) from adoption until the table forgets its last descriptor (EndLease).
//
// THREAD CONTRACT: shared by every thread with a descriptor of it (shared_ptr: the table, each
// transfer in progress, and each engine request of its write-behind and read-ahead hold it, so
// `file` outlives every request using it). The fields above `mu` are written before the file is
// put in the table (Adopt) and only read after, except `witness`, which EndLease closes once no
// descriptor maps to the file. The others are guarded as each says.
//
// LOCK ORDER (the process-wide locks included): every lock is taken alone -- mu, em, the
// data path's own mutexes (datapath/file_data.h), a BrokerConnection's mu and the
// descriptor table's lock are never held while taking another one, except that the
// write-behind's mutex is held while its FlushHooks touch the lease word (an atomic, no lock).
// (The descriptor table's lock is taken before the engine's when fork() prepares, lifetime.cc.)
// What is held across a blocking call: a BrokerConnection's mu across a broker round trip;
// the descriptor table's lock across kcmp only; mu and em across nothing. The data path's
// mutexes are held across no engine I/O; its space reservation's across fallocate, ftruncate
// and FIEMAP of the backing file (datapath/space.h). Engine completions run on engine threads
// and take only the write-behind's and read-ahead's mutexes.
#ifndef DNVME_PRELOAD_ADOPTED_FILE_H_
#define DNVME_PRELOAD_ADOPTED_FILE_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "datapath/file_data.h"
#include "dnvme/broker.h"
#include "dnvme/handle.h"
#include "preload/broker_client.h"

namespace dnvme::preload {

struct AdoptedFile {
  AdoptedFile();  // staging.cc: the data path's shared state is this process's
  std::shared_ptr<BrokerConnection> conn;  // the mount's broker
  FileRef file;      // the backing file (O_DIRECT + buffered), as the broker opened it
  int witness = -1;  // our duplicate of the program's descriptor (kcmp, and the FUSE open)
  uint64_t lease = 0;
  broker::LeaseWord* word = nullptr;  // the lease's word in conn's page
  bool can_read = false, can_write = false;

  // Announcements (lease.h).
  std::mutex mu;                             // guards the three below
  int64_t pending_lo = -1, pending_hi = -1;  // written around the mount, kernel not yet told
  bool mapped = false;                       // mmap'ed: every write is announced at once

  // The file's data path (datapath/file_data.h, configured by staging.h). Write-behind: a write is
  // copied into a pinned extent and returns once it is in the kernel (the program computes its
  // next piece -- torch's CRC, say -- while the disk writes this one); its flushes are counted in
  // the lease word (LeaseWordHooks). A flush error reaches this open file once, at its next
  // write, fsync or close (`open`, errseq). EndLease closes it: the lease word may belong to
  // another file after kClose, so no write may be counted in it any more (a thread still inside a
  // transfer on a descriptor another thread closed gets EBADF). Read-ahead of a sequential reader
  // (the kernel's read-ahead does this for a buffered file, O_DIRECT gets none): its fetches hold
  // the file (`file` outlives them) and its destructor waits for them.
  datapath::FileData data;
  datapath::OpenFile open;  // this open file's place in it
  std::mutex em;            // guards kept
  // An error taken from the write-behind (or a reservation) by a call that returned the bytes it
  // wrote before it (DirectVec): the next write, fsync or close reports it.
  Status kept;

  int fds = 0;  // guarded by the descriptor table's lock: the program's descriptors of it
};

}  // namespace dnvme::preload

#endif  // DNVME_PRELOAD_ADOPTED_FILE_H_
