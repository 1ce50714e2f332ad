// The daemon's request loop (fs/transport/session_loop.h, the kRead form) without a mount: a
// SOCK_SEQPACKET socketpair stands in for /dev/fuse (one message per request and per reply, as
// the device keeps them), given to a real libfuse session with fuse_session_custom_io. The test
// writes hand-built FUSE requests (<linux/fuse.h>) into its end and reads the replies libfuse
// sends for a small ops table: INIT, dispatch to the ops on the loop's threads, an error reply,
// a WRITE whose payload lands in the pool's page-aligned buffer with its write flags, a short
// request ending the session with EIO, and shutdown by fuse_session_exit.
#include "fs/transport/session_loop.h"

#include <linux/fuse.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "fs/fuse_compat.h"
#include "fs/transport/request_buffer.h"

namespace dnvme::fs {
namespace {

// What the ops saw (set from the loop's threads).
struct Seen {
  std::atomic<int> getattrs{0}, writes{0};
  std::atomic<fuse_ino_t> getattr_ino{0};
  std::atomic<bool> write_flags_seen{false}, payload_in_pool{false}, payload_aligned{false};
  std::atomic<uint32_t> write_flags{0};
  std::string payload;  // written before `writes` is bumped
  Transport* transport = nullptr;
};
Seen* g_seen = nullptr;

void TestGetattr(fuse_req_t req, fuse_ino_t ino, fuse_file_info*) {
  g_seen->getattr_ino = ino;
  ++g_seen->getattrs;
  struct stat st {};
  st.st_ino = ino;
  st.st_mode = S_IFREG | 0640;
  st.st_size = 4242;
  fuse_reply_attr(req, &st, 1.0);
}

// Lookups of uid 1000 wait until g_release opens (a user's slow requests); others answer at once.
std::atomic<bool> g_release{true};
std::atomic<int> g_slow_running{0};
void TestLookup(fuse_req_t req, fuse_ino_t, const char*) {
  if (fuse_req_ctx(req)->uid == 1000) {
    ++g_slow_running;
    while (!g_release.load()) usleep(1000);
    --g_slow_running;
  }
  fuse_reply_err(req, ENOENT);
}

void TestWriteBuf(fuse_req_t req, fuse_ino_t, fuse_bufvec* bufv, off_t, fuse_file_info*) {
  if (auto flags = g_seen->transport->WriteFlags(*bufv)) {
    g_seen->write_flags_seen = true;
    g_seen->write_flags = *flags;
  }
  const fuse_buf& b = bufv->buf[bufv->idx];
  const char* mem = static_cast<const char*>(b.mem) + bufv->off;
  RequestBufferPool* pool = g_seen->transport->payload_pool();
  g_seen->payload_in_pool = pool != nullptr && pool->HolderOf(mem, b.size - bufv->off) != nullptr;
  g_seen->payload_aligned = reinterpret_cast<uintptr_t>(mem) % 4096 == 0;
  g_seen->payload.assign(mem, b.size - bufv->off);
  ++g_seen->writes;
  fuse_reply_write(req, b.size - bufv->off);
}

ssize_t IoRead(int fd, void* buf, size_t n, void*) { return read(fd, buf, n); }
ssize_t IoWritev(int fd, iovec* iov, int count, void*) { return writev(fd, iov, count); }

struct Reply {
  fuse_out_header header{};
  std::string body;
};

class ReadLoopTest : public ::testing::Test {
 protected:
  void SetUp() override {
    g_seen = &seen_;
    int sv[2];
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
    kernel_ = sv[0];
    const timeval limit{5, 0};  // a loop that never answers fails the test, not hangs it
    setsockopt(kernel_, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof(limit));
    fuse_lowlevel_ops ops{};
    ops.getattr = TestGetattr;
    ops.lookup = TestLookup;
    ops.write_buf = TestWriteBuf;
    char arg0[] = "session_loop_test";
    char* argv[] = {arg0, nullptr};
    fuse_args args = FUSE_ARGS_INIT(1, argv);
    se_ = fuse_session_new(&args, &ops, sizeof(ops), nullptr);
    // libfuse appends to the argument list (fuse_opt_add_arg) and keeps none of it: free it, as
    // fs/main.cc does (LeakSanitizer found this in the ASan suite).
    fuse_opt_free_args(&args);
    ASSERT_NE(se_, nullptr);
    static const fuse_custom_io io = MakeCustomIo(IoWritev, IoRead);
    ASSERT_EQ(SetCustomIo(se_, io, sv[1]), 0);  // the session owns sv[1] now
    auto loop = ReadLoop::Create(se_, threads_, adoptable_, /*max_request=*/1 << 20);
    ASSERT_TRUE(loop.ok()) << loop.status().ToString();
    loop_ = std::move(loop).value();
    seen_.transport = loop_.get();
    BeforeRun();
    run_ = std::async(std::launch::async, [this] { return loop_->Run(); });
  }
  virtual void BeforeRun() {}
  void TearDown() override {
    if (run_.valid()) {
      fuse_session_exit(se_);
      run_.wait();
    }
    loop_.reset();
    if (se_ != nullptr) fuse_session_destroy(se_);
    close(kernel_);
    g_seen = nullptr;
  }

