#!/usr/bin/python3
"""Would the daemon prefetching a passthrough open's backing file make its reader faster?

Usage (root): bench/passthrough_prefetch.py --dir DIR [--size 2G] [--rounds 2]

Issue 36 item 3 asks whether sequential readers of passthrough opens (which the kernel serves from
the backing file, with its own read-ahead) gain from the daemon reading the backing file ahead
of them with parallel requests. This measures it without changing the daemon: it mounts dnvmefs
(DIR/backing on DIR/mnt, defaults: read-only opens are passthrough), writes one SIZE file, and
every round reads it cold through the mount (1 MiB reads, one process) while K threads of the
same process fill the backing file's page cache ahead in 8 MiB pieces, as a daemon would:
  none          nobody prefetches: the kernel's read-ahead alone (today's mount)
  willneed K    posix_fadvise(POSIX_FADV_WILLNEED) of each piece (no copy)
  pread K       a buffered pread of each piece (a copy into a scratch buffer)
and prints GiB/s per variant (median of the rounds, order alternated, caches dropped and the
free memory warmed before each read: bench/readers.py's drop()).
"""
import argparse
import os
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import readers  # noqa: E402  (drop(), WARM, size_arg, REPO)

PIECE = 8 << 20
VARIANTS = [("none", 0), ("willneed", 2), ("willneed", 4), ("pread", 2)]


def read_with_prefetch(mnt_file, backing_file, how, k):
    size = os.path.getsize(backing_file)
    stop = threading.Event()

    def prefetch(i):
        fd = os.open(backing_file, os.O_RDONLY)
        try:
            for off in range(i * PIECE, size, k * PIECE):
                if stop.is_set():
                    return
                if how == "willneed":
                    os.posix_fadvise(fd, off, PIECE, os.POSIX_FADV_WILLNEED)
                else:
                    os.pread(fd, PIECE, off)
        finally:
            os.close(fd)

    threads = [threading.Thread(target=prefetch, args=(i,)) for i in range(k)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    fd = os.open(mnt_file, os.O_RDONLY)
    buf, n = bytearray(1 << 20), 0
    try:
        while True:
            got = os.readv(fd, [buf])
            if got <= 0:
                break
            n += got
    finally:
        os.close(fd)
        stop.set()
        for t in threads:
            t.join()
    return n / (time.monotonic() - t0) / (1 << 30)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--size", type=readers.size_arg, default=2 << 30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--bin", default=os.path.join(readers.REPO, "build", "bin"))
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root (drop_caches, mounting)")
    readers.WARM[0] = 3 * a.size
    backing, mnt = os.path.join(a.dir, "backing"), os.path.join(a.dir, "mnt")
    os.makedirs(backing, exist_ok=True)
    os.makedirs(mnt, exist_ok=True)
    subprocess.run([os.path.join(a.bin, "dnvmefs"), backing, mnt], check=True,
                   stderr=subprocess.DEVNULL)
    res = {}
    try:
        path = os.path.join(backing, "prefetch.bin")
        subprocess.run(["dd", "if=/dev/urandom", "of=" + path, "bs=1M",
                        "count=%d" % (a.size >> 20), "status=none"], check=True)
        for r in range(a.rounds):
            for how, k in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
                readers.drop()
                res.setdefault((how, k), []).append(
                    read_with_prefetch(os.path.join(mnt, "prefetch.bin"), path, how, k))
        os.unlink(path)
    finally:
        subprocess.run(["umount", mnt])
    print("passthrough read of %.1f GiB through %s, median of %d rounds:" % (
        a.size / (1 << 30), mnt, a.rounds))
    base = statistics.median(res[("none", 0)])
    for (how, k), v in res.items():
        print("  %-10s K=%d  %.2f GiB/s  x none %.2f   (%s)" % (
            how, k, statistics.median(v), statistics.median(v) / base,
            ", ".join("%.2f" % x for x in v)))


if __name__ == "__main__":
    main()
