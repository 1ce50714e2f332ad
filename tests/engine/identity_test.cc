// The identity switch (dnvme/identity.h) and the engine's writer identity (adopt_fd's
// write_as): a thread acting for a user gets exactly the user's file-system identity, comes back
// with exactly its own effective capabilities (a dormant one stays dormant, although the kernel
// raises every permitted file-system capability when fsuid returns to 0), and a write submitted
// for a user is that user's write to the kernel (it clears set-user-ID, as the user's own would).
// These need root (switching needs CAP_SETUID/CAP_SETGID); as another user they skip.
#include "dnvme/identity.h"

#include <linux/capability.h>
#include <sys/fsuid.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <memory>
#include <thread>

#include "dnvme/fd.h"
#include "dnvme/handle.h"
#include "tests/engine/test_util.h"

namespace dnvme {
namespace {

constexpr uid_t kNobody = 65534;

uint64_t Bit(int cap) { return uint64_t{1} << cap; }

// Clears `cap` from the calling thread's effective set (as a daemon keeps CAP_MKNOD dormant).
void LowerEffective(int cap) {
  __user_cap_header_struct hdr{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct d[2] = {};
  ASSERT_EQ(syscall(SYS_capget, &hdr, d), 0);
  d[cap / 32].effective &= ~(1u << (cap % 32));
  ASSERT_EQ(syscall(SYS_capset, &hdr, d), 0);
}

uid_t Fsuid() { return static_cast<uid_t>(setfsuid(static_cast<uid_t>(-1))); }
gid_t Fsgid() { return static_cast<gid_t>(setfsgid(static_cast<gid_t>(-1))); }

class IdentityTest : public test::ScratchTest {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "switching identity needs root (CAP_SETUID/CAP_SETGID)";
    test::ScratchTest::SetUp();
  }
};

TEST_F(IdentityTest, ScopedSwitchActsAsTheUserAndRestoresTheExactEffectiveSet) {
  // On a thread of its own: capabilities are per thread, and the test's main thread stays whole.
  std::thread t([] {
    LowerEffective(CAP_MKNOD);
    auto before = ThreadEffectiveCapabilities();
    ASSERT_TRUE(before.ok());
    ASSERT_EQ(*before & Bit(CAP_MKNOD), 0u);
    {
      auto as = ScopedFsIdentity::Enter(FsIdentity{kNobody, kNobody, {}});
      ASSERT_TRUE(as.ok()) << as.status().ToString();
      EXPECT_EQ(Fsuid(), kNobody);
      EXPECT_EQ(Fsgid(), kNobody);
      auto during = ThreadEffectiveCapabilities();
      ASSERT_TRUE(during.ok());
      EXPECT_EQ(*during & Bit(CAP_DAC_OVERRIDE), 0u) << "the kernel drops fs capabilities";
    }
    EXPECT_EQ(Fsuid(), 0u);
    EXPECT_EQ(Fsgid(), 0u);
    auto after = ThreadEffectiveCapabilities();
    ASSERT_TRUE(after.ok());
    EXPECT_EQ(*after, *before) << "fsuid 0 re-raised permitted fs capabilities (CAP_MKNOD)";
  });
  t.join();
}

TEST_F(IdentityTest, StickySwitchChangesOnlyWhenAskedForAnotherIdentity) {
  std::thread t([] {
    LowerEffective(CAP_MKNOD);
    auto own = ThreadEffectiveCapabilities();
    ASSERT_TRUE(own.ok());
    const FsIdentity a{kNobody, kNobody, {}};
    const FsIdentity b{kNobody - 1, kNobody - 1, {kNobody}};
    DNVME_ASSERT_OK(SwitchThreadFsIdentity(&a));
    EXPECT_EQ(Fsuid(), kNobody);
    DNVME_ASSERT_OK(SwitchThreadFsIdentity(&b));
    EXPECT_EQ(Fsuid(), kNobody - 1);
    gid_t groups[4];
    ASSERT_EQ(getgroups(4, groups), 1);
    EXPECT_EQ(groups[0], kNobody);
    DNVME_ASSERT_OK(SwitchThreadFsIdentity(nullptr));
    EXPECT_EQ(Fsuid(), 0u);
    auto after = ThreadEffectiveCapabilities();
    ASSERT_TRUE(after.ok());
    EXPECT_EQ(*after, *own);
  });
  t.join();
}

// ext4 (and the rest, through file_remove_privs) clears set-user-ID on a write by a process
// without CAP_FSETID: an engine write for a user must do the same, and one for root must not.
TEST_F(IdentityTest, AWriteForAUserIsTheUsersWriteToTheKernel) {
  auto handle = AioHandle::Create();
  ASSERT_TRUE(handle.ok()) << handle.status().ToString();
  test::AlignedBuffer data(1 << 20, 0);
  test::FillPattern(data.data(), data.size(), 0);
  for (const bool as_user : {false, true}) {
    const std::string path = Path(as_user ? "user" : "root");
    UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
    ASSERT_TRUE(fd.valid()) << std::strerror(errno);
    ASSERT_EQ(::fchmod(fd.get(), 04777), 0);
    std::shared_ptr<const FsIdentity> who;
    if (as_user) who = std::make_shared<const FsIdentity>(FsIdentity{kNobody, kNobody, {}});
    auto file = (*handle)->adopt_fd(fd.get(), FileAccess::kWrite, who);
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    EXPECT_EQ(file->write_identity(), who.get());
    // An aligned megabyte (O_DIRECT) and an unaligned tail (the page cache): both paths.
    DNVME_ASSERT_OK((*handle)->sync_pwrite(data.data(), 1 << 20, *file, 0));
    DNVME_ASSERT_OK((*handle)->sync_pwrite(data.data(), 100, *file, (1 << 20) + 7));
    struct stat st {};
    ASSERT_EQ(::fstat(fd.get(), &st), 0);
    EXPECT_EQ((st.st_mode & S_ISUID) != 0, !as_user)
        << (as_user ? "a user's write kept set-user-ID" : "root's write lost set-user-ID");
  }
}

}  // namespace
}  // namespace dnvme
