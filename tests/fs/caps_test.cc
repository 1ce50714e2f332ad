// fs/caps: DropCapabilities in a forked child (capabilities cannot be raised again, so every case
// runs in its own process), checked against the kernel's own view in /proc/self/status.
#include "fs/caps.h"

#include <sys/capability.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>

#include <gtest/gtest.h>

namespace dnvme::fs {
namespace {

// The Cap* lines of /proc/self/status (the thread-group leader's) or another status file as bit
// masks ("CapEff" -> 0x...).
std::map<std::string, uint64_t> ReadCapMasks(const char* path = "/proc/self/status") {
  std::map<std::string, uint64_t> masks;
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return masks;
  char key[64];
  unsigned long long value = 0;
  char line[512];
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::sscanf(line, "Cap%3s:\t%llx", key, &value) == 2)
      masks["Cap" + std::string(key)] = value;
  }
  std::fclose(f);
  return masks;
}

uint64_t Mask(const std::vector<cap_value_t>& caps) {
  uint64_t m = 0;
  for (cap_value_t c : caps) m |= uint64_t{1} << c;
  return m;
}

// What the child saw: the call's outcome and the masks right after it.
struct ChildView {
  bool ok = false;
  std::string status;  // Status::ToString() on error
  size_t kept = 0, dropped = 0;
  std::string report;  // CapReport::ToString()
  std::map<std::string, uint64_t> masks;
};

// Runs `body` in a forked child; the child reports through a pipe in a line format.
ChildView RunInChild(const std::function<Result<CapReport>()>& body) {
  int fds[2];
  EXPECT_EQ(pipe(fds), 0);
  pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    std::ostringstream out;
    Result<CapReport> r = body();
    if (r.ok()) {
      out << "ok\n" << r->kept.size() << "\n" << r->dropped.size() << "\n" << r->ToString() << "\n";
    } else {
      out << "error\n0\n0\n" << r.status().ToString() << "\n";
    }
    for (const auto& [k, v] : ReadCapMasks()) out << k << " " << v << "\n";
    std::string text = out.str();
    ssize_t n = write(fds[1], text.data(), text.size());
    _exit(n == static_cast<ssize_t>(text.size()) ? 0 : 1);
  }
  close(fds[1]);
  std::string text;
  char buf[4096];
  for (ssize_t n; (n = read(fds[0], buf, sizeof(buf))) > 0;)
    text.append(buf, static_cast<size_t>(n));
  close(fds[0]);
  int wstatus = 0;
  EXPECT_EQ(waitpid(pid, &wstatus, 0), pid);
  EXPECT_TRUE(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0) << "child failed: " << text;

  ChildView view;
  std::istringstream in(text);
  std::string first, line;
  std::getline(in, first);
  view.ok = first == "ok";
  in >> view.kept >> view.dropped;
  std::getline(in, line);  // rest of the count line
  std::getline(in, line);
  (view.ok ? view.report : view.status) = line;
  std::string key;
  uint64_t value = 0;
  while (in >> key >> value) view.masks[key] = value;
  return view;
}

// Root with CAP_SETPCAP (needed to shrink the bounding set); the reason otherwise.
std::string PrivilegedSkipReason() {
  if (geteuid() != 0) return "not root: dropping capabilities needs a process that holds them";
  if ((ReadCapMasks()["CapEff"] & (uint64_t{1} << CAP_SETPCAP)) == 0) {
    return "root without cap_setpcap (container?): the bounding set cannot be changed";
  }
  return "";
}

#define SKIP_UNLESS_PRIVILEGED()                                                     \
  do {                                                                               \
    if (std::string why = PrivilegedSkipReason(); !why.empty()) GTEST_SKIP() << why; \
  } while (0)

TEST(CapsTest, DaemonKeepSetLeavesExactlyThoseBits) {
  SKIP_UNLESS_PRIVILEGED();
  const auto parent = ReadCapMasks();
  const uint64_t keep = Mask(DaemonKeepSet());
  ChildView v = RunInChild([] {
    // Put something in the ambient set first so clearing it is observable.
    cap_t caps = cap_get_proc();
    cap_value_t lock = CAP_IPC_LOCK;
    cap_set_flag(caps, CAP_INHERITABLE, 1, &lock, CAP_SET);
    cap_set_proc(caps);
    cap_free(caps);
    if (CAP_AMBIENT_SUPPORTED()) cap_set_ambient(CAP_IPC_LOCK, CAP_SET);
    return DropCapabilities(DaemonKeepSet());
  });
  ASSERT_TRUE(v.ok) << v.status;
  EXPECT_EQ(v.masks["CapEff"], keep & parent.at("CapPrm")) << v.report;
  EXPECT_EQ(v.masks["CapPrm"], keep & parent.at("CapPrm"));
  EXPECT_EQ(v.masks["CapBnd"], keep & parent.at("CapBnd"));
  EXPECT_EQ(v.masks["CapInh"], 0u);
  EXPECT_EQ(v.masks["CapAmb"], 0u);
  EXPECT_EQ(v.kept, static_cast<size_t>(__builtin_popcountll(keep & parent.at("CapPrm"))));
  EXPECT_EQ(v.dropped, static_cast<size_t>(__builtin_popcountll(
                           (parent.at("CapPrm") | parent.at("CapBnd")) & ~keep)));
  EXPECT_NE(v.report.find("cap_ipc_lock"), std::string::npos) << v.report;
  EXPECT_NE(v.report.find("cap_sys_admin"), std::string::npos) << v.report;  // in "dropped"
}

