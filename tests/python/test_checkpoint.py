"""deepnvme.save / load / FastFileWriter: a real model's state_dict (and its optimizer's) round
trip read by plain torch.load, streams crossing buffer boundaries, the file-object contract,
ENOSPC and bad paths, and the data-parallel save with two gloo processes on loopback."""

import errno
import os
import pickle
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ranks  # noqa: E402  (tests/python/ranks.py)

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


def test_load_of_a_missing_path_leaves_nothing_for_the_collector(scratch):
    # The reader of a path that cannot be opened is still collected; its close() must not fail
    # there (Python prints "Exception ignored ..." for an error in a finalizer, and 3.13 did).
    code = ("import gc, deepnvme\n"
            "try:\n"
            "    deepnvme.load(%r)\n"
            "except FileNotFoundError:\n"
            "    pass\n"
            "else:\n"
            "    raise SystemExit('loaded a missing file')\n"
            "gc.collect()\n" % os.path.join(scratch, "missing.pt"))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "Exception ignored" not in p.stderr, p.stderr


def run_ranks(scratch, path, mode, world=2):
    return ranks.run_ranks(scratch, "dp_save_worker.py", [path, mode], mode, world)


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


# --- the zip fast path (deepnvme.torchzip) --------------------------------------------------------
def zip_layout(path, check_crc=True):
    """[(name, data offset, size)] of every record, from the local headers."""
    import struct
    import zipfile
    out = []
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        if check_crc:
            assert z.testzip() is None, "every CRC-32 matches"
        for info in z.infolist():
            f.seek(info.header_offset)
            head = f.read(30)
            name_len, extra_len = struct.unpack("<HH", head[26:30])
            out.append((info.filename, info.header_offset + 30 + name_len + extra_len,
                        info.file_size))
    return out


def odd_state(torch):
    """Every shape of storage torch.save meets: dtypes, views sharing a storage, a slice at an
    offset, a non-contiguous view, empty and zero-dim tensors, a big tensor, plain objects."""
    base = torch.arange(3 << 20, dtype=torch.float32)
    return {"big": base, "view": base[5:1000], "strided": base[::3][:50],
            "t": torch.randn(33, 17).t(), "empty": torch.empty(0, 5), "scalar": torch.tensor(2.5),
            "bool": torch.rand(1000) > 0.5, "i8": torch.randint(-128, 127, (4097,), dtype=torch.int8),
            "f16": torch.randn(3, 3).half(), "c64": torch.randn(5, dtype=torch.complex64),
            "nested": [{"x": torch.ones(2)}, (1, "two", None)], "step": 7}


