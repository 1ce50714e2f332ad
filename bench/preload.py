#!/usr/bin/python3
"""`dnvme run` against the plain mount and raw fio, on one directory, alternated rounds.

Usage (root): bench/preload.py --dir DIR [--size 2G] [--ckpt 1G] [--rounds 3]
                               [--programs torch,numpy]

In DIR it mounts dnvmefs (DIR/backing at DIR/mnt, default options) and runs, every round, in this
order, reversed every other round (each read after dropping caches):
  fio raw        fio --ioengine=libaio --direct=1 --iodepth=32 --bs=1M, write (end_fsync) and read,
                 on DIR/raw.bin: the device's speed
  fio mount      fio --ioengine=psync --direct=0 --bs=1M (a buffered program) on DIR/mnt/p.bin
  fio run        the same command under `dnvme run` (libdnvme_preload.so)
  torch ext4     torch.save(state) + fsync, then torch.load, on DIR/plain/x.pt (no mount)
  torch mount    the same through the mount
  torch run      the same through the mount under `dnvme run` (torch.save through deepnvme's
                 hook: docs/preload.md)
  torch run-nohook  the same under `dnvme run --no-torch-hook`: torch's own save, its writes
                 taken by the preload library
  numpy ext4/mount/run  np.save(array) + fsync, then np.load, the same three ways (numpy writes
                 and reads the array with one fwrite/fread: the preload's stdio path)
  torch/numpy tmpfs  the same on /dev/shm: no device at all, the program's own ceiling (torch
                 1.13 computes a CRC32 of every record in the saving thread)
It prints GiB/s medians (fio: its own job time, not its start-up), machine CPU seconds per GiB
(all CPUs' busy time from /proc/stat around the job, less the start-up CPU of a 1 MiB job of the
same variant and op), and the ratios the issue asks about: run/raw (also round by round: the
rounds run back to back, so a round's pair saw the same machine), run/mount, torch run/ext4.
Freed memory is held (bench/lib.sh's hold_freed_memory) for the run.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(REPO, "build", "bin")
PY = "/usr/bin/python3"
KNOB = "/sys/module/page_reporting/parameters/min_free_ms"

# Each program times itself (not the interpreter's start-up) with this.
BUSY = r"""
import os, sys, time
def busy():
    f = open("/proc/stat").readline().split()[1:]
    return (int(f[0]) + int(f[1]) + int(f[2]) + int(f[5]) + int(f[6])) / os.sysconf("SC_CLK_TCK")