// The daemon's own call: CAP_MKNOD stays permitted (and in the bounding set) but not effective,
// and a ScopedCapability raises it on this thread only while it lives (fs/caps.h).
TEST(CapsTest, DormantCapabilityIsRaisedOnlyInScope) {
  SKIP_UNLESS_PRIVILEGED();
  const auto parent = ReadCapMasks();
  const uint64_t keep = Mask(DaemonKeepSet()) & parent.at("CapPrm");
  const uint64_t dormant = Mask(DaemonDormantSet());
  ASSERT_NE(keep & dormant, 0u) << "the daemon keeps no dormant capability this test can see";
  std::map<std::string, uint64_t> raised, thread_view;
  ChildView v = RunInChild([&]() -> Result<CapReport> {
    Result<CapReport> r = DropCapabilities(DaemonKeepSet(), DaemonDormantSet());
    if (!r.ok()) return r;
    // The other thread exists before the raise (a new thread copies its creator's sets), and
    // reads its own sets while the main thread holds the capability raised.
    std::mutex m;
    std::condition_variable cv;
    bool go = false;
    std::thread other([&] {
      std::unique_lock lock(m);
      cv.wait(lock, [&] { return go; });
      thread_view = ReadCapMasks("/proc/thread-self/status");
    });
    {
      Result<ScopedCapability> up = ScopedCapability::Raise(CAP_MKNOD);
      if (!up.ok()) {
        {
          std::lock_guard lock(m);
          go = true;
        }
        cv.notify_all();
        other.join();
        return up.status();
      }
      raised = ReadCapMasks();  // of this (the main) thread
      {
        std::lock_guard lock(m);
        go = true;
      }
      cv.notify_all();
      other.join();
    }
    if (raised["CapEff"] != (keep & ~dormant) + (uint64_t{1} << CAP_MKNOD) ||
        thread_view["CapEff"] != (keep & ~dormant)) {
      return Status::Internal("raised: main " + std::to_string(raised["CapEff"]) +
                              ", other thread " + std::to_string(thread_view["CapEff"]));
    }
    return r;  // masks are read after the scope ended
  });
  ASSERT_TRUE(v.ok) << v.status;
  EXPECT_EQ(v.masks["CapPrm"], keep);
  EXPECT_EQ(v.masks["CapEff"], keep & ~dormant) << v.report;
  EXPECT_EQ(v.masks["CapBnd"], Mask(DaemonKeepSet()) & parent.at("CapBnd"));
}

TEST(CapsTest, RaisingWhatIsNotPermittedIsEperm) {
  SKIP_UNLESS_PRIVILEGED();
  ChildView v = RunInChild([]() -> Result<CapReport> {
    Result<CapReport> r = DropCapabilities({CAP_IPC_LOCK});
    if (!r.ok()) return r;
    Result<ScopedCapability> up = ScopedCapability::Raise(CAP_MKNOD);
    if (up.ok()) return Status::Internal("raised a capability that was dropped");
    if (up.status().error_number() != EPERM) return up.status();
    return r;
  });
  ASSERT_TRUE(v.ok) << v.status;
  EXPECT_EQ(v.masks["CapEff"], Mask({CAP_IPC_LOCK}));
}

TEST(CapsTest, DormantMustBeKept) {
  Result<CapReport> r = DropCapabilities({CAP_CHOWN}, {CAP_MKNOD});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Status::Code::kInvalidArgument) << r.status().ToString();
}

TEST(CapsTest, EmptyKeepSetDropsEverything) {
  SKIP_UNLESS_PRIVILEGED();
  ChildView v = RunInChild([] { return DropCapabilities({}); });
  ASSERT_TRUE(v.ok) << v.status;
  EXPECT_EQ(v.masks["CapEff"], 0u);
  EXPECT_EQ(v.masks["CapPrm"], 0u);
  EXPECT_EQ(v.masks["CapBnd"], 0u);
  EXPECT_EQ(v.masks["CapInh"], 0u);
  EXPECT_EQ(v.kept, 0u);
}