  // Sends one request: the header (len and unique filled in) and its argument bytes.
  void Send(uint32_t opcode, uint64_t unique, uint64_t nodeid, const std::string& arg,
            uint32_t uid = getuid()) {
    fuse_in_header in{};
    in.len = static_cast<uint32_t>(sizeof(in) + arg.size());
    in.opcode = opcode;
    in.unique = unique;
    in.nodeid = nodeid;
    in.uid = uid;
    in.gid = getgid();
    in.pid = static_cast<uint32_t>(getpid());
    std::string msg(reinterpret_cast<const char*>(&in), sizeof(in));
    msg += arg;
    ASSERT_EQ(send(kernel_, msg.data(), msg.size(), 0), static_cast<ssize_t>(msg.size()));
  }
  template <typename T>
  static std::string Bytes(const T& v) {
    return std::string(reinterpret_cast<const char*>(&v), sizeof(v));
  }
  Reply Receive() {
    std::vector<char> buf(1 << 16);
    Reply r;
    const ssize_t n = recv(kernel_, buf.data(), buf.size(), 0);
    EXPECT_GE(n, static_cast<ssize_t>(sizeof(fuse_out_header))) << std::strerror(errno);
    if (n < static_cast<ssize_t>(sizeof(fuse_out_header))) return r;
    std::memcpy(&r.header, buf.data(), sizeof(r.header));
    EXPECT_EQ(r.header.len, static_cast<uint32_t>(n)) << "the reply's len is not its size";
    r.body.assign(buf.data() + sizeof(fuse_out_header), static_cast<size_t>(n) - sizeof(r.header));
    return r;
  }
  void Init() {
    fuse_init_in init{};
    init.major = FUSE_KERNEL_VERSION;
    init.minor = 31;
    init.max_readahead = 1 << 20;
    Send(FUSE_INIT, 1, 0, Bytes(init));
    Reply r = Receive();
    ASSERT_EQ(r.header.unique, 1u);
    ASSERT_EQ(r.header.error, 0);
    fuse_init_out out{};
    ASSERT_GE(r.body.size(), offsetof(fuse_init_out, max_write) + sizeof(out.max_write));
    std::memcpy(&out, r.body.data(), std::min(r.body.size(), sizeof(out)));
    EXPECT_EQ(out.major, static_cast<uint32_t>(FUSE_KERNEL_VERSION));
    // Debian 12's libfuse 3.14 answers with the kernel's minor, 3.17 with its own (7.40); the
    // kernel takes the lower of the two (fs/fuse_compat.h).
    EXPECT_GE(out.minor, 31u) << "libfuse answered with a protocol older than the kernel's";
  }

