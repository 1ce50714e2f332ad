// libc's own functions (libc.h).
#include "preload/libc.h"

#include <dlfcn.h>

namespace dnvme::preload {
namespace {

template <typename F>
F Next(const char* name) {
  return reinterpret_cast<F>(dlsym(RTLD_NEXT, name));
}

}  // namespace

const LibcFunctions& Libc() {
  static LibcFunctions c = [] {
    LibcFunctions l{};
    l.read = Next<decltype(l.read)>("read");
    l.write = Next<decltype(l.write)>("write");
    l.pread = Next<decltype(l.pread)>("pread64");
    l.pwrite = Next<decltype(l.pwrite)>("pwrite64");
    l.readv = Next<decltype(l.readv)>("readv");
    l.writev = Next<decltype(l.writev)>("writev");
    l.preadv = Next<decltype(l.preadv)>("preadv64");
    l.pwritev = Next<decltype(l.pwritev)>("pwritev64");
    l.preadv2 = Next<decltype(l.preadv2)>("preadv64v2");
    l.pwritev2 = Next<decltype(l.pwritev2)>("pwritev64v2");
    l.open = Next<decltype(l.open)>("open");
    l.open64 = Next<decltype(l.open64)>("open64");
    l.openat = Next<decltype(l.openat)>("openat");
    l.openat64 = Next<decltype(l.openat64)>("openat64");
    l.creat = Next<decltype(l.creat)>("creat");
    l.creat64 = Next<decltype(l.creat64)>("creat64");
    l.close = Next<decltype(l.close)>("close");
    l.fcntl = Next<decltype(l.fcntl)>("fcntl");
    l.dup = Next<decltype(l.dup)>("dup");
    l.dup2 = Next<decltype(l.dup2)>("dup2");
    l.dup3 = Next<decltype(l.dup3)>("dup3");
    l.fsync = Next<decltype(l.fsync)>("fsync");
    l.fdatasync = Next<decltype(l.fdatasync)>("fdatasync");
    l.copy_file_range = Next<decltype(l.copy_file_range)>("copy_file_range");
    l.sendfile = Next<decltype(l.sendfile)>("sendfile64");
    l.splice = Next<decltype(l.splice)>("splice");
    l.ftruncate = Next<decltype(l.ftruncate)>("ftruncate64");
    l.ftruncate64 = l.ftruncate;
    l.fallocate = Next<decltype(l.fallocate)>("fallocate64");
    l.mmap = Next<decltype(l.mmap)>("mmap64");
    l.mmap64 = l.mmap;
    l.execve = Next<decltype(l.execve)>("execve");
    l.execv = Next<decltype(l.execv)>("execv");
    l.execvp = Next<decltype(l.execvp)>("execvp");
    l.execvpe = Next<decltype(l.execvpe)>("execvpe");
    l.posix_spawn = Next<decltype(l.posix_spawn)>("posix_spawn");
    l.posix_spawnp = Next<decltype(l.posix_spawnp)>("posix_spawnp");
    return l;
  }();
  return c;
}

}  // namespace dnvme::preload
