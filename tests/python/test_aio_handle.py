"""deepnvme.aio_handle against real files: the DeepNVMe tutorial's examples with deepnvme in place
of AsyncIOBuilder().load(), a dtype x size matrix with unaligned sizes and offsets (torch and
numpy), pinned tensors, cast_to_byte_tensor, the GIL released during I/O, error cases, gds_handle
refusing with its reason, and `cmake --install`."""

import errno
import os
import subprocess
import sys
import threading

import pytest


def file_bytes(path):
    with open(path, "rb") as f:
        return f.read()


# --- The DeepNVMe tutorial, with `deepnvme` in place of AsyncIOBuilder().load() -------------------
# Same shapes of code as the tutorial's file_write/file_read helpers; 64 MiB instead of 1 GiB so
# the suite stays quick on a 2-core CI machine.
TUTORIAL_BYTES = 64 << 20


@pytest.fixture
def tutorial_tensor(torch):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (TUTORIAL_BYTES,), dtype=torch.uint8, generator=g)


def test_tutorial_blocking_write_and_read(deepnvme, torch, scratch, tutorial_tensor):
    aio_handle = deepnvme.aio_handle  # was: AsyncIOBuilder().load().aio_handle
    h = aio_handle()
    out_f = os.path.join(scratch, "test_1GB.pt")
    assert h.sync_pwrite(tutorial_tensor, out_f) == 1
    assert os.path.getsize(out_f) == TUTORIAL_BYTES
    t = torch.empty(TUTORIAL_BYTES, dtype=torch.uint8)
    assert h.sync_pread(t, out_f) == 1
    assert torch.equal(t, tutorial_tensor)


def test_tutorial_non_blocking_write_and_read(deepnvme, torch, scratch, tutorial_tensor):
    h = deepnvme.aio_handle()
    out_f = os.path.join(scratch, "test_1GB.pt")
    assert h.async_pwrite(tutorial_tensor, out_f) == 0
    assert h.wait() == 1
    t = torch.empty_like(tutorial_tensor)
    assert h.async_pread(t, out_f) == 0
    assert h.wait() == 1
    assert torch.equal(t, tutorial_tensor)
    assert h.wait() == 0  # nothing pending


def test_tutorial_parallel_write(deepnvme, torch, scratch, tutorial_tensor):
    h = deepnvme.aio_handle(intra_op_parallelism=4)
    assert h.get_intra_op_parallelism() == 4
    out_f = os.path.join(scratch, "test_1GB.pt")
    h.sync_pwrite(tutorial_tensor, out_f)
    t = torch.empty_like(tutorial_tensor)
    h.sync_pread(t, out_f)
    assert torch.equal(t, tutorial_tensor)


def test_tutorial_pinned_tensors(deepnvme, torch, scratch, tutorial_tensor):
    h = deepnvme.aio_handle()
    before = deepnvme.pinned_bytes_in_use()
    pinned_t = h.new_cpu_locked_tensor(TUTORIAL_BYTES, torch.empty(0, dtype=torch.uint8))
    assert deepnvme.pinned_bytes_in_use() - before >= TUTORIAL_BYTES
    assert pinned_t.numel() == TUTORIAL_BYTES and pinned_t.dtype == torch.uint8
    assert pinned_t.data_ptr() % 4096 == 0
    pinned_t.copy_(tutorial_tensor)
    out_f = os.path.join(scratch, "test_1GB.pt")
    h.sync_pwrite(pinned_t, out_f)
    pinned_t.zero_()
    h.async_pread(pinned_t, out_f)
    h.wait()
    assert torch.equal(pinned_t, tutorial_tensor)
    assert h.free_cpu_locked_tensor(pinned_t) is True
    assert h.free_cpu_locked_tensor(pinned_t) is False  # already released
    del pinned_t
    assert deepnvme.pinned_bytes_in_use() == before


def test_tutorial_offsets(deepnvme, torch, scratch, tutorial_tensor):
    # Two halves written at their offsets, read back crosswise.
    h = deepnvme.aio_handle()
    out_f = os.path.join(scratch, "halves.bin")
    half = TUTORIAL_BYTES // 2
    first, second = tutorial_tensor[:half], tutorial_tensor[half:]
    h.async_pwrite(second, out_f, half)
    h.async_pwrite(first, out_f, 0)
    assert h.wait() == 2
    assert file_bytes(out_f) == tutorial_tensor.numpy().tobytes()
    t = torch.empty(half, dtype=torch.uint8)
    h.sync_pread(t, out_f, half)
    assert torch.equal(t, second)
    # The general form with DeepSpeed's keyword `async`.
    assert h.pread(t, out_f, False, **{"async": True}, file_offset=0) == 0
    h.wait()
    assert torch.equal(t, first)


