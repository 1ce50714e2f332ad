"""deepnvme as a drop-in for DeepSpeed 0.19's async_io, pin_memory and deepspeed.io.

The ops are loaded the way DeepSpeed's code loads them, ``AsyncIOBuilder().load()``, through a
stand-in package with DeepSpeed's module layout (tests/python/standin_deepspeed; DeepSpeed itself
cannot be installed here) after ``deepnvme.deepspeed.activate()``. The shapes are those of
DeepSpeed's own tests (tests/unit/ops/aio/test_aio.py): 1 KiB blocks, 4 KiB I/Os, queue depth 2,
intra_op_parallelism 2, every single_submit x overlap_events combination, locked and ordinary
buffers, file offsets, fd writes, slices of locked buffers, handles that share locked buffers, and
the GIL released while an operation runs. Then the deepspeed.io writers, aio_read/aio_write/
deepspeed_memcpy, and the calls where deepnvme deliberately differs (an OSError or correct data
where DeepSpeed asserts or leaves a short file).
"""

import ctypes
import errno
import filecmp
import inspect
import os
import struct
import sys
import threading

import pytest

STANDIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "standin_deepspeed")

BLOCK_SIZE = 1024
QUEUE_DEPTH = 2
IO_SIZE = 4096
IO_PARALLEL = 2


