#!/usr/bin/python3
"""Readers benchmark: ordinary readers of a cold file on plain ext4, through the mount, under
`dnvme run` and from tmpfs, against raw fio on the same device (issue 36).

Usage (root): bench/readers.py --dir DIR [--size 2G] [--rounds 3] [--clients a,b,...]
                               [--paths ext4,mount,run,tmpfs] [--mount-opts OPTS] [--bin DIR]

DIR is the device under test (bench/fastdev.sh's RAM ext4, or a directory on the disk). The
script mounts dnvmefs itself (BIN/dnvmefs DIR/backing DIR/mnt -f [-o OPTS], in its own session;
always unmounted at the end, also on Ctrl-C, SIGTERM or a failure) and removes its files. --bin
picks another build's bin directory (A/B runs; its ../python is the deepnvme used). Paths:
  ext4   DIR/plain/F, no mount
  mount  DIR/mnt/F, through dnvmefs
  run    DIR/mnt/F, the reader under `BIN/dnvme run --mount DIR/mnt --` (libdnvme_preload.so)
  tmpfs  /dev/shm/dnvme-readers-PID/F: no device, the program's own ceiling
Clients (--clients, default all; SIZE bytes of data each, rates over the file's size):
  fio          fio --ioengine=psync --direct=0 --bs=1M --rw=read of a random-content file
  dd, cp       dd if=F of=/dev/null bs=1M; cp F /dev/null (the same kind of file)
  np           np.load of an np.save'd float32 array
  np-mmap      np.load(F, mmap_mode='r'), then one read per 4 KiB page (a strided sum)
  torch        torch.load of a torch.save'd state (16 float32 tensors)
  torch-ds     torch.load of the same state written by deepnvme.save
  torch-mmap   torch.load(F, mmap=True), then one read per page of every tensor (n/a where this
               torch has no mmap=)
  ds-load      deepnvme.load of a deepnvme.save'd file
  h5py         f["d"][...] of a contiguous float32 dataset (no chunks, no filter)
  safetensors  8-byte little-endian header length, JSON header of 16 F32 tensors, raw bytes
               (written here, no package): mmap, np.frombuffer per tensor, one read per page
Every round, each client reads on each path, the path order reversed from one client to the next
and every other round (so each pair of paths alternates, and consecutive cells on the same file
share it). A file is written untimed by its own process (through the mount without `dnvme run`
for mount and run; the run cell reads the file the mount cell read, or the other way round),
fsynced, then `sync`, drop_caches, the free memory warmed (--warm bytes touched and freed,
default 3 x --size: see drop()) and a 1 s pause, and the timed read runs as its own process.
Python readers time themselves after their imports (the interpreter's start-up is not counted);
fio counts its own job time; dd and cp are timed around the process (a few ms of start-up in).
CPU is the whole machine's (all CPUs' user+nice+system+irq+softirq in /proc/stat: the reader,
the daemon, kernel threads) around the read; fio's less the median start-up CPU of a 1 MiB fio
job of the same variant (measured first, 3 times); nothing subtracted for dd and cp. The device's
limit, raw fio --ioengine=libaio --direct=1 --iodepth=32 --bs=1M --rw=read of DIR/raw.bin (laid
out once), runs once per round, first in even rounds and last in odd ones. Freed memory is held
(bench/lib.sh's hold_freed_memory) for the run.

Prints per client and path the median GiB/s, "x ext4" (over the same client on plain ext4; a '*'
marks cells below 1.0), "x lim" (over min(raw fio, the same client on tmpfs)), machine CPU
seconds per GiB (median), then one JSON line with every round's samples. GiB = 2^30 bytes.
A client that cannot run here (no fio, h5py, deepnvme, torch's mmap=) is listed with the reason;
a reader or writer that fails is reported in its cell and the run goes on.
"""
import argparse
import ctypes
import json
import mmap
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402
from benchlib import size_arg  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = "/usr/bin/python3"
KNOB = "/sys/module/page_reporting/parameters/min_free_ms"
GiB = 1 << 30
PATHS = ("ext4", "mount", "run", "tmpfs")
# client: (kind of file it reads, what it needs)
CLIENTS = {"fio": ("bin", ["fio"]), "dd": ("bin", []), "cp": ("bin", []),
           "np": ("npy", ["numpy"]), "np-mmap": ("npy", ["numpy"]),
           "torch": ("pt", ["torch"]), "torch-ds": ("ds", ["torch", "deepnvme"]),
           "torch-mmap": ("pt", ["torch", "mmap"]), "ds-load": ("ds", ["torch", "deepnvme"]),
           "h5py": ("h5", ["numpy", "h5py"]), "safetensors": ("st", ["numpy"])}

