#include "fs/control/client_memory.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>

#include "dnvme/log.h"

namespace dnvme::fs {
namespace {

// One registered mapping as the signal handler sees it. `state`: 0 free, 1 being set up or torn
// down (ignored by the handler), 2 live.
struct Slot {
  std::atomic<uintptr_t> start{0};
  std::atomic<uintptr_t> end{0};
  std::atomic<int> state{0};
  std::atomic<bool> revoked{false};
};
static_assert(std::atomic<uintptr_t>::is_always_lock_free, "the SIGBUS handler needs lock-free");
static_assert(std::atomic<int>::is_always_lock_free, "the SIGBUS handler needs lock-free");

Slot g_slots[ClientMapping::kMaxMappings];
long g_page = 4096;
std::atomic<bool> g_fail_page_repair{false};  // FailPageRepairForTesting

// Private zero pages over [from, end), in place of the client's lost ones.
bool MapZeros(uintptr_t from, uintptr_t end) {
  void* p = mmap(reinterpret_cast<void*>(from), end - from, PROT_READ | PROT_WRITE,
                 MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return p != MAP_FAILED;
}

void OnSigbus(int sig, siginfo_t* info, void* /*ucontext*/) {
  const int saved_errno = errno;  // the interrupted code may be about to read it
  const uintptr_t addr = reinterpret_cast<uintptr_t>(info->si_addr);
  for (Slot& s : g_slots) {
    if (s.state.load(std::memory_order_acquire) != 2) continue;
    const uintptr_t start = s.start.load(std::memory_order_relaxed);
    const uintptr_t end = s.end.load(std::memory_order_relaxed);
    if (addr < start || addr >= end) continue;
    // The client shrank its object: put private zero pages over the rest of the mapping so the
    // faulting copy (and any later one) completes; the transfer is then reported as failed.
    // First from the faulting page on, which keeps the pages before it (a split of the mapping:
    // it needs a new VMA, so it fails with ENOMEM at vm.max_map_count). Failing that, the whole
    // registered range, which is one mapping (or the two of an earlier repair) replaced by one:
    // no split, no new VMA. A fault in client memory never takes the default action: if even
    // that fails (no memory for the page tables), the access faults again on return and lands
    // here again, after a pause: one thread waits for memory rather than the daemon dying.
    const uintptr_t page = addr & ~static_cast<uintptr_t>(g_page - 1);
    if ((!g_fail_page_repair.load(std::memory_order_relaxed) && MapZeros(page, end)) ||
        MapZeros(start, end)) {
      s.revoked.store(true, std::memory_order_release);
    } else {
      const timespec pause{0, 1000 * 1000};
      nanosleep(&pause, nullptr);
    }
    errno = saved_errno;
    return;
  }
  // Not ours: the default action, so a real bug still dumps core.
  signal(sig, SIG_DFL);
  errno = saved_errno;
}

void InstallHandlerOnce() {
  static std::once_flag once;
  std::call_once(once, [] {
    g_page = sysconf(_SC_PAGESIZE);
    if (g_page <= 0) g_page = 4096;
    struct sigaction sa {};
    sa.sa_sigaction = OnSigbus;
    sa.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, nullptr) != 0) {
      Logger().error("installing the SIGBUS handler for client memory failed: {}",
                     std::strerror(errno));
    }
  });
}

int TakeSlot(uintptr_t start, uintptr_t end, bool for_root) {
  const int slots = for_root ? ClientMapping::kMaxMappings
                             : ClientMapping::kMaxMappings - ClientMapping::kRootReserve;
  for (int i = 0; i < slots; ++i) {
    int expected = 0;
    if (g_slots[i].state.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) {
      g_slots[i].start.store(start, std::memory_order_relaxed);
      g_slots[i].end.store(end, std::memory_order_relaxed);
      g_slots[i].revoked.store(false, std::memory_order_relaxed);
      g_slots[i].state.store(2, std::memory_order_release);
      return i;
    }
  }
  return -1;
}

}  // namespace

