// InodeTable (fs/core/inode_table.h) on a scratch directory standing for BACKING_DIR, no mount:
// one Inode per backing (dev, ino) living by the kernel's lookup count, pins, the root and the
// control nodes that are never forgotten, the inode charges of users' lookups (per uid) and every
// lookup's descriptor out of the daemon's budget (FdShape), and the pruner.
#include "fs/core/inode_table.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
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

// Adds a lease that must be accepted; returns whether another connection holds one too.
bool AddLease(PreloadLeases& l, uint64_t conn, uid_t uid, broker::LeaseWord* w, bool writable) {
  bool other = false;
  Status st = l.Add(conn, uid, w, writable, &other);
  EXPECT_TRUE(st.ok()) << st.ToString();
  return other;
}

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

// A table whose limits divide a descriptor limit of `nofile` (FdShape::For).
void RemakeWithFds(std::unique_ptr<InodeTable>* table, std::unique_ptr<UidLimits>* limits,
                   datapath::FileDataShared* shared, const std::string& dir, int64_t nofile) {
  table->reset();
  *limits = std::make_unique<UidLimits>(InodeMax(kUnlimited), FdShape::For(nofile));
  *table = std::make_unique<InodeTable>(shared, limits->get());
  DNVME_ASSERT_OK((*table)->OpenRoot(dir));
}

TEST_F(InodeTableTest, EveryLookupComesOutOfTheDescriptorBudgetRootsToo) {
  // RLIMIT_NOFILE 2048: reserve 256, capacity 1792, users 896, inodes 448.
  RemakeWithFds(&table_, &limits_, &data_shared_, dir(), 2048);
  const FdShape& shape = limits_->fd_shape();
  ASSERT_EQ(shape.inodes, 448);
  std::vector<std::string> names;
  for (int i = 0; i < shape.inodes + 2; ++i) {
    names.push_back("f" + std::to_string(i));
    MakeFile(names.back());
  }
  std::vector<fuse_ino_t> nodes;
  for (int i = 0; i < shape.inodes; ++i) {
    nodes.push_back(Looked(names[i].c_str(), i % 2 == 0 ? 0 : 1000));  // root's lookups count
  }
  EXPECT_EQ(limits_->FdsHeld().inodes, shape.inodes);
  EXPECT_GT(limits_->Held(0, UidResource::kDescriptors), 0) << "root's lookups are charged";
  EXPECT_TRUE(table_->Crowded());
  fuse_entry_param e{};
  // Past the cap even root's lookup is refused: the rest is for opens and the daemon itself.
  EXPECT_EQ(LookupAs(0, names[shape.inodes].c_str(), &e), ENFILE);
  EXPECT_EQ(LookupAs(1001, names[shape.inodes].c_str(), &e), ENFILE);
  EXPECT_FALSE(Held(names[shape.inodes]));
  EXPECT_EQ(Looked(names[0].c_str(), 1001), nodes[0]) << "a held inode costs nothing";
  EXPECT_EQ(limits_->FdsHeld().users_inodes, shape.inodes / 2) << "users' half, no more";
  // Opens still find room, root's and a user's.
  auto root_open = limits_->ChargeFds(0, 3, FdUse::kOther);
  auto user_open = limits_->ChargeFds(1001, 3, FdUse::kOther);
  DNVME_EXPECT_OK(root_open.status());
  DNVME_EXPECT_OK(user_open.status());
  // A forgotten inode frees its place.
  table_->Forget(nodes[1], 1);
  nodes[1] = Looked(names[shape.inodes].c_str(), 0);
  table_->Forget(nodes[0], 2);
  for (size_t i = 1; i < nodes.size(); ++i) table_->Forget(nodes[i], 1);
  EXPECT_EQ(limits_->FdsHeld().inodes, 0);
  EXPECT_EQ(limits_->FdsHeld().all, 6);
}

