#!/usr/bin/python3
"""Checkpoint save benchmark: torch.save+fsync vs deepnvme.save vs torch.save through dnvmefs.

Usage (as root, from the repository, after scripts/build.sh):
    /usr/bin/python3 bench/checkpoint.py [--dir DIR] [--size 1G] [--runs 3] [--tensors 16]
                                         [--mount-options OPTS] [--json-out FILE]
                                         [--hold-freed-memory]

One state dict of SIZE bytes (TENSORS float32 tensors of random values) is saved, in every
round, by each variant into the same directory DIR on one disk:
  torch       torch.save(state, DIR/x.pt), then fsync (the file opened again, os.fsync)
  deepnvme    deepnvme.save(state, DIR/x.pt): pinned double buffer, O_DIRECT libaio, fsync
  mount       torch.save(state, MNT/x.pt) + fsync through a dnvmefs mount whose backing
              directory is DIR/backing (started by this script, -f, always unmounted)
  fio         fio --ioengine=libaio --direct=1 --iodepth=32 --bs=1M --rw=write --end_fsync=1
              of SIZE in DIR: the disk's raw O_DIRECT write speed, the yardstick
Then the load side, on one file written by deepnvme.save, cold every time (drop_caches before
each run), the order rotating per round:
  torch.load      torch.load(DIR/x.pt)
  deepnvme.load   deepnvme.load(DIR/x.pt): one parallel O_DIRECT read, then torch.load from memory
  mount.load      torch.load(MNT/x.pt) of the same file through the mount
  fio read        fio --rw=read, same flags, on that file: the raw read speed
  torch.load warm torch.load(DIR/x.pt) with the file already in the page cache (read once,
                  untimed): no I/O at all, the loader's own ceiling. A load through any
                  filesystem can be at most this fast, so it bounds what a mount can gain.
Before each save run the previous file is removed and `sync` plus drop_caches settle the disk.
The order of the variants rotates every round so none always gets the same position. Prints every
run, the median GiB/s per variant and the ratios deepnvme/torch, mount/torch and each/fio, and
the machine's CPU seconds per GiB of each variant (every process and kernel thread: user, nice,
system, irq and softirq of /proc/stat's cpu line, around the timed call; median over rounds).
Pass --dir on a fast device (bench/fastdev.sh) as well as on the disk.
GiB = 2^30 bytes. The whole time of the call is measured (serialization included), as a
training loop would see it. --hold-freed-memory: on a VM whose kernel hands freed memory back to
the host at once (free page reporting), delay that for the run, as bench/lib.sh's
hold_freed_memory does for the shell benchmarks: fresh page cache then costs what it costs on a
real machine.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "build", "python"))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import deepnvme  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402
from benchlib import size_arg  # noqa: E402

GiB = 1 << 30


def die(msg):
    sys.exit("checkpoint.py: " + msg)


def settle():
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as e:
        print("checkpoint.py: cannot drop caches (%s); results include cache effects" % e,
              file=sys.stderr)


PAGE_REPORTING_KNOB = "/sys/module/page_reporting/parameters/min_free_ms"


def hold_freed_memory():
    """Delays the VM's free page reporting by 5 min (bench/lib.sh); returns the old value to put
    back, or None where the knob does not exist."""
    if not os.access(PAGE_REPORTING_KNOB, os.W_OK):
        print("checkpoint.py: no %s here: freed memory is not reported early" %
              PAGE_REPORTING_KNOB, file=sys.stderr)
        return None
    with open(PAGE_REPORTING_KNOB) as f:
        saved = f.read().strip()
    with open(PAGE_REPORTING_KNOB, "w") as f:
        f.write("300000\n")
    print("checkpoint.py: freed memory held for 5 min before it is reported to the host "
          "(min_free_ms %s -> 300000 for this run)" % saved, file=sys.stderr)
    return saved


def release_freed_memory(saved):
    if saved is None:
        return
    try:
        with open(PAGE_REPORTING_KNOB, "w") as f:
            f.write(saved + "\n")
    except OSError as e:
        print("checkpoint.py: could not put %s back to %s: %s" % (PAGE_REPORTING_KNOB, saved, e),
              file=sys.stderr)


def fsync_path(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def machine_busy_s():
    """CPU seconds every CPU has worked so far (processes and kernel threads)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    if fields[0] != "cpu":
        die("unexpected first line of /proc/stat: %r" % fields[0])
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def make_state(size, tensors):
    per = size // tensors // 4
    g = torch.Generator().manual_seed(0)
    state = {"layer%02d.weight" % i: torch.randn(per, generator=g) for i in range(tensors)}
    state["step"] = 1000
    return state


