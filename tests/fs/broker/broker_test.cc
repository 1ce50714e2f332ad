// The preload broker (fs/broker/broker.h) against a fake BrokerCore, over its real abstract
// SOCK_SEQPACKET socket, no mount: the wire format of include/dnvme/broker.h (hello and its sealed
// lease page, opens with their descriptors, wrote/drain/close), malformed and refused requests,
// the per-uid connection limit, and the lease states a client sees in its page (shared,
// mount_dirty) as PreloadLeases (fs/broker/leases.h) sets them. PreloadLeases is also tested on
// its own: the bounded wait for a holder's writes in flight.
#include "fs/broker/broker.h"

#include <fcntl.h>
#include <grp.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "dnvme/broker.h"
#include "fs/broker/leases.h"
#include "tests/engine/test_util.h"

namespace dnvme::fs {
namespace {

using std::chrono::milliseconds;

// What the broker knows of an inode is only the Inode* the core hands it (it passes it back and
// never looks inside), so the fake core hands out pointers to its own records.
struct FakeInode {
  PreloadLeases leases;
  std::atomic<int> pins{0}, drains{0}, invalidations{0};
};

class FakeCore : public BrokerCore {
 public:
  static UidLimits::Maxima Limits(int64_t conns) {
    UidLimits::Maxima m;
    m.fill(1 << 20);
    m[static_cast<size_t>(UidResource::kBrokerConns)] = conns;
    return m;
  }
  FakeCore(int root_fd, int64_t conns) : root_fd_(root_fd), limits_(Limits(conns)) {}

  // The file at `fd` is one the kernel has looked up (PinInode finds it).
  FakeInode& Know(int fd) {
    struct stat st {};
    EXPECT_EQ(fstat(fd, &st), 0);
    std::lock_guard lock(mu_);
    auto& slot = known_[{st.st_dev, st.st_ino}];
    if (!slot) slot = std::make_unique<FakeInode>();
    return *slot;
  }

  int root_fd() const override { return root_fd_; }
  Inode* PinInode(dev_t dev, ino_t ino) override {
    std::lock_guard lock(mu_);
    auto it = known_.find({dev, ino});
    if (it == known_.end()) return nullptr;
    ++it->second->pins;
    return reinterpret_cast<Inode*>(it->second.get());
  }
  void Unpin(Inode* in) override { --Of(in).pins; }
  Status DrainForExternal(Inode& in) override {
    ++Of(&in).drains;
    std::lock_guard lock(mu_);
    return drain_status_;
  }
  void AfterExternalWrite(Inode& in) override { ++Of(&in).invalidations; }
  int OpenCount(Inode& in) override { return open_count_.load() + Of(&in).leases.count(); }
  PreloadLeases& LeasesOf(Inode& in) override { return Of(&in).leases; }
  UidLimits& uid_limits() override { return limits_; }

  void FailDrains(Status st) {
    std::lock_guard lock(mu_);
    drain_status_ = std::move(st);
  }
  // Opens through the mount beyond the clients' leases.
  std::atomic<int> open_count_{0};

 private:
  static FakeInode& Of(Inode* in) { return *reinterpret_cast<FakeInode*>(in); }
  const int root_fd_;
  UidLimits limits_;
  std::mutex mu_;
  std::map<std::pair<dev_t, ino_t>, std::unique_ptr<FakeInode>> known_;
  Status drain_status_;
};

struct Answer {
  broker::Reply reply;
  std::vector<UniqueFd> fds;
  ssize_t bytes = -1;
};

// One client connection, as libdnvme_preload.so makes it.
class Client {
 public:
  explicit Client(const std::string& name) {
    sock_.Reset(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::string abstract = name;
    abstract[0] = '\0';  // "@name": the leading NUL of the abstract namespace
    std::memcpy(addr.sun_path, abstract.data(), abstract.size());
    const auto len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + abstract.size());
    connected_ = connect(sock_.get(), reinterpret_cast<sockaddr*>(&addr), len) == 0;
    const timeval limit{5, 0};  // a broker that never answers fails the test, not hangs it
    setsockopt(sock_.get(), SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof(limit));
  }
  ~Client() {
    if (page_ != nullptr) munmap(page_, broker::kLeasePageBytes);
  }
  bool connected() const { return connected_; }
  int fd() const { return sock_.get(); }
  void Close() { sock_.Reset(); }

