// Exit and fork (lifetime.h).
#include "preload/lifetime.h"

#include <fcntl.h>
#include <pthread.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <string>

#include "preload/counters.h"
#include "preload/descriptor_table.h"
#include "preload/internal.h"
#include "preload/libc.h"
#include "preload/reserve.h"
#include "preload/settings.h"
#include "preload/staging.h"

namespace dnvme::preload {
namespace {

void WriteStats() {
  const Settings& settings = PreloadSettings();
  if (settings.stats_file.empty()) return;
  const std::string line = ProcessCounters().JsonLine(getpid(), EngineIfMade());
  int fd =
      Libc().open(settings.stats_file.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return;
  ssize_t n;
  do {
    n = Libc().write(fd, line.data(), line.size());
  } while (n < 0 && errno == EINTR);
  Libc().close(fd);
}

void AtExit() {
  AnnounceEverything();
  for (auto& f : AllAdopted()) {
    (void)f->data.Drain();
    TrimReservation(*f);
  }
  WriteStats();
}

void ForkPrepare() {
  AnnounceEverything();
  LockTableForFork();
  LockEngineForFork();
}

void ForkParent() {
  UnlockEngineAfterFork();
  UnlockTableAfterFork();
}

void ForkChild() {
  // Only this thread survived: the engine's workers and every lock holder are gone. Forget it
  // all (leaking the engine: its destructor would wait for threads that do not exist here); the
  // parent's leases stay the parent's, and this process adopts its files again when it uses them.
  ForgetTableInChild();
  ForgetEngineInChild();
  // This process's counters are its own (its stats line says what it did).
  ProcessCounters().Reset();
}

}  // namespace

void InstallProcessHooks() {
  pthread_atfork(ForkPrepare, ForkParent, ForkChild);
  atexit(AtExit);
}

}  // namespace dnvme::preload
