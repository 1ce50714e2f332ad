// ClientMapping (fs/control/client_memory.h): the daemon-wide table keeps its last slots for
// root, a hole of a client object is mapped without being allocated in the daemon and a transfer
// over one is refused, hugetlbfs
// objects are refused, and a shrunk object's fault is repaired (never fatal) while a fault
// outside client memory still kills.
#include "fs/control/client_memory.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <vector>

#include <gtest/gtest.h>

#include "tests/engine/test_util.h"

namespace dnvme::fs {
namespace {

int MemFd(int64_t size) {
  const int fd = memfd_create("client_memory_test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(ftruncate(fd, size), 0);
  return fd;
}

TEST(ClientMapping, TheLastSlotsAreRoots) {
  const int fd = MemFd(4096);
  std::vector<std::unique_ptr<ClientMapping>> maps;
  const int users = ClientMapping::kMaxMappings - ClientMapping::kRootReserve;
  for (int i = 0; i < users; ++i) {
    auto m = ClientMapping::Map(fd, 0, 4096, true, "user", /*for_root=*/false);
    ASSERT_TRUE(m.ok()) << i << ": " << m.status().ToString();
    maps.push_back(std::move(m).value());
  }
  auto refused = ClientMapping::Map(fd, 0, 4096, true, "user", false);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().error_number(), EMFILE);
  EXPECT_NE(refused.status().message().find("root"), std::string::npos);
  for (int i = 0; i < ClientMapping::kRootReserve; ++i) {
    auto m = ClientMapping::Map(fd, 0, 4096, true, "root", /*for_root=*/true);
    ASSERT_TRUE(m.ok()) << "root's slot " << i << ": " << m.status().ToString();
    maps.push_back(std::move(m).value());
  }
  EXPECT_FALSE(ClientMapping::Map(fd, 0, 4096, true, "root", true).ok());
  maps.pop_back();  // a slot freed is taken again
  EXPECT_TRUE(ClientMapping::Map(fd, 0, 4096, true, "root", true).ok());
  close(fd);
}

TEST(ClientMapping, ASparseObjectIsNotPopulated) {
  const int64_t size = int64_t{64} << 20;
  const int fd = MemFd(size);
  auto m = ClientMapping::Map(fd, 0, size, true, "sparse", false);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  struct stat st {};
  ASSERT_EQ(fstat(fd, &st), 0);
  EXPECT_LT(st.st_blocks * 512, 1 << 20) << "registering a sparse object allocated it";
  close(fd);
}

TEST(ClientMapping, AHoleRangeOfAHalfAllocatedObjectIsNotPopulated) {
  // The first half is a hole, the second is data: the object's allocated size (st_blocks) equals
  // the registered range's length, which the old check took for "no hole".
  const int64_t half = int64_t{8} << 20;
  const int fd = MemFd(2 * half);
  std::vector<char> data(half, 'd');
  ASSERT_EQ(pwrite(fd, data.data(), data.size(), half), static_cast<ssize_t>(half));
  struct stat before {};
  ASSERT_EQ(fstat(fd, &before), 0);
  for (bool writable : {true, false}) {
    auto m = ClientMapping::Map(fd, 0, half, writable, "hole", false);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    struct stat after {};
    ASSERT_EQ(fstat(fd, &after), 0);
    EXPECT_EQ(after.st_blocks, before.st_blocks)
        << "registering the hole allocated it (writable " << writable << ")";
  }
  // The data half is registered as well (and may be pre-faulted: nothing new to allocate).
  auto m = ClientMapping::Map(fd, half, half, true, "data", false);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m.value()->data()[0], 'd');
  close(fd);
}

// A transfer may land only on allocated pages: a hole (left or punched by the client) is refused
// with the byte it starts at, before anything faults it in on the daemon's account.
TEST(ClientMapping, ATransferOverAHoleIsRefusedAndAllocatesNothing) {
  const int64_t size = int64_t{4} << 20;
  const int fd = MemFd(size);
  std::vector<char> data(size / 2, 'd');
  ASSERT_EQ(pwrite(fd, data.data(), data.size(), 0), static_cast<ssize_t>(data.size()));
  auto m = ClientMapping::Map(fd, 0, size, true, "half", false);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  struct stat before {};
  ASSERT_EQ(fstat(fd, &before), 0);
  DNVME_EXPECT_OK(m.value()->CheckAllocated(0, size / 2));
  DNVME_EXPECT_OK(m.value()->CheckAllocated(100, 4096));       // unaligned, inside the data
  Status hole = m.value()->CheckAllocated(size / 2 - 10, 20);  // runs into the hole
  EXPECT_EQ(hole.error_number(), EFAULT) << hole.ToString();
  EXPECT_NE(hole.message().find("at byte " + std::to_string(size / 2)), std::string::npos)
      << hole.message();
  // Punched after registration: refused too.
  ASSERT_EQ(fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 4096, 4096), 0);
  EXPECT_EQ(m.value()->CheckAllocated(0, size / 2).error_number(), EFAULT);
  struct stat after {};
  ASSERT_EQ(fstat(fd, &after), 0);
  EXPECT_LE(after.st_blocks, before.st_blocks) << "the check allocated client memory";
  // Only preallocated (fallocate leaves shmem pages not up to date: mincore calls them absent)
  // is refused too; written by its owner: accepted, the whole range.
  ASSERT_EQ(posix_fallocate(fd, 0, size), 0);
  EXPECT_EQ(m.value()->CheckAllocated(0, size).error_number(), EFAULT);
  std::vector<char> zeros(size, 0);
  ASSERT_EQ(pwrite(fd, zeros.data(), zeros.size(), 0), static_cast<ssize_t>(zeros.size()));
  DNVME_EXPECT_OK(m.value()->CheckAllocated(0, size));
  DNVME_EXPECT_OK(m.value()->CheckAllocated(0, 0));
  close(fd);
}

