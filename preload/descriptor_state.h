// Per descriptor number of the program: what a large transfer on it should do. Unknown
// descriptors are classified once (adoption.h), so a descriptor the engine does not serve costs
// one atomic load per call after that.
//
// Thread contract: lock-free; each entry is an atomic (acquire/release). An entry becomes kOurs,
// and stops being kOurs, only under the descriptor table's lock (descriptor_table.h; a forked
// child, one thread, excepted), so a kOurs entry has its AdoptedFile in the table; kUnknown and
// kNotOurs are hints, set without it.
#ifndef DNVME_PRELOAD_DESCRIPTOR_STATE_H_
#define DNVME_PRELOAD_DESCRIPTOR_STATE_H_

#include <cstdint>

namespace dnvme::preload {

enum DescriptorState : uint8_t {
  kUnknown = 0,  // not looked at yet (or reused): the next large transfer tries to adopt it
  kNotOurs = 1,  // libc serves it (not a dnvmefs file, refused, or the library's own)
  kOurs = 2,     // adopted: the descriptor table has its AdoptedFile
};

// The state of `fd`; descriptors out of the tracked range (negative, >= 2^20) are kNotOurs.
DescriptorState StateOf(int fd);
// Sets `fd`'s state (ignored out of range).
void SetState(int fd, DescriptorState s);

}  // namespace dnvme::preload

#endif  // DNVME_PRELOAD_DESCRIPTOR_STATE_H_