Result<std::unique_ptr<ClientMapping>> ClientMapping::Map(int fd, int64_t offset, int64_t size,
                                                          bool writable, const std::string& label,
                                                          bool for_root) {
  InstallHandlerOnce();
  struct stat st {};
  if (fstat(fd, &st) != 0) return Status::FromErrno(errno, "fstat " + label);
  if (!S_ISREG(st.st_mode)) {
    return Status::InvalidArgument(label + " is not a shared-memory object (not a regular file)");
  }
  struct statfs sf {};
  if (fstatfs(fd, &sf) != 0) return Status::FromErrno(errno, "fstatfs " + label);
  // Only tmpfs objects (/dev/shm, memfds): mapping a file of a real filesystem (or of this very
  // mount, which would deadlock on its own page faults) is refused. So is hugetlbfs
  // (MFD_HUGETLB, a hugetlbfs file): its faults raise SIGBUS that no repair of ours can undo --
  // when the huge page pool is empty, and when the owner shrinks it (it cannot be sealed, and a
  // 4 KiB page cannot be mapped inside a huge page mapping).
  if (sf.f_type == static_cast<decltype(sf.f_type)>(HUGETLBFS_MAGIC)) {
    return Status::InvalidArgument(
        label +
        " is a hugetlbfs object (MFD_HUGETLB or a hugetlbfs file): the daemon cannot make its "
        "faults safe (an empty huge page pool or a shrunk object raises SIGBUS): register a "
        "/dev/shm object or a memfd without MFD_HUGETLB");
  }
  if (sf.f_type != TMPFS_MAGIC) {
    return Status::InvalidArgument(label + " is not on tmpfs (not a /dev/shm object or a memfd)");
  }
  if (offset % g_page != 0) {
    return Status::InvalidArgument("'offset' " + std::to_string(offset) +
                                   " is not a multiple of the page size " + std::to_string(g_page));
  }
  if (offset > st.st_size) {
    return Status::InvalidArgument("'offset' " + std::to_string(offset) + " is past the end of " +
                                   label + " (" + std::to_string(st.st_size) + " bytes)");
  }
  if (size == 0) size = st.st_size - offset;
  if (size <= 0) return Status::InvalidArgument(label + " is empty");
  if (size > st.st_size - offset) {
    return Status::InvalidArgument("'size' " + std::to_string(size) + " at 'offset' " +
                                   std::to_string(offset) + " is past the end of " + label + " (" +
                                   std::to_string(st.st_size) + " bytes)");
  }
  auto m = std::unique_ptr<ClientMapping>(new ClientMapping());
  m->label_ = label;
  m->size_ = size;
  m->map_len_ = static_cast<size_t>((size + g_page - 1) / g_page * g_page);

  // A memfd that allows sealing is sealed against shrinking, which removes the SIGBUS case.
  int seals = fcntl(fd, F_GET_SEALS);
  if (seals >= 0 && !(seals & F_SEAL_SEAL) && !(seals & F_SEAL_SHRINK)) {
    if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) == 0) seals |= F_SEAL_SHRINK;
  }
  m->sealed_ = seals >= 0 && (seals & F_SEAL_SHRINK);

  const int prot = writable ? PROT_READ | PROT_WRITE : PROT_READ;
  void* p = mmap(nullptr, m->map_len_, prot, MAP_SHARED, fd, offset);
  if (p == MAP_FAILED) return Status::FromErrno(errno, "mmap " + label);
  m->base_ = static_cast<char*>(p);
  m->writable_ = writable;
  // Fault the page tables in now, once, at registration (like DeepNVMe pinning its buffers at
  // allocation): otherwise the first O_DIRECT transfer pays a page fault per 4 KiB page inside
  // get_user_pages (~250k for 1 GiB). Best effort: older kernels lack the advice (EINVAL), and a
  // part the client already truncated fails here (EFAULT) and later in the transfer.
  // Never over a hole of the registered range: populating a tmpfs hole allocates it, in the
  // daemon and on its account, for a client that may never touch it (a 1 GiB sparse object
  // became 1 GiB of the machine's memory at registration). The holes are looked up over the
  // range itself (SEEK_HOLE), not guessed from the object's allocated size: a range that is all
  // hole in an object that is half data is still all hole. A range with any hole is not
  // pre-faulted at all, rather than extent by extent: a client decides how many extents there
  // are (every other page), and registration should not cost the daemon one call per extent.
  // Unpopulated, a hole is filled only where a transfer actually lands (bounded, like a hole
  // punched after this check, by the registered bytes: ctl_max_bytes).
  const int advice = writable ? MADV_POPULATE_WRITE : MADV_POPULATE_READ;
  const off_t hole = lseek(fd, static_cast<off_t>(offset), SEEK_HOLE);
  if (hole < 0 || hole < offset + size) {
    // Once per registration, which a user repeats at will: throttled.
    DNVME_LOG_THROTTLED(debug, "client buffer {} has holes: not pre-faulted", LogEscape(label));
  } else if (madvise(p, m->map_len_, advice) != 0) {
    DNVME_LOG_THROTTLED(debug, "pre-faulting client buffer {} skipped: {}", LogEscape(label),
                        std::strerror(errno));
  }
  const auto start = reinterpret_cast<uintptr_t>(p);
  m->slot_ = TakeSlot(start, start + m->map_len_, for_root);
  if (m->slot_ < 0) {
    return Status::ResourceExhausted(
        EMFILE, std::string("the daemon's table of client buffers is full") +
                    (for_root ? ""
                              : " for users other than root (the last " +
                                    std::to_string(kRootReserve) + " slots are root's)"));
  }
  return m;
}

