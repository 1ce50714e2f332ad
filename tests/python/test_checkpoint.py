"""deepnvme.save / load / FastFileWriter: a real model's state_dict (and its optimizer's) round
trip read by plain torch.load, streams crossing buffer boundaries, the file-object contract,
ENOSPC and bad paths, and the data-parallel save with two gloo processes on loopback."""

import errno
import json
import os
import socket
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def assert_same_state(torch, a, b, where="state"):
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), where
        for k in a:
            assert_same_state(torch, a[k], b[k], "%s.%s" % (where, k))
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(torch, x, y, "%s[%d]" % (where, i))
    else:
        assert a == b, where


def real_model_state(torch):
    """A small real network after one optimizer step: conv, batch norm (buffers), LSTM,
    embedding, attention, a half-precision copy, and Adam's state."""
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 16, 3)
            self.bn = torch.nn.BatchNorm2d(16)
            self.emb = torch.nn.Embedding(5000, 128)
            self.lstm = torch.nn.LSTM(128, 256, num_layers=2)
            self.attn = torch.nn.MultiheadAttention(256, 8)
            self.head = torch.nn.Linear(256, 10)

        def forward(self, img, tokens):
            x = self.bn(self.conv(img)).mean()
            seq, _ = self.lstm(self.emb(tokens))
            seq, _ = self.attn(seq, seq, seq)
            return self.head(seq).mean() + x

    net = Net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    loss = net(torch.randn(2, 3, 16, 16), torch.randint(0, 5000, (7, 2)))
    loss.backward()
    opt.step()
    return {"model": net.state_dict(), "optimizer": opt.state_dict(),
            "half": {k: v.half() for k, v in net.state_dict().items() if v.is_floating_point()},
            "epoch": 3, "note": "checkpoint \u2713"}


def test_real_model_round_trip(deepnvme, torch, scratch):
    state = real_model_state(torch)
    path = os.path.join(scratch, "model.pt")
    size = deepnvme.save(state, path)
    assert size == os.path.getsize(path) and size > 10 << 20
    assert_same_state(torch, state, torch.load(path))  # plain torch.load reads it
    assert_same_state(torch, state, deepnvme.load(path))
    # deepnvme.load reads any torch.save file.
    plain = os.path.join(scratch, "plain.pt")
    torch.save(state, plain)
    assert_same_state(torch, state, deepnvme.load(plain, map_location="cpu"))
    # A model restored from it computes the same.
    assert deepnvme.load(path)["model"]["head.weight"].sum() == state["model"]["head.weight"].sum()


@pytest.mark.parametrize("buffer_kib", [4, 64, 1024])
def test_streams_cross_buffer_boundaries(deepnvme, torch, scratch, buffer_kib):
    h = deepnvme.aio_handle(block_size=65536, queue_depth=8, intra_op_parallelism=2)
    for i, n in enumerate([0, 1, 4095, 4096, 65537, 3 << 20]):
        obj = {"t": torch.arange(n, dtype=torch.uint8), "n": n, "list": [torch.ones(i + 1)]}
        path = os.path.join(scratch, "s%d.pt" % n)
        size = deepnvme.save(obj, path, h, buffer_bytes=buffer_kib << 10, num_buffers=2 + i % 3)
        assert os.path.getsize(path) == size
        assert_same_state(torch, obj, torch.load(path))


def test_fast_file_writer_is_a_file(deepnvme, scratch):
    path = os.path.join(scratch, "stream.bin")
    pieces = [b"x" * 10, bytearray(range(256)) * 5000, memoryview(b"tail" * 1001), b""]
    with deepnvme.FastFileWriter(path, buffer_bytes=1 << 16) as f:
        assert f.writable() and not f.readable() and not f.seekable()
        total = 0
        for p in pieces:
            assert f.write(p) == len(p)
            total += len(p)
            assert f.tell() == total
        f.flush()
    assert f.closed
    with open(path, "rb") as r:
        assert r.read() == b"".join(bytes(p) for p in pieces)
    with pytest.raises(ValueError):
        f.write(b"more")
    f.close()  # idempotent

    # An exception inside the with-block abandons the stream and propagates unchanged.
    with pytest.raises(KeyError):
        with deepnvme.FastFileWriter(path) as g:
            g.write(b"abc")
            raise KeyError("serializer failed")
    assert g.closed

    with pytest.raises(ValueError, match="buffer_bytes"):
        deepnvme.FastFileWriter(path, buffer_bytes=1000)
    with pytest.raises(ValueError, match="num_buffers"):
        deepnvme.FastFileWriter(path, num_buffers=1)
    import numpy as np
    with deepnvme.FastFileWriter(path) as f:
        with pytest.raises((BufferError, ValueError)):
            f.write(np.zeros((4, 4))[:, 0])  # not contiguous


