// The control file's data requests (fs/control/transfer.cc) through a real CtlSession, a real
// engine handle (handle.open: an AioHandle on libaio) and client memory registered from
// /dev/shm, against real files in a scratch BACKING_DIR; the core is a fake (ControlCore), no
// mount. Sync and async pread/pwrite with unaligned offsets, the file created by a pwrite, a read
// past the end (the engine's short transfer becomes the request's error), the bounds and
// refusals, the coherence calls around a transfer of a file the mount knows, and the pending limit.
#include <fcntl.h>
#include <sys/inotify.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "dnvme/fd.h"
#include "fs/control/control.h"
#include "tests/engine/test_util.h"

namespace dnvme::fs {
namespace {

using nlohmann::json;

// A file the mount knows: the session only passes its Inode* back to the core.
struct FakeInode {
  std::atomic<int> pins{0}, drains{0}, invalidations{0};
};

class FakeCore : public ControlCore {
 public:
  FakeCore(int root_fd, int64_t max_pending) : root_fd_(root_fd), limits_(Maxima(max_pending)) {}
  void Know(const std::string& path) {
    struct stat st {};
    ASSERT_EQ(stat(path.c_str(), &st), 0) << path;
    known_dev_ = st.st_dev;
    known_ino_ = st.st_ino;
  }
  Inode* PinInode(dev_t dev, ino_t ino) override {
    if (dev != known_dev_ || ino != known_ino_) return nullptr;
    ++known_.pins;
    return reinterpret_cast<Inode*>(&known_);
  }
  void Unpin(Inode*) override { --known_.pins; }
  Status DrainForExternal(Inode&) override {
    ++known_.drains;
    return drain_status_;
  }
  void AfterExternalWrite(Inode&) override { ++known_.invalidations; }
  void AfterExternalCreate(const std::string& dir, const std::string& name) override {
    created_.push_back(dir + "|" + name);
  }
  UidLimits& uid_limits() override { return limits_; }
  CtlCounters& ctl_counters() override { return counters_; }
  HandleConfig EngineConfig() override { return HandleConfig{}; }
  Result<HandleConfig> SetEngineConfig(const std::string&) override {
    return Status::Unsupported(EPERM, "not in this test");
  }
  bool MayReconfigure(uid_t) const override { return false; }
  std::string StatsJson() override { return "{}"; }
  void AddCtlEngine(AioHandle*) override { ++engines_; }
  void RemoveCtlEngine(AioHandle*) override { --engines_; }
  int root_fd() const override { return root_fd_; }
  const std::string& mountpoint() const override { return mountpoint_; }

  FakeInode known_;
  Status drain_status_;
  std::vector<std::string> created_;
  int engines_ = 0;

