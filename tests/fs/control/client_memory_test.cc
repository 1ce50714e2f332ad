// ClientMapping (fs/control/client_memory.h): the daemon-wide table keeps its last slots for
// root, and a sparse client object is mapped without being allocated in the daemon.
#include "fs/control/client_memory.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <memory>
#include <vector>

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace dnvme::fs