@pytest.fixture(scope="module")
def ds(deepnvme, torch):
    """The stand-in deepspeed package, activated; deactivated and unimported afterwards."""
    sys.path.insert(0, STANDIN)
    try:
        import deepspeed  # noqa: F401  (the stand-in)
        import deepspeed.ops
        from deepspeed.ops.op_builder import AsyncIOBuilder
        assert deepspeed.__version__.endswith("+standin")
        with pytest.raises(RuntimeError, match="JIT load"):
            AsyncIOBuilder().load()  # without activation: DeepSpeed's own (failing) build
        import deepnvme.deepspeed as dsmod
        result = dsmod.activate()
        yield result
    finally:
        import deepnvme.deepspeed as dsmod
        dsmod.deactivate()
        sys.path.remove(STANDIN)
        for name in [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")]:
            del sys.modules[name]


@pytest.fixture
def aio(ds):
    from deepspeed.ops.op_builder import AsyncIOBuilder
    return AsyncIOBuilder().load()


def ref_file(tmp, name, num_bytes=IO_SIZE):
    data = os.urandom(num_bytes)
    path = os.path.join(tmp, name)
    with open(path, "wb") as f:
        f.write(data)
    return path, data


def new_buffer(torch, h, kind, num_bytes=IO_SIZE):
    """DeepSpeed's buffer kinds on a machine without CUDA: locked (new_cpu_locked_tensor) or an
    ordinary CPU tensor ('unpinned')."""
    if kind == "locked":
        return h.new_cpu_locked_tensor(num_bytes, torch.empty(0, dtype=torch.uint8))
    return torch.empty(num_bytes, dtype=torch.uint8)


# --- activation -----------------------------------------------------------------------------------
def test_activation_redirects_every_builder(ds, deepnvme, torch):
    from deepspeed.ops import __compatible_ops__
    from deepspeed.ops.aio import AsyncIOBuilder as AioFromOpsAio
    from deepspeed.ops.op_builder import (AsyncIOBuilder, GDSBuilder, PinMemoryBuilder,
                                          UtilsBuilder)
    from deepspeed.ops.op_builder.cpu import AsyncIOBuilder as CpuAsyncIOBuilder
    assert ds["async_io"] == ds["pin_memory"] == ds["utils"] == "deepnvme"
    assert AsyncIOBuilder().load() is deepnvme
    assert AioFromOpsAio().load(verbose=False) is deepnvme
    assert CpuAsyncIOBuilder().load() is deepnvme, "the CPU accelerator's builder too"
    assert AsyncIOBuilder().is_compatible() and __compatible_ops__["async_io"]
    assert __compatible_ops__["pin_memory"] and __compatible_ops__["utils"]
    for name in ("aio_handle", "aio_read", "aio_write", "deepspeed_memcpy"):
        assert callable(getattr(AsyncIOBuilder().load(), name)), name
    assert isinstance(PinMemoryBuilder().load().pin_handle(), deepnvme.pin_handle)
    utils = UtilsBuilder().load()
    a, b = torch.arange(4, dtype=torch.float32), torch.arange(3, dtype=torch.int64)
    views = utils.cast_to_byte_tensor([a, b])
    assert [v.numel() for v in views] == [16, 24] and views[0].data_ptr() == a.data_ptr()
    flat = utils.flatten([a, a + 1])
    assert flat.tolist() == [0, 1, 2, 3, 1, 2, 3, 4]
    assert [t.tolist() for t in utils.unflatten(flat, [a, a])] == [a.tolist(), (a + 1).tolist()]
    if deepnvme.gds_unavailable_reason():
        # No GPU: GDSBuilder stays DeepSpeed's (it inherits from AsyncIOBuilder, whose load is
        # redirected), and the result says why.
        assert ds["gds"] == deepnvme.gds_unavailable_reason()
        with pytest.raises(RuntimeError, match="JIT load"):
            GDSBuilder().load()
        assert not __compatible_ops__["gds"]
    else:
        assert ds["gds"] == "deepnvme" and GDSBuilder().load() is deepnvme


def test_deactivate_restores_deepspeed(ds, deepnvme):
    import deepnvme.deepspeed as dsmod
    from deepspeed.ops import __compatible_ops__
    from deepspeed.ops.op_builder import AsyncIOBuilder
    from deepspeed.runtime.checkpoint_engine import decoupled_checkpoint_engine as decoupled
    dsmod.deactivate()
    try:
        assert not dsmod.active()
        with pytest.raises(RuntimeError, match="JIT load"):
            AsyncIOBuilder().load()
        assert __compatible_ops__["async_io"] is False
        assert inspect.isfunction(decoupled.init_decoupled_checkpoint), "DeepSpeed's own again"
        assert "decoupled_checkpoint" not in __compatible_ops__
    finally:
        dsmod.activate()
    assert AsyncIOBuilder().load() is deepnvme
    assert not inspect.isfunction(decoupled.init_decoupled_checkpoint)


def test_decoupled_checkpoint_process_writes_with_deepnvme(ds, deepnvme, torch, scratch):
    """DeepSpeed's decoupled checkpoint engine saves from a process it spawns (a fresh
    interpreter): activate() reaches into it, so the async_io op it loads there is deepnvme (the
    stand-in's own build would fail), and what it writes is the state queued to it."""
    assert ds["decoupled_checkpoint"] == "deepnvme"
    from deepspeed.runtime.checkpoint_engine.decoupled_checkpoint_engine import \
        DecoupledCheckpointEngine
    state = {"a": torch.arange(1 << 20, dtype=torch.float32),
             "b": torch.ones(3, 5, dtype=torch.float64)}
    path = os.path.join(scratch, "decoupled.bin")
    engine = DecoupledCheckpointEngine()
    try:
        engine.save(state, path)
        assert engine.commit()
    finally:
        engine.cleanup()
    assert engine.process.exitcode == 0
    with open(path + ".op") as f:
        assert f.read() == "deepnvme"
    with open(path, "rb") as f:
        assert f.read() == b"".join(t.numpy().tobytes() for t in state.values())


# --- DeepSpeed's test_aio.py shapes -----------------------------------------------------------
def check_handle_state(h, single_submit, overlap_events):
    assert h.get_single_submit() == single_submit
    assert h.get_overlap_events() == overlap_events
    assert h.get_intra_op_parallelism() == IO_PARALLEL
    assert h.get_block_size() == BLOCK_SIZE
    assert h.get_queue_depth() == QUEUE_DEPTH
    assert h.get_alignment() == IO_PARALLEL * 512  # DeepSpeed's value


MODES = [(s, o) for s in (True, False) for o in (True, False)]


@pytest.mark.parametrize("kind", ["locked", "unpinned"])
@pytest.mark.parametrize("single_submit,overlap_events", MODES)
def test_parallel_and_async_read(aio, torch, scratch, single_submit, overlap_events, kind):
    h = aio.aio_handle(BLOCK_SIZE, QUEUE_DEPTH, single_submit, overlap_events, IO_PARALLEL)
    check_handle_state(h, single_submit, overlap_events)
    path, data = ref_file(scratch, "_py_random_0.pt")
    buf = new_buffer(torch, h, kind)
    assert h.sync_pread(buf, path, 0) == 1
    assert bytes(buf.tolist()) == data
    buf.zero_()
    assert h.async_pread(buf, path, 0) == 0
    assert h.wait() == 1
    assert bytes(buf.tolist()) == data
    # DeepSpeed's test frees every buffer it is given; for an ordinary tensor that is False.
    assert h.free_cpu_locked_tensor(buf) == (kind == "locked")


@pytest.mark.parametrize("kind", ["locked", "unpinned"])
@pytest.mark.parametrize("single_submit,overlap_events", MODES)
def test_parallel_and_async_write(aio, torch, scratch, single_submit, overlap_events, kind):
    h = aio.aio_handle(BLOCK_SIZE, QUEUE_DEPTH, single_submit, overlap_events, IO_PARALLEL)
    ref, data = ref_file(scratch, "_py_random_0.pt")
    buf = new_buffer(torch, h, kind)
    buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    out = os.path.join(scratch, "_aio_write_random_0.pt")
    assert h.sync_pwrite(buf, out, 0) == 1
    assert filecmp.cmp(ref, out, shallow=False)
    os.unlink(out)
    assert h.async_pwrite(buf, out, 0) == 0
    assert h.wait() == 1
    assert filecmp.cmp(ref, out, shallow=False)
    h.free_cpu_locked_tensor(buf)


@pytest.mark.parametrize("kind", ["locked", "unpinned"])
@pytest.mark.parametrize("async_queue", [2, 3])
def test_async_queue(aio, torch, scratch, async_queue, kind):
    h = aio.aio_handle(BLOCK_SIZE, QUEUE_DEPTH, True, True, IO_PARALLEL)
    refs = [ref_file(scratch, "_py_random_%d.pt" % i) for i in range(async_queue)]
    bufs = [new_buffer(torch, h, kind) for _ in refs]
    for buf, (path, _) in zip(bufs, refs):
        assert h.async_pread(buf, path, 0) == 0
    assert h.wait() == async_queue
    for buf, (_, data) in zip(bufs, refs):
        assert bytes(buf.tolist()) == data
    outs = [os.path.join(scratch, "_aio_write_random_%d.pt" % i) for i in range(async_queue)]
    for buf, out in zip(bufs, outs):
        assert h.async_pwrite(buf, out, 0) == 0
    assert h.wait() == async_queue
    for (path, _), out in zip(refs, outs):
        assert filecmp.cmp(path, out, shallow=False)
    for buf in bufs:
        h.free_cpu_locked_tensor(buf)


PARTITIONS = [[1, 1, 1], [1, 1, 2], [1, 2, 1], [2, 1, 1]]


@pytest.mark.parametrize("use_fd", [False, True])
@pytest.mark.parametrize("kind", ["locked", "unpinned"])
@pytest.mark.parametrize("file_partitions", PARTITIONS)
def test_offset_write(aio, torch, scratch, file_partitions, kind, use_fd):
    h = aio.aio_handle(BLOCK_SIZE, QUEUE_DEPTH, True, True, IO_PARALLEL)
    sizes = [p * 1024 for p in file_partitions]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    data = h.new_cpu_locked_tensor(sum(sizes), torch.empty(0, dtype=torch.uint8)) \
        if kind == "locked" else torch.empty(sum(sizes), dtype=torch.uint8)
    data.copy_(torch.frombuffer(bytearray(os.urandom(sum(sizes))), dtype=torch.uint8))
    ref = os.path.join(scratch, "ref.bin")
    out = os.path.join(scratch, "aio.bin")
    open(ref, "wb").close()
    for off, n in zip(offsets, sizes):
        src = torch.narrow(data, 0, off, n)
        if kind == "locked":
            assert h.is_pinned(src), "a slice of a locked buffer is pinned"
        with open(ref, "r+b") as f:
            f.seek(off)
            f.write(src.numpy().tobytes())
        if use_fd:
            fd = os.open(out, flags=os.O_DIRECT | os.O_CREAT | os.O_WRONLY)
            assert h.async_pwrite(buffer=src, fd=fd, file_offset=off) == 0
        else:
            assert h.async_pwrite(buffer=src, filename=out, file_offset=off) == 0
        assert h.wait() == 1
        if use_fd:
            os.close(fd)
        assert filecmp.cmp(ref, out, shallow=False), "after the partition at %d" % off
    h.free_cpu_locked_tensor(data)


@pytest.mark.parametrize("kind", ["locked", "unpinned"])
@pytest.mark.parametrize("file_partitions", PARTITIONS)
def test_offset_read(aio, torch, scratch, file_partitions, kind):
    h = aio.aio_handle(BLOCK_SIZE, QUEUE_DEPTH, True, True, IO_PARALLEL)
    sizes = [p * 1024 for p in file_partitions]
    path, data = ref_file(scratch, "ref.bin", sum(sizes))
    buf = new_buffer(torch, h, kind, max(sizes))
    off = 0
    for n in sizes:
        dst = torch.narrow(buf, 0, 0, n)
        assert h.sync_pread(dst, path, off) == 1
        assert bytes(dst.tolist()) == data[off:off + n]
        off += n
    h.free_cpu_locked_tensor(buf)


def test_every_file_api_also_takes_an_fd(aio, torch, scratch):
    """DeepSpeed has async_pwrite(buffer, fd, file_offset); deepnvme takes an fd in every
    pread/pwrite form (positionally in filename's place, or as fd=)."""
    h = aio.aio_handle(BLOCK_SIZE, QUEUE_DEPTH, False, True, IO_PARALLEL)
    path, data = ref_file(scratch, "ref.bin", 3 * IO_SIZE + 100)
    buf = torch.zeros(3 * IO_SIZE + 100, dtype=torch.uint8)
    fd = os.open(path, os.O_RDWR)
    try:
        assert h.sync_pread(buf, fd) == 1
        assert bytes(buf.tolist()) == data
        buf.zero_()
        assert h.async_pread(buf, fd=fd) == 0 and h.wait() == 1
        assert bytes(buf.tolist()) == data
        assert h.pread(buf[:100], fd, False, False, 5) == 1
        assert bytes(buf[:100].tolist()) == data[5:105]
        buf.fill_(7)
        assert h.sync_pwrite(buf, fd=fd, file_offset=10) == 1
        assert h.pwrite(buf[:3], fd, True, True, 1) == 0 and h.wait() == 1
        with pytest.raises(TypeError, match="not both"):
            h.sync_pwrite(buf, path, fd=fd)
        with pytest.raises(ValueError, match="fd"):
            h.sync_pwrite(buf, -1)
    finally:
        os.close(fd)
    with open(path, "rb") as f:
        got = f.read()
    assert got[:1] == data[:1] and got[1:4] == b"\x07" * 3 and got[4:10] == data[4:10]
    assert got[10:] == b"\x07" * len(buf)
    with pytest.raises(OSError) as e:
        h.sync_pwrite(buf, fd)  # closed now
    assert e.value.errno == errno.EBADF


# --- the pinned-tensor manager ------------------------------------------------------------------
def test_locked_buffers_are_shared_across_handles_and_pin_handle(aio, ds, torch):
    from deepspeed.ops.op_builder import PinMemoryBuilder
    a = aio.aio_handle(BLOCK_SIZE, QUEUE_DEPTH, False, False, 1)
    b = aio.aio_handle()
    pin = PinMemoryBuilder().load().pin_handle()
    buf = a.new_cpu_locked_tensor(4096, torch.empty(0, dtype=torch.float))
    assert buf.dtype == torch.float and buf.numel() == 4096 and buf.data_ptr() % 4096 == 0
    assert a.is_pinned(buf) and a.is_pinned(buf.narrow(0, 1024, 1024))
    assert b.is_pinned(buf) and pin.is_pinned(buf) and pin.is_pinned(buf.narrow(0, 16, 16))
    assert b.is_pinned(buf[::2]), "a strided view inside the buffer"
    assert not a.is_pinned(torch.empty(4096, dtype=torch.float))
    assert not pin.is_pinned(torch.empty(4096, dtype=torch.float))
    # A view reaching past the end of the locked memory is not pinned.
    end = buf.data_ptr() + buf.numel() * buf.element_size()
    assert a.is_pinned((ctypes.c_char * 8).from_address(end - 8))
    assert not a.is_pinned((ctypes.c_char * 16).from_address(end - 8))
    assert not a.free_cpu_locked_tensor(buf.narrow(0, 1024, 1024)), "a slice is not freed"
    assert b.free_cpu_locked_tensor(buf) is True, "another handle frees it"
    assert not a.is_pinned(buf) and not pin.is_pinned(buf)
    assert buf.sum().item() == 0, "the memory outlives the registration while viewed"

    other = pin.new_cpu_locked_tensor(4096, torch.empty(0, dtype=torch.float))
    assert pin.is_pinned(other) and a.is_pinned(other) and a.is_pinned(other.narrow(0, 1024, 1024))
    assert pin.free_cpu_locked_tensor_by_ptr(other.data_ptr()) is True
    assert not a.is_pinned(other)
    assert pin.free_cpu_locked_tensor_by_ptr(other.data_ptr()) is False
    third = pin.new_cpu_locked_tensor(10, torch.empty(0, dtype=torch.uint8))
    assert a.free_cpu_locked_tensor(third) is True and not pin.is_pinned(third)
    # DeepSpeed spells the keyword example_tenosr.
    t = a.new_cpu_locked_tensor(num_elem=8, example_tenosr=torch.empty(0, dtype=torch.int32))
    assert t.dtype == torch.int32 and a.is_pinned(t) and a.free_cpu_locked_tensor(t)


def test_swapper_shape(aio, torch, scratch):
    """ZeRO-Infinity's swap buffers: one locked buffer per dtype cut into narrow() slices that the
    pool asserts are pinned, swapped out with async_pwrite(path, 0) and back with async_pread,
    each batch collected by one wait() that must return the batch size."""
    write_h = aio.aio_handle(block_size=BLOCK_SIZE, queue_depth=8, single_submit=False,
                             overlap_events=True, intra_op_parallelism=2)
    read_h = aio.aio_handle(block_size=BLOCK_SIZE, queue_depth=8, single_submit=False,
                            overlap_events=True, intra_op_parallelism=2)
    numel = 3000
    pool = write_h.new_cpu_locked_tensor(4 * numel, torch.zeros(1, dtype=torch.float16)).zero_()
    slices = [pool.narrow(0, i * numel, numel - 8 * i) for i in range(4)]  # odd sizes and offsets
    for i, s in enumerate(slices):
        assert read_h.is_pinned(s)
        s.copy_(torch.randn(s.numel()).half())
    paths = [os.path.join(scratch, "param_%d.tensor.swp" % i) for i in range(len(slices))]
    expect = [s.clone() for s in slices]
    for s, p in zip(slices, paths):
        assert write_h.async_pwrite(s, p, 0) == 0
    assert len(slices) == write_h.wait()
    pool.zero_()
    for s, p in zip(slices, paths):
        assert read_h.async_pread(s, p, 0) == 0
    assert len(slices) == read_h.wait()
    for s, e in zip(slices, expect):
        assert torch.equal(s, e)
    assert write_h.free_cpu_locked_tensor(pool)


# --- the GIL --------------------------------------------------------------------------------------
@pytest.mark.parametrize("operation", ["pread", "pwrite", "sync_pread", "sync_pwrite", "wait"])
def test_blocking_calls_release_the_gil(aio, torch, scratch, operation):
    """With a switch interval of 60 s the interpreter hands the GIL to another thread only when
    the running one releases it: the peer thread makes progress only if the I/O calls do."""
    h = aio.aio_handle(IO_SIZE, QUEUE_DEPTH, True, True, IO_PARALLEL)
    size = 32 << 20
    buf = h.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
    path = os.path.join(scratch, "gil.bin")
    assert h.sync_pwrite(buf, path, 0) == 1
    calls = {
        "pread": lambda: h.pread(buf, path, False, False, 0),
        "pwrite": lambda: h.pwrite(buf, path, False, False, 0),
        "sync_pread": lambda: h.sync_pread(buf, path, 0),
        "sync_pwrite": lambda: h.sync_pwrite(buf, path, 0),
        "wait": lambda: (h.async_pread(buf, path, 0), h.wait())[1],
    }
    ran = []
    started = threading.Event()
    stop = threading.Event()

    def peer():
        started.set()
        while not stop.is_set():
            ran.append(1)
            stop.wait(0.001)

    old = sys.getswitchinterval()
    t = threading.Thread(target=peer)
    t.start()
    started.wait()
    sys.setswitchinterval(60)
    try:
        before = len(ran)
        for _ in range(8):
            assert calls[operation]() == 1
        progressed = len(ran) - before
    finally:
        sys.setswitchinterval(old)
        stop.set()
        t.join()
    h.free_cpu_locked_tensor(buf)
    assert progressed > 0, "%s held the GIL for the whole operation" % operation


# --- module functions ---------------------------------------------------------------------------
def test_aio_read_write_and_memcpy(aio, torch, scratch):
    src = torch.frombuffer(bytearray(os.urandom(IO_SIZE * 3 + 7)), dtype=torch.uint8)
    path = os.path.join(scratch, "whole.bin")
    assert aio.aio_write(src, path, BLOCK_SIZE, QUEUE_DEPTH, False, True, True) == 0
    dst = torch.zeros_like(src)
    assert aio.aio_read(dst, path, BLOCK_SIZE, QUEUE_DEPTH, True, False, False) == 0
    assert torch.equal(src, dst)
    with pytest.raises(ValueError, match="bytes"):  # DeepSpeed asserts on a size mismatch
        aio.aio_read(torch.zeros(10, dtype=torch.uint8), path, BLOCK_SIZE, QUEUE_DEPTH, False,
                     False, False)
    with pytest.raises(FileNotFoundError):  # DeepSpeed returns -1
        aio.aio_read(dst, path + ".missing", BLOCK_SIZE, QUEUE_DEPTH, False, False, False)
    a = torch.randn(1000)
    b = torch.zeros(1000)
    assert aio.deepspeed_memcpy(b, a) == 0 and torch.equal(a, b)
    with pytest.raises(ValueError, match="bytes"):
        aio.deepspeed_memcpy(torch.zeros(10), a)


# --- where deepnvme differs: reported, never asserted or short ----------------------------------
def test_differences_are_errors_or_correct_data(aio, torch, scratch):
    h = aio.aio_handle(BLOCK_SIZE, QUEUE_DEPTH, False, False, IO_PARALLEL)
    # Sizes not divisible by intra_op_parallelism (DeepSpeed: -1) and unaligned offsets
    # (DeepSpeed: O_DIRECT EINVAL, a short or empty file) move the exact bytes.
    odd = torch.frombuffer(bytearray(os.urandom(4097)), dtype=torch.uint8)
    path = os.path.join(scratch, "odd.bin")
    assert h.sync_pwrite(odd, path, 3) == 1
    with open(path, "rb") as f:
        assert f.read() == b"\0" * 3 + bytes(odd.tolist())
    back = torch.zeros(4097, dtype=torch.uint8)
    assert h.sync_pread(back, path, 3) == 1 and torch.equal(back, odd)
    # A read past the end (DeepSpeed: assert, the process dies) is an OSError.
    with pytest.raises(OSError) as e:
        h.sync_pread(torch.zeros(8192, dtype=torch.uint8), path, 0)
    assert e.value.errno == errno.ENODATA and e.value.filename == path
    # wait() with nothing pending (DeepSpeed: assert) is 0.
    assert h.wait() == 0
    # A missing directory (DeepSpeed: -1 and a message on stdout) is FileNotFoundError.
    with pytest.raises(FileNotFoundError):
        h.async_pwrite(odd, os.path.join(scratch, "no", "such.bin"), 0)
    assert h.wait() == 0, "nothing was queued"
    # read/write take DeepSpeed's (buffer, filename, validate, file_offset) and return 0.
    whole = os.path.join(scratch, "whole.bin")
    assert h.write(odd, whole, True, 0) == 0
    back.zero_()
    assert h.read(back, whole, True, 0) == 0 and torch.equal(back, odd)
    with pytest.raises(ValueError, match="4100 bytes"):  # DeepSpeed asserts the sizes match
        h.read(back, path, False, 0)


# --- deepspeed.io writers -----------------------------------------------------------------------
def fd_links():
    d = "/proc/self/fd"
    out = []
    for n in os.listdir(d):
        try:
            out.append(os.readlink(os.path.join(d, n)))
        except OSError:
            pass
    return out


@pytest.mark.parametrize("double_buffer", [True, False])
@pytest.mark.parametrize("pinned", ["locked", "unpinned"])
def test_fast_file_writer_with_torch_save(aio, deepnvme, torch, scratch, double_buffer, pinned):
    from deepnvme.io import FastFileWriter, FastFileWriterConfig
    h = aio.aio_handle(block_size=BLOCK_SIZE, queue_depth=QUEUE_DEPTH, single_submit=False,
                       overlap_events=False, intra_op_parallelism=1)
    staging = new_buffer(torch, h, pinned, 4096)
    state = {"w": torch.randn(3000), "b": torch.arange(77, dtype=torch.int64), "step": 9}
    path = os.path.join(scratch, "ckpt.pt")
    before = [l for l in fd_links() if l.endswith(" (deleted)")]
    for _ in range(3):
        cfg = FastFileWriterConfig(dnvme_handle=h, pinned_tensor=staging,
                                   double_buffer=double_buffer, num_parallel_writers=1,
                                   writer_rank=0)
        w = FastFileWriter(file_path=path, config=cfg)
        torch.save(state, w)
        assert w.fileno() == -1
        w.flush()
        w.close()
        w.close()  # idempotent
        loaded = torch.load(path)
        assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["b"], state["b"])
        stats = w.stats()
        assert stats["bytes"] == os.path.getsize(path) and stats["close"] == 1
        assert stats["fileno"] == 1 and stats["flush"] >= 1 and stats["write"] > 0
        assert stats["path"] == path
        os.unlink(path)
    after = [l for l in fd_links() if l.endswith(" (deleted)")]
    assert after == before, "the writer closed its file"
    # A longer old file is truncated, so the new checkpoint is exactly what was written.
    with open(path, "wb") as f:
        f.write(b"x" * (1 << 20))
    with FastFileWriter(path, FastFileWriterConfig(h, staging, double_buffer)) as w:
        w.write(b"short")
    with open(path, "rb") as f:
        assert f.read() == b"short"
    h.free_cpu_locked_tensor(staging)