TEST(ClientMapping, HugetlbfsIsRefusedWithTheReason) {
  const int fd = memfd_create("client_memory_test_huge", MFD_CLOEXEC | MFD_HUGETLB);
  if (fd < 0) GTEST_SKIP() << "memfd_create(MFD_HUGETLB): " << std::strerror(errno);
  // Sizing needs no huge page: they are taken at fault time.
  if (ftruncate(fd, 2 << 20) != 0) {
    close(fd);
    GTEST_SKIP() << "ftruncate of a hugetlb memfd: " << std::strerror(errno);
  }
  auto m = ClientMapping::Map(fd, 0, 0, true, "/proc/1/fd/3", false);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().error_number(), EINVAL);
  EXPECT_NE(m.status().message().find("hugetlbfs"), std::string::npos) << m.status().ToString();
  EXPECT_NE(m.status().message().find("SIGBUS"), std::string::npos) << m.status().ToString();
  close(fd);
}

// A memfd that cannot be sealed (no MFD_ALLOW_SEALING), of `size` bytes of 'x'.
int UnsealableMemFd(int64_t size) {
  const int fd = memfd_create("client_memory_test_unsealed", MFD_CLOEXEC);
  EXPECT_GE(fd, 0);
  std::vector<char> data(size, 'x');
  EXPECT_EQ(pwrite(fd, data.data(), data.size(), 0), static_cast<ssize_t>(size));
  return fd;
}

// Reads every page of `m` (volatile: the compiler must touch them all); their sum.
long TouchAll(const ClientMapping& m) {
  long sum = 0;
  for (int64_t i = 0; i < m.size(); i += 4096) {
    sum += static_cast<const volatile char*>(m.data())[i];
  }
  return sum;
}

TEST(ClientMapping, AShrunkObjectIsRepairedPageByPage) {
  const int64_t size = 1 << 20;
  const int fd = UnsealableMemFd(size);
  auto m = ClientMapping::Map(fd, 0, size, true, "shrunk", false);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  ASSERT_FALSE(m.value()->sealed());
  ASSERT_EQ(ftruncate(fd, size / 2), 0);
  EXPECT_EQ(TouchAll(*m.value()), 'x' * (size / 2 / 4096)) << "the kept half reads as it was";
  EXPECT_TRUE(m.value()->revoked());
  close(fd);
}

TEST(ClientMapping, WhenThePageRepairFailsTheWholeMappingIsReplaced) {
  // As at vm.max_map_count: zero pages from the faulting page on would split the mapping, and
  // the split fails. The handler then replaces the whole mapping instead of letting SIGBUS kill.
  const int64_t size = 1 << 20;
  const int fd = UnsealableMemFd(size);
  auto m = ClientMapping::Map(fd, 0, size, true, "shrunk", false);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  ASSERT_EQ(ftruncate(fd, size / 2), 0);
  ClientMapping::FailPageRepairForTesting(true);
  const long sum = TouchAll(*m.value());
  ClientMapping::FailPageRepairForTesting(false);
  EXPECT_EQ(sum, 'x' * (size / 2 / 4096)) << "read before the fault";
  EXPECT_TRUE(m.value()->revoked());
  EXPECT_EQ(m.value()->data()[0], 0) << "the pages before the fault were replaced as well";
  // The replacement is writable too (a pread target).
  m.value()->data()[size - 1] = 1;
  close(fd);
}

TEST(ClientMappingDeathTest, AFaultOutsideClientMemoryStillKills) {
  // The handler is installed (by any Map); a SIGBUS elsewhere keeps the default action.
  const int keep = MemFd(4096);
  auto m = ClientMapping::Map(keep, 0, 4096, true, "installs the handler", false);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EXIT(
      {
        const int fd = memfd_create("not_registered", MFD_CLOEXEC);
        if (fd < 0 || ftruncate(fd, 8192) != 0) _exit(2);
        void* p = mmap(nullptr, 8192, PROT_READ, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED || ftruncate(fd, 0) != 0) _exit(2);
        const volatile char c = static_cast<volatile char*>(p)[4096];
        (void)c;
        _exit(0);
      },
      ::testing::KilledBySignal(SIGBUS), "");
  close(keep);
}

}  // namespace
}  // namespace dnvme::fs
