"""One rank of the torch.distributed.checkpoint tests (tests/python/test_dcp.py starts two).

    dcp_worker.py RANK WORLD PORT RESULT_JSON DIR

Initialises gloo on 127.0.0.1:PORT and a one-dimensional CPU device mesh, builds the same state
on every rank (a seeded model, a large plain tensor, a tensor sharded across the ranks as a
DTensor, plain objects), and checks, writing each finding to RESULT_JSON:
  ours_to_dcp   saved with deepnvme.dcp.FileSystemWriter, loaded by DCP's own reader;
  ours_to_ours  the same checkpoint loaded by deepnvme.dcp.FileSystemReader (records read into
                the tensors being loaded);
  reshard       the sharded tensor loaded whole on every rank (Replicate): read and narrowed;
  dcp_to_ours   saved by DCP's own FileSystemWriter, loaded by deepnvme's reader;
  async         dcp.async_save with deepnvme's writer, the state changed as soon as it
                returned, then loaded: the state at the call;
  damaged       one byte of a large record changed: deepnvme's reader fails the load (CRC-32);
  bad_path      a checkpoint directory that is a file: the save fails on every rank;
  log           what deepnvme.dcp logged at ERROR on this rank (its own errors).
plus the bytes each rank's handles moved and the fsyncs its writer made.
"""

import faulthandler
import logging
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import deepnvme
import deepnvme.dcp
import ranks

def build_state(mesh):
    torch.manual_seed(4321)
    model = torch.nn.Sequential(torch.nn.Embedding(4096, 512), torch.nn.Linear(512, 512),
                                torch.nn.LayerNorm(512))
    full = torch.arange(2 << 20, dtype=torch.float32)  # 8 MiB, 4 MiB per rank
    return {"model": model.state_dict(), "big": torch.randn(3 << 20),
            "sharded": distribute_tensor(full, mesh, [Shard(0)]),
            "step": 17, "meta": {"lr": 0.1, "note": "dnvme"}}


def zeros_like_state(state):
    def zero(v):
        if isinstance(v, DTensor):
            return distribute_tensor(torch.zeros(v.shape, dtype=v.dtype), v.device_mesh,
                                     v.placements)
        if isinstance(v, torch.Tensor):
            return torch.zeros_like(v)
        if isinstance(v, dict):
            return {k: zero(x) for k, x in v.items()}
        return None if isinstance(v, (int, float, str)) else v
    return zero(state)


def same(a, b, where="state"):
    """None when equal, else where they differ."""
    if isinstance(a, DTensor) or isinstance(b, DTensor):
        a = a.full_tensor() if isinstance(a, DTensor) else a
        b = b.full_tensor() if isinstance(b, DTensor) else b
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
            return where + ": type or shape"
        return None if torch.equal(a, b) else where + ": values"
    if isinstance(a, dict):
        if not isinstance(b, dict) or set(a) != set(b):
            return where + ": keys"
        for k in a:
            d = same(a[k], b[k], "%s.%s" % (where, k))
            if d:
                return d
        return None
    return None if a == b else "%s: %r != %r" % (where, a, b)


def attempt(result, name, fn):
    try:
        result[name] = fn()
    except Exception as e:  # the test reads the finding
        result[name] = "%s: %s | %s" % (type(e).__name__, e,
                                        traceback.format_exc().splitlines()[-3:])


def main():
    rank, world, port, result_path, top = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                           sys.argv[4], sys.argv[5])
    faulthandler.dump_traceback_later(150, exit=True)  # a hang shows its stacks
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    state = build_state(mesh)
    result = {"rank": rank, "log": []}
    # deepnvme.dcp logs each rank's own error (DCP's collection of it may fail, see dcp.py).
    collect = logging.Handler(logging.ERROR)
    collect.emit = lambda record: result["log"].append(record.getMessage())
    logging.getLogger("deepnvme").addHandler(collect)
    writes = deepnvme.aio_handle(block_size=1 << 20, queue_depth=16, intra_op_parallelism=2)
    reads = deepnvme.aio_handle(block_size=1 << 20, queue_depth=16, intra_op_parallelism=2)
    fsyncs = []
    real_fsync = os.fsync

    def counting_fsync(fd):
        fsyncs.append(os.readlink("/proc/self/fd/%d" % fd))
        return real_fsync(fd)

    ours, theirs, later = (os.path.join(top, n) for n in ("ours", "theirs", "async"))

    def save_ours():
        os.fsync = counting_fsync
        try:
            dcp.save(state, storage_writer=deepnvme.dcp.FileSystemWriter(ours, handle=writes))
        finally:
            os.fsync = real_fsync
        return "ok"

    attempt(result, "save_ours", save_ours)
    result["fsyncs"] = sorted(os.path.basename(p) for p in fsyncs)
    result["bytes_written"] = writes.stats()["bytes_written"]

    def load(reader, expect=state, into=None):
        target = into if into is not None else zeros_like_state(expect)
        dcp.load(target, storage_reader=reader)
        return same(expect, target) or "equal"

    attempt(result, "ours_to_dcp", lambda: load(dcp.FileSystemReader(ours)))
    before = reads.stats()["bytes_read"]
    attempt(result, "ours_to_ours", lambda: load(deepnvme.dcp.FileSystemReader(ours, reads)))
    result["bytes_read"] = reads.stats()["bytes_read"] - before

    def reshard():
        whole = zeros_like_state(state)
        whole["sharded"] = distribute_tensor(torch.zeros(state["sharded"].shape), mesh,
                                             [Replicate()])
        dcp.load(whole, storage_reader=deepnvme.dcp.FileSystemReader(ours, reads))
        return same(state, whole) or "equal"

    attempt(result, "reshard", reshard)

    def dcp_to_ours():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(theirs))
        return load(deepnvme.dcp.FileSystemReader(theirs, reads))

    attempt(result, "dcp_to_ours", dcp_to_ours)

    def async_save():
        expect = zeros_like_state(state)
        for src, dst in ((state["model"], expect["model"]),):
            for k in src:
                dst[k].copy_(src[k])
        expect["big"].copy_(state["big"])
        expect["sharded"].to_local().copy_(state["sharded"].to_local())
        expect.update(step=state["step"], meta=dict(state["meta"]))
        future = dcp.async_save(state, storage_writer=deepnvme.dcp.FileSystemWriter(later))
        # Staged: the caller may change its tensors at once.
        state["big"].add_(1.0)
        state["model"]["0.weight"].mul_(-1.0)
        future.result()
        return load(deepnvme.dcp.FileSystemReader(later), expect=expect)

    attempt(result, "async", async_save)

    def damaged():
        dist.barrier()
        if rank == 0:
            path = os.path.join(ours, "__0_0.distcp")
            size = os.path.getsize(path)
            with open(path, "r+b") as f:  # inside the largest record: the middle of the file
                f.seek(size // 2)
                byte = f.read(1)
                f.seek(size // 2)
                f.write(bytes([byte[0] ^ 0xFF]))
        dist.barrier()
        return load(deepnvme.dcp.FileSystemReader(ours, reads))

    attempt(result, "damaged", damaged)

    def bad_path():
        blocker = os.path.join(top, "a-file")
        if rank == 0:
            with open(blocker, "w") as f:
                f.write("not a directory")
        dist.barrier()
        dcp.save(state, storage_writer=deepnvme.dcp.FileSystemWriter(blocker))
        return "saved"

    attempt(result, "bad_path", bad_path)
    ranks.leave(result_path, result)


if __name__ == "__main__":
    main()