@pytest.mark.parametrize("save_size", [True, False])
@pytest.mark.parametrize("writers", [1, 2, 3])
def test_save_storage_object_list_partitions(aio, torch, scratch, save_size, writers):
    from deepnvme.io import FastFileWriter, FastFileWriterConfig, MockFileWriter
    h = aio.aio_handle()
    staging = h.new_cpu_locked_tensor(1 << 16, torch.empty(0, dtype=torch.uint8))
    tensors = [torch.randn(1001), torch.arange(333, dtype=torch.int16), torch.ones(7).double()]
    objs = [(t.storage().untyped(), t.dtype) for t in tensors]
    expect = b""
    for t in tensors:
        if save_size:
            expect += struct.pack("<q", t.numel())
        expect += t.numpy().tobytes()
    parts = []
    for rank in range(writers):
        path = os.path.join(scratch, "part-%d.%d" % (rank, writers))
        cfg = FastFileWriterConfig(h, staging, True, num_parallel_writers=writers,
                                   writer_rank=rank)
        with FastFileWriter(path, cfg) as w:
            n = w.save_torch_storage_object_list(objs, save_size)
        with open(path, "rb") as f:
            parts.append(f.read())
        assert n == len(parts[-1])
    assert b"".join(parts) == expect
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1, "shares differ by at most one byte"
    mock_path = os.path.join(scratch, "mock.bin")
    m = MockFileWriter(mock_path)
    assert m.save_torch_storage_object_list(objs, save_size) == len(expect)
    assert m.write(b"abc") == 3 and m.fileno() == -1
    m.close()
    assert os.path.getsize(mock_path) == 0 and m.stats()["bytes"] == len(expect) + 3
    h.free_cpu_locked_tensor(staging)