# --- dtype x size matrix ----------------------------------------------------------------------

TORCH_DTYPES = ["uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
                "float64", "bool", "complex64", "complex128"]
SIZES = [1, 3, 511, 4097, (1 << 20) + 5, (3 << 20) + 1]  # elements; all unaligned in bytes


def make_tensor(torch, dtype, n, seed):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * torch.empty(0, dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype)


@pytest.mark.parametrize("dtype_name", TORCH_DTYPES)
def test_torch_dtype_size_matrix(deepnvme, torch, scratch, dtype_name):
    dtype = getattr(torch, dtype_name)
    configs = [dict(), dict(block_size=65536, queue_depth=4, intra_op_parallelism=3,
                            overlap_events=True), dict(single_submit=True, queue_depth=2)]
    for i, n in enumerate(SIZES):
        h = deepnvme.aio_handle(**configs[i % len(configs)])
        t = make_tensor(torch, dtype, n, seed=i)
        path = os.path.join(scratch, "%s_%d.bin" % (dtype_name, n))
        offset = [0, 4097, 4096, 1][i % 4]
        h.sync_pwrite(t, path, offset)
        data = file_bytes(path)
        assert len(data) == offset + t.numel() * t.element_size()
        assert data[offset:] == t.view(torch.uint8).numpy().tobytes()
        r = torch.empty_like(t)
        assert h.async_pread(r, path, offset) == 0
        assert h.wait() == 1
        assert torch.equal(r.view(torch.uint8), t.view(torch.uint8)), (dtype_name, n, offset)


@pytest.mark.parametrize("dtype", ["uint8", "int32", "float16", "float64", "complex64", "bool"])
def test_numpy_arrays(deepnvme, np, scratch, dtype):
    h = deepnvme.aio_handle(intra_op_parallelism=2)
    rng = np.random.default_rng(5)
    for n in (1, 4095, 100003):
        a = rng.integers(0, 256, size=n * np.dtype(dtype).itemsize, dtype=np.uint8).view(dtype)
        a = a.reshape(-1, 1) if n % 2 else a  # 2-D contiguous too
        path = os.path.join(scratch, "np_%s_%d.bin" % (dtype, n))
        h.sync_pwrite(a, path, 12345)
        assert file_bytes(path)[12345:] == a.tobytes()
        b = np.zeros_like(a)
        h.sync_pread(b, path, 12345)
        assert b.tobytes() == a.tobytes()


def test_plain_buffers_and_validate(deepnvme, scratch):
    h = deepnvme.aio_handle()
    path = os.path.join(scratch, "buf.bin")
    src = bytes(range(256)) * 4099
    assert h.pwrite(src, path, True, False, 0) == 1  # read-only buffer as a write source
    dst = bytearray(len(src))
    assert h.pread(dst, path, True, False, 0) == 1
    assert bytes(dst) == src
    assert h.stats()["validate_checks"] >= 2
    assert h.read(dst, path, True) == 0 and bytes(dst) == src
    assert h.write(memoryview(src)[:1000], path, False, 5) == 0
    assert file_bytes(path)[5:1005] == src[:1000]


# --- pinned tensors and byte views ----------------------------------------------------------------

@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "int64", "bool", "complex64"])
def test_new_cpu_locked_tensor(deepnvme, torch, scratch, dtype_name):
    dtype = getattr(torch, dtype_name)
    h = deepnvme.aio_handle()
    t = h.new_cpu_locked_tensor(12345, torch.empty(3, dtype=dtype))
    assert t.dtype == dtype and t.numel() == 12345 and t.device.type == "cpu"
    assert t.data_ptr() % 4096 == 0
    assert not t.view(torch.uint8).any()  # zero-filled
    src = make_tensor(torch, dtype, 12345, seed=9)
    t.copy_(src)
    path = os.path.join(scratch, "locked.bin")
    h.sync_pwrite(t, path)
    assert h.free_cpu_locked_tensor(t)
    # Freed by the handle but still referenced here: the memory stays valid.
    t.zero_()
    h.sync_pread(t, path)
    assert torch.equal(t.view(torch.uint8), src.view(torch.uint8))
    assert h.new_cpu_locked_tensor(0, t).numel() == 0
    with pytest.raises(ValueError):
        h.new_cpu_locked_tensor(-1, t)
    with pytest.raises(TypeError):
        h.new_cpu_locked_tensor(10, "float32")


