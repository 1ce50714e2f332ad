#!/usr/bin/python3
"""Readers benchmark: ordinary readers of a cold file on plain ext4, through the mount, under
`dnvme run` and from tmpfs, against raw fio on the same device (issue 36).

Usage (root): bench/readers.py --dir DIR [--size 2G] [--rounds 3] [--clients a,b,...]
                               [--paths ext4,mount,run,tmpfs] [--mount-opts OPTS] [--bin DIR]
                               [--run-opts OPTS] [--scenarios cold,warm,shared4,...]

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
  pyread       a Python loop of 1 MiB readinto() calls into one bytearray (a plain loader's
               read loop: the page cache's speed shows in it)
  st-load      the safetensors package (python3-safetensors, Debian 13's: the torch 2.6 lane)
               load_file(F) of a safetensors file written by its save_file, then one read per
               page of every tensor (the package maps the file: nothing is read until touched)
  st-open      safe_open(F, "pt"), get_tensor of every tensor and one read per page of it
Scenarios (--scenarios, default cold,warm,shared2,shared4,shared8,readback,big; cold is every
client's, the others fio's and pyread's only):
  cold         the file dropped from the page cache first (drop() below)
  warm         the same read again at once (the file read a second time)
  sharedN      N processes of the client read the one cold file at once (fio: --numjobs=N,
               group-reported; pyread: N processes, from the first start to the last end)
  readback     the file written through the path by the client (fio write + fsync; pyread:
               1 MiB writes + fsync), then read at once: save, then load or validate
  big          read in a memory cgroup whose limit is half the file (larger than the reader's
               free memory), after a hot file (a 16th of it, at most 64 MiB) was read there:
               "hot kept" is how much of the hot file the page cache still holds after the read
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
from benchlib import MemoryCgroup, evict, resident_bytes, size_arg  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = "/usr/bin/python3"
KNOB = "/sys/module/page_reporting/parameters/min_free_ms"
GiB = 1 << 30
PATHS = ("ext4", "mount", "run", "tmpfs")
# client: (kind of file it reads, what it needs)
CLIENTS = {"fio": ("bin", ["fio"]), "pyread": ("bin", []), "dd": ("bin", []), "cp": ("bin", []),
           "np": ("npy", ["numpy"]), "np-mmap": ("npy", ["numpy"]),
           "torch": ("pt", ["torch"]), "torch-ds": ("ds", ["torch", "deepnvme"]),
           "torch-mmap": ("pt", ["torch", "mmap"]), "ds-load": ("ds", ["torch", "deepnvme"]),
           "h5py": ("h5", ["numpy", "h5py"]), "safetensors": ("st", ["numpy"]),
           "st-load": ("stp", ["torch", "safetensors"]), "st-open": ("stp", ["torch", "safetensors"])}
SCENARIOS = ("cold", "warm", "shared2", "shared4", "shared8", "readback", "big")
SCENARIO_CLIENTS = ("fio", "pyread")  # the clients of every scenario but cold

# What this interpreter has: {name: None, or why not}.
PROBE = r"""
import inspect, json
r = {"torch_version": None}
for m in ("numpy", "torch", "h5py", "deepnvme", "safetensors"):
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
elif kind == "stp":
    import torch
    from safetensors.torch import save_file
    save_file({"t%02d" % i: torch.from_numpy(rng.random(per, dtype=np.float32))
               for i in range(n)}, path)
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
if client.startswith("st-"):
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file
def busy():
    f = open("/proc/stat").readline().split()[1:]
    return (int(f[0]) + int(f[1]) + int(f[2]) + int(f[5]) + int(f[6])) / os.sysconf("SC_CLK_TCK")
def touch(a):  # one read per 4 KiB page, and the last byte
    b = a.reshape(-1).view(np.uint8)
    return int(b[::4096].sum()) + int(b[-1]) if b.size else 0
c0, t0 = busy(), time.monotonic()
if client == "pyread":
    buf = bytearray(1 << 20)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
elif client == "st-load":  # the package maps the file: touch every page, as np-mmap does
    for t in load_file(path).values():
        touch(t.numpy())
elif client == "st-open":
    with safe_open(path, "pt") as f:
        for k in f.keys():
            touch(f.get_tensor(k).numpy())