def test_py_file_writer_and_bad_configs(aio, torch, scratch):
    from deepnvme.io import FastFileWriter, FastFileWriterConfig, PyFileWriter
    path = os.path.join(scratch, "py.pt")
    w = PyFileWriter(path)
    torch.save({"a": torch.ones(5)}, w)
    w.close()
    assert torch.equal(torch.load(path)["a"], torch.ones(5))
    assert w.stats()["bytes"] == os.path.getsize(path) and w.fileno() == -1
    h = aio.aio_handle()
    staging = torch.empty(4096, dtype=torch.uint8)
    with pytest.raises(TypeError, match="FastFileWriterConfig"):
        FastFileWriter(path, {"dnvme_handle": h})
    with pytest.raises(TypeError, match="aio_handle"):
        FastFileWriter(path, FastFileWriterConfig(object(), staging))
    with pytest.raises(ValueError, match="writer_rank"):
        FastFileWriter(path, FastFileWriterConfig(h, staging, num_parallel_writers=2,
                                                  writer_rank=2))
    with pytest.raises(ValueError, match="too small"):
        FastFileWriter(path, FastFileWriterConfig(h, torch.empty(1, dtype=torch.uint8)))
    with pytest.raises(FileNotFoundError):
        FastFileWriter(os.path.join(scratch, "no", "x.pt"), FastFileWriterConfig(h, staging))