def test_save_writes_a_standard_zip_with_aligned_records(deepnvme, torch, scratch):
    path = os.path.join(scratch, "fast.pt")
    state = odd_state(torch)
    handle = deepnvme.aio_handle()
    size = deepnvme.save(state, path, handle)
    assert size == os.path.getsize(path)
    layout = zip_layout(path)
    names = [n for n, _, _ in layout]
    assert names[0] == "archive/data.pkl" and names[-1] == "archive/version"
    big = state["big"].storage().data_ptr()
    for name, at, n in layout:
        assert at % 64 == 0, name  # torch's own alignment
        if n >= 1 << 20:
            # The record agrees with the storage's memory modulo the page: every whole page
            # goes O_DIRECT from the tensor itself.
            assert at % 4096 == big % 4096, "%s at %d, memory at %#x" % (name, at, big)
    stats = handle.stats()
    assert stats["bytes_bounce"] == 0, stats
    assert stats["bytes_direct"] >= state["big"].numel() * 4 - 4096, stats
    assert_same_state(torch, state, torch.load(path), "torch.load")
    assert_same_state(torch, state, deepnvme.load(path), "deepnvme.load")
    loaded = deepnvme.load(path)
    assert loaded["view"].storage().data_ptr() == loaded["big"].storage().data_ptr(), \
        "views still share their storage"
    # torch's own files (64-byte aligned records) load the same way.
    # Memory off a 64-byte boundary gets a page-aligned record (through the bounce buffers),
    # so records stay 64-byte aligned for readers that map them.
    raw = bytearray(os.urandom((2 << 20) + 64))
    odd = torch.frombuffer(raw, dtype=torch.uint8, offset=3, count=2 << 20)
    assert odd.storage().data_ptr() % 64 != 0
    odd_path = os.path.join(scratch, "odd.pt")
    deepnvme.save({"odd": odd}, odd_path)
    rec = [(n, at) for n, at, k in zip_layout(odd_path) if k >= 1 << 20]
    assert len(rec) == 1 and rec[0][1] % 4096 == 0, rec
    assert torch.equal(deepnvme.load(odd_path)["odd"], odd)
    # Each storage is read into memory that agrees with its record modulo the page: no
    # bounce copy for our files nor for torch's own (64-byte aligned records).
    native = os.path.join(scratch, "native.pt")
    torch.save(state, native)
    for f in (path, native):
        reader = deepnvme.aio_handle(intra_op_parallelism=2)
        assert_same_state(torch, state, deepnvme.load(f, handle=reader), "deepnvme.load " + f)
        stats = reader.stats()
        assert stats["bytes_bounce"] == 0 and stats["bytes_direct"] > 0, (f, stats)
    # torch.load's arguments pass through.
    assert_same_state(torch, state, deepnvme.load(path, map_location="cpu"), "map_location")
    assert torch.equal(deepnvme.load(path, weights_only=True)["big"], state["big"])


