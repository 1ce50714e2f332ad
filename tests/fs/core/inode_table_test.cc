// InodeTable (fs/core/inode_table.h) on a scratch directory standing for BACKING_DIR, no mount:
// one Inode per backing (dev, ino) living by the kernel's lookup count, pins, the root and the
// control nodes that are never forgotten, and the inode charges of users' lookups (per uid, and
// all users together at most half of RLIMIT_NOFILE).
#include "fs/core/inode_table.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "datapath/file_data.h"
#include "fs/limits/uid_limits.h"
#include "tests/engine/test_util.h"

namespace dnvme::fs {
namespace {

constexpr int64_t kUnlimited = int64_t{1} << 40;

// Every maximum unlimited but the inodes'.
UidLimits::Maxima InodeMax(int64_t max_inodes) {
  UidLimits::Maxima m;
  m.fill(kUnlimited);
  m[static_cast<size_t>(UidResource::kInodes)] = max_inodes;
  return m;
}

// The descriptors this process has open now.
int OpenFds() {
  DIR* d = opendir("/proc/self/fd");
  if (d == nullptr) return -1;
  int n = 0;
  while (readdir(d) != nullptr) ++n;
  closedir(d);
  return n - 3;  // ".", ".." and the directory's own descriptor
}

struct stat StatOf(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(lstat(path.c_str(), &st), 0) << path;
  return st;
}

class InodeTableTest : public dnvme::test::ScratchTest {
 protected:
  void SetUp() override {
    ScratchTest::SetUp();
    if (HasFatalFailure()) return;
    Remake(kUnlimited);
  }
  void TearDown() override {
    table_.reset();  // before the limits its inodes' charges point to
    ScratchTest::TearDown();
  }

  // A table whose inodes share a data path with nothing set (write-behind and read-ahead off).
  std::unique_ptr<InodeTable> MakeTable(UidLimits* limits) {
    return std::make_unique<InodeTable>(&data_shared_, limits);
  }
  // A fresh table on the scratch directory, each uid's lookups holding at most `max_inodes`
  // inodes (limits_; no limits at all when `charged` is false).
  void Remake(int64_t max_inodes, bool charged = true) {
    table_.reset();
    limits_ = std::make_unique<UidLimits>(InodeMax(max_inodes));
    table_ = MakeTable(charged ? limits_.get() : nullptr);
    DNVME_ASSERT_OK(table_->OpenRoot(dir()));
  }