"""
TORCH_SAVE = BUSY + r"""
import os, sys, time, torch
path, size = sys.argv[1], int(sys.argv[2])
n = 16
state = {"t%d" % i: torch.randn(size // n // 4) for i in range(n)}
c0, t0 = busy(), time.monotonic()
torch.save(state, path)
fd = os.open(path, os.O_RDONLY); os.fsync(fd); os.close(fd)
print(time.monotonic() - t0, busy() - c0)
"""
TORCH_LOAD = BUSY + r"""
import os, sys, time, torch
path = sys.argv[1]
c0, t0 = busy(), time.monotonic()
state = torch.load(path)
print(time.monotonic() - t0, busy() - c0)
"""
NP_SAVE = BUSY + r"""
import os, sys, time, numpy as np
path, size = sys.argv[1], int(sys.argv[2])
a = np.random.default_rng(1).standard_normal(size // 4, dtype=np.float32)
c0, t0 = busy(), time.monotonic()
np.save(path, a)
fd = os.open(path, os.O_RDONLY); os.fsync(fd); os.close(fd)
print(time.monotonic() - t0, busy() - c0)
"""
NP_LOAD = BUSY + r"""
import os, sys, time, numpy as np
path = sys.argv[1]
c0, t0 = busy(), time.monotonic()
a = np.load(path)
print(time.monotonic() - t0, busy() - c0)
"""
PROGRAMS = {"torch": (TORCH_SAVE, TORCH_LOAD, "x.pt"), "numpy": (NP_SAVE, NP_LOAD, "x.npy")}


def busy_s():
    with open("/proc/stat") as f:
        v = f.readline().split()[1:]
    return (int(v[0]) + int(v[1]) + int(v[2]) + int(v[5]) + int(v[6])) / os.sysconf("SC_CLK_TCK")


def drop():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


def settle():
    os.sync()
    time.sleep(3)


def timed(cmd):
    c0, t0 = busy_s(), time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit("failed: %s\n%s%s" % (cmd, p.stdout, p.stderr[-3000:]))
    return time.monotonic() - t0, busy_s() - c0, p.stdout


def fio(path, size, rw, raw):
    eng = ["--ioengine=libaio", "--direct=1", "--iodepth=32"] if raw else \
        ["--ioengine=psync", "--direct=0"]
    return ["fio", "--name=j", "--filename=" + path, "--rw=" + rw, "--bs=1M",
            "--size=%d" % size, "--end_fsync=1" if rw == "write" else "--end_fsync=0",
            "--output-format=json"] + eng


def fio_secs(out, rw):
    """The job's own time (fio's runtime, end_fsync included), not fio's start-up: fio takes
    about 0.27 s and 0.14 CPU s to start, as long as a 1 GiB read of the RAM ext4 itself."""
    job = json.loads(out[out.index("{"):])["jobs"][0][rw]
    return job["io_bytes"] / job["bw_bytes"]


def startup_cpu(pre, path, raw):
    """Machine CPU seconds of a 1 MiB job of this variant, per op (fio's and the preload's
    start-up; a read's includes pinning the read-ahead buffers, a write's fio's laying out and
    fsync of the file), median of 5: subtracted from each measured job of that op. A write's
    start-up is not a read's: raw fio's 1 MiB write job costs 0.44 CPU s on the RAM ext4, its
    read job 0.28, and subtracting the first from reads had made raw reads look cheaper."""
    cpus = {"write": [], "read": []}
    for _ in range(5):
        for rw in ("write", "read"):
            drop()
            _, c, _ = timed((pre or []) + fio(path, 1 << 20, rw, raw))
            cpus[rw].append(c)
        os.unlink(path)
    return {rw: statistics.median(v) for rw, v in cpus.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--size", default="2G")
    ap.add_argument("--ckpt", default="1G")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--programs", default="torch,numpy")
    a = ap.parse_args()
    programs = [x for x in a.programs.split(",") if x]
    for x in programs:
        if x not in PROGRAMS:
            sys.exit("unknown program %r (torch, numpy)" % x)
    unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    size = int(a.size[:-1]) * unit[a.size[-1]]
    ckpt = int(a.ckpt[:-1]) * unit[a.ckpt[-1]]
    d = os.path.abspath(a.dir)
    backing, mnt, plain = (os.path.join(d, x) for x in ("backing", "mnt", "plain"))
    shm = "/dev/shm/dnvme-bench-%d" % os.getpid()
    for x in (backing, mnt, plain, shm):
        os.makedirs(x, exist_ok=True)
    saved = None
    if os.path.exists(KNOB):
        saved = open(KNOB).read().strip()
        open(KNOB, "w").write("300000")
    subprocess.run([os.path.join(BIN, "dnvmefs"), backing, mnt], check=True)
    run = [os.path.join(BIN, "dnvme"), "run", "--mount", mnt, "--"]
    run_nohook = run[:-1] + ["--no-torch-hook", "--"]
    res = {}

    def note(name, secs, cpu, nbytes):
        res.setdefault(name, []).append((nbytes / secs / (1 << 30), cpu / (nbytes / (1 << 30))))

    try:
        fios = (("fio raw", os.path.join(d, "raw.bin"), None),
                ("fio mount", os.path.join(mnt, "p.bin"), []),
                ("fio run", os.path.join(mnt, "p.bin"), run))
        base = {name: startup_cpu(pre, path, pre is None) for name, path, pre in fios}
        print("start-up CPU s subtracted: %s" % base, file=sys.stderr)
        for r in range(a.rounds):
            # Alternated: no variant always runs first (after the settle) or last.
            for name, path, pre in (fios if r % 2 == 0 else fios[::-1]):
                raw = pre is None
                settle()
                _, c, out = timed((pre or []) + fio(path, size, "write", raw))
                note(name + " write", fio_secs(out, "write"), c - base[name]["write"], size)
                drop()
                _, c, out = timed((pre or []) + fio(path, size, "read", raw))
                note(name + " read", fio_secs(out, "read"), c - base[name]["read"], size)
                os.unlink(path)
            for prog in programs:
                save, load, fname = PROGRAMS[prog]
                variants = ((prog + " ext4", os.path.join(plain, fname), []),
                            (prog + " mount", os.path.join(mnt, fname), []),
                            (prog + " run", os.path.join(mnt, fname), run),
                            (prog + " tmpfs", os.path.join(shm, fname), []))
                if prog == "torch":
                    variants += (("torch run-nohook", os.path.join(mnt, fname), run_nohook),)
                for name, path, pre in (variants if r % 2 == 0 else variants[::-1]):
                    settle()
                    _, _, out = timed(pre + [PY, "-c", save, path, str(ckpt)])
                    s, c = map(float, out.split())
                    note(name + " save", s, c, ckpt)
                    drop()
                    _, _, out = timed(pre + [PY, "-c", load, path])
                    s, c = map(float, out.split())
                    note(name + " load", s, c, ckpt)
                    os.unlink(path)
            print("round %d done" % (r + 1), file=sys.stderr)
    finally:
        subprocess.run(["umount", mnt])
        shutil.rmtree(shm, ignore_errors=True)
        if saved is not None:
            open(KNOB, "w").write(saved)
    med = {k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v))
           for k, v in res.items()}
    print("%-20s %8s %10s   (median of %d rounds, %s)" % ("variant", "GiB/s", "CPU s/GiB",
                                                           a.rounds, d))
    for k, (g, c) in med.items():
        print("%-20s %8.2f %10.3f" % (k, g, c))
    print("ratios:")
    for op in ("write", "read"):
        run, raw = res["fio run " + op], res["fio raw " + op]
        print("  fio run %s / raw fio:   %.2f  (CPU %.2f)   per round: %s" % (
            op, med["fio run " + op][0] / med["fio raw " + op][0],
            med["fio run " + op][1] / med["fio raw " + op][1],
            ", ".join("%.2f (CPU %.2f)" % (x[0] / y[0], x[1] / y[1]) for x, y in zip(run, raw))))
        print("  fio run %s / mount:     %.2f" % (op, med["fio run " + op][0] /
                                                  med["fio mount " + op][0]))
    for prog in programs:
        for op in ("save", "load"):
            ext4 = med["%s ext4 %s" % (prog, op)][0]
            print("  %s run %s / ext4:   %.2f   %s mount %s / ext4: %.2f   "
                  "(ceiling: %s tmpfs %s / ext4: %.2f)" % (
                      prog, op, med["%s run %s" % (prog, op)][0] / ext4, prog, op,
                      med["%s mount %s" % (prog, op)][0] / ext4, prog, op,
                      med["%s tmpfs %s" % (prog, op)][0] / ext4))
    if "torch" in programs:
        print("  torch run-nohook save / ext4: %.2f   load: %.2f" % tuple(
            med["torch run-nohook " + op][0] / med["torch ext4 " + op][0]
            for op in ("save", "load")))
    print(json.dumps({k: v for k, v in res.items()}))


if __name__ == "__main__":
    main()