@pytest.mark.parametrize("dtype_name", TORCH_DTYPES)
def test_cast_to_byte_tensor(deepnvme, torch, dtype_name):
    dtype = getattr(torch, dtype_name)
    t = make_tensor(torch, dtype, 1000, seed=3).reshape(10, 100)
    b = deepnvme.cast_to_byte_tensor(t)
    assert b.dtype == torch.uint8 and b.dim() == 1
    assert b.numel() == t.numel() * t.element_size()
    assert b.data_ptr() == t.data_ptr()  # zero-copy
    b[0] = 255 - int(b[0])  # a write through the view changes the tensor's bytes
    assert int(t.view(torch.uint8).reshape(-1)[0]) == int(b[0])
    scalar = torch.tensor(3.5, dtype=torch.float64)
    assert deepnvme.cast_to_byte_tensor(scalar).numel() == 8
    assert deepnvme.cast_to_byte_tensor(torch.empty(0, dtype=dtype)).numel() == 0
    with pytest.raises(ValueError):
        deepnvme.cast_to_byte_tensor(t.t())  # not contiguous
    with pytest.raises(TypeError):
        deepnvme.cast_to_byte_tensor(b"bytes")


# --- the GIL is released during I/O -------------------------------------------------------------

def test_gil_released_during_io(deepnvme, torch, scratch):
    h = deepnvme.aio_handle()
    t = torch.ones(256 << 20, dtype=torch.uint8)
    path = os.path.join(scratch, "gil.bin")
    counter = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            counter[0] += 1

    th = threading.Thread(target=spin)
    th.start()
    try:
        deltas = []
        for op in (lambda: h.sync_pwrite(t, path), lambda: h.sync_pread(t, path)):
            before = counter[0]
            op()
            deltas.append(counter[0] - before)
    finally:
        stop.set()
        th.join()
    # With the GIL held for the whole call the other thread could not run at all during it.
    assert all(d > 1000 for d in deltas), deltas


# --- errors ---------------------------------------------------------------------------------------

def test_io_errors_raise_oserror_with_errno_path_offset(deepnvme, torch, scratch):
    h = deepnvme.aio_handle()
    t = torch.zeros(5000, dtype=torch.uint8)
    missing = os.path.join(scratch, "missing.bin")
    with pytest.raises(FileNotFoundError) as e:
        h.sync_pread(t, missing, 4096)
    assert e.value.errno == errno.ENOENT and e.value.filename == missing
    assert e.value.offset == 4096

    short = os.path.join(scratch, "short.bin")
    h.sync_pwrite(t[:100], short)
    with pytest.raises(OSError) as e:
        h.sync_pread(t, short)
    assert e.value.errno == errno.ENODATA and e.value.filename == short
    assert "past end of file" in str(e.value)

    with pytest.raises(IsADirectoryError):
        h.sync_pwrite(t, scratch)
    with pytest.raises(FileNotFoundError):
        h.sync_pwrite(t, os.path.join(scratch, "no", "such", "dir.bin"))

    # An async failure surfaces at wait(), after every operation finished; the handle is reusable.
    good = os.path.join(scratch, "good.bin")
    h.async_pwrite(t, good)
    with pytest.raises(FileNotFoundError):
        h.async_pread(t, missing)  # the open fails at submission: nothing is queued
    r = torch.zeros_like(t)
    h.async_pread(r, short)  # fails in flight: past the end of the file
    h.async_pwrite(t, good, 5000)
    with pytest.raises(OSError) as e:
        h.wait()
    assert e.value.errno == errno.ENODATA and e.value.filename == short
    assert os.path.getsize(good) == 10000
    assert h.sync_pread(t, good) == 1

    with pytest.raises(ValueError):
        h.read(t, short)  # 5000-byte buffer, 100-byte file


def test_enospc_reaches_the_caller(deepnvme, torch, small_tmpfs):
    h = deepnvme.aio_handle()
    t = torch.ones(4 << 20, dtype=torch.uint8)
    path = os.path.join(small_tmpfs, "full.bin")
    with pytest.raises(OSError) as e:
        h.sync_pwrite(t, path)
    assert e.value.errno == errno.ENOSPC and e.value.filename == path
    h.async_pwrite(t, path + ".2")
    with pytest.raises(OSError) as e:
        h.wait()
    assert e.value.errno == errno.ENOSPC