def test_save_errors(deepnvme, torch, scratch, small_tmpfs):
    state = {"w": torch.ones(4 << 20, dtype=torch.uint8)}
    with pytest.raises(OSError) as e:
        deepnvme.save(state, os.path.join(small_tmpfs, "full.pt"))
    assert e.value.errno == errno.ENOSPC
    with pytest.raises(FileNotFoundError):
        deepnvme.save(state, os.path.join(scratch, "no", "dir", "x.pt"))
    with pytest.raises(FileNotFoundError):
        deepnvme.load(os.path.join(scratch, "missing.pt"))
    with pytest.raises(TypeError):
        deepnvme.save(state, os.path.join(scratch, "x.pt"), handle="not a handle")
    # Still fine afterwards.
    path = os.path.join(scratch, "ok.pt")
    deepnvme.save(state, path)
    assert torch.equal(deepnvme.load(path)["w"], state["w"])


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(scratch, path, mode, world=2):
    port = str(free_port())
    procs, results = [], []
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    for rank in range(world):
        out = os.path.join(scratch, "rank%d-%s.json" % (rank, mode))
        results.append(out)
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(HERE, "dp_save_worker.py"), str(rank), str(world), port,
             path, mode, out], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=240)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log
    out = []
    for r in results:
        with open(r) as f:
            out.append(json.load(f))
    return out


def test_data_parallel_save_two_ranks(deepnvme, torch, scratch):
    sys.path.insert(0, HERE)
    try:
        import dp_save_worker
    finally:
        sys.path.remove(HERE)
    path = os.path.join(scratch, "dp.pt")
    with open(path, "wb") as f:
        f.write(b"old checkpoint, longer than nothing" * 1000000)  # must be replaced entirely
    results = run_ranks(scratch, path, "same")
    assert all(r["ok"] for r in results), results
    length = results[0]["length"]
    assert all(r["length"] == length for r in results)
    assert os.path.getsize(path) == length
    expected = dp_save_worker.build_state(1000)
    assert_same_state(torch, expected, torch.load(path))
    # Each rank wrote its share (1 MiB stripes, round robin), together exactly the file.
    written = [r["bytes_written"] for r in results]
    assert sum(written) == length, written
    assert all(w >= (length // 2) - (1 << 20) for w in written), written

    # Ranks with different objects: every rank raises and no corrupt file is left behind.
    bad = os.path.join(scratch, "dp_bad.pt")
    results = run_ranks(scratch, bad, "differ")
    assert not any(r["ok"] for r in results), results
    assert all("different lengths" in r["error"] for r in results), results
    assert not os.path.exists(bad)


def test_data_parallel_needs_distributed(deepnvme, torch, scratch):
    with pytest.raises(RuntimeError, match="init_process_group"):
        deepnvme.save({"a": 1}, os.path.join(scratch, "x.pt"), data_parallel=True)


def test_save_reuses_the_kept_pinned_buffers(deepnvme, torch, scratch):
    path = os.path.join(scratch, "pool.pt")
    deepnvme.save({"a": torch.ones(10)}, path)  # creates the default handle and pool
    pool = deepnvme.buffer_pool()
    assert pool.available == pool.count == 3 and pool.buffer_bytes == 32 << 20
    pinned = deepnvme.pinned_bytes_in_use()
    state = {"a": torch.arange(100 << 20, dtype=torch.uint8)}  # 100 MiB: every buffer is used
    deepnvme.save(state, path)
    assert deepnvme.pinned_bytes_in_use() == pinned, "a save with the default shape pins nothing"
    assert pool.available == pool.count, "the buffers are back in the pool"
    assert torch.equal(torch.load(path)["a"], state["a"])
    # Another shape pins its own buffers for the save and releases them after.
    deepnvme.save(state, path, buffer_bytes=1 << 20, num_buffers=2)
    assert deepnvme.pinned_bytes_in_use() == pinned
    assert torch.equal(deepnvme.load(path)["a"], state["a"])
    # Or borrows a pool the caller keeps.
    mine = deepnvme.buffer_pool(1 << 20, 2)
    with deepnvme.FastFileWriter(path, buffer_bytes=1 << 20, num_buffers=2, pool=mine) as f:
        f.write(b"z" * (3 << 20))
        assert mine.available == 0
    assert mine.available == 2