TEST_F(InodeTableTest, UsersTogetherNeverTakeRootsHalf) {
  // RLIMIT_NOFILE 1024: reserve 256, capacity 768, users 384, inodes 192.
  RemakeWithFds(&table_, &limits_, &data_shared_, dir(), 1024);
  const FdShape& shape = limits_->fd_shape();
  // Users' opens (three descriptors each) fill their share...
  std::vector<UidCharge> held;
  while (true) {
    auto c = limits_->ChargeFds(1000 + held.size() % 4, 3, FdUse::kOther);
    if (!c.ok()) {
      EXPECT_EQ(c.status().error_number(), ENFILE);
      EXPECT_NE(c.status().message().find("users' share"), std::string::npos)
          << c.status().message();
      break;
    }
    held.push_back(std::move(c).value());
  }
  EXPECT_LE(limits_->FdsHeld().users, shape.users);
  EXPECT_GT(limits_->FdsHeld().users, shape.users - 3);
  MakeFile("mine");
  MakeFile("theirs");
  fuse_entry_param e{};
  EXPECT_EQ(LookupAs(1005, "theirs", &e), ENFILE) << "a user's lookup is a user's descriptor";
  // ...and root's lookups and opens still work.
  const fuse_ino_t mine = Looked("mine", 0);
  auto root_open = limits_->ChargeFds(0, 3, FdUse::kOther);
  DNVME_EXPECT_OK(root_open.status());
  held.clear();
  EXPECT_EQ(limits_->FdsHeld().users, 0);
  table_->Forget(mine, 1);
}

TEST_F(InodeTableTest, ThePrunerAsksTheKernelToForgetTheOldestInodes) {
  // RLIMIT_NOFILE 1024: inodes 192, prune_at 96, prune_to 48.
  RemakeWithFds(&table_, &limits_, &data_shared_, dir(), 1024);
  const FdShape& shape = limits_->fd_shape();
  std::mutex mu;
  std::condition_variable cv;
  std::vector<uint64_t> asked;
  // Stands for the kernel: forgets every inode it is asked to (none in use here).
  table_->StartPruner([&](const std::vector<uint64_t>& ids) {
    for (uint64_t id : ids) table_->Forget(id, 1);
    std::lock_guard lock(mu);
    asked.insert(asked.end(), ids.begin(), ids.end());
    cv.notify_all();
    return Status::Ok();
  });
  std::vector<fuse_ino_t> nodes;
  for (int i = 0; i < shape.prune_at; ++i) {
    const std::string name = "f" + std::to_string(i);
    MakeFile(name);
    nodes.push_back(Looked(name.c_str(), 0));
  }
  {
    std::unique_lock lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(10), [&] { return !asked.empty(); }))
        << "the pruner never ran";
  }
  table_->StopPruner();
  // Down to prune_to, and the ones asked for are the oldest: the first looked up.
  EXPECT_LE(limits_->FdsHeld().inodes, shape.prune_to);
  std::set<uint64_t> oldest(nodes.begin(), nodes.begin() + (shape.prune_at - shape.prune_to));
  for (uint64_t id : asked) EXPECT_EQ(oldest.count(id), 1u) << "a newer inode was asked for";
  EXPECT_FALSE(table_->Crowded());
  EXPECT_GE(table_->prune_counters().rounds, 1u);
  std::set<uint64_t> gone(asked.begin(), asked.end());
  for (fuse_ino_t ino : nodes) {
    if (gone.count(ino) == 0) table_->Forget(ino, 1);
  }
  EXPECT_EQ(limits_->FdsHeld().all, 0);
}

TEST_F(InodeTableTest, APrunerTheKernelRefusesStopsForGood) {
  RemakeWithFds(&table_, &limits_, &data_shared_, dir(), 1024);
  std::atomic<int> calls{0};
  table_->StartPruner([&](const std::vector<uint64_t>&) {
    ++calls;
    return Status::Unsupported(EOPNOTSUPP, "no FUSE_NOTIFY_PRUNE");
  });
  std::vector<fuse_ino_t> nodes;
  for (int i = 0; i < limits_->fd_shape().prune_at + 10; ++i) {
    const std::string name = "f" + std::to_string(i);
    MakeFile(name);
    nodes.push_back(Looked(name.c_str(), 0));
  }
  for (int i = 0; i < 500 && table_->prune_counters().running; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_FALSE(table_->prune_counters().running);
  EXPECT_EQ(calls.load(), 1);
  table_->StopPruner();
  for (fuse_ino_t ino : nodes) table_->Forget(ino, 1);
}

TEST_F(InodeTableTest, AHolderOfALeaseTurnsOffAttributeCaching) {
  // A file a `dnvme run` client holds may change behind the kernel.
  MakeFile("a");
  fuse_entry_param e{};
  ASSERT_EQ(LookupAs(0, "a", &e), 0);
  EXPECT_EQ(e.attr_timeout, kEntryTimeout);
  broker::LeaseWord word{};
  AddLease(table_->Get(e.ino).leases, /*conn=*/1, /*uid=*/1000, &word, /*writable=*/true);
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