TEST(CapsTest, KeptSetpcapStaysInEveryKeptSet) {
  SKIP_UNLESS_PRIVILEGED();
  const uint64_t keep = Mask({CAP_SETPCAP, CAP_IPC_LOCK});
  ChildView v = RunInChild([] { return DropCapabilities({CAP_SETPCAP, CAP_IPC_LOCK}); });
  ASSERT_TRUE(v.ok) << v.status;
  EXPECT_EQ(v.masks["CapEff"], keep);
  EXPECT_EQ(v.masks["CapPrm"], keep);
  EXPECT_EQ(v.masks["CapBnd"], keep);
}

TEST(CapsTest, SecondDropHasNothingLeftToDrop) {
  SKIP_UNLESS_PRIVILEGED();
  ChildView v = RunInChild([]() -> Result<CapReport> {
    Result<CapReport> first = DropCapabilities(DaemonKeepSet());
    if (!first.ok()) return first.status();
    return DropCapabilities(DaemonKeepSet());
  });
  ASSERT_TRUE(v.ok) << v.status;
  EXPECT_EQ(v.dropped, 0u) << v.report;
  EXPECT_EQ(v.masks["CapPrm"], v.masks["CapBnd"]);
}

// Not root (or root that became nobody): nothing to drop is not an error.
TEST(CapsTest, OrdinaryUserGetsEmptyReportNotError) {
  const bool root = geteuid() == 0;
  ChildView v = RunInChild([root]() -> Result<CapReport> {
    if (root && (setresgid(65534, 65534, 65534) != 0 || setresuid(65534, 65534, 65534) != 0)) {
      return Status::FromErrno(errno, "setresuid(nobody)");
    }
    return DropCapabilities(DaemonKeepSet());
  });
  ASSERT_TRUE(v.ok) << v.status;
  EXPECT_EQ(v.dropped, 0u) << v.report;
  EXPECT_EQ(v.kept, 0u) << v.report;
  EXPECT_EQ(v.masks["CapEff"], 0u);
  EXPECT_EQ(v.masks["CapPrm"], 0u);
  if (v.masks["CapBnd"] != 0) {
    EXPECT_NE(v.report.find("bounding set left unchanged"), std::string::npos) << v.report;
  }
}

TEST(CapsTest, RejectsValuesThatAreNotCapabilities) {
  for (cap_value_t bad : {cap_value_t{-1}, cap_value_t{9999}}) {
    Result<CapReport> r = DropCapabilities({CAP_CHOWN, bad});
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), Status::Code::kInvalidArgument) << r.status().ToString();
  }
}

TEST(CapsTest, RefusesWhileOtherThreadsRun) {
  ChildView v = RunInChild([] {
    std::mutex m;
    std::condition_variable cv;
    bool done = false;
    std::thread t([&] {
      std::unique_lock lock(m);
      cv.wait(lock, [&] { return done; });
    });
    Result<CapReport> r = DropCapabilities(DaemonKeepSet());
    {
      std::lock_guard lock(m);
      done = true;
    }
    cv.notify_all();
    t.join();
    return r;
  });
  ASSERT_FALSE(v.ok);
  EXPECT_NE(v.status.find("Internal"), std::string::npos) << v.status;
  EXPECT_NE(v.status.find("before any thread starts"), std::string::npos) << v.status;
}

TEST(CapsTest, ReportToString) {
  CapReport r;
  r.kept = {"cap_chown"};
  r.dropped = {"cap_sys_admin", "cap_net_raw"};
  r.notes = {"bounding set left unchanged (no cap_setpcap)"};
  EXPECT_EQ(r.ToString(),
            "kept [cap_chown] dropped 2 [cap_sys_admin, cap_net_raw]; bounding set left unchanged "
            "(no cap_setpcap)");
}

}  // namespace
}  // namespace dnvme::fs

namespace dnvme::fs {
namespace {

// Passthrough (fs/fuse/passthrough.h) adds CAP_SYS_ADMIN, dormant: the backing-file ioctls raise
// it on one thread; without passthrough it stays out of every set.
TEST(CapsTest, PassthroughKeepsCapSysAdminDormantOnly) {
  auto has = [](const std::vector<cap_value_t>& set, cap_value_t cap) {
    return std::find(set.begin(), set.end(), cap) != set.end();
  };
  EXPECT_FALSE(has(DaemonKeepSet(), CAP_SYS_ADMIN));
  EXPECT_FALSE(has(DaemonDormantSet(), CAP_SYS_ADMIN));
  EXPECT_TRUE(has(DaemonKeepSet(true), CAP_SYS_ADMIN));
  EXPECT_TRUE(has(DaemonDormantSet(true), CAP_SYS_ADMIN));
  for (cap_value_t cap : DaemonDormantSet(true)) EXPECT_TRUE(has(DaemonKeepSet(true), cap)) << cap;
  EXPECT_EQ(DaemonKeepSet(true).size(), DaemonKeepSet().size() + 1);
}

}  // namespace
}  // namespace dnvme::fs
