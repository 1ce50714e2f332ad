#!/usr/bin/python3
"""Read-path knobs of `dnvme run` against raw fio, paired round by round.

Usage (root): bench/preload_read_knobs.py --dir DIR [--size 2G] [--loops 4] [--rounds 7]
                                          VARIANT [VARIANT...]

A VARIANT is READAHEAD[:CONFIG.json]: the read-ahead bytes of the preload library
(DNVME_PRELOAD_READAHEAD, e.g. 32M; 0 turns it off) and, optionally, an engine HandleConfig JSON
for it (DNVME_PRELOAD_CONFIG; the library's default is queue depth 32, 1 MiB blocks, one worker per CPU up to 4).

In DIR it mounts dnvmefs (DIR/backing at DIR/mnt, default options), writes DIR/raw.bin and the
backing file of DIR/mnt/p.bin with fio (libaio O_DIRECT), then every round, in an order reversed
every other round, reads after dropping caches:
  raw      fio --ioengine=libaio --direct=1 --iodepth=32 --bs=1M on DIR/raw.bin
  VARIANT  fio --ioengine=psync --direct=0 --bs=1M on DIR/mnt/p.bin under `dnvme run`
each `--loops` times over the file (fio's --loops: longer jobs, so the fixed costs of a job and
the machine's second-to-second noise weigh less). It prints, per variant, the median GiB/s, the
median machine CPU s/GiB (all CPUs' busy time from /proc/stat around the job, less a 1 MiB read
job's), and the medians of the per-round ratios to raw fio (each round's pair saw the same
machine). Only reads: bench/preload.py is the full benchmark.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

from preload import busy_s, drop  # bench/preload.py: the same CPU count and cache drop

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(REPO, "build", "bin")
UNIT = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def size_arg(s):
    if s == "0":
        return 0
    if len(s) < 2 or s[-1] not in UNIT or not s[:-1].isdigit():
        raise argparse.ArgumentTypeError("%r is not a size such as 512K, 32M or 2G" % s)
    return int(s[:-1]) * UNIT[s[-1]]


def fio(path, size, rw, raw, loops=1):
    eng = ["--ioengine=libaio", "--direct=1", "--iodepth=32"] if raw else \
        ["--ioengine=psync", "--direct=0"]
    return ["fio", "--name=j", "--filename=" + path, "--rw=" + rw, "--bs=1M", "--size=%d" % size,
            "--loops=%d" % loops, "--output-format=json"] + eng


def read_job(cmd, env):
    """(seconds of fio's own job time, machine CPU seconds around the whole process)."""
    c0 = busy_s()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    cpu = busy_s() - c0
    if p.returncode != 0:
        sys.exit("failed: %s\n%s%s" % (" ".join(cmd), p.stdout, p.stderr[-3000:]))
    job = json.loads(p.stdout[p.stdout.index("{"):])["jobs"][0]["read"]
    return job["io_bytes"] / job["bw_bytes"], cpu


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--size", type=size_arg, default="2G")
    ap.add_argument("--loops", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("variants", nargs="+", metavar="VARIANT")
    a = ap.parse_args()
    if a.size <= 0 or a.loops < 1 or a.rounds < 1:
        sys.exit("--size, --loops and --rounds must be positive")
    d = os.path.abspath(a.dir)
    backing, mnt = os.path.join(d, "backing"), os.path.join(d, "mnt")
    os.makedirs(backing, exist_ok=True)
    os.makedirs(mnt, exist_ok=True)
    variants = [("raw", os.path.join(d, "raw.bin"), [], None)]
    run = [os.path.join(BIN, "dnvme"), "run", "--mount", mnt, "--"]
    for spec in a.variants:
        ra, _, cfg = spec.partition(":")
        env = dict(os.environ, DNVME_PRELOAD_READAHEAD=str(size_arg(ra)))
        if cfg:
            if not os.path.isfile(cfg):
                sys.exit("%s: no such engine config file" % cfg)
            env["DNVME_PRELOAD_CONFIG"] = os.path.abspath(cfg)
        variants.append((spec, os.path.join(mnt, "p.bin"), run, env))
    subprocess.run([os.path.join(BIN, "dnvmefs"), backing, mnt], check=True)
    files = (os.path.join(d, "raw.bin"), os.path.join(backing, "p.bin"))
    try:
        for f in files:
            subprocess.run(fio(f, a.size, "write", True), check=True, capture_output=True)
        start = {}
        for name, path, pre, env in variants:
            cpus = []
            for _ in range(3):
                drop()
                cpus.append(read_job(pre + fio(path, 1 << 20, "read", not pre), env)[1])
            start[name] = statistics.median(cpus)
        print("start-up CPU s subtracted (a 1 MiB read job): %s" % start, file=sys.stderr)
        res = {}
        gib = a.size * a.loops / (1 << 30)
        for r in range(a.rounds):
            for name, path, pre, env in (variants if r % 2 == 0 else variants[::-1]):
                drop()
                secs, cpu = read_job(pre + fio(path, a.size, "read", not pre, a.loops), env)
                res.setdefault(name, []).append((gib / secs, (cpu - start[name]) / gib))
    finally:
        subprocess.run(["umount", mnt])
        for f in files:
            try:
                os.unlink(f)
            except FileNotFoundError:
                pass
    raw = res["raw"]
    print("%-24s %7s %10s %14s %10s   (medians of %d rounds, %s x %d, %s)" % (
        "variant", "GiB/s", "CPU s/GiB", "GiB/s / raw", "CPU / raw", a.rounds,
        "%dM" % (a.size >> 20), a.loops, d))
    for name, v in res.items():
        print("%-24s %7.2f %10.3f %14.2f %10.2f" % (
            name, statistics.median(x[0] for x in v), statistics.median(x[1] for x in v),
            statistics.median(x[0] / y[0] for x, y in zip(v, raw)),
            statistics.median(x[1] / y[1] for x, y in zip(v, raw))))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
