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
  variants      a transposed tensor saved, loaded into a contiguous one; a float32 tensor loaded
                into a float64 one (records read apart, then copied as DCP does);
  damaged       one byte of a large record changed: deepnvme's reader fails the load (CRC-32);
  damaged_small one byte of a small tensor's record changed: the same;
  bad_path      a checkpoint directory that is a file: the save fails on every rank;
  log           what deepnvme.dcp logged at ERROR on this rank (its own errors);
  into_target   how many tensors ours_to_ours read straight into the tensor being loaded.
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
    original = build_state(mesh)  # the same values, never changed (async_save changes state)
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
    reader = deepnvme.dcp.FileSystemReader(ours, reads)
    attempt(result, "ours_to_ours", lambda: load(reader))
    result["bytes_read"] = reads.stats()["bytes_read"] - before
    result["into_target"] = reader.records_into_target

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

    def variants():
        path = os.path.join(top, "variants")
        torch.manual_seed(99)
        saved = {"t": torch.randn(1024, 768).t(), "f": torch.randn(1 << 19)}  # 3 MiB, 2 MiB
        dcp.save(saved, storage_writer=deepnvme.dcp.FileSystemWriter(path))
        into = {"t": torch.zeros(768, 1024), "f": torch.zeros(1 << 19, dtype=torch.float64)}
        dcp.load(into, storage_reader=deepnvme.dcp.FileSystemReader(path))
        ok = torch.equal(into["t"], saved["t"]) and torch.equal(into["f"], saved["f"].double())
        return "equal" if ok else "differ"

    attempt(result, "variants", variants)

    def flip(path, at):
        with open(path, "r+b") as f:
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0xFF]))

    def damaged():
        dist.barrier()
        if rank == 0:  # inside the largest record: the middle of the file
            path = os.path.join(ours, "__0_0.distcp")
            flip(path, os.path.getsize(path) // 2)
        dist.barrier()
        return load(deepnvme.dcp.FileSystemReader(ours, reads), expect=original)

    attempt(result, "damaged", damaged)

    def damaged_small():
        # The LayerNorm's bias (2 KiB): its record inside its archive, from the metadata.
        path = os.path.join(top, "small")
        dcp.save(original, storage_writer=deepnvme.dcp.FileSystemWriter(path))
        dist.barrier()
        if rank == 0:
            import io
            import pickle
            import zipfile
            with open(os.path.join(path, ".metadata"), "rb") as f:
                meta = pickle.load(f)
            (info,) = [v for k, v in meta.storage_data.items() if k.fqn == "model.2.bias"]
            file = os.path.join(path, info.relative_path)
            with open(file, "rb") as f:
                f.seek(info.offset)
                archive = f.read(info.length)
            entry = [i for i in zipfile.ZipFile(io.BytesIO(archive)).infolist()
                     if i.filename.endswith("data/0")][0]
            name_len, extra_len = int.from_bytes(archive[entry.header_offset + 26:][:2],
                                                 "little"), \
                int.from_bytes(archive[entry.header_offset + 28:][:2], "little")
            flip(file, info.offset + entry.header_offset + 30 + name_len + extra_len + 5)
        dist.barrier()
        return load(deepnvme.dcp.FileSystemReader(path, reads), expect=original)

    attempt(result, "damaged_small", damaged_small)

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