  int threads_ = 2;
  size_t adoptable_ = 1;
  Seen seen_;
  int kernel_ = -1;
  fuse_session* se_ = nullptr;
  std::unique_ptr<ReadLoop> loop_;
  std::future<int> run_;
};

TEST_F(ReadLoopTest, InitThenRequestsAreDispatchedAndAnswered) {
  Init();
  fuse_getattr_in ga{};
  Send(FUSE_GETATTR, 2, 7, Bytes(ga));
  Reply r = Receive();
  EXPECT_EQ(r.header.unique, 2u);
  EXPECT_EQ(r.header.error, 0);
  ASSERT_EQ(r.body.size(), sizeof(fuse_attr_out));
  fuse_attr_out out{};
  std::memcpy(&out, r.body.data(), sizeof(out));
  EXPECT_EQ(out.attr.ino, 7u);
  EXPECT_EQ(out.attr.size, 4242u);
  EXPECT_EQ(seen_.getattrs.load(), 1);
  EXPECT_EQ(seen_.getattr_ino.load(), 7u);

  Send(FUSE_LOOKUP, 3, 1, std::string("missing") + '\0');
  Reply e = Receive();
  EXPECT_EQ(e.header.unique, 3u);
  EXPECT_EQ(e.header.error, -ENOENT);
  EXPECT_TRUE(e.body.empty());

  // Many requests, both threads: each answered once, under its own unique.
  for (uint64_t u = 10; u < 60; ++u) Send(FUSE_GETATTR, u, u, Bytes(ga));
  std::vector<bool> answered(60, false);
  for (int i = 0; i < 50; ++i) {
    Reply k = Receive();
    ASSERT_GE(k.header.unique, 10u);
    ASSERT_LT(k.header.unique, 60u);
    EXPECT_FALSE(answered[k.header.unique]) << "answered twice: " << k.header.unique;
    answered[k.header.unique] = true;
  }
  EXPECT_EQ(seen_.getattrs.load(), 51);
  auto stats = loop_->StatsJson();
  EXPECT_NE(stats.find("\"requests_read\":53"), std::string::npos) << stats;
}

TEST_F(ReadLoopTest, AWritePayloadLandsInThePoolWithItsFlags) {
  Init();
  const std::string data = "payload bytes of a WRITE";
  fuse_write_in w{};
  w.size = static_cast<uint32_t>(data.size());
  w.write_flags = FUSE_WRITE_CACHE;
  Send(FUSE_WRITE, 4, 9, Bytes(w) + data);
  Reply r = Receive();
  EXPECT_EQ(r.header.unique, 4u);
  EXPECT_EQ(r.header.error, 0);
  ASSERT_EQ(r.body.size(), sizeof(fuse_write_out));
  fuse_write_out out{};
  std::memcpy(&out, r.body.data(), sizeof(out));
  EXPECT_EQ(out.size, data.size());
  ASSERT_EQ(seen_.writes.load(), 1);
  EXPECT_EQ(seen_.payload, data);
  EXPECT_TRUE(seen_.write_flags_seen.load()) << "WriteFlags lost the request's flags";
  EXPECT_EQ(seen_.write_flags.load(), static_cast<uint32_t>(FUSE_WRITE_CACHE));
  EXPECT_TRUE(seen_.payload_in_pool.load()) << "the payload is not in a pool buffer";
  EXPECT_TRUE(seen_.payload_aligned.load()) << "the payload does not start on a page";
}

TEST_F(ReadLoopTest, AShortRequestEndsTheSessionWithEio) {
  Init();
  const char scrap[8] = {};
  ASSERT_EQ(send(kernel_, scrap, sizeof(scrap), 0), 8);
  ASSERT_EQ(run_.wait_for(std::chrono::seconds(5)), std::future_status::ready);
  EXPECT_EQ(run_.get(), -EIO);
  EXPECT_TRUE(fuse_session_exited(se_));
}

TEST_F(ReadLoopTest, ExitEndsEveryLoopThread) {
  Init();
  fuse_session_exit(se_);  // as libfuse's SIGTERM handler does; the threads sit in read(2)
  ASSERT_EQ(run_.wait_for(std::chrono::seconds(5)), std::future_status::ready)
      << "a loop thread blocked in read(2) was not woken";
  EXPECT_EQ(run_.get(), 0);
}

// ShareLoopThreads: one uid's slow requests occupy at most threads - reserve loop threads; the
// rest are handed to its overflow, and another user's request is answered meanwhile.
class SharedLoopTest : public ReadLoopTest {
 protected:
  SharedLoopTest() {
    threads_ = 4;
    adoptable_ = 16;
  }
  void BeforeRun() override {
    loop_->ShareLoopThreads(/*reserve=*/1, [this](uid_t uid, std::function<void()> job) {
      std::lock_guard lock(mu_);
      handed_uids_.push_back(uid);
      helpers_.emplace_back(std::move(job));
      return true;
    });
  }
  void TearDown() override {
    g_release = true;
    for (auto& t : helpers_) t.join();
    ReadLoopTest::TearDown();
  }
  std::mutex mu_;
  std::vector<uid_t> handed_uids_;
  std::vector<std::thread> helpers_;
};

TEST_F(SharedLoopTest, OneUidNeverTakesEveryLoopThread) {
  Init();
  g_release = false;
  // Eight slow requests of uid 1000: three run on loop threads (4 - reserve 1), five are handed
  // over and run on the overflow's threads.
  for (uint64_t u = 10; u < 18; ++u) Send(FUSE_LOOKUP, u, 1, std::string("slow") + '\0', 1000);
  for (int i = 0; i < 500 && g_slow_running.load() < 8; ++i) usleep(2000);
  EXPECT_EQ(g_slow_running.load(), 8);
  // Another user is answered while all eight wait: a loop thread was left for it.
  fuse_getattr_in ga{};
  Send(FUSE_GETATTR, 30, 7, Bytes(ga), 2000);
  Reply r = Receive();
  EXPECT_EQ(r.header.unique, 30u);
  EXPECT_EQ(r.header.error, 0);
  {
    std::lock_guard lock(mu_);
    EXPECT_EQ(handed_uids_.size(), 5u);
    for (uid_t u : handed_uids_) EXPECT_EQ(u, 1000u);
  }
  g_release = true;
  for (int i = 0; i < 8; ++i) {
    Reply k = Receive();
    EXPECT_EQ(k.header.error, -ENOENT);
  }
  EXPECT_NE(loop_->StatsJson().find("\"handed_over\":5"), std::string::npos) << loop_->StatsJson();
}

}  // namespace
}  // namespace dnvme::fs