elif client == "np":
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
print(time.monotonic() - t0, busy() - c0, t0, time.monotonic())
"""
# pyread's writer (readback): 1 MiB writes of random bytes, then fsync; timed by the caller.
PYWRITE = r"""
import os, sys
path, size = sys.argv[1], int(sys.argv[2])
block = os.urandom(1 << 20)
with open(path, "wb", buffering=0) as f:
    for i in range(0, size, 1 << 20):
        f.write(block[:min(1 << 20, size - i)])
    os.fsync(f.fileno())
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
    ap.add_argument("--run-opts", default="",
                    help="options of `dnvme run` for the run path (e.g. '--read-cache off')")
    ap.add_argument("--scenarios", type=list_arg(SCENARIOS, "scenario"), default=list(SCENARIOS))
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
    run = [dnvme, "run", "--mount", mnt] + a.run_opts.split() + ["--"]
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

        def ensure(client, p):
            """The client's file on path p (written once, untimed); its path."""
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
            return f

        def read(client, p, f, pre=None):
            """One timed read of f by client; (seconds, machine CPU seconds)."""
            pre = (run if p == "run" else []) if pre is None else pre
            if client == "fio":
                _, c, out = timed(pre + fio(f, os.path.getsize(f), "read", False) +
                                  ["--invalidate=0"])
                return fio_secs(out), c - base[p]
            if client in ("dd", "cp"):
                cmd = ["dd", "if=" + f, "of=/dev/null", "bs=1M"] if client == "dd" else \
                    ["cp", f, "/dev/null"]
                s, c, _ = timed(pre + cmd)
                return s, c
            s, c = map(float, timed(pre + [PY, "-c", READ, client, f], env)[2].split()[:2])
            return s, c

        def cell(client, p):
            """Cold, then (fio, pyread) warm: the same read again at once."""
            f = ensure(client, p)
            drop()
            s, c = read(client, p, f)
            note(client + " " + p, s, c, os.path.getsize(f))
            if "warm" in a.scenarios and client in SCENARIO_CLIENTS:
                s, c = read(client, p, f)
                note(client + ":warm " + p, s, c, os.path.getsize(f))

        def shared(client, p, n):
            """n readers of the one cold file at once: aggregate GiB/s."""
            f = ensure(client, p)
            size = os.path.getsize(f)
            drop()
            pre = run if p == "run" else []
            if client == "fio":
                _, c, out = timed(pre + fio(f, size, "read", False) + [
                    "--invalidate=0", "--numjobs=%d" % n, "--group_reporting"])
                note("%s:shared%d %s" % (client, n, p), fio_secs(out), c - n * base[p], n * size)
                return
            c0 = busy_s()
            kids = [subprocess.Popen(pre + [PY, "-c", READ, client, f], env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                    for _ in range(n)]
            outs = [k.communicate() for k in kids]
            c = busy_s() - c0
            bad = [e for k, (_, e) in zip(kids, outs) if k.returncode != 0]
            if bad:
                raise RuntimeError("a reader failed: " + (bad[0].strip() or "?")[-150:])
            spans = [list(map(float, o.split()))[2:4] for o, _ in outs]
            wall = max(t1 for _, t1 in spans) - min(t0 for t0, _ in spans)
            note("%s:shared%d %s" % (client, n, p), wall, c, n * size)

        def readback(client, p):
            """Written through the path by the client (+ fsync), then read at once."""
            f = os.path.join(where[p], "wb.bin")
            rm(f)
            drop()
            pre = run if p == "run" else []
            try:
                if client == "fio":
                    _, c, out = timed(pre + fio(f, a.size, "write", False))
                    job = json.loads(out[out.index("{"):])["jobs"][0]["write"]
                    secs = job["io_bytes"] / job["bw_bytes"]
                else:
                    secs, c, _ = timed(pre + [PY, "-c", PYWRITE, f, str(a.size)])
                note("%s:write %s" % (client, p), secs, c, a.size)
                s, c = read(client, p, f)
                note("%s:readback %s" % (client, p), s, c, a.size)
            finally:
                rm(f)

        def big(client, p):
            """Read in a memory cgroup of half the file's size, after a hot file was read
            there; also notes how much of the hot file stayed cached."""
            f = ensure(client, p)
            size = os.path.getsize(f)
            hot = os.path.join(where[p], "hot.bin")
            hot_size = min(64 << 20, size // 16)
            with open(hot, "wb") as h:
                h.write(os.urandom(hot_size))
            try:
                drop()
                with MemoryCgroup(size // 2, "dnvme-readers") as cg:
                    if cg.preexec is None:
                        raise RuntimeError(cg.reason)
                    pre = run if p == "run" else []
                    subprocess.run(pre + ["cat", hot], stdout=subprocess.DEVNULL, check=True,
                                   preexec_fn=cg.preexec)
                    # The reader joins the cgroup itself (its launcher, dnvme run, execs it).
                    join = [PY, "-c", "import os,sys; open(sys.argv[1],'w').write(str(os.getpid()));"
                            " os.execvp(sys.argv[2], sys.argv[2:])",
                            os.path.join(cg.path, "cgroup.procs")]
                    s, c = read(client, p, f, pre + join)
                note("%s:big %s" % (client, p), s, c, size)
                kept = resident_bytes(hot) if p != "tmpfs" else None
                if kept is not None:
                    res.setdefault("%s:big %s kept" % (client, p), []).append(
                        (kept / hot_size, 0.0))
            finally:
                rm(hot)

        for r in range(a.rounds):
            if fio_ok and r % 2 == 0:
                raw_read()
            for i, client in enumerate(clients):
                jobs = [(client, cell)] if "cold" in a.scenarios or "warm" in a.scenarios else []
                if client in SCENARIO_CLIENTS:
                    for sc in a.scenarios:
                        if sc.startswith("shared"):
                            n = int(sc[len("shared"):])
                            jobs.append(("%s:%s" % (client, sc),
                                         lambda c, p, n=n: shared(c, p, n)))
                        elif sc == "readback":
                            jobs.append((client + ":readback", readback))
                        elif sc == "big":
                            jobs.append((client + ":big", big))
                for j, (name, job) in enumerate(jobs):
                    for p in (a.paths if (r + i + j) % 2 == 0 else a.paths[::-1]):
                        try:
                            job(client, p)
                        except RuntimeError as e:
                            print("readers.py: %s %s failed: %s" % (name, p, e), file=sys.stderr)
                            fails.setdefault(name + " " + p, []).append(str(e))
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
          "dnvme run %s; %.1f GiB warmed after each drop" % (
              d, a.size / GiB, a.rounds, have.get("torch_version"), a.mount_opts or "(defaults)",
              a.run_opts or "(defaults)", WARM[0] / GiB))
    if "raw" in med:
        print("raw fio (libaio O_DIRECT qd32 1M read): %.2f GiB/s, CPU %.3f s/GiB" % med["raw"])
    else:
        print("raw fio: not run (%s)" % have["fio"])
    print("%-16s %-6s %8s %8s %8s %10s   (x lim = cell / min(raw, tmpfs of the client); "
          "* below ext4; big: hot kept = share of the hot file still cached)" % (
              "client", "path", "GiB/s", "x ext4", "x lim", "CPU s/GiB"))
    rows = []
    for c in a.clients:
        if c in skipped:
            rows.append((c, None))
            continue
        if "cold" in a.scenarios or "warm" in a.scenarios:
            rows.append((c, c))
        if c in SCENARIO_CLIENTS:
            for sc in a.scenarios:
                if sc == "readback":
                    rows += [(c, c + ":write"), (c, c + ":readback")]
                elif sc != "cold":
                    rows.append((c, c + ":" + sc))
    for c, row in rows:
        if row is None:
            print("%-16s %s" % (c, skipped[c]))
            continue
        for j, p in enumerate(a.paths):
            name = "%-16s %-6s" % (row if j == 0 else "", p)
            if row + " " + p not in med:
                if row + " " + p in fails or ":" not in row:
                    print("%s failed: %s" % (name, fails.get(row + " " + p, ["?"])[-1]))
                continue
            g, cpu = med[row + " " + p]
            ext4 = med.get(row + " ext4", (None,))[0]
            # The limit: raw fio, and the same row on tmpfs (for N readers, N x raw is no limit).
            lims = [x for x in (med.get("raw", (None,))[0] if ":shared" not in row else None,
                                med.get(row + " tmpfs", (None,))[0]) if x]
            rx = "%7.2f%s" % (g / ext4, "*" if g < ext4 else " ") if ext4 else "%7s " % "-"
            lx = "%8.2f" % (g / min(lims)) if lims else "%8s" % "-"
            bad = " (%d of %d rounds failed)" % (len(fails[row + " " + p]), a.rounds) \
                if row + " " + p in fails else ""
            kept = med.get(row + " " + p + " kept")
            extra = "  hot kept %.0f%%" % (100 * kept[0]) if kept else ""
            print("%s %8.2f %s %s %10.3f%s%s" % (name, g, rx, lx, cpu, bad, extra))
    print(json.dumps({"dir": d, "size": a.size, "rounds": a.rounds, "mount_opts": a.mount_opts,
                      "run_opts": a.run_opts, "scenarios": a.scenarios,
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