  Answer SendRaw(const void* data, size_t n) {
    EXPECT_EQ(send(sock_.get(), data, n, MSG_NOSIGNAL), static_cast<ssize_t>(n));
    return Receive();
  }
  Answer Send(const broker::Request& r) { return SendRaw(&r, sizeof(r)); }
  Answer Receive() {
    Answer a;
    iovec iov{&a.reply, sizeof(a.reply)};
    alignas(cmsghdr) char control[CMSG_SPACE(4 * sizeof(int))] = {};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    a.bytes = recvmsg(sock_.get(), &msg, MSG_CMSG_CLOEXEC);
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      const size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < n; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        a.fds.emplace_back(fd);
      }
    }
    return a;
  }

  // Hello; maps the lease page it brings.
  Answer Hello() {
    broker::Request r;
    r.op = static_cast<uint32_t>(broker::Op::kHello);
    Answer a = Send(r);
    if (a.reply.error == 0 && a.fds.size() == 1) {
      void* p = mmap(nullptr, broker::kLeasePageBytes, PROT_READ | PROT_WRITE, MAP_SHARED,
                     a.fds[0].get(), 0);
      if (p != MAP_FAILED) page_ = static_cast<broker::LeaseWord*>(p);
    }
    return a;
  }
  Answer Open(const std::string& path, int flags, uint64_t ino) {
    broker::Request r;
    r.op = static_cast<uint32_t>(broker::Op::kOpen);
    r.flags = static_cast<uint32_t>(flags);
    r.ino = ino;
    r.path_len = static_cast<uint32_t>(std::min<size_t>(path.size(), broker::kMaxPath));
    std::memcpy(r.path, path.data(), r.path_len);
    return Send(r);
  }
  Answer Lease(broker::Op op, uint64_t lease, int64_t length = 0) {
    broker::Request r;
    r.op = static_cast<uint32_t>(op);
    r.lease = lease;
    r.length = length;
    return Send(r);
  }
  broker::LeaseWord& word(uint32_t slot) { return page_[slot]; }
  bool mapped() const { return page_ != nullptr; }

 private:
  UniqueFd sock_;
  bool connected_ = false;
  broker::LeaseWord* page_ = nullptr;
};

std::string MessageOf(const Answer& a) { return std::string(a.reply.message); }

// Polls `done` for up to 5 s (the broker's connection threads finish on their own time).
template <typename F>
bool Eventually(F done) {
  for (int i = 0; i < 500; ++i) {
    if (done()) return true;
    std::this_thread::sleep_for(milliseconds(10));
  }
  return done();
}