  void MakeFile(const std::string& name, size_t size = 0, mode_t mode = 0644) {
    const int fd = open(Path(name).c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
    ASSERT_GE(fd, 0) << name;
    ASSERT_EQ(ftruncate(fd, static_cast<off_t>(size)), 0);
    close(fd);
  }

  // Lookup under the root; the errno (0 on success), and the entry in *e.
  int LookupAs(uid_t uid, const char* name, fuse_entry_param* e, fuse_ino_t parent = FUSE_ROOT_ID) {
    Result<fuse_entry_param> got = table_->Lookup(parent, name, uid);
    *e = got.ok() ? got.value() : fuse_entry_param{};
    return got.status().ErrnoOr();
  }
  // A lookup that must succeed; its node id.
  fuse_ino_t Looked(const char* name, uid_t uid = 0, fuse_ino_t parent = FUSE_ROOT_ID) {
    fuse_entry_param e{};
    const int err = LookupAs(uid, name, &e, parent);
    EXPECT_EQ(err, 0) << name << ": " << strerror(err);
    return e.ino;
  }
  // Whether the table holds an inode for the backing file at `name`, without keeping it.
  bool Held(const std::string& name) {
    const struct stat st = StatOf(Path(name));
    Inode* in = table_->Pin(st.st_dev, st.st_ino);
    if (in != nullptr) table_->Unpin(in);
    return in != nullptr;
  }
  int64_t Charged(uid_t uid) const { return limits_->Held(uid, UidResource::kInodes); }

  datapath::FileDataShared data_shared_;
  std::unique_ptr<UidLimits> limits_;
  std::unique_ptr<InodeTable> table_;
};

TEST_F(InodeTableTest, LookupFillsTheEntryFromTheBackingFile) {
  MakeFile("a", 1234, 0640);
  const struct stat want = StatOf(Path("a"));
  fuse_entry_param e{};
  ASSERT_EQ(LookupAs(0, "a", &e), 0);
  EXPECT_NE(e.ino, 0u);
  EXPECT_NE(e.ino, FUSE_ROOT_ID);
  EXPECT_EQ(e.attr.st_ino, want.st_ino);
  EXPECT_EQ(e.attr.st_size, 1234);
  EXPECT_EQ(e.attr.st_mode, want.st_mode);
  EXPECT_EQ(e.entry_timeout, kEntryTimeout);
  EXPECT_EQ(e.attr_timeout, kEntryTimeout);
  Inode& in = table_->Get(e.ino);
  EXPECT_EQ(in.virt, VirtualNode::kNone);
  EXPECT_EQ(in.dev, want.st_dev);
  EXPECT_EQ(in.ino, want.st_ino);
  EXPECT_EQ(in.type, static_cast<mode_t>(S_IFREG));
  EXPECT_EQ(in.nlookup, 1u);
  // It keeps an O_PATH descriptor of that very file.
  ASSERT_GE(in.fd, 0);
  EXPECT_NE(fcntl(in.fd, F_GETFL) & O_PATH, 0);
  struct stat by_fd {};
  ASSERT_EQ(fstat(in.fd, &by_fd), 0);
  EXPECT_EQ(by_fd.st_ino, want.st_ino);
  table_->Forget(e.ino, 1);
}

TEST_F(InodeTableTest, AMissingNameIsAnErrnoAndHoldsNothing) {
  MakeFile("file");
  const int fds = OpenFds();
  fuse_entry_param e{};
  EXPECT_EQ(LookupAs(0, "nope", &e), ENOENT);
  EXPECT_EQ(LookupAs(1000, "nope", &e), ENOENT);
  EXPECT_EQ(Charged(1000), 0);
  const fuse_ino_t file = Looked("file");
  EXPECT_EQ(LookupAs(0, "x", &e, file), ENOTDIR);  // a regular file as the parent
  table_->Forget(file, 1);
  EXPECT_EQ(OpenFds(), fds);
}

TEST_F(InodeTableTest, ASymlinkIsLookedUpItselfNeverFollowed) {
  MakeFile("target", 10);
  ASSERT_EQ(symlink("target", Path("link").c_str()), 0);
  ASSERT_EQ(symlink("nowhere", Path("dangling").c_str()), 0);
  fuse_entry_param e{};
  ASSERT_EQ(LookupAs(0, "link", &e), 0);
  EXPECT_TRUE(S_ISLNK(e.attr.st_mode));
  EXPECT_EQ(e.attr.st_ino, StatOf(Path("link")).st_ino);
  EXPECT_EQ(table_->Get(e.ino).type, static_cast<mode_t>(S_IFLNK));
  const fuse_ino_t target = Looked("target");
  EXPECT_NE(e.ino, target);
  fuse_entry_param d{};
  ASSERT_EQ(LookupAs(0, "dangling", &d), 0);  // the link exists, whatever it names
  EXPECT_TRUE(S_ISLNK(d.attr.st_mode));
  for (fuse_ino_t ino : {e.ino, target, d.ino}) table_->Forget(ino, 1);
}

TEST_F(InodeTableTest, OneInodePerBackingFileWhateverTheName) {
  MakeFile("a");
  ASSERT_EQ(link(Path("a").c_str(), Path("hard").c_str()), 0);
  ASSERT_EQ(mkdir(Path("sub").c_str(), 0755), 0);
  MakeFile("sub/a");
  const int fds = OpenFds();
  const fuse_ino_t a = Looked("a");
  EXPECT_EQ(Looked("a"), a);
  EXPECT_EQ(Looked("hard"), a);  // a hard link: the same (dev, ino)
  EXPECT_EQ(table_->Get(a).nlookup, 3u);
  EXPECT_EQ(OpenFds(), fds + 1);  // one descriptor for the three lookups
  const fuse_ino_t sub = Looked("sub");
  EXPECT_EQ(table_->Get(sub).type, static_cast<mode_t>(S_IFDIR));
  const fuse_ino_t sub_a = Looked("a", 0, sub);  // looked up under its parent's inode
  EXPECT_NE(sub_a, a);
  EXPECT_EQ(table_->Get(sub_a).ino, StatOf(Path("sub/a")).st_ino);
  table_->Forget(a, 3);
  table_->Forget(sub_a, 1);
  table_->Forget(sub, 1);
  EXPECT_EQ(OpenFds(), fds);
}

TEST_F(InodeTableTest, ForgetDropsTheInodeAndItsDescriptorAtZero) {
  MakeFile("a");
  const int fds = OpenFds();
  const fuse_ino_t a = Looked("a");
  Looked("a");
  Looked("a");
  table_->Forget(a, 2);
  EXPECT_TRUE(Held("a"));
  EXPECT_EQ(table_->Get(a).nlookup, 1u);
  EXPECT_EQ(OpenFds(), fds + 1);
  table_->Forget(a, 1);
  EXPECT_FALSE(Held("a"));
  EXPECT_EQ(OpenFds(), fds);
  // Looked up again: a fresh inode, counted from one.
  const fuse_ino_t again = Looked("a");
  EXPECT_EQ(table_->Get(again).nlookup, 1u);
  EXPECT_EQ(table_->Get(again).ino, StatOf(Path("a")).st_ino);
  table_->Forget(again, 1);
  EXPECT_EQ(OpenFds(), fds);
}

TEST_F(InodeTableTest, AForgetOfMoreThanTheCountDropsTheInodeOnce) {
  MakeFile("a");
  const int fds = OpenFds();
  const fuse_ino_t a = Looked("a", 1000);
  Looked("a", 1000);
  EXPECT_EQ(Charged(1000), 1);
  table_->Forget(a, 5);  // logged; the count stops at zero
  EXPECT_FALSE(Held("a"));
  EXPECT_EQ(Charged(1000), 0);
  EXPECT_EQ(OpenFds(), fds);
}

TEST_F(InodeTableTest, TheRootAndTheControlNodesAreNeverForgotten) {
  const struct stat root = StatOf(dir());
  Inode& r = table_->Get(FUSE_ROOT_ID);
  EXPECT_EQ(r.fd, table_->root_fd());
  EXPECT_EQ(r.ino, root.st_ino);
  EXPECT_EQ(r.dev, root.st_dev);
  EXPECT_EQ(r.type, static_cast<mode_t>(S_IFDIR));
  table_->Forget(FUSE_ROOT_ID, 100);
  EXPECT_EQ(&table_->Get(FUSE_ROOT_ID), &r);
  EXPECT_GE(table_->root_fd(), 0);
  EXPECT_GE(fcntl(table_->root_fd(), F_GETFD), 0);

  std::set<Inode*> nodes;
  for (VirtualNode k : {VirtualNode::kCtlDir, VirtualNode::kCtl, VirtualNode::kStats,
                        VirtualNode::kConfig, VirtualNode::kBroker}) {
    Inode& v = table_->Virtual(k);
    EXPECT_EQ(v.virt, k);
    EXPECT_EQ(v.fd, -1);  // served by the daemon, nothing in BACKING_DIR
    EXPECT_EQ(v.type, static_cast<mode_t>(k == VirtualNode::kCtlDir ? S_IFDIR : S_IFREG));
    EXPECT_EQ(&table_->Virtual(k), &v);  // the same node every time
    nodes.insert(&v);
    table_->Forget(reinterpret_cast<fuse_ino_t>(&v), 1);
    EXPECT_EQ(v.virt, k);  // still there (ASan would see a freed node)
  }
  EXPECT_EQ(nodes.size(), 5u);
}

TEST_F(InodeTableTest, APinKeepsAnInodeTheKernelForgot) {
  MakeFile("a");
  MakeFile("never");
  const struct stat never = StatOf(Path("never"));
  EXPECT_EQ(table_->Pin(never.st_dev, never.st_ino), nullptr);  // the kernel never looked it up
  const fuse_ino_t a = Looked("a");
  const struct stat st = StatOf(Path("a"));
  Inode* pinned = table_->Pin(st.st_dev, st.st_ino);
  ASSERT_EQ(reinterpret_cast<fuse_ino_t>(pinned), a);
  EXPECT_EQ(pinned->nlookup, 2u);
  table_->Forget(a, 1);  // the kernel forgets it; the pin keeps it
  EXPECT_EQ(pinned->ino, st.st_ino);
  EXPECT_GE(fcntl(pinned->fd, F_GETFD), 0);
  EXPECT_EQ(table_->Pin(st.st_dev, st.st_ino), pinned);
  table_->Unpin(pinned);
  table_->Unpin(pinned);
  EXPECT_EQ(table_->Pin(st.st_dev, st.st_ino), nullptr);
}

TEST_F(InodeTableTest, AnInodeKeepsItsFileWhenTheNameGoesToAnother) {
  // The O_PATH descriptor keeps the unlinked file's inode number from being reused, so a new file
  // of the same name is always another inode, never the old node id with new contents.
  MakeFile("a", 100);
  const fuse_ino_t old_node = Looked("a");
  const ino_t old_ino = table_->Get(old_node).ino;
  ASSERT_EQ(unlink(Path("a").c_str()), 0);
  MakeFile("a", 200);
  fuse_entry_param e{};
  ASSERT_EQ(LookupAs(0, "a", &e), 0);
  EXPECT_NE(e.attr.st_ino, old_ino);
  EXPECT_NE(e.ino, old_node);
  EXPECT_EQ(e.attr.st_size, 200);
  struct stat st {};
  ASSERT_EQ(fstat(table_->Get(old_node).fd, &st), 0);
  EXPECT_EQ(st.st_ino, old_ino);  // still the unlinked file
  EXPECT_EQ(st.st_nlink, 0u);
  EXPECT_EQ(st.st_size, 100);
  table_->Forget(old_node, 1);
  table_->Forget(e.ino, 1);
}

TEST_F(InodeTableTest, OpenRootKeepsTheFirstRootAndFailsWithTheErrno) {
  const int fd = table_->root_fd();
  const ino_t ino = table_->Get(FUSE_ROOT_ID).ino;
  ASSERT_EQ(mkdir(Path("other").c_str(), 0755), 0);
  DNVME_EXPECT_OK(table_->OpenRoot(Path("other")));  // a mount over BACKING_DIR itself
  EXPECT_EQ(table_->root_fd(), fd);
  EXPECT_EQ(table_->Get(FUSE_ROOT_ID).ino, ino);
  table_->CloseRoot();
  EXPECT_EQ(table_->root_fd(), -1);
  EXPECT_EQ(fcntl(fd, F_GETFD), -1);
  table_->CloseRoot();  // twice: nothing to close
  EXPECT_EQ(table_->root_fd(), -1);

  auto fresh = MakeTable(nullptr);
  Status missing = fresh->OpenRoot(Path("missing"));
  EXPECT_FALSE(missing.ok());
  EXPECT_EQ(missing.ErrnoOr(), ENOENT) << missing.ToString();
  EXPECT_EQ(fresh->root_fd(), -1);
  MakeFile("plain");
  Status not_dir = fresh->OpenRoot(Path("plain"));
  EXPECT_EQ(not_dir.ErrnoOr(), ENOTDIR) << not_dir.ToString();
  DNVME_EXPECT_OK(fresh->OpenRoot(Path("other")));
  EXPECT_EQ(fresh->Get(FUSE_ROOT_ID).ino, StatOf(Path("other")).st_ino);
}

TEST_F(InodeTableTest, AUsersNewInodesAreChargedUpToItsShare) {
  Remake(2);
  for (const char* n : {"a", "b", "c", "d", "e"}) MakeFile(n);
  const int fds = OpenFds();
  const fuse_ino_t a = Looked("a", 1000);
  Looked("a", 1000);  // the same inode: charged once
  const fuse_ino_t b = Looked("b", 1000);
  EXPECT_EQ(Charged(1000), 2);
  fuse_entry_param e{};
  EXPECT_EQ(LookupAs(1000, "c", &e), ENFILE);
  EXPECT_EQ(Charged(1000), 2);
  EXPECT_FALSE(Held("c"));
  EXPECT_EQ(OpenFds(), fds + 2);  // the refused lookup's descriptor was closed
  // An inode the kernel holds already costs nothing more, whoever made it.
  EXPECT_EQ(Looked("a", 1000), a);
  const fuse_ino_t d = Looked("d", 0);
  EXPECT_EQ(Looked("d", 1000), d);
  EXPECT_EQ(Charged(1000), 2);
  // Root is never charged; another uid has its own share.
  const fuse_ino_t c = Looked("c", 0);
  EXPECT_EQ(Looked("e", 1001), Looked("e", 1001));
  EXPECT_EQ(Charged(1001), 1);
  EXPECT_EQ(Charged(0), 0);
  // The charge goes back when the kernel forgets the inode, not before.
  table_->Forget(a, 2);
  EXPECT_EQ(Charged(1000), 2);
  table_->Forget(a, 1);
  EXPECT_EQ(Charged(1000), 1);
  MakeFile("f");
  const fuse_ino_t f = Looked("f", 1000);
  EXPECT_EQ(Charged(1000), 2);
  for (fuse_ino_t ino : {b, f, c}) table_->Forget(ino, 1);
  table_->Forget(d, 2);
  EXPECT_EQ(Charged(1000), 0);
  table_->Forget(Looked("e", 0), 3);
  EXPECT_EQ(Charged(1001), 0);
  EXPECT_EQ(OpenFds(), fds);
}

TEST_F(InodeTableTest, WithoutLimitsNothingIsCharged) {
  Remake(1, /*charged=*/false);
  std::vector<fuse_ino_t> nodes;
  for (int i = 0; i < 20; ++i) {
    const std::string name = "f" + std::to_string(i);
    MakeFile(name);
    nodes.push_back(Looked(name.c_str(), 1000));
  }
  EXPECT_EQ(Charged(1000), 0);
  for (fuse_ino_t ino : nodes) table_->Forget(ino, 1);
}

// Lowers RLIMIT_NOFILE's soft limit for one test, and puts it back.
class NofileLimit {
 public:
  explicit NofileLimit(rlim_t soft) {
    getrlimit(RLIMIT_NOFILE, &saved_);
    rlimit rl = saved_;
    rl.rlim_cur = soft;
    ok_ = setrlimit(RLIMIT_NOFILE, &rl) == 0;
  }
  ~NofileLimit() { setrlimit(RLIMIT_NOFILE, &saved_); }
  bool ok() const { return ok_; }