 private:
  static UidLimits::Maxima Maxima(int64_t max_pending) {
    UidLimits::Maxima m;
    m.fill(int64_t{1} << 40);
    m[static_cast<size_t>(UidResource::kPending)] = max_pending;
    return m;
  }
  const int root_fd_;
  dev_t known_dev_ = 0;
  ino_t known_ino_ = 0;
  UidLimits limits_;
  CtlCounters counters_;
  std::string mountpoint_ = "/mnt/transfer-test";
};

// A /dev/shm object of `size` bytes, mapped here as the client's memory.
class ShmBuffer {
 public:
  explicit ShmBuffer(size_t size) : size_(size) {
    static std::atomic<int> seq{0};
    name_ = "dnvme-transfer-test." + std::to_string(getpid()) + "." + std::to_string(seq++);
    const int fd = shm_open(("/" + name_).c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    EXPECT_GE(fd, 0) << std::strerror(errno);
    EXPECT_EQ(ftruncate(fd, static_cast<off_t>(size)), 0);
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    EXPECT_NE(p, MAP_FAILED);
    data_ = static_cast<char*>(p);
    memset(data_, 0, size);  // written by its owner, as a client's buffer must be (CheckAllocated)
    close(fd);
  }
  ~ShmBuffer() {
    munmap(data_, size_);
    shm_unlink(("/" + name_).c_str());
  }
  const std::string& name() const { return name_; }
  char* data() { return data_; }

 private:
  size_t size_;
  std::string name_;
  char* data_ = nullptr;
};

class TransferTest : public ::testing::Test {
 protected:
  void SetUp() override { Start(/*max_pending=*/1024); }
  void Start(int64_t max_pending) {
    session_.reset();
    ASSERT_TRUE(dir_.ok()) << dir_.error();
    root_.Reset(open(dir_.path().c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
    ASSERT_TRUE(root_.valid());
    core_ = std::make_unique<FakeCore>(root_.get(), max_pending);
    session_ = std::make_shared<CtlSession>(*core_, caller_);
    json h = Call({{"op", "handle.open"},
                   {"block_size", 64 << 10},
                   {"queue_depth", 8},
                   {"bounce_bytes_per_worker", 1 << 20}});
    ASSERT_EQ(h["ok"], true) << h.dump();
    handle_ = h["handle"];
    json b = Call({{"op", "buffer.register"}, {"shm", shm_.name()}});
    ASSERT_EQ(b["ok"], true) << b.dump();
    buffer_ = b["buffer"];
    EXPECT_EQ(b["size"], kBufferBytes);
  }
  void TearDown() override { session_.reset(); }

  // One request, run here (the session's queue is tested in ctl_session_test.cc).
  json Call(const json& request) {
    EXPECT_TRUE(session_->Request(request.dump(), caller_).ok());
    std::string answer;
    session_->Read(1 << 20, [&](const Result<std::string>& r) {
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      answer = r.value();
    });
    return json::parse(answer);
  }
  json Transfer(const char* op, const std::string& path, int64_t length, int64_t buffer_offset,
                int64_t file_offset, bool async = false) {
    json r = {{"op", op},
              {"handle", handle_},
              {"buffer", buffer_},
              {"path", path},
              {"length", length},
              {"buffer_offset", buffer_offset},
              {"file_offset", file_offset}};
    if (async) r["async"] = true;
    return Call(r);
  }
  std::string File(const std::string& name) {
    const std::vector<uint8_t> bytes = test::ReadWholeFile(dir_.path() + "/" + name);
    return std::string(bytes.begin(), bytes.end());
  }
  void PutFile(const std::string& name, const std::string& bytes) {
    UniqueFd fd(open((dir_.path() + "/" + name).c_str(), O_CREAT | O_TRUNC | O_WRONLY, 0644));
    ASSERT_TRUE(fd.valid());
    ASSERT_EQ(write(fd.get(), bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
  }
  static std::string Pattern(size_t n, int seed) {
    std::string s(n, '\0');
    for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 131 + seed * 7 + i / 4096) & 0xff);
    return s;
  }

  static constexpr int64_t kBufferBytes = 1 << 20;
  test::ScratchDir dir_;
  UniqueFd root_;
  ShmBuffer shm_{kBufferBytes};
  std::unique_ptr<FakeCore> core_;
  std::shared_ptr<CtlSession> session_;
  Caller caller_{getuid(), getgid(), getpid(), {}};
  int64_t handle_ = 0, buffer_ = 0;
};

TEST_F(TransferTest, SyncPwriteCreatesTheFileAndPreadReadsItBack) {
  const std::string data = Pattern(300000, 1);
  std::memcpy(shm_.data(), data.data(), data.size());
  json w = Transfer("pwrite", "out.bin", static_cast<int64_t>(data.size()), 0, 0);
  ASSERT_EQ(w["ok"], true) << w.dump();
  EXPECT_EQ(w["bytes"], data.size());
  EXPECT_EQ(File("out.bin"), data);
  struct stat made {};
  ASSERT_EQ(stat((dir_.path() + "/out.bin").c_str(), &made), 0);
  // DeepSpeed's pwrite makes its file 0600; the ctl write carries no umask to apply to more.
  EXPECT_EQ(made.st_mode & 07777, 0600u);
  ASSERT_EQ(core_->created_.size(), 1u);
  EXPECT_NE(core_->created_[0].find("|out.bin"), std::string::npos) << core_->created_[0];

  std::memset(shm_.data(), 0, kBufferBytes);
  json r =
      Transfer("pread", "/mnt/transfer-test/out.bin", static_cast<int64_t>(data.size()), 4096, 0);
  ASSERT_EQ(r["ok"], true) << r.dump();
  EXPECT_EQ(std::memcmp(shm_.data() + 4096, data.data(), data.size()), 0);
  const CtlCounters& c = core_->ctl_counters();
  EXPECT_EQ(c.ops_written.load(), 1u);
  EXPECT_EQ(c.ops_read.load(), 1u);
  EXPECT_EQ(c.bytes_written.load(), data.size());
  EXPECT_EQ(c.bytes_read.load(), data.size());
}

TEST_F(TransferTest, UnalignedOffsetsAndLengthsLandExactly) {
  const std::string before = Pattern(20000, 2);
  PutFile("f", before);
  const std::string data = Pattern(4097, 3);
  std::memcpy(shm_.data() + 3, data.data(), data.size());
  json w = Transfer("pwrite", "f", 4097, /*buffer_offset=*/3, /*file_offset=*/1001);
  ASSERT_EQ(w["ok"], true) << w.dump();
  std::string want = before;
  want.replace(1001, data.size(), data);
  EXPECT_EQ(File("f"), want) << "bytes around the write changed, or the write moved";

  std::memset(shm_.data(), 0x5a, kBufferBytes);
  json r = Transfer("pread", "f", 777, /*buffer_offset=*/5, /*file_offset=*/999);
  ASSERT_EQ(r["ok"], true) << r.dump();
  EXPECT_EQ(std::string(shm_.data() + 5, 777), want.substr(999, 777));
  EXPECT_EQ(shm_.data()[4], 0x5a) << "the read wrote before its buffer_offset";
  EXPECT_EQ(shm_.data()[5 + 777], 0x5a) << "the read wrote past its length";
}

TEST_F(TransferTest, AReadPastTheEndIsAnErrorWithItsErrno) {
  PutFile("short", Pattern(5000, 4));
  json r = Transfer("pread", "short", 8192, 0, 0);
  EXPECT_EQ(r["ok"], false) << r.dump();
  EXPECT_EQ(r["error"]["code"], "ENODATA") << r.dump();  // Status::EndOfFile
  EXPECT_EQ(core_->ctl_counters().ops_failed.load(), 1u);
  json at_end = Transfer("pread", "short", 1, 0, 5000);
  EXPECT_EQ(at_end["ok"], false) << at_end.dump();
}

TEST_F(TransferTest, BoundsAndRefusals) {
  PutFile("f", "x");
  ASSERT_EQ(mkdir((dir_.path() + "/d").c_str(), 0755), 0);
  struct Case {
    json request;
    const char* code;
    const char* says;
  };
  auto base = [&](const char* op, const std::string& path) {
    return json{{"op", op},    {"handle", handle_},  {"buffer", buffer_}, {"path", path},
                {"length", 1}, {"buffer_offset", 0}, {"file_offset", 0}};
  };
  std::vector<Case> cases;
  json past = base("pwrite", "f");
  past["buffer_offset"] = kBufferBytes - 10;
  past["length"] = 11;
  cases.push_back({past, "EINVAL", "past the end of buffer"});
  json whole = base("pread", "f");
  whole["buffer_offset"] = kBufferBytes + 1;
  whole["length"] = 0;
  cases.push_back({whole, "EINVAL", "past the end of buffer"});
  json no_handle = base("pread", "f");
  no_handle["handle"] = 99;
  cases.push_back({no_handle, "EBADF", "no handle 99"});
  json no_buffer = base("pwrite", "f");
  no_buffer["buffer"] = 98;
  cases.push_back({no_buffer, "EBADF", "no buffer 98"});
  cases.push_back({base("pread", "/elsewhere/f"), "EXDEV", "not inside the mount"});
  cases.push_back({base("pread", "d"), "EINVAL", "not a regular file"});
  cases.push_back({base("pread", "missing"), "ENOENT", ""});
  cases.push_back({base("pread", "../escape"), "", ""});
  for (const Case& k : cases) {
    json a = Call(k.request);
    EXPECT_EQ(a["ok"], false) << k.request.dump() << " -> " << a.dump();
    if (a["ok"] != false) continue;
    if (k.code[0] != '\0') {
      EXPECT_EQ(a["error"]["code"], k.code) << a.dump();
    }
    EXPECT_NE(a["error"]["message"].get<std::string>().find(k.says), std::string::npos) << a.dump();
  }
  EXPECT_EQ(File("f"), "x") << "a refused pwrite wrote";
  struct stat st {};
  EXPECT_NE(stat((dir_.path() + "/missing").c_str(), &st), 0) << "a pread created a file";
}

// A name that is not a regular file is refused before the object is opened at all: opening a
// device runs its driver's open (a tape rewinds; the mount itself is nodev), and a FIFO's open
// is seen by the other end. inotify's IN_OPEN is raised by every open but O_PATH's.
TEST_F(TransferTest, ANameThatIsNotARegularFileIsNeverOpened) {
  ASSERT_EQ(mkfifo((dir_.path() + "/fifo").c_str(), 0666), 0) << std::strerror(errno);
  UniqueFd watch(inotify_init1(IN_NONBLOCK | IN_CLOEXEC));
  ASSERT_TRUE(watch.valid()) << std::strerror(errno);
  ASSERT_GE(inotify_add_watch(watch.get(), dir_.path().c_str(), IN_OPEN), 0)
      << std::strerror(errno);
  for (const char* op : {"pread", "pwrite"}) {
    json r = Transfer(op, "fifo", 4096, 0, 0);
    EXPECT_EQ(r["ok"], false) << r.dump();
    EXPECT_EQ(r["error"]["code"], "EINVAL") << r.dump();
    EXPECT_NE(r["error"]["message"].get<std::string>().find("not a regular file"),
              std::string::npos)
        << r.dump();
  }
  json f = Call({{"op", "fsync"}, {"path", "fifo"}});
  EXPECT_EQ(f["ok"], false) << f.dump();
  EXPECT_EQ(f["error"]["code"], "EINVAL") << f.dump();
  char events[4096];
  const ssize_t n = read(watch.get(), events, sizeof(events));
  EXPECT_EQ(n, -1) << "the FIFO was opened (" << n << " bytes of inotify events)";
  EXPECT_EQ(errno, EAGAIN);
  // The directory itself may be fsynced, as fsync(2) of a directory may.
  json d = Call({{"op", "fsync"}, {"path", "/mnt/transfer-test"}});
  EXPECT_EQ(d["ok"], true) << d.dump();
}

TEST_F(TransferTest, AsyncTransfersAreCollectedByWait) {
  const std::string data = Pattern(200000, 5);
  std::memcpy(shm_.data(), data.data(), data.size());
  json w = Transfer("pwrite", "a", static_cast<int64_t>(data.size()), 0, 0, /*async=*/true);
  ASSERT_EQ(w["ok"], true) << w.dump();
  EXPECT_EQ(w["async"], true);
  const uint64_t op = w["op_id"];
  PutFile("tiny", "abc");
  json bad = Transfer("pread", "tiny", 4096, 0, 0, /*async=*/true);
  ASSERT_EQ(bad["ok"], true) << "submitted; it fails at completion: " << bad.dump();
  EXPECT_EQ(core_->uid_limits().Held(getuid(), UidResource::kPending), 2);

  json done = Call({{"op", "wait"}, {"handle", handle_}});
  ASSERT_EQ(done["ok"], true) << done.dump();
  EXPECT_EQ(done["completed"], 2);
  EXPECT_EQ(done["failed"], 1);
  ASSERT_EQ(done["ops"].size(), 2u);
  EXPECT_EQ(done["ops"][0]["op_id"], op);
  EXPECT_EQ(done["ops"][0]["op"], "pwrite");
  EXPECT_EQ(done["ops"][0]["ok"], true);
  EXPECT_EQ(done["ops"][0]["bytes"], data.size());
  EXPECT_EQ(done["ops"][1]["ok"], false);
  EXPECT_NE(done["ops"][1]["error"]["errno"], 0);
  EXPECT_EQ(File("a"), data);
  EXPECT_EQ(core_->uid_limits().Held(getuid(), UidResource::kPending), 0)
      << "wait did not give the pending charges back";
  EXPECT_EQ(core_->uid_limits().Held(getuid(), UidResource::kFiles), 0);
  json again = Call({{"op", "wait"}, {"handle", handle_}});
  EXPECT_EQ(again["completed"], 0) << "records are collected once";
}

TEST_F(TransferTest, AFileTheMountKnowsIsDrainedBeforeAndInvalidatedAfter) {
  PutFile("known", Pattern(8192, 6));
  core_->Know(dir_.path() + "/known");
  std::memcpy(shm_.data(), "new bytes", 9);
  json w = Transfer("pwrite", "known", 9, 0, 0);
  ASSERT_EQ(w["ok"], true) << w.dump();
  EXPECT_EQ(core_->known_.drains.load(), 1);
  EXPECT_EQ(core_->known_.invalidations.load(), 1);
  EXPECT_EQ(core_->known_.pins.load(), 0) << "the transfer kept its pin";
  json r = Transfer("pread", "known", 9, 0, 0);
  ASSERT_EQ(r["ok"], true) << r.dump();
  EXPECT_EQ(core_->known_.drains.load(), 2);
  EXPECT_EQ(core_->known_.invalidations.load(), 1) << "a read dropped the mount's caches";

  // Data the mount cannot land fails the transfer, before any byte moves.
  core_->drain_status_ = Status::FromErrno(ENOSPC, "write-behind of 'known'");
  std::memcpy(shm_.data(), "XXXXXXXXX", 9);
  json refused = Transfer("pwrite", "known", 9, 0, 0);
  EXPECT_EQ(refused["ok"], false) << refused.dump();
  EXPECT_EQ(refused["error"]["code"], "ENOSPC") << refused.dump();
  EXPECT_EQ(File("known").substr(0, 9), "new bytes");
  EXPECT_EQ(core_->known_.pins.load(), 0);
}

TEST_F(TransferTest, UncollectedAsyncTransfersAreBoundedPerUid) {
  Start(/*max_pending=*/1);
  PutFile("f", Pattern(8192, 7));
  json first = Transfer("pread", "f", 4096, 0, 0, /*async=*/true);
  ASSERT_EQ(first["ok"], true) << first.dump();
  json second = Transfer("pread", "f", 4096, 0, 4096, /*async=*/true);
  EXPECT_EQ(second["ok"], false) << second.dump();
  EXPECT_EQ(second["error"]["code"], "EAGAIN") << second.dump();
  EXPECT_NE(second["error"]["message"].get<std::string>().find("ctl_max_pending"),
            std::string::npos)
      << second.dump();
  ASSERT_EQ(Call({{"op", "wait"}, {"handle", handle_}})["completed"], 1);
  json third = Transfer("pread", "f", 4096, 0, 4096, /*async=*/true);
  EXPECT_EQ(third["ok"], true) << "the collected transfer's place was not given back";
  Call({{"op", "wait"}, {"handle", handle_}});
}

}  // namespace
}  // namespace dnvme::fs