class BrokerTest : public ::testing::Test {
 protected:
  void SetUp() override { Start(/*conns=*/16); }
  void Start(int64_t conns) {
    broker_.reset();
    core_.reset();
    ASSERT_TRUE(dir_.ok()) << dir_.error();
    root_.Reset(open(dir_.path().c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
    ASSERT_TRUE(root_.valid());
    core_ = std::make_unique<FakeCore>(root_.get(), conns);
    auto b = Broker::Start(*core_);
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    broker_ = std::move(b).value();
  }
  void TearDown() override {
    broker_.reset();  // joins every connection thread before the core goes
    core_.reset();
  }
  // A file in BACKING_DIR with `bytes`; its inode number.
  uint64_t MakeFile(const std::string& name, const std::string& bytes, bool known = true) {
    const std::string path = dir_.path() + "/" + name;
    UniqueFd fd(open(path.c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0644));
    EXPECT_TRUE(fd.valid());
    EXPECT_EQ(write(fd.get(), bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
    if (known) inode_[name] = &core_->Know(fd.get());
    struct stat st {};
    EXPECT_EQ(fstat(fd.get(), &st), 0);
    return st.st_ino;
  }
  FakeInode& inode(const std::string& name) { return *inode_.at(name); }

  test::ScratchDir dir_;
  UniqueFd root_;
  std::unique_ptr<FakeCore> core_;
  std::unique_ptr<Broker> broker_;
  std::map<std::string, FakeInode*> inode_;
};

TEST_F(BrokerTest, AnnouncesItsAbstractName) {
  EXPECT_EQ(broker_->name().rfind("@dnvmefs.", 0), 0u) << broker_->name();
  EXPECT_EQ(broker_->Announcement(),
            "protocol " + std::to_string(broker::kProtocol) + "\nsocket " + broker_->name() + "\n");
}

TEST_F(BrokerTest, HelloBringsTheProtocolAndASealedLeasePage) {
  Client c(broker_->name());
  ASSERT_TRUE(c.connected());
  Answer a = c.Hello();
  ASSERT_EQ(a.bytes, static_cast<ssize_t>(sizeof(broker::Reply)));
  EXPECT_EQ(a.reply.magic, broker::kMagic);
  EXPECT_EQ(a.reply.error, 0) << MessageOf(a);
  EXPECT_EQ(a.reply.flags, broker::kProtocol);
  ASSERT_EQ(a.fds.size(), 1u);
  struct stat st {};
  ASSERT_EQ(fstat(a.fds[0].get(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), broker::kLeasePageBytes);
  const int seals = fcntl(a.fds[0].get(), F_GET_SEALS);
  EXPECT_EQ(seals & (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL),
            F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  EXPECT_NE(ftruncate(a.fds[0].get(), 0), 0) << "a client could shrink the daemon's page";
  EXPECT_TRUE(c.mapped());
  // A second hello keeps the page (the same memory, not a new one).
  c.word(3).writes_inflight.store(7);
  Answer again = c.Hello();
  ASSERT_EQ(again.fds.size(), 1u);
  auto* p = static_cast<broker::LeaseWord*>(
      mmap(nullptr, broker::kLeasePageBytes, PROT_READ, MAP_SHARED, again.fds[0].get(), 0));
  ASSERT_NE(p, MAP_FAILED);
  EXPECT_EQ(p[3].writes_inflight.load(), 7u);
  munmap(p, broker::kLeasePageBytes);
}

TEST_F(BrokerTest, MalformedRequestsAreRefusedAndTheConnectionGoesOn) {
  Client c(broker_->name());
  ASSERT_TRUE(c.connected());
  const char shorter[8] = {};
  Answer a = c.SendRaw(shorter, sizeof(shorter));
  EXPECT_EQ(a.reply.error, EINVAL);
  EXPECT_NE(MessageOf(a).find("malformed"), std::string::npos) << MessageOf(a);
  EXPECT_TRUE(a.fds.empty());

  broker::Request bad_magic;
  bad_magic.magic = 0x12345678;
  bad_magic.op = static_cast<uint32_t>(broker::Op::kHello);
  a = c.Send(bad_magic);
  EXPECT_EQ(a.reply.error, EINVAL);
  EXPECT_NE(MessageOf(a).find("malformed"), std::string::npos) << MessageOf(a);
  EXPECT_TRUE(a.fds.empty()) << "no page for a request with a bad magic";

  a = c.Open("f", O_RDONLY, 1);
  EXPECT_EQ(a.reply.error, EINVAL);
  EXPECT_NE(MessageOf(a).find("before hello"), std::string::npos) << MessageOf(a);

  ASSERT_EQ(c.Hello().reply.error, 0);
  broker::Request unknown;
  unknown.op = 99;
  a = c.Send(unknown);
  EXPECT_EQ(a.reply.error, EINVAL);
  EXPECT_NE(MessageOf(a).find("unknown broker op 99"), std::string::npos) << MessageOf(a);
  for (auto op : {broker::Op::kWrote, broker::Op::kDrain, broker::Op::kClose}) {
    a = c.Lease(op, 42);
    EXPECT_EQ(a.reply.error, EINVAL);
    EXPECT_NE(MessageOf(a).find("no lease 42"), std::string::npos) << MessageOf(a);
  }
  EXPECT_GE(broker_->counters().refused.load(), 7u);
  EXPECT_EQ(broker_->counters().requests.load(), 8u);
}

TEST_F(BrokerTest, OpenRefusesPathsModesAndFilesItMustNotHandOut) {
  const uint64_t ino = MakeFile("data", "abc");
  const uint64_t unknown_ino = MakeFile("unlooked", "x", /*known=*/false);
  ASSERT_EQ(mkdir((dir_.path() + "/sub").c_str(), 0755), 0);
  ASSERT_EQ(mkdir((dir_.path() + "/.dnvme").c_str(), 0755), 0);
  Client c(broker_->name());
  ASSERT_EQ(c.Hello().reply.error, 0);
  struct Case {
    std::string path;
    int flags;
    uint64_t ino;
    int error;
    const char* says;
  };
  const Case cases[] = {
      {"", O_RDONLY, ino, EINVAL, "empty path"},
      {"/data", O_RDONLY, ino, EINVAL, "not relative"},
      {"sub/../data", O_RDONLY, ino, EINVAL, "'..'"},
      {".dnvme/ctl", O_RDONLY, ino, EINVAL, "control file"},
      {"data", O_ACCMODE, ino, EINVAL, "bad access mode"},
      {"missing", O_RDONLY, ino, ENOENT, ""},
      {"sub", O_RDONLY, ino, EINVAL, "not a regular file"},
      {"data", O_RDONLY, ino + 1000, ESTALE, "no longer the file"},
      {"unlooked", O_RDONLY, unknown_ino, ESTALE, "not open on the mount"},
  };
  for (const Case& k : cases) {
    Answer a = c.Open(k.path, k.flags, k.ino);
    EXPECT_EQ(a.reply.error, k.error) << "'" << k.path << "': " << MessageOf(a);
    EXPECT_NE(MessageOf(a).find(k.says), std::string::npos) << MessageOf(a);
    EXPECT_TRUE(a.fds.empty()) << "'" << k.path << "' refused but descriptors sent";
  }
  // A path_len beyond the buffer is refused, not read past.
  broker::Request r;
  r.op = static_cast<uint32_t>(broker::Op::kOpen);
  r.path_len = broker::kMaxPath + 1;
  std::memcpy(r.path, "data", 4);
  Answer a = c.Send(r);
  EXPECT_EQ(a.reply.error, EINVAL);
  EXPECT_NE(MessageOf(a).find("too long"), std::string::npos) << MessageOf(a);
  EXPECT_EQ(inode("data").pins.load(), 0) << "a refused open left the inode pinned";
  EXPECT_EQ(inode("data").leases.count(), 0);
}

TEST_F(BrokerTest, OpenGrantsALeaseWithTheFilesDescriptors) {
  const uint64_t ino = MakeFile("data", "hello broker");
  Client c(broker_->name());
  ASSERT_EQ(c.Hello().reply.error, 0);
  Answer a = c.Open("data", O_RDWR, ino);
  ASSERT_EQ(a.reply.error, 0) << MessageOf(a);
  EXPECT_EQ(a.reply.lease, 1u);
  EXPECT_EQ(a.reply.slot, 0u);
  EXPECT_EQ(a.reply.size, 12);
  ASSERT_EQ(a.fds.size(), (a.reply.flags & broker::kHasDirect) ? 2u : 1u);
  // The buffered descriptor: the backing file itself, blocking, read-write.
  char buf[32] = {};
  EXPECT_EQ(pread(a.fds[0].get(), buf, sizeof(buf), 0), 12);
  EXPECT_STREQ(buf, "hello broker");
  EXPECT_EQ(fcntl(a.fds[0].get(), F_GETFL) & (O_NONBLOCK | O_ACCMODE), O_RDWR);
  if (a.fds.size() == 2) {
    EXPECT_NE(fcntl(a.fds[1].get(), F_GETFL) & O_DIRECT, 0);
  }
  FakeInode& in = inode("data");
  EXPECT_EQ(in.pins.load(), 1);
  EXPECT_EQ(in.drains.load(), 1) << "write-behind not landed before the hand-out";
  EXPECT_EQ(in.invalidations.load(), 1) << "cached views not dropped at the hand-out";
  EXPECT_EQ(in.leases.count(), 1);
  EXPECT_EQ(c.word(0).shared.load(), 0u) << "nobody else has it open";
  EXPECT_EQ(broker_->counters().leases_open.load(), 1u);

  // A second lease of the same connection takes the next slot.
  Answer b = c.Open("data", O_RDONLY, ino);
  ASSERT_EQ(b.reply.error, 0) << MessageOf(b);
  EXPECT_EQ(b.reply.lease, 2u);
  EXPECT_EQ(b.reply.slot, 1u);
  EXPECT_EQ(in.pins.load(), 2);
}

TEST_F(BrokerTest, WroteDrainAndCloseMoveTheLease) {
  const uint64_t ino = MakeFile("data", "x");
  Client c(broker_->name());
  ASSERT_EQ(c.Hello().reply.error, 0);
  Answer a = c.Open("data", O_WRONLY, ino);
  ASSERT_EQ(a.reply.error, 0) << MessageOf(a);
  const uint64_t lease = a.reply.lease;
  FakeInode& in = inode("data");

  ASSERT_EQ(c.Lease(broker::Op::kWrote, lease).reply.error, 0);
  EXPECT_EQ(in.invalidations.load(), 2);

  // A WRITE through the mount marks the holder's word; a drain lands it and clears the mark.
  in.leases.MarkMountDirty();
  EXPECT_EQ(c.word(a.reply.slot).mount_dirty.load(), 1u);
  ASSERT_EQ(c.Lease(broker::Op::kDrain, lease).reply.error, 0);
  EXPECT_EQ(c.word(a.reply.slot).mount_dirty.load(), 0u);
  EXPECT_EQ(in.drains.load(), 2);
  EXPECT_EQ(broker_->counters().drains.load(), 1u);

  // A failed drain comes back with its errno and message.
  core_->FailDrains(Status::FromErrno(ENOSPC, "landing write-behind"));
  Answer failed = c.Lease(broker::Op::kDrain, lease);
  EXPECT_EQ(failed.reply.error, ENOSPC);
  EXPECT_NE(MessageOf(failed).find("landing write-behind"), std::string::npos);
  core_->FailDrains(Status::Ok());

  // Close with nothing written (length < 0): no invalidation; the lease and the pin end.
  ASSERT_EQ(c.Lease(broker::Op::kClose, lease, -1).reply.error, 0);
  EXPECT_EQ(in.invalidations.load(), 2);
  EXPECT_EQ(in.pins.load(), 0);
  EXPECT_EQ(in.leases.count(), 0);
  EXPECT_EQ(broker_->counters().leases_open.load(), 0u);
  Answer gone = c.Lease(broker::Op::kWrote, lease);
  EXPECT_EQ(gone.reply.error, EINVAL) << "a closed lease still answered";

  // Its slot is free again; a close after writing invalidates.
  Answer again = c.Open("data", O_RDWR, ino);
  ASSERT_EQ(again.reply.error, 0) << MessageOf(again);
  EXPECT_EQ(again.reply.slot, a.reply.slot);
  EXPECT_NE(again.reply.lease, lease) << "lease ids are not reused";
  const int before = in.invalidations.load();
  ASSERT_EQ(c.Lease(broker::Op::kClose, again.reply.lease, 0).reply.error, 0);
  EXPECT_EQ(in.invalidations.load(), before + 1);
}

TEST_F(BrokerTest, AReadOnlyLeaseInvalidatesNobodysCache) {
  // A user with read access only must not drop every other reader's cached views at will: not
  // at the lease's hand-out, nor by kWrote, nor at its close.
  const uint64_t ino = MakeFile("data", "x");
  Client c(broker_->name());
  ASSERT_EQ(c.Hello().reply.error, 0);
  Answer a = c.Open("data", O_RDONLY, ino);
  ASSERT_EQ(a.reply.error, 0) << MessageOf(a);
  FakeInode& in = inode("data");
  EXPECT_EQ(in.invalidations.load(), 0) << "a reader's lease dropped the cached views";
  EXPECT_EQ(in.drains.load(), 1) << "what the mount holds lands before the reader reads around it";
  const int before = in.invalidations.load();
  EXPECT_EQ(c.Lease(broker::Op::kWrote, a.reply.lease).reply.error, EBADF);
  EXPECT_EQ(in.invalidations.load(), before);
  ASSERT_EQ(c.Lease(broker::Op::kClose, a.reply.lease, 0).reply.error, 0);
  EXPECT_EQ(in.invalidations.load(), before) << "a reader's close invalidated";
  EXPECT_EQ(in.leases.count(), 0);
}

TEST_F(BrokerTest, AFileOpenedElsewhereIsShared) {
  const uint64_t ino = MakeFile("data", "x");
  Client one(broker_->name()), two(broker_->name());
  ASSERT_EQ(one.Hello().reply.error, 0);
  ASSERT_EQ(two.Hello().reply.error, 0);
  Answer a = one.Open("data", O_RDWR, ino);
  ASSERT_EQ(a.reply.error, 0) << MessageOf(a);
  EXPECT_EQ(one.word(a.reply.slot).shared.load(), 0u);
  // Another client's lease: both holders invalidate after each write from now on.
  Answer b = two.Open("data", O_RDONLY, ino);
  ASSERT_EQ(b.reply.error, 0) << MessageOf(b);
  EXPECT_EQ(one.word(a.reply.slot).shared.load(), 1u);
  EXPECT_EQ(two.word(b.reply.slot).shared.load(), 1u);
  EXPECT_EQ(inode("data").leases.count(), 2);

  // An open through the mount beyond the leases makes a new sole holder shared too.
  const uint64_t other = MakeFile("other", "y");
  core_->open_count_ = 1;
  Answer c = one.Open("other", O_RDONLY, other);
  ASSERT_EQ(c.reply.error, 0) << MessageOf(c);
  EXPECT_EQ(one.word(c.reply.slot).shared.load(), 1u);
}

TEST_F(BrokerTest, ADisconnectEndsEveryLease) {
  const uint64_t ino = MakeFile("data", "x");
  auto c = std::make_unique<Client>(broker_->name());
  ASSERT_EQ(c->Hello().reply.error, 0);
  ASSERT_EQ(c->Open("data", O_RDWR, ino).reply.error, 0);
  ASSERT_EQ(c->Open("data", O_RDONLY, ino).reply.error, 0);
  FakeInode& in = inode("data");
  EXPECT_EQ(in.pins.load(), 2);
  const int invalidated = in.invalidations.load();
  c.reset();  // the client exits without closing its leases
  EXPECT_TRUE(Eventually([&] { return in.pins.load() == 0; })) << in.pins.load() << " pins left";
  EXPECT_EQ(in.leases.count(), 0);
  EXPECT_EQ(in.invalidations.load(), invalidated + 2)
      << "what it wrote around the mount stays cached";
  EXPECT_TRUE(Eventually([&] { return broker_->counters().connections_open.load() == 0; }));
}

TEST_F(BrokerTest, APerUidConnectionLimitRefusesWithTheReason) {
  Start(/*conns=*/1);
  Client first(broker_->name());
  ASSERT_EQ(first.Hello().reply.error, 0);
  Client second(broker_->name());
  ASSERT_TRUE(second.connected());
  Answer a = second.Hello();  // the refusal is waiting for it
  EXPECT_EQ(a.reply.error, EMFILE) << MessageOf(a);
  EXPECT_NE(MessageOf(a).find("broker_max_conns_per_uid"), std::string::npos) << MessageOf(a);
  EXPECT_TRUE(a.fds.empty());
  EXPECT_GE(broker_->counters().refused.load(), 1u);
  // The first connection's end gives its place back.
  first.Close();
  EXPECT_TRUE(Eventually([&] { return broker_->counters().connections_open.load() == 0; }));
  Client third(broker_->name());
  EXPECT_EQ(third.Hello().reply.error, 0) << "the limit was not given back";
}

// ---- PreloadLeases on its own -------------------------------------------------------------------

// The groups a client is served with are exactly its own, however many (the first buffer of 64
// is too small past 64), and a descriptor whose groups cannot be read is an error, not 64 entries
// of group 0.
// Adds a lease that must be accepted; returns whether another connection holds one too.
bool AddLease(PreloadLeases& l, uint64_t conn, uid_t uid, broker::LeaseWord* w, bool writable) {
  bool other = false;
  Status st = l.Add(conn, uid, w, writable, &other);
  EXPECT_TRUE(st.ok()) << st.ToString();
  return other;
}

TEST(BrokerPeerGroups, AreTheClientsOwnOrAnError) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root (setgroups)";
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    // 100 groups, none of them 0: then a socket pair takes them as its peer credentials.
    std::vector<gid_t> want;
    for (gid_t g = 1000; g < 1100; ++g) want.push_back(g);
    if (setgroups(want.size(), want.data()) != 0) _exit(2);
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) _exit(3);
    auto got = Broker::PeerGroups(sv[0]);
    if (!got.ok()) _exit(4);
    std::vector<gid_t> g = got.value();
    std::sort(g.begin(), g.end());
    if (g != want) _exit(5);
    auto bad = Broker::PeerGroups(fds[0]);  // a pipe: no peer, no groups
    if (bad.ok() || bad.status().error_number() != ENOTSOCK) _exit(6);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  close(fds[0]);
  close(fds[1]);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "2 setgroups, 3 socketpair, 4 PeerGroups failed, 5 other "
                                       "groups than the client's, 6 a pipe was not an error";
}

TEST(PreloadLeases, AddRemoveAndShared) {
  PreloadLeases l;
  broker::LeaseWord a{}, b{};
  EXPECT_EQ(l.count(), 0);
  EXPECT_FALSE(AddLease(l, 1, 1000, &a, true)) << "the only connection is not 'another'";
  EXPECT_FALSE(AddLease(l, 1, 1000, &b, false)) << "two leases of one connection are not shared";
  EXPECT_EQ(a.shared.load(), 0u);
  EXPECT_EQ(l.count(), 2);
  l.Remove(&b);
  broker::LeaseWord c{};
  EXPECT_TRUE(AddLease(l, 2, 1001, &c, false));
  EXPECT_EQ(a.shared.load(), 1u);
  EXPECT_EQ(c.shared.load(), 1u);
  l.Remove(&c);
  l.Remove(&c);  // twice: no effect
  EXPECT_EQ(l.count(), 1);
  l.MarkMountDirty();
  EXPECT_EQ(a.mount_dirty.load(), 1u);
}

// One user's leases of one file are bounded (every WRITE through the mount walks them), root's
// are not, and a lease given back makes room again.
TEST(PreloadLeases, OneUsersLeasesOfAFileAreBounded) {
  PreloadLeases l;
  std::vector<broker::LeaseWord> words(PreloadLeases::kMaxPerUid + 8);
  for (size_t i = 0; i < PreloadLeases::kMaxPerUid; ++i) AddLease(l, 1 + i, 1000, &words[i], false);
  bool other = false;
  Status refused = l.Add(99, 1000, &words[PreloadLeases::kMaxPerUid], false, &other);
  EXPECT_EQ(refused.error_number(), EMFILE) << refused.ToString();
  EXPECT_NE(refused.message().find("leases of the file"), std::string::npos);
  EXPECT_EQ(l.count(), static_cast<int>(PreloadLeases::kMaxPerUid));
  // Another user, and root, still get theirs.
  AddLease(l, 200, 1001, &words[PreloadLeases::kMaxPerUid + 1], true);
  AddLease(l, 201, 0, &words[PreloadLeases::kMaxPerUid + 2], true);
  l.Remove(&words[0]);
  AddLease(l, 202, 1000, &words[PreloadLeases::kMaxPerUid + 3], false);
}

TEST(PreloadLeases, WaitForWritesWaitsOnlyForWritableHoldersAndOnlyOnceToTheLimit) {
  PreloadLeases l;
  broker::LeaseWord reader{}, writer{};
  AddLease(l, 1, 1000, &reader, /*writable=*/false);
  reader.writes_inflight.store(3);  // a read-only lease's counter is never waited for
  EXPECT_TRUE(l.WaitForWrites(false, milliseconds(50)));
  EXPECT_EQ(l.PollWrites(false, false), PreloadLeases::Poll::kLanded);

  AddLease(l, 1, 1001, &writer, /*writable=*/true);  // one connection: not shared
  writer.writes_inflight.store(1);
  EXPECT_EQ(l.PollWrites(false, false), PreloadLeases::Poll::kBusy);
  // The writes land while the waiter waits.
  std::thread lands([&] {
    std::this_thread::sleep_for(milliseconds(30));
    writer.writes_inflight.store(0);
  });
  EXPECT_TRUE(l.WaitForWrites(false, milliseconds(2000)));
  lands.join();
  EXPECT_EQ(writer.shared.load(), 0u) << "share_if_busy=false marked the holder";

  // A counter that never comes down keeps one wait to its limit, then is not trusted again.
  writer.writes_inflight.store(1);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(l.WaitForWrites(/*share_if_busy=*/true, milliseconds(50)));
  EXPECT_GE(std::chrono::steady_clock::now() - t0, milliseconds(50));
  EXPECT_EQ(writer.shared.load(), 1u) << "share_if_busy did not mark a busy holder";
  EXPECT_TRUE(l.WaitForWrites(false, milliseconds(2000))) << "an untrusted counter was waited for";
  EXPECT_EQ(l.PollWrites(false, false), PreloadLeases::Poll::kLanded);
}

TEST(PreloadLeases, PollGivesUpWhenLateAndMarksOnlyWhenAsked) {
  PreloadLeases l;
  broker::LeaseWord w{};
  AddLease(l, 1, 2000, &w, /*writable=*/true);  // uids of its own: HolderTrust is the process's
  w.writes_inflight.store(1);
  EXPECT_EQ(l.PollWrites(/*share_if_busy=*/false, /*late=*/false), PreloadLeases::Poll::kBusy);
  EXPECT_EQ(w.shared.load(), 0u);
  EXPECT_EQ(l.PollWrites(/*share_if_busy=*/true, /*late=*/false), PreloadLeases::Poll::kBusy);
  EXPECT_EQ(w.shared.load(), 1u);
  EXPECT_EQ(l.PollWrites(false, /*late=*/true), PreloadLeases::Poll::kGaveUp);
  EXPECT_EQ(l.PollWrites(false, false), PreloadLeases::Poll::kLanded) << "untrusted after one";
}

// Issue 54: one stall per holder and per file, however many leases the holder adds.
TEST(PreloadLeases, ANewLeaseOfAHolderThatStalledIsNotWaitedForOnAnyFile) {
  PreloadLeases file1, file2;
  broker::LeaseWord first{}, again{}, elsewhere{};
  AddLease(file1, 1, 3000, &first, /*writable=*/true);
  first.writes_inflight.store(1);
  EXPECT_FALSE(file1.WaitForWrites(false, milliseconds(50)));  // the one stall
  file1.Remove(&first);
  AddLease(file1, 2, 3000, &again, /*writable=*/true);  // a new lease, a new connection, same user
  again.writes_inflight.store(1);
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(file1.WaitForWrites(false, milliseconds(2000)));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, milliseconds(500))
      << "the new lease was trusted";
  AddLease(file2, 3, 3000, &elsewhere, /*writable=*/true);
  elsewhere.writes_inflight.store(1);
  t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(file2.WaitForWrites(false, milliseconds(2000)));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, milliseconds(500)) << "trusted on another file";
}

TEST(PreloadLeases, AFileThatStalledAWaitIsNotWaitedOnAgainForAWhile) {
  PreloadLeases l;
  broker::LeaseWord a{}, b{};
  AddLease(l, 1, 3100, &a, /*writable=*/true);
  a.writes_inflight.store(1);
  EXPECT_FALSE(l.WaitForWrites(false, milliseconds(50)));
  AddLease(l, 2, 3101, &b, /*writable=*/true);  // another user (an accomplice) on the same file
  b.writes_inflight.store(1);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(l.PollWrites(false, false), PreloadLeases::Poll::kLanded);
  EXPECT_TRUE(l.WaitForWrites(false, milliseconds(2000)));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, milliseconds(500));
}

TEST(HolderTrust, DistrustLastsItsTimeAndIsBounded) {
  HolderTrust t;
  const auto now = std::chrono::steady_clock::now();
  EXPECT_FALSE(t.Distrusted(5, now));
  t.Distrust(5, now);
  EXPECT_TRUE(t.Distrusted(5, now + std::chrono::seconds(59)));
  EXPECT_FALSE(t.Distrusted(5, now + HolderTrust::kDistrust));
  for (uid_t u = 100; u < 100 + HolderTrust::kMaxUids + 10; ++u) t.Distrust(u, now);
  EXPECT_TRUE(t.Distrusted(100 + HolderTrust::kMaxUids + 9, now));
  EXPECT_FALSE(t.Distrusted(100, now)) << "the oldest goes first when full";
}

TEST(PreloadLeases, OnlyAWritableLeaseHoldsBackTheTrim) {
  // A reader's lease cannot extend the file: it must not keep the writer's reserved space.
  PreloadLeases l;
  broker::LeaseWord r{}, w{};
  int ran = 0;
  AddLease(l, 1, 65534, &r, /*writable=*/false);
  EXPECT_TRUE(l.WithoutLeases([&] { ++ran; }));
  EXPECT_EQ(ran, 1);
  AddLease(l, 2, 1000, &w, /*writable=*/true);
  EXPECT_FALSE(l.WithoutLeases([&] { ++ran; }));
  EXPECT_EQ(ran, 1);
  l.Remove(&w);
  EXPECT_TRUE(l.WithoutLeases([&] { ++ran; }));
  l.Remove(&r);
  EXPECT_EQ(ran, 2);
}

TEST(PreloadLeases, GuardIsHeldWhileALeaseLivesAndOpenedOnce) {
  UidLimits limits(UidLimits::Maxima{}, FdShape::For(1024));
  PreloadLeases l;
  broker::LeaseWord a{}, b{};
  int opens = 0;
  auto open_guard = [&]() -> Result<PreloadLeases::Guard> {
    ++opens;
    DNVME_ASSIGN_OR_RETURN(UidCharge charge, limits.ChargeFds(1000, 1, FdUse::kOther));
    return PreloadLeases::Guard{UniqueFd(open("/dev/null", O_WRONLY | O_CLOEXEC)),
                                std::move(charge)};
  };
  ASSERT_TRUE(l.EnsureGuard(open_guard).ok());
  AddLease(l, 1, 1000, &a, true);
  ASSERT_TRUE(l.EnsureGuard(open_guard).ok());
  AddLease(l, 2, 1000, &b, false);
  EXPECT_EQ(opens, 1);
  EXPECT_TRUE(l.guarded());
  EXPECT_EQ(limits.Held(1000, UidResource::kDescriptors), 1) << "the guard is its maker's";
  l.Remove(&a);
  EXPECT_TRUE(l.guarded()) << "a lease still lives";
  l.Remove(&b);
  EXPECT_FALSE(l.guarded()) << "the guard outlived the last lease";
  EXPECT_EQ(limits.FdsHeld().all, 0) << "the guard's descriptor went back with it";
  // A refusal refuses the open.
  Status st = l.EnsureGuard(
      []() -> Result<PreloadLeases::Guard> { return Status::FromErrno(ETXTBSY, "busy"); });
  EXPECT_FALSE(st.ok());
  EXPECT_EQ(st.ErrnoOr(), ETXTBSY);
}

}  // namespace
}  // namespace dnvme::fs
