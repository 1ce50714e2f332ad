// libc's own functions, found behind the interposers with dlsym(RTLD_NEXT).
//
// Everything in libdnvme_preload.so that means "what the program would have got" calls these,
// never the interposed names: a call to ::read from inside the library would come back to us.
//
// Thread contract: Libc() is thread-safe; the table is filled once (at load, by the constructor
// in interposers.cc, or at the first call) and never written again.
#ifndef DNVME_PRELOAD_LIBC_H_
#define DNVME_PRELOAD_LIBC_H_

#include <spawn.h>
#include <sys/types.h>
#include <sys/uio.h>

namespace dnvme::preload {

struct LibcFunctions {
  ssize_t (*read)(int, void*, size_t);
  ssize_t (*write)(int, const void*, size_t);
  ssize_t (*pread)(int, void*, size_t, off_t);
  ssize_t (*pwrite)(int, const void*, size_t, off_t);
  ssize_t (*readv)(int, const iovec*, int);
  ssize_t (*writev)(int, const iovec*, int);
  ssize_t (*preadv)(int, const iovec*, int, off_t);
  ssize_t (*pwritev)(int, const iovec*, int, off_t);
  ssize_t (*preadv2)(int, const iovec*, int, off_t, int);
  ssize_t (*pwritev2)(int, const iovec*, int, off_t, int);
  int (*open)(const char*, int, ...);
  int (*open64)(const char*, int, ...);
  int (*openat)(int, const char*, int, ...);
  int (*openat64)(int, const char*, int, ...);
  int (*creat)(const char*, mode_t);
  int (*creat64)(const char*, mode_t);
  int (*close)(int);
  int (*fcntl)(int, int, ...);
  int (*dup)(int);
  int (*dup2)(int, int);
  int (*dup3)(int, int, int);
  int (*fsync)(int);
  int (*fdatasync)(int);
  ssize_t (*copy_file_range)(int, off64_t*, int, off64_t*, size_t, unsigned);
  ssize_t (*sendfile)(int, int, off_t*, size_t);
  ssize_t (*splice)(int, off64_t*, int, off64_t*, size_t, unsigned);
  int (*ftruncate)(int, off_t);
  int (*ftruncate64)(int, off_t);
  int (*fallocate)(int, int, off_t, off_t);
  void* (*mmap)(void*, size_t, int, int, int, off_t);
  void* (*mmap64)(void*, size_t, int, int, int, off_t);
  int (*execve)(const char*, char* const[], char* const[]);
  int (*execv)(const char*, char* const[]);
  int (*execvp)(const char*, char* const[]);
  int (*execvpe)(const char*, char* const[], char* const[]);
  int (*posix_spawn)(pid_t*, const char*, const posix_spawn_file_actions_t*,
                     const posix_spawnattr_t*, char* const[], char* const[]);
  int (*posix_spawnp)(pid_t*, const char*, const posix_spawn_file_actions_t*,
                      const posix_spawnattr_t*, char* const[], char* const[]);
};

// The table of libc's functions (the 64-bit-offset forms where glibc has two).
const LibcFunctions& Libc();

}  // namespace dnvme::preload

#endif  // DNVME_PRELOAD_LIBC_H_
