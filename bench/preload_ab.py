#!/usr/bin/python3
"""Builds of libdnvme_preload.so against each other under `dnvme run`, paired round by round.

Usage (root): bench/preload_ab.py --dir DIR [--size 4G] [--ckpt 1G] [--rounds 6] [--bs 1M]
                                  [--no-torch] [--bin BUILD/bin] [--quiet-wait 900]
                                  NAME=LIBRARY.so NAME=LIBRARY.so [...]

In DIR it mounts dnvmefs (DIR/backing at DIR/mnt, default options, the daemon of --bin) and
runs, every round, for each library in an order reversed every other round (DNVME_PRELOAD_LIB):
  fio write    fio --ioengine=psync --direct=0 --rw=write --bs=BS --end_fsync=1 of --size on
               DIR/mnt/p.bin under `dnvme run`: fio's own job time
  fio read     the same file read back the same way, caches dropped first (the read-ahead)
  torch save   torch.save of a --ckpt state dict of 16 tensors + fsync on DIR/mnt/x.pt under
               `dnvme run` (the torch.save hook): its own time (bench/preload.py's program)
  torch load   torch.load of it, caches dropped first
Before each round it waits (up to --quiet-wait seconds) until the load average is below 1 and no
compiler runs, and marks a round during which one started "contaminated": this VM is shared.
It prints each variant's median GiB/s and machine CPU s/GiB (all CPUs' busy time around the job,
start-up included: the same for every library), and each variant's per-round ratio to the first
(every round's pair saw the same machine), also over the clean rounds only.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from preload import PY, TORCH_LOAD, TORCH_SAVE, drop, fio_secs, settle, timed  # bench/preload.py


def busy_now():
    load = float(open("/proc/loadavg").read().split()[0])
    found = subprocess.run(["pgrep", "-f", r"cmake|c\+\+|cc1plus"], capture_output=True,
                           text=True).stdout.split()
    return load, len(found)


def wait_quiet(limit):
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        load, builds = busy_now()
        if builds == 0 and load < 1.0:
            return True
        time.sleep(10)
    return False


def main():
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--size", default="4G")
    ap.add_argument("--ckpt", default="1G")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--bs", default="1M")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--bin", default=os.path.join(repo, "build", "bin"))
    ap.add_argument("--quiet-wait", type=int, default=900)
    ap.add_argument("libs", nargs="+", help="NAME=LIBRARY.so, the first is the baseline")
    a = ap.parse_args()
    unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    size = int(a.size[:-1]) * unit[a.size[-1]]
    ckpt = int(a.ckpt[:-1]) * unit[a.ckpt[-1]]
    libs = [x.split("=", 1) for x in a.libs]
    if len(libs) < 2 or any(len(x) != 2 or not os.path.exists(x[1]) for x in libs):
        sys.exit("give two or more NAME=LIBRARY.so with existing libraries")
    d = os.path.abspath(a.dir)
    backing, mnt = os.path.join(d, "backing"), os.path.join(d, "mnt")
    for x in (backing, mnt):
        os.makedirs(x, exist_ok=True)
    subprocess.run([os.path.join(a.bin, "dnvmefs"), backing, mnt], check=True)
    run = [os.path.join(a.bin, "dnvme"), "run", "--mount", mnt, "--"]
    ops = ["fio write", "fio read"] + ([] if a.no_torch else ["torch save", "torch load"])
    res, clean = {}, []

    def note(key, secs, cpu, nbytes):
        res.setdefault(key, []).append((nbytes / secs / (1 << 30), cpu / (nbytes / (1 << 30))))

    try:
        for r in range(a.rounds):
            quiet = wait_quiet(a.quiet_wait)
            for name, lib in (libs if r % 2 == 0 else libs[::-1]):
                os.environ["DNVME_PRELOAD_LIB"] = lib
                p = os.path.join(mnt, "p.bin")
                settle()
                _, c, out = timed(run + ["fio", "--name=j", "--filename=" + p, "--rw=write",
                                         "--bs=" + a.bs, "--size=%d" % size, "--end_fsync=1",
                                         "--ioengine=psync", "--direct=0",
                                         "--output-format=json"])
                note("fio write " + name, fio_secs(out, "write"), c, size)
                drop()
                _, c, out = timed(run + ["fio", "--name=j", "--filename=" + p, "--rw=read",
                                         "--bs=" + a.bs, "--size=%d" % size,
                                         "--ioengine=psync", "--direct=0",
                                         "--output-format=json"])
                note("fio read " + name, fio_secs(out, "read"), c, size)
                os.unlink(p)
                if a.no_torch:
                    continue
                p = os.path.join(mnt, "x.pt")
                settle()
                _, _, out = timed(run + [PY, "-c", TORCH_SAVE, p, str(ckpt)])
                s, c = map(float, out.split())
                note("torch save " + name, s, c, ckpt)
                drop()
                _, _, out = timed(run + [PY, "-c", TORCH_LOAD, p])
                s, c = map(float, out.split())
                note("torch load " + name, s, c, ckpt)
                os.unlink(p)
            clean.append(quiet and busy_now()[1] == 0)
            print("round %d (%s): %s" % (r + 1, "clean" if clean[-1] else "contaminated",
                                         {k: "%.2f" % v[-1][0] for k, v in res.items()}),
                  file=sys.stderr, flush=True)
    finally:
        subprocess.run(["umount", mnt])
    print("%-24s %8s %10s   (median of %d rounds, %d clean; %s)" % (
        "variant", "GiB/s", "CPU s/GiB", a.rounds, sum(clean), d))
    for k in sorted(res):
        v = res[k]
        print("%-24s %8.2f %10.3f   rounds: %s" % (
            k, statistics.median(x[0] for x in v), statistics.median(x[1] for x in v),
            " ".join("%.2f" % x[0] for x in v)))
    base = libs[0][0]
    for op in ops:
        for name, _ in libs[1:]:
            pairs = [x[0] / y[0] for x, y in zip(res["%s %s" % (op, name)],
                                                 res["%s %s" % (op, base)])]
            line = "%s %s/%s per round: %s  median %.3f" % (
                op, name, base, " ".join("%.2f" % p for p in pairs), statistics.median(pairs))
            kept = [p for p, c in zip(pairs, clean) if c]
            if kept and len(kept) < len(pairs):
                line += "   clean rounds: median %.3f" % statistics.median(kept)
            print(line)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