# What this interpreter has: {name: None, or why not}.
PROBE = r"""
import inspect, json
r = {"torch_version": None}
for m in ("numpy", "torch", "h5py", "deepnvme"):
    try:
        mod, r[m] = __import__(m), None
    except Exception as e:
        r[m] = "no %s module (%s: %s)" % (m, type(e).__name__, e)
    if m == "torch":
        r["mmap"] = r[m] or (None if "mmap" in inspect.signature(mod.load).parameters else
                             "n/a (torch %s has no mmap=)" % mod.__version__)
        r["torch_version"] = r[m] or mod.__version__
print(json.dumps(r))
"""
WRITE = r"""
import json, os, sys, numpy as np
kind, path, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
rng, n = np.random.default_rng(1), 16
per = size // n // 4
if kind == "bin":
    with open(path, "wb") as f:
        for i in range(0, size, 64 << 20):
            f.write(rng.bytes(min(64 << 20, size - i)))
elif kind == "npy":
    np.save(path, rng.random(size // 4, dtype=np.float32))
elif kind in ("pt", "ds"):
    import torch
    state = {"t%02d" % i: torch.from_numpy(rng.random(per, dtype=np.float32)) for i in range(n)}
    if kind == "pt":
        torch.save(state, path)
    else:
        import deepnvme
        deepnvme.save(state, path)
elif kind == "h5":
    import h5py
    with h5py.File(path, "w") as f:
        d, step = f.create_dataset("d", shape=(size // 4,), dtype="f4"), 16 << 20
        for i in range(0, size // 4, step):
            d[i:i + step] = rng.random(min(step, size // 4 - i), dtype=np.float32)
    with h5py.File(path, "r") as f:
        assert f["d"].chunks is None and f["d"].compression is None
elif kind == "st":
    hdr = {"t%02d" % i: {"dtype": "F32", "shape": [per], "data_offsets": [i * per * 4,
                                                                          (i + 1) * per * 4]}
           for i in range(n)}
    h = json.dumps(hdr).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little") + h)
        for i in range(n):
            f.write(rng.random(per, dtype=np.float32).data)
fd = os.open(path, os.O_RDONLY); os.fsync(fd); os.close(fd)
"""
# Each reader times itself (not the interpreter's start-up nor its imports).
READ = r"""
import json, mmap, os, sys, time
import numpy as np
client, path = sys.argv[1], sys.argv[2]
if client.startswith("torch") or client == "ds-load":
    import torch
if client == "ds-load":
    import deepnvme
if client == "h5py":
    import h5py
def busy():
    f = open("/proc/stat").readline().split()[1:]
    return (int(f[0]) + int(f[1]) + int(f[2]) + int(f[5]) + int(f[6])) / os.sysconf("SC_CLK_TCK")
def touch(a):  # one read per 4 KiB page, and the last byte
    b = a.reshape(-1).view(np.uint8)
    return int(b[::4096].sum()) + int(b[-1]) if b.size else 0
c0, t0 = busy(), time.monotonic()
if client == "np":
    a = np.load(path)
elif client == "np-mmap":
    touch(np.load(path, mmap_mode="r"))
elif client in ("torch", "torch-ds"):
    s = torch.load(path)
elif client == "torch-mmap":
    s = torch.load(path, mmap=True)
    for t in s.values():
        touch(t.numpy())
elif client == "ds-load":
    s = deepnvme.load(path)
elif client == "h5py":
    with h5py.File(path, "r") as f:
        a = f["d"][...]
elif client == "safetensors":
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    hl = int.from_bytes(m[:8], "little")
    for k, v in json.loads(m[8:8 + hl]).items():
        if k != "__metadata__":
            a, b = v["data_offsets"]
            touch(np.frombuffer(m, dtype=np.float32, count=(b - a) // 4, offset=8 + hl + a))
print(time.monotonic() - t0, busy() - c0)
"""


