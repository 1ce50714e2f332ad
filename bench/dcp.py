#!/usr/bin/python3
"""torch.distributed.checkpoint and asynchronous save benchmark (issue 37's goals).

Usage (root, a Python with torch >= 2.4: the torch 2.6 lane's tree, see bench/dcp_lane.sh):
    python3 bench/dcp.py --dir DIR [--size 2G] [--rounds 3] [--tensors 16] [--json-out FILE]

Two ranks (gloo on loopback) hold a state of SIZE bytes in all: TENSORS float32 tensors, each
sharded in halves across the ranks (DTensor, Shard(0): each rank holds and writes SIZE/2, as FSDP
does). In every round, in an order that alternates between rounds, into DIR:
  fio          fio --ioengine=libaio --direct=1 --iodepth=32 --bs=1M --rw=write --numjobs=2
               --end_fsync=1, SIZE/2 per job (run by rank 0 while rank 1 waits): the yardstick
  dcp.save     dcp.save with DCP's own FileSystemWriter (sync_files, its defaults)
  ours.save    dcp.save with deepnvme.dcp.FileSystemWriter (defaults)
then, with the page cache dropped before each, the loads of the checkpoint each wrote into the
ranks' preallocated state:
  dcp.load     dcp.load with DCP's FileSystemReader of DCP's checkpoint
  ours.load    dcp.load with deepnvme.dcp.FileSystemReader of ours (CRC-32 checked)
  fio.read     fio --rw=read of the fio files, same flags
and the asynchronous saves:
  ours.async   dcp.async_save with deepnvme's writer: the stall (until async_save returns) and
               the whole save (until its future is done)
  memcpy       one copy of the rank's state into page-locked memory allocated beforehand
               (torch's copy_, the ranks at once): what a snapshot must at least cost
  save.async   deepnvme.save(state, blocking=False) of rank 0's state alone (rank 1 waits): the
               stall and the whole save (wait()), against a fio write of the same size (1 job)
  save.memcpy  one copy of that state into page-locked memory allocated beforehand
A timed run starts after a barrier and ends at the barrier after it (the slower rank's time).
Staging memory is kept from the first round (the first round's stall includes allocating it;
reported separately). Prints every run, medians and the goals' ratios.
GiB = 2^30 bytes.
"""

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import size_arg  # noqa: E402

GiB = 1 << 30


def settle():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def fio(path, size, rw, jobs):
    out = subprocess.run(
        ["fio", "--name=raw", "--directory=" + path, "--rw=" + rw, "--ioengine=libaio",
         "--direct=1", "--iodepth=32", "--bs=1M", "--size=%d" % (size // jobs),
         "--numjobs=%d" % jobs, "--group_reporting", "--end_fsync=1", "--fallocate=none",
         "--output-format=json"], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit("dcp.py: fio failed: " + out.stderr[-2000:])
    return json.loads(out.stdout)["jobs"][0]["write" if rw == "write" else "read"]["bw_bytes"]


def rank_main(rank, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), USE_LIBUV="0")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    sys.path.insert(0, os.path.join(ROOT, args.build, "python"))
    import deepnvme
    import deepnvme.dcp

    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    per = args.size // args.tensors // 4
    g = torch.Generator().manual_seed(0)
    state = {"w%02d" % i: distribute_tensor(torch.randn(per, generator=g), mesh, [Shard(0)])
             for i in range(args.tensors)}
    state["step"] = 1000
    target = {k: (distribute_tensor(torch.zeros(per), mesh, [Shard(0)]) if k != "step" else 0)
              for k in state}
    local_bytes = sum(v.to_local().nbytes for k, v in state.items() if k != "step")
    pinned = torch.frombuffer(deepnvme._C.HostBuffer(local_bytes, True), dtype=torch.uint8)
    flat = [v.to_local().view(torch.uint8) for k, v in state.items() if k != "step"]
    plain = {k: v.to_local() for k, v in state.items() if k != "step"}  # rank 0's own state
    results = []

    def timed(name, fn, round_no):
        dist.barrier()
        t0 = time.perf_counter()
        extra = fn()
        extra = extra if isinstance(extra, dict) else None
        dist.barrier()
        seconds = time.perf_counter() - t0
        if rank == 0:
            row = {"round": round_no, "variant": name, "seconds": seconds}
            row.update(extra or {})
            results.append(row)
            print(json.dumps(row), flush=True)

    def on_rank0(fn):
        return fn() if rank == 0 else None

    def fresh(path):
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
            os.makedirs(path)
            settle()
        dist.barrier()

    top = args.dir
    dirs = {n: os.path.join(top, n) for n in ("fio", "dcp", "ours", "async", "save")}

    def memcpy():
        at = 0
        for t in flat:
            pinned[at:at + t.numel()].copy_(t)
            at += t.numel()

    for round_no in range(args.rounds):
        saves = [("fio", lambda: on_rank0(lambda: {"fio_bw": fio(dirs["fio"], args.size,
                                                                   "write", 2)})),
                 ("dcp.save", lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(
                     dirs["dcp"]))),
                 ("ours.save", lambda: dcp.save(state, storage_writer=deepnvme.dcp
                                                .FileSystemWriter(dirs["ours"])))]
        if round_no % 2:
            saves.reverse()
        for name, fn in saves:
            fresh(dirs[name.split(".")[0]])
            timed(name, fn, round_no)
        loads = [("dcp.load", lambda: dcp.load(target, storage_reader=dcp.FileSystemReader(
                      dirs["dcp"]))),
                 ("ours.load", lambda: dcp.load(target, storage_reader=deepnvme.dcp
                                                .FileSystemReader(dirs["ours"]))),
                 ("fio.read", lambda: on_rank0(lambda: {"fio_bw": fio(dirs["fio"], args.size,
                                                                        "read", 2)}))]
        if round_no % 2:
            loads.reverse()
        for name, fn in loads:
            if rank == 0:
                settle()
            timed(name, fn, round_no)
        if rank == 0:  # the RAM disk holds one checkpoint at a time beside the state
            for n in ("fio", "dcp", "ours"):
                shutil.rmtree(dirs[n], ignore_errors=True)

        # Asynchronous: the stall, then the whole save.
        fresh(dirs["async"])
        dist.barrier()
        t0 = time.perf_counter()
        future = dcp.async_save(state, storage_writer=deepnvme.dcp.FileSystemWriter(
            dirs["async"]))
        stall = time.perf_counter() - t0
        future.result()
        dist.barrier()
        if rank == 0:
            row = {"round": round_no, "variant": "ours.async", "seconds":
                   time.perf_counter() - t0, "stall": stall}
            results.append(row)
            print(json.dumps(row), flush=True)
        timed("memcpy", memcpy, round_no)

        fresh(dirs["save"])

        def save_async():
            t = time.perf_counter()
            saving = deepnvme.save(plain, os.path.join(dirs["save"], "x.pt"), blocking=False)
            stall = time.perf_counter() - t
            saving.wait()
            return {"stall": stall}

        timed("save.async", lambda: on_rank0(save_async), round_no)
        timed("save.memcpy", lambda: on_rank0(memcpy), round_no)
        fresh(dirs["fio"])
        timed("save.fio", lambda: on_rank0(lambda: {"fio_bw": fio(dirs["fio"], local_bytes,
                                                                   "write", 1)}), round_no)
        if rank == 0:
            for n in ("fio", "async", "save"):
                shutil.rmtree(dirs[n], ignore_errors=True)
    if rank == 0:
        with open(os.path.join(top, "results.json"), "w") as f:
            json.dump({"size": args.size, "local_bytes": local_bytes, "rows": results}, f)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # no destroy_process_group: see tests/python/ranks.py