 private:
  rlimit saved_{};
  bool ok_ = false;
};

TEST_F(InodeTableTest, AllUsersTogetherHoldAtMostHalfOfTheDescriptorLimit) {
  // With a soft limit of 2k, users' lookups may hold k inodes together: root keeps the rest.
  const int k = OpenFds() + 8;  // the limit is then never what stops a lookup first
  std::vector<std::string> names;
  for (int i = 0; i < k + 3; ++i) {
    names.push_back("f" + std::to_string(i));
    MakeFile(names.back());
  }
  NofileLimit limit(static_cast<rlim_t>(2 * k));
  ASSERT_TRUE(limit.ok());
  std::vector<fuse_ino_t> nodes;
  for (int i = 0; i < k; ++i) {
    nodes.push_back(Looked(names[i].c_str(), 1000 + i % 2));  // two users share the half
  }
  fuse_entry_param e{};
  EXPECT_EQ(LookupAs(1002, names[k].c_str(), &e), ENFILE);  // a third user: the half is full
  EXPECT_EQ(LookupAs(1000, names[k].c_str(), &e), ENFILE);
  EXPECT_EQ(Charged(1002), 0);
  EXPECT_EQ(Looked(names[0].c_str(), 1002), nodes[0]);  // a held inode costs nothing
  nodes.push_back(nodes[0]);
  const fuse_ino_t by_root = Looked(names[k].c_str(), 0);  // root's share
  // A forgotten inode frees its place for any user.
  table_->Forget(nodes[1], 1);
  nodes.erase(nodes.begin() + 1);
  nodes.push_back(Looked(names[k + 1].c_str(), 1002));
  EXPECT_EQ(Charged(1002), 1);
  EXPECT_EQ(LookupAs(1001, names[k + 2].c_str(), &e), ENFILE);
  for (fuse_ino_t ino : nodes) table_->Forget(ino, 1);
  table_->Forget(by_root, 1);
  EXPECT_EQ(Charged(1000) + Charged(1001) + Charged(1002), 0);
}

TEST_F(InodeTableTest, AHolderOfALeaseTurnsOffAttributeCaching) {
  // A file a `dnvme run` client holds may change behind the kernel.
  MakeFile("a");
  fuse_entry_param e{};
  ASSERT_EQ(LookupAs(0, "a", &e), 0);
  EXPECT_EQ(e.attr_timeout, kEntryTimeout);
  broker::LeaseWord word{};
  table_->Get(e.ino).leases.Add(/*conn=*/1, /*uid=*/1000, &word, /*writable=*/true);
  ASSERT_EQ(LookupAs(0, "a", &e), 0);
  EXPECT_EQ(e.attr_timeout, 0.0);
  EXPECT_EQ(e.entry_timeout, kEntryTimeout);  // the name still is what it was
  table_->Get(e.ino).leases.Remove(&word);
  ASSERT_EQ(LookupAs(0, "a", &e), 0);
  EXPECT_EQ(e.attr_timeout, kEntryTimeout);
  table_->Forget(e.ino, 3);
}

TEST_F(InodeTableTest, ConcurrentLookupsAndForgetsLeaveNothingBehind) {
  // FUSE threads look up and forget the same files at once: every inode goes exactly when its
  // last reference does, with its descriptor and its charge.
  constexpr int kFiles = 6;
  constexpr int kThreads = 4;
  constexpr int kRounds = 400;
  for (int i = 0; i < kFiles; ++i) MakeFile("f" + std::to_string(i));
  const int fds = OpenFds();
  std::atomic<int> errors{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const uid_t uid = t == 0 ? 0 : 1000 + static_cast<uid_t>(t);
      for (int r = 0; r < kRounds; ++r) {
        const std::string name = "f" + std::to_string((r * 7 + t) % kFiles);
        fuse_entry_param e{};
        if (LookupAs(uid, name.c_str(), &e) != 0) {
          ++errors;
          continue;
        }
        if (r % 3 == 0) {  // two references, forgotten in one FORGET
          fuse_entry_param again{};
          if (LookupAs(uid, name.c_str(), &again) != 0 || again.ino != e.ino) {
            ++errors;
          }
          table_->Forget(e.ino, 2);
        } else {
          table_->Forget(e.ino, 1);
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(errors.load(), 0);
  for (int i = 0; i < kFiles; ++i) EXPECT_FALSE(Held("f" + std::to_string(i))) << i;
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(Charged(1000 + t), 0) << t;
  EXPECT_EQ(OpenFds(), fds);
}

}  // namespace
}  // namespace dnvme::fs