def test_bad_arguments(deepnvme, torch, np, scratch):
    with pytest.raises(ValueError, match="block_size"):
        deepnvme.aio_handle(block_size=0)
    with pytest.raises(ValueError, match="queue_depth"):
        deepnvme.aio_handle(queue_depth=0)
    with pytest.raises(ValueError, match="intra_op_parallelism"):
        deepnvme.aio_handle(intra_op_parallelism=0)
    with pytest.raises(TypeError):
        deepnvme.aio_handle(num_threads=2)
    with pytest.raises(TypeError):
        deepnvme.aio_handle(block_size="1M")
    with pytest.raises(TypeError):
        deepnvme.aio_handle(single_submit="yes")

    h = deepnvme.aio_handle()
    path = os.path.join(scratch, "x.bin")
    t = torch.zeros(64, 64)
    with pytest.raises(ValueError, match="contiguous"):
        h.sync_pwrite(t.t(), path)
    with pytest.raises(ValueError, match="meta"):
        h.sync_pwrite(torch.empty(8, device="meta"), path)
    with pytest.raises(ValueError, match="read-only"):
        a = np.zeros(8)
        a.flags.writeable = False
        h.sync_pread(a, path)
    with pytest.raises(ValueError):
        h.sync_pread(b"immutable", path)
    with pytest.raises(ValueError):
        h.sync_pwrite(np.zeros((8, 8))[:, 1], path)  # strided view
    with pytest.raises(TypeError, match="tensor, a numpy array or a buffer"):
        h.sync_pwrite(12, path)
    with pytest.raises(ValueError, match="file_offset"):
        h.sync_pwrite(t, path, -1)
    with pytest.raises(TypeError):
        h.sync_pwrite(t, path, 1.5)
    with pytest.raises(TypeError):
        h.sync_pwrite(t, 4.2)
    with pytest.raises(OSError) as e:  # an int is an fd (DeepSpeed's async_pwrite(buffer, fd))
        h.sync_pwrite(t, 1 << 20)
    assert e.value.errno == errno.EBADF
    with pytest.raises(TypeError):
        h.pwrite(t, path, False, False, 0, bogus=1)
    assert not os.path.exists(path)  # nothing was written by any refused call
    h.sync_pwrite(t, path)  # and the handle still works
    assert os.path.getsize(path) == t.numel() * 4


def test_gds_handle_refuses_with_its_reason(deepnvme, torch):
    # The GPU path itself is tested by test_gpu.py; here: the class has DeepSpeed's methods, and
    # without a usable CUDA device creating one raises GdsUnavailableError with CUDA's reason.
    for name in ("sync_pread", "sync_pwrite", "async_pread", "async_pwrite", "pread", "pwrite",
                 "wait", "new_cpu_locked_tensor", "new_pinned_device_tensor",
                 "free_pinned_device_tensor", "pin_device_tensor", "unpin_device_tensor",
                 "get_block_size"):
        assert callable(getattr(deepnvme.gds_handle, name)), name
    reason = deepnvme._C.cuda_unavailable_reason()
    if not reason:
        h = deepnvme.gds_handle()
        assert h.mode in ("gds", "p2pdma", "compat", "bounce") and h.mode_reason
        return
    with pytest.raises(deepnvme.GdsUnavailableError) as e:
        deepnvme.gds_handle()
    assert reason in str(e.value)
    assert isinstance(e.value, RuntimeError) and isinstance(e.value, OSError)
    assert e.value.errno == errno.ENODEV
    assert reason in deepnvme.gds_unavailable_reason()


def test_getters_and_repr(deepnvme):
    h = deepnvme.aio_handle(block_size=262144, queue_depth=16, single_submit=True,
                            overlap_events=True, intra_op_parallelism=3)
    assert (h.get_block_size(), h.get_queue_depth(), h.get_single_submit(),
            h.get_overlap_events(), h.get_intra_op_parallelism()) == (262144, 16, True, True, 3)
    assert "queue_depth=16" in repr(h)
    d = deepnvme.aio_handle()
    assert (d.get_block_size(), d.get_queue_depth(), d.get_single_submit(),
            d.get_overlap_events(), d.get_intra_op_parallelism()) == (1048576, 128, False, False, 1)


# --- cmake --install --------------------------------------------------------------------------

def test_cmake_install_gives_an_importable_package(deepnvme, scratch):
    build = os.environ.get("DNVME_BUILD_DIR")
    if not build:
        pytest.skip("DNVME_BUILD_DIR is not set (ctest sets it)")
    prefix = os.path.join(scratch, "prefix")
    r = subprocess.run(["cmake", "--install", build, "--prefix", prefix, "--component", "python"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    found = [root for root, dirs, _ in os.walk(prefix) if "deepnvme" in dirs]
    assert len(found) == 1, found
    env = dict(os.environ, PYTHONPATH=found[0])
    probe = ("import deepnvme, os; h = deepnvme.aio_handle(); "
             "assert os.path.dirname(deepnvme.__file__).startswith(%r); "
             "print(deepnvme.__version__, h.get_queue_depth())" % prefix)
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env,
                       cwd=scratch)
    assert r.returncode == 0, r.stderr
    version, qd = r.stdout.split()
    assert qd == "128" and version.count(".") == 2 and "@" not in version