# --- DeepSpeed 0.19.6: DS_PIN_MEMORY_BACKEND=native and the accelerator's pin calls ---------------
@pytest.mark.parametrize("op", ["pin_memory", "async_io"])
def test_native_pin_memory_backend_pins_with_deepnvme(ds, deepnvme, torch, monkeypatch, op):
    """With DS_PIN_MEMORY_BACKEND=native, DeepSpeed's accelerator pins host memory through the op
    it loads (pin_handle, or an aio_handle in 0.19.6's first version): after activate() that is
    deepnvme's registry, so the tensors are page-locked by deepnvme, known to every deepnvme
    handle (slices too), freed at unpin_memory or when collected."""
    import gc
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils import pin_memory as ds_pin
    monkeypatch.setenv("DS_PIN_MEMORY_BACKEND", "native")
    monkeypatch.setattr(ds_pin, "OP", op)
    monkeypatch.setattr(ds_pin, "_manager", None)
    accel, ours = get_accelerator(), deepnvme.pin_handle()
    gc.collect()
    before = deepnvme.pinned_bytes_in_use()

    src = torch.randn(64, 33)
    pinned = accel.pin_memory(src)
    assert pinned.shape == src.shape and torch.equal(pinned, src)
    assert accel.is_pinned(pinned) and ours.is_pinned(pinned)
    assert accel.is_pinned(pinned[5:]) and ours.is_pinned(pinned[5:]), "slices of it too"
    assert deepnvme.pinned_bytes_in_use() >= before + src.numel() * 4
    flat = accel.pin_memory(src, make_copy=False, match_shape=False)
    assert flat.shape == (src.numel(),) and ours.is_pinned(flat) and not flat.any()
    scratch = accel.pin_empty((3, 4096), dtype=torch.bfloat16)
    assert scratch.shape == (3, 4096) and scratch.dtype == torch.bfloat16
    assert ours.is_pinned(scratch) and accel.is_pinned(scratch)
    nothing = accel.pin_empty(0, 5, dtype=torch.float16)
    assert nothing.shape == (0, 5) and accel.is_pinned(nothing)
    assert not accel.is_pinned(torch.empty(10)) and not ours.is_pinned(torch.empty(10))

    # unpin_memory unregisters at once; the memory goes with the last view of it.
    assert accel.unpin_memory(pinned) is True
    assert not ours.is_pinned(pinned) and not accel.is_pinned(pinned)
    del pinned
    if op == "async_io":  # that version frees only at unpin
        for t in (flat, scratch, nothing):
            accel.unpin_memory(t)
    # Else never unpinned: freed when collected (DeepSpeed's finalizer frees by address).
    del flat, scratch, nothing
    gc.collect()
    assert deepnvme.pinned_bytes_in_use() == before

    # The default backend (torch) does not come here.
    monkeypatch.setenv("DS_PIN_MEMORY_BACKEND", "torch")
    plain = torch.ones(3)
    assert accel.pin_memory(plain) is plain and not accel.is_pinned(plain)
    assert deepnvme.pinned_bytes_in_use() == before