def test_mount_zip_writer_coalesces_into_large_writes(deepnvme, torch, scratch, monkeypatch):
    """MountZipWriter (what torch.save becomes under `dnvme run`, deepnvme/run_hook.py) writes
    the same archive with plain pwritev calls: every small piece (headers, descriptors, small
    records, the tail) rides in front of the next large record or in one last write, so a
    preloaded process makes no small write between two large ones."""
    from deepnvme import torchzip
    calls = []
    real_pwrite, real_pwritev = os.pwrite, os.pwritev

    def pwrite(fd, data, off):
        calls.append(("pwrite", off, len(memoryview(data))))
        return real_pwrite(fd, data, off)

    def pwritev(fd, parts, off):
        calls.append(("pwritev", off, sum(len(memoryview(p)) for p in parts)))
        # A short write now and then: the writer must continue it.
        if len(calls) % 2 and sum(len(memoryview(p)) for p in parts) > 5000:
            first = memoryview(parts[0])
            return real_pwritev(fd, [first[:len(first) // 2 + 1]], off)
        return real_pwritev(fd, parts, off)

    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(os, "pwritev", pwritev)
    path = os.path.join(scratch, "mount.pt")
    state = odd_state(torch)
    state["many"] = [torch.full((100,), float(i)) for i in range(300)]  # 300 small records
    state["big2"] = torch.randn(1 << 20)
    writer = torchzip.MountZipWriter(path)
    torchzip.save(state, writer, pickle, 2)
    size = writer.close()
    monkeypatch.undo()
    assert size == os.path.getsize(path)
    zip_layout(path)  # Python's zipfile reads it and checks every CRC
    assert_same_state(torch, state, torch.load(path), "torch.load")
    # In file order, with no gap or overlap; small calls only at the very end.
    pos = 0
    for i, (kind, off, n) in enumerate(calls):
        assert off <= pos, (i, calls[i - 1:i + 1])
        pos = max(pos, off + n)
    assert pos == size
    large = [c for c in calls if c[2] >= 1 << 20]
    assert len(large) >= 2, calls
    last_large = calls.index(large[-1])
    assert all(n >= 1 << 20 or i > last_large for i, (_, _, n) in enumerate(calls)), calls
    # Held pieces over HOLD_LIMIT go out on their own, in file order too.
    monkeypatch.setattr(torchzip.MountZipWriter, "HOLD_LIMIT", 4096)
    small_path = os.path.join(scratch, "small.pt")
    writer = torchzip.MountZipWriter(small_path)
    torchzip.save({"many": state["many"]}, writer, pickle, 2)
    writer.close()
    assert_same_state(torch, {"many": state["many"]}, torch.load(small_path), "small records")


def test_zip64_structures(deepnvme, torch, scratch, monkeypatch):
    """Checkpoints over 4 GiB need zip64 sizes, offsets and end records; the limit is lowered so
    a few MiB take every zip64 branch, and both zip readers must still accept the file."""
    from deepnvme import torchzip
    monkeypatch.setattr(torchzip, "ZIP64_LIMIT", 1 << 20)
    path = os.path.join(scratch, "zip64.pt")
    state = {"a": torch.randn(1 << 19), "b": torch.arange(3 << 18, dtype=torch.int64),
             "small": torch.ones(3)}
    deepnvme.save(state, path)
    with open(path, "rb") as f:
        data = f.read()
    assert b"PK\x06\x06" in data and b"PK\x06\x07" in data, "zip64 end records"
    zip_layout(path)  # Python's zipfile reads it and checks every CRC
    assert_same_state(torch, state, torch.load(path), "torch.load zip64")
    assert_same_state(torch, state, deepnvme.load(path), "deepnvme.load zip64")


def test_crc32_is_zlibs(deepnvme, torch):
    """The records' CRC comes from _C.crc32 (carry-less multiplication): zlib's value for every
    length and start the folding treats differently, continued from a previous value, over a
    tensor's memory, and a clear error for memory that is not one contiguous block."""
    import random
    import zlib
    from deepnvme import _C
    rng = random.Random(5)
    data = bytes(rng.getrandbits(8) for _ in range(5000))
    for start in range(0, 17):
        for n in list(range(0, 300)) + [1023, 1024, 4095, 4096 + 7, 4983 - start]:
            piece = memoryview(data)[start:start + n]
            assert _C.crc32(piece) == zlib.crc32(piece), (start, n)
    assert _C.crc32(data[100:], _C.crc32(data[:100])) == zlib.crc32(data)
    assert _C.crc32(data, 0xFFFFFFFF) == zlib.crc32(data, 0xFFFFFFFF)
    t = torch.randn(3 << 20)
    assert _C.crc32(t.numpy()) == zlib.crc32(t.numpy())
    with pytest.raises((BufferError, ValueError, TypeError)):
        _C.crc32(t.numpy()[::2])
    assert _C.crc32_implementation() in ("pclmul", "table")


def test_load_checks_crc_and_refuses_damage(deepnvme, torch, scratch):
    path = os.path.join(scratch, "damaged.pt")
    state = {"w": torch.randn(1 << 20)}
    deepnvme.save(state, path)
    name, at, n = [r for r in zip_layout(path) if r[0].endswith("data/0")][0]
    with open(path, "r+b") as f:
        f.seek(at + n // 2)
        byte = f.read(1)
        f.seek(at + n // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(OSError) as e:
        deepnvme.load(path)
    assert e.value.errno == errno.EIO and "CRC" in str(e.value)
    loaded = deepnvme.load(path, verify=False)
    assert not torch.equal(loaded["w"], state["w"])
    assert not torch.equal(torch.load(path)["w"], state["w"]), "torch's reader does not check"


def _damage(path, record, torch_layout):
    name, at, n = [r for r in torch_layout if r[0].endswith(record)][0]
    with open(path, "r+b") as f:
        f.seek(at + n // 2)
        byte = f.read(1)
        f.seek(at + n // 2)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_load_reads_records_ahead_in_any_order_and_keeps_each_error_for_its_record(
        deepnvme, torch, scratch, monkeypatch):
    """deepnvme.load's reader reads the large records ahead on a thread of its own, in the order
    torch asks for them (storage keys 0, 1, 2, ...; the file holds them as strings sort, 0, 1,
    10, 11, 2, ...), at most READ_AHEAD bytes beyond what was taken: a load takes its storages
    from it; asked for in any other order, or twice, they are still exact; a damaged record fails
    only when asked for, and close() stops a thread that waits for room."""
    import threading
    from deepnvme import checkpoint, torchzip
    path = os.path.join(scratch, "ahead.pt")
    state = {"t%02d" % i: torch.randn((1 << 20) // 4 * (1 + i % 3)) for i in range(12)}
    deepnvme.save(state, path)
    handle = checkpoint._native(checkpoint.default_read_handle())
    layout = zip_layout(path)
    names = sorted((n.split("/", 1)[1] for n, _, _ in layout if "/data/" in n),
                   key=lambda n: int(n.rsplit("/", 1)[1]))
    assert [n for n, _, _ in layout if "/data/" in n][2].endswith("data/10"), "file order"
    # A whole load, with a window of a few records: the storages come from the read-ahead (but
    # the first, which torch asked for before the thread began); in file order the thread would
    # fill its window with data/10 and data/11 and serve only a few.
    monkeypatch.setattr(torchzip.TorchZipReader, "READ_AHEAD", 8 << 20)
    seen = []
    close = torchzip.TorchZipReader.close
    monkeypatch.setattr(torchzip.TorchZipReader, "close",
                        lambda self: seen.append(self.read_ahead_records) or close(self))
    assert_same_state(torch, deepnvme.load(path), state)
    assert seen and seen[0] >= len(names) - 3, (seen, len(names))
    monkeypatch.setattr(torchzip.TorchZipReader, "close", close)
    monkeypatch.setattr(torchzip.TorchZipReader, "READ_AHEAD", 512 << 20)
    expect = {}
    with torchzip.TorchZipReader(path, handle) as plain:
        plain._thread = False  # no read-ahead: each record read by the asking thread
        for name in names:
            expect[name] = plain.get_storage_from_record(name, 0, None).clone()
        assert plain.read_ahead_records == 0
    # Deterministic: the thread has read everything before the first ask.
    with torchzip.TorchZipReader(path, handle) as r:
        r._start_read_ahead()
        r._thread.join()
        for name in names:
            assert torch.equal(r.get_storage_from_record(name, 0, None), expect[name]), name
        assert r.read_ahead_records == len(names)
        for name in names[:2]:  # asked for again: read again, exact
            assert torch.equal(r.get_storage_from_record(name, 0, None), expect[name]), name
    for order in (names[::-1], names[1::2] + names[0::2]):
        with torchzip.TorchZipReader(path, handle) as r:
            r.READ_AHEAD = 3 << 20  # a window of about two records
            for name in order:
                assert torch.equal(r.get_storage_from_record(name, 0, None), expect[name]), name
            assert torch.equal(r.get_storage_from_record(order[0], 0, None), expect[order[0]])
    # close() with the thread waiting for room in its window stops it.
    with torchzip.TorchZipReader(path, handle) as r:
        r.READ_AHEAD = 1
        r.get_storage_from_record(names[0], 0, None)
        assert r._thread.is_alive()
    assert not [t for t in threading.enumerate() if t.name == "deepnvme-load-ahead"]
    # A damaged record read ahead fails when it is asked for, not before, and not the others.
    _damage(path, names[3], layout)
    with torchzip.TorchZipReader(path, handle) as r:
        r._start_read_ahead()
        r._thread.join()
        for name in names[:3]:
            assert torch.equal(r.get_storage_from_record(name, 0, None), expect[name])
        with pytest.raises(OSError) as e:
            r.get_storage_from_record(names[3], 0, None)
        assert e.value.errno == errno.EIO and "CRC" in str(e.value)
        for name in names[4:]:
            assert torch.equal(r.get_storage_from_record(name, 0, None), expect[name])
    with torchzip.TorchZipReader(path, handle) as r:  # never asked for: no error
        for name in names[:3] + names[4:]:
            assert torch.equal(r.get_storage_from_record(name, 0, None), expect[name])

def test_load_arguments_it_cannot_honour_go_to_torch_load(deepnvme, torch, scratch, monkeypatch):
    """A torch.load argument the fast path does not know (torch 2's mmap=, or any other) is
    passed to torch.load itself: torch's answer, not a TypeError from deepnvme's loader."""
    path = os.path.join(scratch, "args.pt")
    deepnvme.save({"w": torch.ones(3)}, path)
    with pytest.raises(TypeError, match="no_such_argument"):
        deepnvme.load(path, no_such_argument=True)
    from deepnvme import torchzip
    calls = []
    monkeypatch.setattr(torchzip.TorchZipReader, "get_storage_from_record",
                        lambda self, *a: calls.append(a) or torch.ones(12, dtype=torch.uint8))
    deepnvme.load(path, encoding="utf-8")
    assert calls, "pickle arguments keep the fast path"


def test_load_with_mmap_is_torch_load_of_the_path(deepnvme, torch, scratch):
    # torch >= 2.1 maps a path it opens itself (a file object gets "f must be a file path in order
    # to use the mmap argument"); an older torch refuses mmap= the same way for both.
    path = os.path.join(scratch, "mmap.pt")
    state = {"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(7)}
    deepnvme.save(state, path)
    torch_path = os.path.join(scratch, "mmap-torch.pt")
    torch.save(state, torch_path)
    for p in (path, torch_path):
        try:
            want = torch.load(p, mmap=True)
        except Exception as e:  # this torch has no mmap=: deepnvme must answer as torch does
            with pytest.raises(type(e)):
                deepnvme.load(p, mmap=True)
            continue
        got = deepnvme.load(p, mmap=True)
        assert set(got) == set(want)
        for k in want:
            assert torch.equal(got[k], want[k]), k


def test_save_and_load_from_threads_sharing_the_default_handles(deepnvme, torch, scratch):
    """Two threads saving and loading at once through the default handles: each gets its own
    data and its own errors (the engine's FileRef transfers, not the handle's shared wait())."""
    import threading
    errors, results = [], {}

    def work(i):
        try:
            state = {"w": torch.full((1 << 20,), float(i))}
            p = os.path.join(scratch, "t%d.pt" % i)
            for _ in range(3):
                deepnvme.save(state, p)
                results[i] = deepnvme.load(p)["w"]
                assert torch.equal(results[i], state["w"])
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sorted(results) == [0, 1, 2]


def test_failed_save_leaves_no_file(deepnvme, torch, scratch, small_tmpfs):
    path = os.path.join(scratch, "bad.pt")
    with pytest.raises((AttributeError, TypeError, pickle.PicklingError), match="lambda|pickle"):
        deepnvme.save({"w": torch.ones(4), "f": lambda: 0}, path)  # a lambda cannot be pickled
    assert not os.path.exists(path)
    full = os.path.join(small_tmpfs, "full.pt")
    with pytest.raises(OSError) as e:
        deepnvme.save({"w": torch.ones(4 << 20, dtype=torch.uint8)}, full)
    assert e.value.errno == errno.ENOSPC and not os.path.exists(full)


def test_public_api_fallback(deepnvme, torch, scratch, monkeypatch):
    """A torch whose private serializer deepnvme does not know: save streams torch.save through
    a FastFileWriter and load reads through torch.load, with the same results."""
    from deepnvme import torchzip
    monkeypatch.setattr(torchzip, "supported", lambda: "pretend torch changed")
    path = os.path.join(scratch, "fallback.pt")
    state = odd_state(torch)
    deepnvme.save(state, path)
    assert_same_state(torch, state, deepnvme.load(path), "fallback")
    assert_same_state(torch, state, torch.load(path), "torch.load of the fallback")


def test_weights_only_refusal_keeps_torchs_explanation(deepnvme, torch, scratch):
    """A global that weights_only refuses: deepnvme.load raises what torch.load raises, with
    torch's explanation (how to allow the global or load with weights_only=False), not the bare
    unpickler message."""
    import fractions
    path = os.path.join(scratch, "unsafe.pt")
    torch.save({"ratio": fractions.Fraction(1, 3), "t": torch.arange(10)}, path)
    with pytest.raises(pickle.UnpicklingError) as theirs:
        torch.load(path, weights_only=True)
    with pytest.raises(pickle.UnpicklingError) as ours:
        deepnvme.load(path, weights_only=True)
    assert str(ours.value) == str(theirs.value)
    assert "weights_only" in str(ours.value) and "Fraction" in str(ours.value), str(ours.value)
    # Allowed, the same file loads through the fast path.
    assert deepnvme.load(path, weights_only=False)["ratio"] == fractions.Fraction(1, 3)


def skip_data_or_skip(torch):
    if not hasattr(torch.serialization, "skip_data"):
        pytest.skip("torch %s has no torch.serialization.skip_data (torch >= 2.5)" %
                    torch.__version__)
    return torch.serialization.skip_data


def test_skip_data_saves_the_layout_without_the_bytes(deepnvme, torch, scratch):
    """torch >= 2.5's skip_data: deepnvme.save (TorchZipWriter) and MountZipWriter (torch.save
    under `dnvme run`) write every record's header and size but none of its bytes, as torch.save
    does; the bytes written later at each record's offset make the full checkpoint."""
    from deepnvme import torchzip
    skip_data = skip_data_or_skip(torch)
    # Insertion order: "small" is storage 0, "large" (above SMALL_RECORD) storage 1.
    state = {"small": torch.arange(1000, dtype=torch.float32),
             "large": torch.randn(3 << 18), "step": 3}
    theirs, ours, mount = (os.path.join(scratch, n) for n in ("t.pt", "d.pt", "m.pt"))
    with skip_data():
        torch.save(state, theirs)
        deepnvme.save(state, ours)
        writer = torchzip.MountZipWriter(mount)
        torchzip.save(state, writer, pickle, 2)
        writer.close()

    def records(path):
        return {n.split("/", 1)[1]: (at, size)
                for n, at, size in zip_layout(path, check_crc=False)}

    want = {name: size for name, (_, size) in records(theirs).items() if name.startswith("data/")}
    assert want == {"data/0": 4000, "data/1": (3 << 18) * 4}, want
    for path in (ours, mount):
        got = records(path)
        assert {n: size for n, (_, size) in got.items() if n.startswith("data/")} == want, path
        blocks = os.stat(path).st_blocks * 512
        assert blocks < os.path.getsize(path) - (1 << 20), \
            "%s: the large record is a hole (%d bytes allocated of %d)" % (
                path, blocks, os.path.getsize(path))
        empty = torch.load(path)
        assert empty["step"] == 3 and empty["large"].shape == state["large"].shape
        assert not empty["large"].any() and not empty["small"].any(), path
        # The second pass: each storage's bytes at its record's offset.
        with open(path, "r+b") as f:
            for name, key in (("data/0", "small"), ("data/1", "large")):
                f.seek(got[name][0])
                f.write(state[key].numpy().tobytes())
        assert_same_state(torch, state, torch.load(path), "torch.load of filled " + path)
        # deepnvme.load too: a CRC of 0 (what skip_data leaves) is not checked.
        assert_same_state(torch, state, deepnvme.load(path), "deepnvme.load of filled " + path)


def test_zip_writer_methods_torch_calls_are_checked(deepnvme, torch, scratch, monkeypatch):
    """Every method of torch's own zip writer that its _save names must be TorchZipWriter's too;
    without one (as write_record_metadata was before torch 2.5 came) the fast path is not used and
    deepnvme.save falls back to torch's public API instead of failing half-way."""
    from deepnvme import torchzip
    assert torchzip.supported() is None
    monkeypatch.delattr(torchzip.TorchZipWriter, "write_record")
    reason = torchzip.supported()
    assert reason is not None and "write_record" in reason, reason
    path = os.path.join(scratch, "fallback.pt")
    state = odd_state(torch)
    deepnvme.save(state, path)
    assert_same_state(torch, state, torch.load(path), "torch.load of the fallback")


def test_async_save_snapshots_the_state_and_writes_a_blocking_saves_file(deepnvme, torch, scratch):
    """save(blocking=False) returns once the state is serialized and its bytes copied to staging
    memory: the caller changes its tensors at once, and the file is byte for byte the one a
    blocking save of the state at the call writes (same tensors, same layout)."""
    state = odd_state(torch)
    blocking, later = os.path.join(scratch, "blocking.pt"), os.path.join(scratch, "async.pt")
    deepnvme.save(state, blocking)
    expected = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
    saving = deepnvme.save(state, later, blocking=False)
    assert isinstance(saving, deepnvme.AsyncSave) and saving.path == later
    state["big"].add_(1.0)  # storage shared with "view" and "strided"
    state["t"].zero_()
    size = saving.wait()
    assert saving.done() and size == os.path.getsize(later)
    with open(blocking, "rb") as a, open(later, "rb") as b:
        assert a.read() == b.read(), "the asynchronous save's file is the blocking save's"
    assert_same_state(torch, expected, deepnvme.load(later), "async save")
    # The staging memory is kept: the next save of the same state allocates none.
    kept = deepnvme.staging.kept_staging_bytes()
    assert kept >= state["big"].numel() * 4, kept
    pinned = deepnvme.pinned_bytes_in_use()
    deepnvme.save(state, later, blocking=False).wait()
    assert deepnvme.pinned_bytes_in_use() == pinned
    assert deepnvme.staging.kept_staging_bytes() == kept
    assert_same_state(torch, state, torch.load(later), "second async save")
    # Saves run in call order: the last one's state is the file's.
    first = deepnvme.save({"n": torch.zeros(3 << 20)}, later, blocking=False)
    second = deepnvme.save({"n": torch.ones(5)}, later, blocking=False)
    first.wait()
    second.wait()
    assert torch.equal(torch.load(later)["n"], torch.ones(5))
    assert deepnvme.release_staging_memory() >= kept
    assert deepnvme.staging.kept_staging_bytes() == 0
    with pytest.raises(ValueError, match="data_parallel"):
        deepnvme.save(state, later, blocking=False, data_parallel=True)


def test_async_save_errors_reach_wait(deepnvme, torch, scratch, small_tmpfs):
    state = {"w": torch.ones(4 << 20, dtype=torch.uint8)}
    full = os.path.join(small_tmpfs, "full.pt")
    saving = deepnvme.save(state, full, blocking=False)
    with pytest.raises(OSError) as e:
        saving.wait()
    assert e.value.errno == errno.ENOSPC and saving.done()
    assert not os.path.exists(full), "a failed save leaves no partial archive"
    with pytest.raises(FileNotFoundError):
        deepnvme.save(state, os.path.join(scratch, "no", "dir", "x.pt"), blocking=False).wait()
    with pytest.raises(OSError):  # again: wait() keeps answering
        saving.wait()


def run_python(code):
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stderr


def test_async_save_errors_nobody_waited_for_are_logged(scratch):
    """An asynchronous save's error is never lost: logged when its handle is dropped (once the
    save is over) and at exit for handles still held; the program's exit waits for running
    saves, so a save that returned is complete in the file."""
    missing = os.path.join(scratch, "no", "dir")
    common = ("import gc, torch, deepnvme\n"
              "state = {'w': torch.arange(16 << 20, dtype=torch.int32)}\n")
    stderr = run_python(common + "h = deepnvme.save(state, %r, blocking=False)\n"
                        "del h\ngc.collect()\n" % os.path.join(missing, "dropped.pt"))
    assert "failed and nobody called wait()" in stderr and "dropped.pt" in stderr, stderr
    assert stderr.count("nobody called wait()") == 1, stderr
    stderr = run_python(common + "h = deepnvme.save(state, %r, blocking=False)\n" %
                        os.path.join(missing, "held.pt"))
    assert "failed and nobody called wait()" in stderr and "held.pt" in stderr, stderr
    # Taken by wait(): nothing logged.
    stderr = run_python(common + "h = deepnvme.save(state, %r, blocking=False)\n"
                        "try:\n    h.wait()\nexcept FileNotFoundError:\n    pass\n" %
                        os.path.join(missing, "taken.pt"))
    assert "nobody called wait()" not in stderr, stderr
    # Exit right after the call: the save completes first.
    done = os.path.join(scratch, "at-exit.pt")
    run_python(common + "deepnvme.save(state, %r, blocking=False)\n" % done)
    import torch
    assert torch.equal(torch.load(done)["w"], torch.arange(16 << 20, dtype=torch.int32))


def test_staging_memory_is_reused_only_when_nothing_uses_it(deepnvme, torch):
    """A staged tensor (dcp.async_save's snapshot) keeps its staging memory in use for as long as
    it or any view of it lives; then the next snapshot reuses it."""
    from deepnvme import staging
    staging.release_staging_memory()
    src = torch.arange(1 << 20, dtype=torch.float32)
    staged = staging.Staged().copy_tensor(src)
    assert torch.equal(staged, src)
    assert staging.kept_staging_bytes() == 0, "in use while the staged tensor lives"
    view = staged[10:20]
    address = staged.data_ptr()
    del staged
    assert staging.kept_staging_bytes() == 0, "and while a view of it lives"
    assert view[0].item() == 10.0
    del view
    assert staging.kept_staging_bytes() >= src.numel() * 4
    again = staging.Staged().copy_tensor(src + 1)
    assert again.data_ptr() == address, "the next snapshot reuses it"
    assert staging.kept_staging_bytes() == 0
    del again
    if os.geteuid() == 0:  # root: the staging memory is page-locked
        assert deepnvme.pinned_bytes_in_use() >= src.numel() * 4
    assert staging.release_staging_memory() >= src.numel() * 4
    assert staging.kept_staging_bytes() == 0


def test_async_save_after_fork_and_during_exit(scratch):
    """A forked child's saves run (the parent's save thread and default handle are not the
    child's: the child makes its own), a handle the parent made fails there with ECHILD instead
    of hanging, and a save called while the interpreter exits (an atexit handler) is written
    before exit."""
    child = os.path.join(scratch, "child.pt")
    at_exit = os.path.join(scratch, "atexit.pt")
    run_python(
        "import atexit, errno, os, torch, deepnvme\n"
        "state = {'w': torch.arange(1 << 20)}\n"
        "deepnvme.save(state, %r, blocking=False).wait()  # the parent's save thread exists\n"
        "deepnvme.save(state, %r)  # and its default handle\n"
        "parent_handle = deepnvme.aio_handle()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    import signal; signal.alarm(60)  # a hang fails the test instead of stalling it\n"
        "    # torch's own parallel ops hang in a forked child once the parent has used its OpenMP\n"
        "    # pool (torch 2.6); one thread, as torch's DataLoader workers run.\n"
        "    torch.set_num_threads(1)\n"
        "    deepnvme.save(state, %r, blocking=False).wait(timeout=60)\n"
        "    deepnvme.save(state, %r + '.blocking')  # the default handle is the child's own\n"
        "    try:\n"
        "        parent_handle.sync_pwrite(torch.ones(4096), %r + '.x')\n"
        "    except OSError as e:\n"
        "        assert e.errno == errno.ECHILD and 'forked child' in str(e), e\n"
        "    else:\n"
        "        os._exit(4)\n"
        "    os._exit(0)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "assert os.waitstatus_to_exitcode(status) == 0, status\n"
        "atexit.register(lambda: deepnvme.save(state, %r, blocking=False))\n" %
        (os.path.join(scratch, "parent.pt"), os.path.join(scratch, "parent2.pt"), child, child,
         child, at_exit))
    import torch
    assert not os.path.exists(child + ".x")
    for path in (child, child + ".blocking", at_exit):
        assert torch.equal(torch.load(path)["w"], torch.arange(1 << 20)), path
