// The descriptor table (descriptor_table.h).
#include "preload/descriptor_table.h"

#include <linux/kcmp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <map>
#include <mutex>
#include <new>
#include <unordered_map>

#include "dnvme/log.h"
#include "preload/descriptor_state.h"
#include "preload/internal.h"
#include "preload/lease.h"
#include "preload/libc.h"
#include "preload/staging.h"

namespace dnvme::preload {
namespace {

struct DescriptorTable {
  std::mutex mu;                                                   // guards the two below
  std::unordered_map<int, std::shared_ptr<AdoptedFile>> files;     // program fd -> file
  std::map<dev_t, std::shared_ptr<BrokerConnection>> connections;  // mount device -> broker
};
DescriptorTable g_table;

}  // namespace

bool SameOpenFile(int a, int b) {
  return syscall(SYS_kcmp, getpid(), getpid(), KCMP_FILE, a, b) == 0;
}

std::shared_ptr<AdoptedFile> LookupAdopted(int fd) {
  std::lock_guard lock(g_table.mu);
  auto it = g_table.files.find(fd);
  return it == g_table.files.end() ? nullptr : it->second;
}

std::vector<std::shared_ptr<AdoptedFile>> AllAdopted() {
  std::vector<std::shared_ptr<AdoptedFile>> all;
  std::lock_guard lock(g_table.mu);
  for (auto& [fd, f] : g_table.files) all.push_back(f);
  return all;
}

// One open file, one AdoptedFile: one offset, one write-behind, one lease.
std::shared_ptr<AdoptedFile> ShareWithDuplicate(int fd) {
  std::lock_guard lock(g_table.mu);
  std::shared_ptr<AdoptedFile> same;
  for (const auto& [n, f] : g_table.files) {
    if (f->witness >= 0 && SameOpenFile(fd, f->witness)) {
      same = f;
      break;
    }
  }
  if (same) {
    g_table.files[fd] = same;
    ++same->fds;
    SetState(fd, kOurs);
  }
  return same;
}

std::shared_ptr<BrokerConnection> ConnectionOf(dev_t dev) {
  std::lock_guard lock(g_table.mu);
  auto it = g_table.connections.find(dev);
  return it == g_table.connections.end() ? nullptr : it->second;
}

std::shared_ptr<BrokerConnection> KeepConnection(dev_t dev,
                                                 std::shared_ptr<BrokerConnection> conn) {
  std::lock_guard lock(g_table.mu);
  auto [it, fresh] = g_table.connections.emplace(dev, std::move(conn));
  return it->second;
}

void AddAdopted(int fd, std::shared_ptr<AdoptedFile> f) {
  std::lock_guard lock(g_table.mu);
  ++f->fds;
  g_table.files[fd] = std::move(f);
  SetState(fd, kOurs);
}

Status DropDescriptor(int fd) {
  std::shared_ptr<AdoptedFile> f;
  bool last = false;
  {
    std::lock_guard lock(g_table.mu);
    auto it = g_table.files.find(fd);
    if (it != g_table.files.end()) {
      f = std::move(it->second);
      g_table.files.erase(it);
      last = --f->fds == 0;
    }
    SetState(fd, kUnknown);
  }
  if (!f) return Status::Ok();
  // The last descriptor of the file: the lease ends (announcing what was written).
  if (last) {
    Status err = WaitWrites(*f);
    f->data.Invalidate();
    EndLease(*f);
    return err;
  }
  // Not the last: an error stays for the file's next write, fsync or close.
  (void)f->data.Drain();
  return Status::Ok();
}

int Duplicated(int fd, int nfd) {
  if (nfd < 0) return nfd;
  // Freed behind our back (fclose, close_range): its error has no one left to hear it.
  if (StateOf(nfd) == kOurs) (void)DropDescriptor(nfd);
  std::lock_guard lock(g_table.mu);
  auto it = g_table.files.find(fd);
  if (it != g_table.files.end()) {
    g_table.files[nfd] = it->second;
    ++it->second->fds;
    SetState(nfd, kOurs);
  } else {
    SetState(nfd, StateOf(fd) == kNotOurs ? kNotOurs : kUnknown);
  }
  return nfd;
}

Status Disown(int fd) {
  std::shared_ptr<AdoptedFile> f = LookupAdopted(fd);
  if (!f) return Status::Ok();
  std::vector<int> fds;
  {
    std::lock_guard lock(g_table.mu);
    for (const auto& [n, other] : g_table.files) {
      if (other == f) fds.push_back(n);
    }
  }
  Status err;
  for (int n : fds) {
    if (Status e = DropDescriptor(n); !e.ok()) err = std::move(e);
    SetState(n, kNotOurs);
  }
  return err;
}

Status ForgetBeforeClose(int fd) {
  if (StateOf(fd) == kOurs) return DropDescriptor(fd);
  SetState(fd, kUnknown);
  return Status::Ok();
}

int OpenedDescriptor(int fd) {
  if (fd >= 0) {
    if (StateOf(fd) == kOurs) {
      (void)DropDescriptor(fd);  // the number was reused: the old file's error is lost with it
    } else {
      SetState(fd, kUnknown);
    }
  }
  return fd;
}

Status LandWrites(int fd) {
  if (StateOf(fd) != kOurs) return Status::Ok();
  auto f = LookupAdopted(fd);
  return f ? WaitWrites(*f) : Status::Ok();
}

// Before the mount serves `fd` (a small transfer, mmap, fsync...): what this process wrote
// around it must be visible to the mount first.
void BeforeMountUse(int fd) {
  if (StateOf(fd) != kOurs) return;
  auto f = LookupAdopted(fd);
  if (f && HasPending(*f)) {
    if (Status st = Announce(*f); !st.ok()) dnvme::Logger().warn("dnvme run: {}", st.ToString());
  }
}

// Before the mount changes `fd`'s file for this process (a small write, a truncate): what was
// read ahead may be stale after it.
void BeforeMountWrite(int fd) {
  BeforeMountUse(fd);
  if (StateOf(fd) != kOurs) return;
  if (auto f = LookupAdopted(fd)) f->data.Invalidate();
}

void BeforeMap(int fd) {
  if (fd >= 0 && StateOf(fd) == kOurs) {
    BeforeMountUse(fd);
    if (auto f = LookupAdopted(fd)) NoteMapped(*f);
  }
}

// Before fork, exec, and a mount-path use of a file.
void AnnounceEverything() {
  for (auto& f : AllAdopted()) {
    if (HasPending(*f)) {
      if (Status st = Announce(*f); !st.ok()) dnvme::Logger().warn("dnvme run: {}", st.ToString());
    }
  }
}

void LockTableForFork() { g_table.mu.lock(); }
void UnlockTableAfterFork() { g_table.mu.unlock(); }

void ForgetTableInChild() {
  // Only this thread survived: every lock holder is gone. The parent's leases stay the parent's.
  new (&g_table.mu) std::mutex();
  for (auto& [dev, c] : g_table.connections) {
    new (&c->mu) std::mutex();
    Libc().close(c->sock);
    c->sock = -1;
  }
  for (auto& [fd, f] : g_table.files) {
    if (f->witness >= 0) Libc().close(f->witness);
    f->witness = -1;
    SetState(fd, kUnknown);
  }
  // Leak the files' engine-side state too: their FileRefs may be referenced by the leaked
  // engine's (dead) operations.
  new (&g_table.files) std::unordered_map<int, std::shared_ptr<AdoptedFile>>();
  new (&g_table.connections) std::map<dev_t, std::shared_ptr<BrokerConnection>>();
}

}  // namespace dnvme::preload
