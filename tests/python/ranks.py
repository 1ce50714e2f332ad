"""Runs one test worker script as WORLD processes (ranks) over gloo on loopback, for the tests
that need torch.distributed (test_checkpoint's data-parallel save, test_dcp)."""

import json
import os
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(scratch, script, args, tag, world=2, timeout=240):
    """Runs `script` (in tests/python) as `world` processes with argv RANK WORLD PORT RESULT_JSON
    ARGS...; each writes its result as JSON. Returns them, rank order; a rank that fails or hangs
    fails the test with its output."""
    port = str(free_port())
    procs, results = [], []
    # USE_LIBUV=0: torch >= 2.4's TCPStore rendezvous asks for libuv by default, and Debian's torch
    # (2.6 in trixie) is built without it; older torch ignores the variable.
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", USE_LIBUV="0")
    for rank in range(world):
        out = os.path.join(scratch, "rank%d-%s.json" % (rank, tag))
        results.append(out)
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(HERE, script), str(rank), str(world), port, out] +
            [str(a) for a in args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, "rank %d exited with %d:\n%s" % (rank, p.returncode, log)
    out = []
    for r in results:
        with open(r) as f:
            out.append(json.load(f))
    return out


def leave(result_path, result):
    """What a worker does last: writes its result, waits for the other ranks, and exits without
    torch's process-group teardown. On torch 2.6 with gloo destroy_process_group hung in 1 of ~10
    runs here after every collective had completed (pytorch/pytorch#75097, "destroy_process_group()
    has a certain probability of hangs")."""
    import torch.distributed as dist
    with open(result_path, "w") as f:
        json.dump(result, f)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