def die(msg):
    sys.exit("readers.py: " + msg)


def list_arg(known, what):
    def parse(text):
        items = [x for x in text.split(",") if x]
        bad = [x for x in items if x not in known]
        if bad or not items:
            raise argparse.ArgumentTypeError("unknown %s %s (known: %s)" % (
                what, ", ".join(bad) or "(none given)", ", ".join(known)))
        return items
    return parse


def rm(path):
    try:
        if path:
            os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        print("readers.py: cannot remove %s: %s" % (path, e), file=sys.stderr)


def busy_s():
    with open("/proc/stat") as f:
        v = f.readline().split()[1:]
    return (int(v[0]) + int(v[1]) + int(v[2]) + int(v[5]) + int(v[6])) / os.sysconf("SC_CLK_TCK")


WARM = [0]  # bytes of memory touched and freed after each drop (--warm)


def drop():
    """sync, drop the page cache, then warm the free memory: touch WARM[0] bytes of fresh
    anonymous memory and free it. The VM hands free pages back to its host (free page
    reporting); a read that fills the page cache with such pages faults in the host for each,
    and ran 1-9 GiB/s at random (the same passthrough read 0.98 and then 6.6 GiB/s). Pages freed
    just now are held (min_free_ms) and come back first: the read then runs on memory the VM
    has, as on a real machine."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")
    if WARM[0] > 0:
        m = mmap.mmap(-1, WARM[0], flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            buf = (ctypes.c_char * WARM[0]).from_buffer(m)
            ctypes.memset(buf, 1, WARM[0])  # every page touched, at memset's speed
            del buf
        finally:
            m.close()
    time.sleep(1)


def timed(cmd, env=None):
    """(seconds, machine CPU seconds, stdout) of cmd; RuntimeError if it fails."""
    c0, t0 = busy_s(), time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise RuntimeError("rc %d: %s" % (p.returncode, (p.stderr.strip() or p.stdout.strip() or
                                                         "no output").splitlines()[-1][-150:]))
    return time.monotonic() - t0, busy_s() - c0, p.stdout


def fio(path, size, rw, raw):
    eng = ["--ioengine=libaio", "--direct=1", "--iodepth=32"] if raw else \
        ["--ioengine=psync", "--direct=0"]
    return ["fio", "--name=j", "--filename=" + path, "--rw=" + rw, "--bs=1M", "--size=%d" % size,
            "--end_fsync=%d" % (rw == "write"), "--output-format=json"] + eng


def fio_secs(out):
    """The read job's own time, not fio's start-up (about 0.27 s)."""
    job = json.loads(out[out.index("{"):])["jobs"][0]["read"]
    return job["io_bytes"] / job["bw_bytes"]


def startup_cpu(pre, path, raw):
    """Median machine CPU of a cold 1 MiB read job of this fio variant (3 runs)."""
    timed(fio(path, 1 << 20, "write", raw))
    cpus = []
    for _ in range(3):
        drop()
        cpus.append(timed(pre + fio(path, 1 << 20, "read", raw))[1])
    os.unlink(path)
    return statistics.median(cpus)


class Mount(benchlib.ForegroundMount):
    """The mount under test (benchlib.ForegroundMount), its messages on stderr."""

    def __init__(self, binary, backing, mnt, opts):
        try:
            super().__init__(binary, backing, mnt, opts)
        except RuntimeError as e:
            die(str(e))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--size", type=size_arg, default=2 * GiB)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=list_arg(list(CLIENTS), "client"),
                    default=list(CLIENTS))
    ap.add_argument("--paths", type=list_arg(PATHS, "path"), default=list(PATHS))
    ap.add_argument("--mount-opts", default="")
    ap.add_argument("--bin", default=os.path.join(REPO, "build", "bin"))
    ap.add_argument("--warm", type=lambda t: 0 if t.strip() == "0" else size_arg(t), default=None,
                    help="memory touched and freed after each drop_caches (default: 3 x --size, "
                         "at most half of MemAvailable); 0 turns it off")
    a = ap.parse_args()
    if a.rounds < 1 or a.size < (1 << 20):
        die("--rounds must be >= 1 and --size >= 1M")
    if os.geteuid() != 0:
        die("run as root (drop_caches, mounting)")
    with open("/proc/meminfo") as f:
        avail = next(int(x.split()[1]) * 1024 for x in f if x.startswith("MemAvailable:"))
    WARM[0] = min(3 * a.size, avail // 2) if a.warm is None else a.warm
    binp = os.path.abspath(a.bin)
    dnvmefs, dnvme = os.path.join(binp, "dnvmefs"), os.path.join(binp, "dnvme")
    mounted = "mount" in a.paths or "run" in a.paths
    for b in [dnvmefs] + ([dnvme] if "run" in a.paths else []):
        if mounted and not os.access(b, os.X_OK):
            die("%s not found (scripts/build.sh, or --bin)" % b)
    pkg = os.path.join(os.path.dirname(binp), "python")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [pkg] + [x for x in [os.environ.get("PYTHONPATH")] if x]))
    have = json.loads(subprocess.run([PY, "-c", PROBE], capture_output=True, text=True,
                                     env=env, check=True).stdout)
    have["fio"] = None if shutil.which("fio") else "no fio (apt-get install fio)"
    fio_ok = have["fio"] is None
    skipped = {c: next((have[n] for n in CLIENTS[c][1] if have[n]), None) for c in a.clients}
    clients = [c for c in a.clients if not skipped[c]]
    skipped = {c: why for c, why in skipped.items() if why}
    for c, why in skipped.items():
        print("readers.py: skipping %s: %s" % (c, why), file=sys.stderr)

    d = os.path.abspath(a.dir)
    backing, mnt, plain = (os.path.join(d, x) for x in ("backing", "mnt", "plain"))
    shm = "/dev/shm/dnvme-readers-%d" % os.getpid()
    if os.path.ismount(mnt):
        die("%s is already mounted: unmount it or pick another --dir" % mnt)
    made = [x for x in (d, backing, mnt, plain, shm) if not os.path.isdir(x)]
    for x in (backing, mnt, plain, shm):
        os.makedirs(x, exist_ok=True)
    where = {"ext4": plain, "mount": mnt, "run": mnt, "tmpfs": shm}
    run = [dnvme, "run", "--mount", mnt, "--"]
    raw_file = os.path.join(d, "raw.bin")
    res, fails, sizes = {}, {}, {}
    saved, mount, cur = None, None, None

    def stop(signum, _frame):
        raise KeyboardInterrupt("signal %d" % signum)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop)
    t_start = time.monotonic()
    try:
        if os.access(KNOB, os.W_OK):
            saved = open(KNOB).read().strip()
            open(KNOB, "w").write("300000")
            print("readers.py: freed memory held (min_free_ms %s -> 300000)" % saved,
                  file=sys.stderr)
        else:
            print("readers.py: no %s: freed memory is not reported early" % KNOB,
                  file=sys.stderr)
        if mounted:
            mount = Mount(dnvmefs, backing, mnt, a.mount_opts)
        base = {}
        if fio_ok:
            base["raw"] = startup_cpu([], raw_file, True)
            if "fio" in clients:
                for p in a.paths:
                    base[p] = startup_cpu(run if p == "run" else [],
                                          os.path.join(where[p], "s.bin"), False)
            print("readers.py: fio start-up CPU s subtracted: %s" %
                  {k: round(v, 3) for k, v in base.items()}, file=sys.stderr)
            timed(fio(raw_file, a.size, "write", True))

        def note(name, secs, cpu, nbytes):
            res.setdefault(name, []).append((nbytes / secs / GiB, cpu / (nbytes / GiB)))

        def raw_read():
            drop()
            _, c, out = timed(fio(raw_file, a.size, "read", True))
            note("raw", fio_secs(out), c - base["raw"], a.size)

        def cell(client, p):
            nonlocal cur
            kind = CLIENTS[client][0]
            f = os.path.join(where[p], "r." + kind)
            if cur != f:
                rm(cur)
                cur = f
                try:
                    timed([PY, "-c", WRITE, kind, f, str(a.size)], env)
                except RuntimeError:
                    rm(f)
                    cur = None
                    raise
                sizes[kind] = os.path.getsize(f)
            drop()
            pre = run if p == "run" else []
            if client == "fio":
                _, c, out = timed(pre + fio(f, sizes[kind], "read", False))
                s, c = fio_secs(out), c - base[p]
            elif client in ("dd", "cp"):
                cmd = ["dd", "if=" + f, "of=/dev/null", "bs=1M"] if client == "dd" else \
                    ["cp", f, "/dev/null"]
                s, c, _ = timed(pre + cmd)
            else:
                s, c = map(float, timed(pre + [PY, "-c", READ, client, f], env)[2].split())
            note(client + " " + p, s, c, sizes[kind])

        for r in range(a.rounds):
            if fio_ok and r % 2 == 0:
                raw_read()
            for i, client in enumerate(clients):
                for p in (a.paths if (r + i) % 2 == 0 else a.paths[::-1]):
                    try:
                        cell(client, p)
                    except RuntimeError as e:
                        print("readers.py: %s %s failed: %s" % (client, p, e), file=sys.stderr)
                        fails.setdefault(client + " " + p, []).append(str(e))
            if fio_ok and r % 2 == 1:
                raw_read()
            print("readers.py: round %d done (%.0f s)" % (r + 1, time.monotonic() - t_start),
                  file=sys.stderr)
    finally:
        rm(cur)
        rm(raw_file)
        unmounted = mount.close() if mount else True
        if not unmounted:
            print("readers.py: %s is still mounted: unmount it by hand" % mnt, file=sys.stderr)
        shutil.rmtree(shm, ignore_errors=True)
        for x in reversed([x for x in made if x != shm] if unmounted else []):
            try:
                (os.rmdir if x in (d, mnt) else shutil.rmtree)(x)
            except OSError as e:
                print("readers.py: cannot remove %s: %s" % (x, e), file=sys.stderr)
        if saved is not None:
            open(KNOB, "w").write(saved)
    print_table(a, d, have, clients, skipped, res, fails)
    print("readers.py: %.0f s in all" % (time.monotonic() - t_start), file=sys.stderr)


def print_table(a, d, have, clients, skipped, res, fails):
    med = {k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v))
           for k, v in res.items()}
    print("readers.py: %s, %.2f GiB per file, median of %d rounds; torch %s; mount -o %s; "
          "%.1f GiB warmed after each drop" % (
              d, a.size / GiB, a.rounds, have.get("torch_version"), a.mount_opts or "(defaults)",
              WARM[0] / GiB))
    if "raw" in med:
        print("raw fio (libaio O_DIRECT qd32 1M read): %.2f GiB/s, CPU %.3f s/GiB" % med["raw"])
    else:
        print("raw fio: not run (%s)" % have["fio"])
    print("%-12s %-6s %8s %8s %8s %10s   (x lim = cell / min(raw, tmpfs of the client); "
          "* below ext4)" % ("client", "path", "GiB/s", "x ext4", "x lim", "CPU s/GiB"))
    for c in a.clients:
        if c in skipped:
            print("%-12s %s" % (c, skipped[c]))
            continue
        for j, p in enumerate(a.paths):
            name = "%-12s %-6s" % (c if j == 0 else "", p)
            if c + " " + p not in med:
                print("%s failed: %s" % (name, fails.get(c + " " + p, ["?"])[-1]))
                continue
            g, cpu = med[c + " " + p]
            ext4 = med.get(c + " ext4", (None,))[0]
            lims = [x for x in (med.get("raw", (None,))[0], med.get(c + " tmpfs", (None,))[0])
                    if x]
            rx = "%7.2f%s" % (g / ext4, "*" if g < ext4 else " ") if ext4 else "%7s " % "-"
            lx = "%8.2f" % (g / min(lims)) if lims else "%8s" % "-"
            bad = " (%d of %d rounds failed)" % (len(fails[c + " " + p]), a.rounds) \
                if c + " " + p in fails else ""
            print("%s %8.2f %s %s %10.3f%s" % (name, g, rx, lx, cpu, bad))
    print(json.dumps({"dir": d, "size": a.size, "rounds": a.rounds, "mount_opts": a.mount_opts,
                      "samples": {k: [[round(g, 4), round(c, 4)] for g, c in v]
                                  for k, v in res.items()},
                      "skipped": skipped, "failed": fails}))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt as e:
        die("interrupted (%s); cleaned up" % (e or "Ctrl-C"))
    except RuntimeError as e:  # fio's start-up or raw jobs
        die("failed: %s; cleaned up" % e)
