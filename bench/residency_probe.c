// Usage: cc -O2 -o /tmp/residency_probe bench/residency_probe.c -lpthread
//        /tmp/residency_probe FILE cachestat|mincore|nowait|buffered|fadvseq|willneed|readahead [AHEAD_MIB CHUNK_MIB]
//
// What issue 47 measured before choosing how the data path asks for residency and whether to fill
// the page cache from other threads (docs/performance-journal.md, "Issue 47"):
//   cachestat  cachestat(2) of every 1 MiB range of FILE, then of the whole file: microseconds each
//   mincore    mincore of every 1 MiB range of one mapping of FILE, and mmap + mincore + munmap
//   nowait     one preadv2(RWF_NOWAIT) of 1 MiB at offset 0, and how many pages are cached 100 ms
//              later (on a cold file: EAGAIN, and the kernel's read-ahead started anyway)
//   buffered   a 1 MiB pread loop over FILE (GiB/s); fadvseq: after POSIX_FADV_SEQUENTIAL;
//   willneed / readahead: a helper thread keeps POSIX_FADV_WILLNEED / readahead(2) AHEAD_MIB
//              (64) ahead of the reader in CHUNK_MIB (4) pieces
// Drop the page cache first for the cold cases (as root: echo 3 > /proc/sys/vm/drop_caches).
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#include <errno.h>
#include <stdint.h>

struct cachestat_range { uint64_t off, len; };
struct cachestat { uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted; };
static long cstat(int fd, uint64_t off, uint64_t len, struct cachestat* cs) {
  struct cachestat_range r = {off, len};
  return syscall(451, fd, &r, cs, 0);
}
static double now() { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static int fd; static off_t fsize; static _Atomic long long rpos; static long long ahead = 64 << 20, chunk = 4 << 20;
static int helper_mode; static _Atomic int done_flag;
static void* helper(void* a) {
  (void)a; long long issued = 0;
  while (!done_flag && issued < fsize) {
    long long want = rpos + ahead;
    if (issued < want) {
      long long n = chunk; if (issued + n > fsize) n = fsize - issued;
      if (helper_mode == 1) posix_fadvise(fd, issued, n, POSIX_FADV_WILLNEED);
      else readahead(fd, issued, n);
      issued += n;
    } else usleep(50);
  }
  return 0;
}
int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s FILE cachestat|mincore|nowait|buffered|fadvseq|willneed|readahead [AHEAD_MIB CHUNK_MIB]\n", argv[0]);
    return 2;
  }
  const char* path = argv[1]; const char* mode = argv[2];
  if (argc > 3) ahead = atoll(argv[3]) << 20;
  if (argc > 4) chunk = atoll(argv[4]) << 20;
  fd = open(path, O_RDONLY); if (fd < 0) { perror("open"); return 1; }
  struct stat st; fstat(fd, &st); fsize = st.st_size;
  size_t bs = 1 << 20; char* buf = NULL;
  if (posix_memalign((void**)&buf, 4096, bs) != 0) { fprintf(stderr, "out of memory\n"); return 1; }
  memset(buf, 0, bs);
  if (!strcmp(mode, "cachestat")) {
    struct cachestat cs; double t = now(); int n = 0;
    for (off_t o = 0; o < fsize; o += bs, n++) if (cstat(fd, o, bs, &cs)) { perror("cachestat"); return 1; }
    double t2 = now();
    cstat(fd, 0, fsize, &cs);
    double t3 = now();
    printf("cachestat per 1MiB: %.2f us; whole file %.1f us; cached %llu pages of %lld\n", (t2 - t) / n * 1e6, (t3 - t2) * 1e6, (unsigned long long)cs.nr_cache, (long long)fsize / 4096);
    return 0;
  }
  if (!strcmp(mode, "mincore")) {
    unsigned char* vec = malloc(bs / 4096); double t = now(); int n = 0;
    char* m = mmap(0, fsize, PROT_READ, MAP_SHARED, fd, 0);
    double t1 = now();
    for (off_t o = 0; o < fsize; o += bs, n++) if (mincore(m + o, bs, vec)) { perror("mincore"); return 1; }
    double t2 = now();
    for (int i = 0; i < 1000; i++) { char* m2 = mmap(0, bs, PROT_READ, MAP_SHARED, fd, 0); mincore(m2, bs, vec); munmap(m2, bs); }
    double t3 = now();
    printf("mmap whole file %.1f us; mincore per 1MiB (mapped once): %.2f us; mmap+mincore+munmap per 1MiB: %.2f us\n", (t1-t)*1e6, (t2 - t1) / n * 1e6, (t3 - t2) / 1000 * 1e6);
    return 0;
  }
  if (!strcmp(mode, "nowait")) {  // does RWF_NOWAIT on a cold file start I/O?
    struct cachestat cs; cstat(fd, 0, fsize, &cs); printf("before: cached %llu\n", (unsigned long long)cs.nr_cache);
    struct iovec v = {buf, bs}; ssize_t r = preadv2(fd, &v, 1, 0, RWF_NOWAIT);
    printf("preadv2 nowait -> %zd errno %d\n", r, r < 0 ? errno : 0);
    usleep(100000); cstat(fd, 0, fsize, &cs); printf("after: cached %llu\n", (unsigned long long)cs.nr_cache);
    return 0;
  }
  pthread_t th; int h = 0;
  if (!strcmp(mode, "willneed")) { helper_mode = 1; h = 1; }
  if (!strcmp(mode, "readahead")) { helper_mode = 2; h = 1; }
  if (!strcmp(mode, "fadvseq")) posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  double t = now();
  if (h) pthread_create(&th, 0, helper, 0);
  off_t o = 0;
  while (o < fsize) { ssize_t r = pread(fd, buf, bs, o); if (r <= 0) { perror("pread"); return 1; } o += r; rpos = o; }
  double el = now() - t; done_flag = 1; if (h) pthread_join(th, 0);
  printf("%s %.3f GiB/s\n", mode, fsize / el / (1 << 30));
  return 0;
}