def summarize(path, json_out):
    with open(path) as f:
        data = json.load(f)
    size, local = data["size"], data["local_bytes"]
    rows = data["rows"]

    def med(variant, key="seconds", rounds=None):
        vals = [r[key] for r in rows if r["variant"] == variant and
                (rounds is None or r["round"] in rounds)]
        return statistics.median(vals) if vals else float("nan")

    later = set(r["round"] for r in rows if r["round"] > 0) or None
    gib = lambda n, s: n / s / GiB  # noqa: E731
    out = {
        "fio.write GiB/s": statistics.median(r["fio_bw"] for r in rows
                                             if r["variant"] == "fio") / GiB,
        "dcp.save GiB/s": gib(size, med("dcp.save")),
        "ours.save GiB/s": gib(size, med("ours.save")),
        "fio.read GiB/s": statistics.median(r["fio_bw"] for r in rows
                                            if r["variant"] == "fio.read") / GiB,
        "dcp.load GiB/s": gib(size, med("dcp.load")),
        "ours.load GiB/s": gib(size, med("ours.load")),
        "ours.async stall s (rounds > 0)": med("ours.async", "stall", later),
        "ours.async stall s (first)": [r["stall"] for r in rows
                                       if r["variant"] == "ours.async"][0],
        "ours.async GiB/s": gib(size, med("ours.async")),
        "memcpy s": med("memcpy"),
        "save.async stall s (rounds > 0)": med("save.async", "stall", later),
        "save.async stall s (first)": [r["stall"] for r in rows
                                       if r["variant"] == "save.async"][0],
        "save.async GiB/s": gib(local, med("save.async")),
        "save.memcpy s": med("save.memcpy"),
        "save.fio GiB/s": statistics.median(r["fio_bw"] for r in rows
                                            if r["variant"] == "save.fio") / GiB,
    }
    out["ratio ours.save / dcp.save (goal >= 3)"] = out["ours.save GiB/s"] / out["dcp.save GiB/s"]
    out["ratio ours.save / fio write (goal >= 0.8)"] = out["ours.save GiB/s"] / \
        out["fio.write GiB/s"]
    out["ratio ours.load / dcp.load (goal >= 1.5)"] = out["ours.load GiB/s"] / out["dcp.load GiB/s"]
    out["ratio ours.async stall / memcpy"] = out["ours.async stall s (rounds > 0)"] / \
        out["memcpy s"]
    out["ratio save.async stall / memcpy (goal <= 1.25)"] = \
        out["save.async stall s (rounds > 0)"] / out["save.memcpy s"]
    out["ratio save.async / fio write (goal >= 0.8)"] = out["save.async GiB/s"] / \
        out["save.fio GiB/s"]
    for k, v in out.items():
        print("%-48s %.3f" % (k, v))
    if json_out:
        with open(json_out, "w") as f:
            json.dump({"summary": out, "rows": rows}, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--size", type=size_arg, default=2 * GiB)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--build", default="build-torch2")
    ap.add_argument("--json-out")
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank is not None:
        return rank_main(args.rank, args.port, args)
    if os.geteuid() != 0:
        sys.exit("dcp.py: run as root (drop_caches)")
    os.makedirs(args.dir, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, os.path.abspath(__file__)] + sys.argv[1:]
    env = dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count() or 1))
    procs = [subprocess.Popen(argv + ["--rank", str(r), "--port", str(port)], env=env)
             for r in range(2)]
    codes = [p.wait() for p in procs]
    if any(codes):
        sys.exit("dcp.py: a rank failed: %s" % codes)
    summarize(os.path.join(args.dir, "results.json"), args.json_out)


if __name__ == "__main__":
    main()