ClientMapping::~ClientMapping() {
  if (slot_ >= 0) {
    g_slots[slot_].state.store(1, std::memory_order_release);  // the handler ignores it now
  }
  if (base_ != nullptr && munmap(base_, map_len_) != 0) {
    DNVME_LOG_THROTTLED(err, "munmap of client buffer {} failed: {}", LogEscape(label_),
                        std::strerror(errno));
  }
  if (slot_ >= 0) g_slots[slot_].state.store(0, std::memory_order_release);
}

void ClientMapping::FailPageRepairForTesting(bool fail) {
  g_fail_page_repair.store(fail, std::memory_order_relaxed);
}

Status ClientMapping::CheckAllocated(int64_t offset, int64_t length) const {
  if (length <= 0) return Status::Ok();
  const uintptr_t page = static_cast<uintptr_t>(g_page);
  const uintptr_t base = reinterpret_cast<uintptr_t>(base_);
  const uintptr_t first = (base + static_cast<uintptr_t>(offset)) & ~(page - 1);
  const uintptr_t end =
      (base + static_cast<uintptr_t>(offset) + static_cast<uintptr_t>(length) + page - 1) &
      ~(page - 1);
  // In steps: one vector byte per page, a bounded buffer however large the transfer.
  constexpr size_t kStep = 4096;
  unsigned char vec[kStep];
  for (uintptr_t at = first; at < end;) {
    const size_t pages = std::min<size_t>(kStep, (end - at) / page);
    if (mincore(reinterpret_cast<void*>(at), pages * page, vec) != 0) {
      return Status::FromErrno(errno, "mincore of client buffer " + LogEscape(label_));
    }
    for (size_t i = 0; i < pages; ++i) {
      if ((vec[i] & 1) == 0) {
        const uintptr_t bad = at + i * page - base;
        return Status::IoError(
            EFAULT, "buffer " + LogEscape(label_) + " has a page not allocated at byte " +
                        std::to_string(bad) +
                        " (a hole, a page only fallocated, or one swapped out): the daemon "
                        "does not allocate a client's memory on its own account; write the "
                        "buffer (zeros will do) before transferring into or out of it");
      }
    }
    at += pages * page;
  }
  return Status::Ok();
}

bool ClientMapping::revoked() const {
  return slot_ >= 0 && g_slots[slot_].revoked.load(std::memory_order_acquire);
}

}  // namespace dnvme::fs