class DnvmeMount(benchlib.ForegroundMount):
    """dnvmefs BACKING MNT -f in a child, its log beside MNT (benchlib.ForegroundMount)."""

    def __init__(self, backing, mnt, options):
        binary = os.path.join(ROOT, "build", "bin", "dnvmefs")
        if not os.access(binary, os.X_OK):
            die("%s not found: run scripts/build.sh first" % binary)
        self.backing = backing
        self.log = open(os.path.join(os.path.dirname(mnt), "dnvmefs.log"), "wb")
        try:
            super().__init__(binary, backing, mnt, options, out=self.log)
        except RuntimeError as e:
            self.log.close()
            die("%s (see %s)" % (e, self.log.name))

    def close(self):
        unmounted = super().close()
        self.log.close()
        return unmounted


def run_fio(name, size, rw="write"):
    out = subprocess.run(
        ["fio", "--name=raw", "--filename=" + name, "--rw=" + rw, "--ioengine=libaio",
         "--direct=1", "--iodepth=32", "--bs=1M", "--size=%d" % size, "--end_fsync=1",
         "--fallocate=none", "--output-format=json"], capture_output=True, text=True)
    if out.returncode != 0:
        die("fio failed: " + out.stderr[-2000:])
    job = json.loads(out.stdout)["jobs"][0]
    if rw == "write":
        os.unlink(name)
    return job[rw if rw == "write" else "read"]["bw_bytes"]  # O_DIRECT: fsync has nothing left


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=os.path.join(ROOT, "var", "bench-checkpoint"))
    ap.add_argument("--size", type=size_arg, default=GiB)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--mount-options", default="")
    ap.add_argument("--json-out")
    ap.add_argument("--hold-freed-memory", action="store_true")
    args = ap.parse_args()
    if args.runs < 1 or args.tensors < 1:
        die("--runs and --tensors must be >= 1")
    if shutil.which("fio") is None:
        die("fio is missing (apt-get install fio)")
    if os.geteuid() != 0:
        print("checkpoint.py: not root: caches are not dropped", file=sys.stderr)

    os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="ckpt-", dir=args.dir)
    backing, mnt = os.path.join(work, "backing"), os.path.join(work, "mnt")
    os.mkdir(backing)
    os.mkdir(mnt)
    print("checkpoint.py: %s state dict (%d tensors) into %s; torch %s; %d rounds" %
          (args.size, args.tensors, work, torch.__version__, args.runs))
    state = make_state(args.size, args.tensors)
    handle = deepnvme.aio_handle()  # DeepSpeed's defaults, as deepnvme.save uses
    results = {"torch": [], "deepnvme": [], "mount": [], "fio": [], "torch.load": [],
               "deepnvme.load": [], "mount.load": [], "fio read": [], "torch.load warm": []}
    cpu = {k: [] for k in results}  # machine CPU seconds per GiB
    held = hold_freed_memory() if args.hold_freed_memory else None
    mount = None
    try:
        mount = DnvmeMount(backing, mnt, args.mount_options)
        def torch_save(path):
            torch.save(state, path)
            fsync_path(path)

        variants = {
            "torch": lambda: torch_save(os.path.join(work, "x.pt")),
            "deepnvme": lambda: deepnvme.save(state, os.path.join(work, "x.pt"), handle),
            "mount": lambda: torch_save(os.path.join(mnt, "x.pt")),
        }
        order = ["torch", "deepnvme", "mount", "fio"]
        for r in range(args.runs):
            rot = order[r % len(order):] + order[:r % len(order)]
            for name in rot:
                for leftover in (os.path.join(work, "x.pt"), os.path.join(backing, "x.pt")):
                    if os.path.exists(leftover):
                        os.unlink(leftover)
                settle()
                c0 = machine_busy_s()
                if name == "fio":
                    rate = run_fio(os.path.join(work, "fio.dat"), args.size) / GiB
                    moved = args.size
                else:
                    t0 = time.perf_counter()
                    variants[name]()
                    dt = time.perf_counter() - t0
                    moved = os.path.getsize(os.path.join(backing if name == "mount" else work,
                                                         "x.pt"))
                    rate = moved / GiB / dt
                cpu[name].append((machine_busy_s() - c0) / (moved / GiB))
                results[name].append(rate)
                print("  round %d %-8s %6.3f GiB/s" % (r + 1, name, rate), flush=True)

        # Load: one file, read cold by each variant in turn.
        ckpt = os.path.join(work, "x.pt")
        size = deepnvme.save(state, ckpt, handle)
        # The same bytes in the backing directory, for the load through the mount.
        if deepnvme.save(state, os.path.join(backing, "x.pt"), handle) != size:
            die("the two saves of one state dict differ in size")
        loaders = {"torch.load": lambda: torch.load(ckpt),
                   "deepnvme.load": lambda: deepnvme.load(ckpt),  # its default read handle
                   "mount.load": lambda: torch.load(os.path.join(mnt, "x.pt")),
                   "torch.load warm": lambda: torch.load(ckpt)}
        order = ["torch.load", "deepnvme.load", "mount.load", "fio read", "torch.load warm"]
        for r in range(args.runs):
            for name in order[r % len(order):] + order[:r % len(order)]:
                settle()
                if name == "torch.load warm":  # into the page cache, untimed
                    with open(ckpt, "rb") as f:
                        while f.read(64 << 20):
                            pass
                c0 = machine_busy_s()
                if name == "fio read":
                    rate = run_fio(ckpt, size, "read") / GiB
                else:
                    t0 = time.perf_counter()
                    loaded = loaders[name]()
                    rate = size / GiB / (time.perf_counter() - t0)
                    if not torch.equal(loaded["layer00.weight"], state["layer00.weight"]):
                        die("%s returned different data" % name)
                    del loaded
                cpu[name].append((machine_busy_s() - c0) / (size / GiB))
                results[name].append(rate)
                print("  round %d %-13s %6.3f GiB/s" % (r + 1, name, rate), flush=True)
    finally:
        if mount is not None:
            mount.close()
        shutil.rmtree(work, ignore_errors=True)
        release_freed_memory(held)

    med = {k: statistics.median(v) for k, v in results.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    print("\nmedian GiB/s over %d rounds (machine CPU s/GiB):" % args.runs)
    for k in ("fio", "torch", "deepnvme", "mount"):
        print("  %-13s %6.3f   (%.2f of fio raw)   %6.3f" % (k, med[k], med[k] / med["fio"],
                                                          med_cpu[k]))
    for k in ("fio read", "torch.load", "deepnvme.load", "mount.load", "torch.load warm"):
        print("  %-13s %6.3f   (%.2f of fio raw read)   %6.3f" % (
            k, med[k], med[k] / med["fio read"], med_cpu[k]))
    ratios = {"deepnvme_vs_torch": med["deepnvme"] / med["torch"],
              "mount_vs_torch": med["mount"] / med["torch"],
              "ceiling_fio_vs_torch": med["fio"] / med["torch"],
              "load_deepnvme_vs_torch": med["deepnvme.load"] / med["torch.load"],
              "load_mount_vs_torch": med["mount.load"] / med["torch.load"],
              "load_ceiling_warm_vs_torch": med["torch.load warm"] / med["torch.load"]}
    print("ratios (goal >= 4): deepnvme.save / torch.save = %.2fx, mount / torch.save = %.2fx "
          "(fio raw / torch.save, the most any writer can reach on this disk: %.2fx)" %
          (ratios["deepnvme_vs_torch"], ratios["mount_vs_torch"],
           ratios["ceiling_fio_vs_torch"]))
    print("load: deepnvme.load / torch.load = %.2fx, mount.load / torch.load = %.2fx "
          "(torch.load from the page cache / cold torch.load, the most any filesystem can give "
          "torch.load: %.2fx)" % (ratios["load_deepnvme_vs_torch"], ratios["load_mount_vs_torch"],
                                  ratios["load_ceiling_warm_vs_torch"]))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"size": args.size, "runs": results, "median": med,
                       "machine_cpu_s_per_gib": cpu, "median_machine_cpu_s_per_gib": med_cpu,
                       "ratios": ratios}, f, indent=1)


if __name__ == "__main__":
    main()
