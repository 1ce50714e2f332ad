"""The GPU side of deepnvme: CUDA memory through aio_handle (pinned host staging) and gds_handle
(GPUDirect Storage, or the engine's staging path), DeepSpeed's pin_device_tensor /
new_pinned_device_tensor family, CUDA IPC export and Mount.register_cuda.

Two kinds of tests:
  - Always run: the build has CUDA; without a usable device gds_handle raises GdsUnavailableError
    carrying CUDA's own reason; malformed or non-contiguous __cuda_array_interface__ objects are
    refused (ValueError/TypeError) before anything touches CUDA or a file; CUDA memory on a
    machine without a device is refused with the reason (aio_handle, Mount.register_cuda).
  - Need a device (fixture `gpu`): skipped, with the reason printed (`pytest -rs`), when no CUDA
    device is usable, or when neither torch with CUDA nor CuPy can make device arrays. They move
    real device memory and compare with the file's bytes read by plain Python.
"""

import ctypes
import errno
import itertools
import os

import pytest

from tests.fs import mount_harness as mh
from tests.python import ctl_standin


def file_bytes(path):
    with open(path, "rb") as f:
        return f.read()


# --- device-array backends ------------------------------------------------------------------------

class TorchCuda:
    """CUDA tensors from a torch that has CUDA."""
    name = "torch"
    dtypes = ["uint8", "float16", "bfloat16", "float32", "int64"]

    def __init__(self, torch):
        self.torch = torch
        self.device = torch.device("cuda", torch.cuda.current_device())

    def _dtype(self, name):
        return getattr(self.torch, name)

    def itemsize(self, dtype):
        return self.torch.empty(0, dtype=self._dtype(dtype)).element_size()

    def make(self, dtype, n, seed):
        """n elements of random bytes, on the device."""
        torch = self.torch
        g = torch.Generator().manual_seed(seed)
        raw = torch.randint(0, 256, (n * self.itemsize(dtype),), dtype=torch.uint8, generator=g)
        return raw.view(self._dtype(dtype)).to(self.device)

    def zeros(self, dtype, n):
        return self.torch.zeros(n, dtype=self._dtype(dtype), device=self.device)

    def host_bytes(self, a):
        return a.detach().reshape(-1).view(self.torch.uint8).cpu().numpy().tobytes()

    def nbytes(self, a):
        return a.numel() * a.element_size()

    def address(self, a):
        return a.data_ptr()

    def non_contiguous(self):
        return self.torch.zeros(64, 64, device=self.device).t()

    def view_buffer(self, buf):
        return self.torch.as_tensor(buf, device=self.device)

    def host_array(self, n):
        return self.torch.zeros(n, dtype=self.torch.uint8)


class CupyCuda:
    """CuPy arrays (a machine whose torch has no CUDA)."""
    name = "cupy"
    dtypes = ["uint8", "float16", "float32", "int64"]

    def __init__(self, cupy, np):
        self.cupy, self.np = cupy, np

    def itemsize(self, dtype):
        return self.np.dtype(dtype).itemsize

    def make(self, dtype, n, seed):
        rng = self.np.random.default_rng(seed)
        raw = rng.integers(0, 256, size=n * self.itemsize(dtype), dtype=self.np.uint8)
        return self.cupy.asarray(raw).view(dtype)

    def zeros(self, dtype, n):
        return self.cupy.zeros(n, dtype=dtype)

    def host_bytes(self, a):
        return self.cupy.asnumpy(a).tobytes()

    def nbytes(self, a):
        return a.nbytes

    def address(self, a):
        return a.data.ptr

    def non_contiguous(self):
        return self.cupy.zeros((64, 64), dtype="float32").T

    def view_buffer(self, buf):
        return self.cupy.asarray(buf)

    def host_array(self, n):
        return self.np.zeros(n, dtype=self.np.uint8)


@pytest.fixture(scope="module")
def gpu(deepnvme):
    """A backend that makes device arrays, or a skip that says why there is none."""
    if not deepnvme._C.built_with_cuda():
        pytest.skip("this deepnvme was built without CUDA (CMake did not find the CUDA toolkit)")
    reason = deepnvme._C.cuda_unavailable_reason()
    if reason:
        pytest.skip("needs a CUDA device: %s" % reason)
    why = []
    try:
        import torch
    except ImportError as e:
        torch = None
        why.append("torch is not importable (%s)" % e)
    if torch is not None:
        if torch.cuda.is_available():
            return TorchCuda(torch)
        why.append("torch %s cannot use CUDA (torch.version.cuda=%s)" %
                   (torch.__version__, torch.version.cuda))
    try:
        import cupy
        import numpy
        return CupyCuda(cupy, numpy)
    except ImportError as e:
        why.append("CuPy is not importable (%s)" % e)
    pytest.skip("a CUDA device is usable but nothing here makes device arrays: " + "; ".join(why))


@pytest.fixture
def torch_gpu(gpu):
    if gpu.name != "torch":
        pytest.skip("needs torch with CUDA (this returns torch tensors); device arrays come from "
                    "%s here" % gpu.name)
    return gpu


HANDLE_KINDS = ["aio", "gds", "gds_bounce"]


def make_handle(deepnvme, kind, **config):
    if kind == "aio":
        return deepnvme.aio_handle(**config)
    if kind == "gds":
        return deepnvme.gds_handle(**config)
    return deepnvme.gds_handle(cufile="never", **config)


# --- fake CUDA arrays (no GPU needed) ---------------------------------------------------------------

class FakeCudaArray:
    """An object exporting __cuda_array_interface__ over host memory: enough to test the checks
    that run before CUDA is asked anything. On a machine with a device, CUDA then says it is not
    device memory."""

    def __init__(self, nbytes=4096, **overrides):
        self.memory = bytearray(max(nbytes, 1))
        address = ctypes.addressof((ctypes.c_char * len(self.memory)).from_buffer(self.memory))
        self.__cuda_array_interface__ = dict(
            dict(shape=(nbytes,), typestr="|u1", data=(address if nbytes else 0, False),
                 strides=None, version=3, stream=None), **overrides)


# (name, change to a good interface, the exception): refused before CUDA or a file is touched.
BAD_INTERFACES = [
    ("non-contiguous", dict(shape=(64, 64), typestr="<f4", strides=(4, 256)), ValueError),
    ("column-slice", dict(shape=(16, 4), typestr="<u4", strides=(64, 4)), ValueError),
    ("masked", dict(mask=object()), ValueError),
    ("null-pointer", dict(data=(0, False)), ValueError),
    ("no-data", dict(data=None), TypeError),
    ("bad-typestr", dict(typestr="float"), TypeError),
    ("zero-itemsize", dict(typestr="<f0"), TypeError),
    ("bad-shape", dict(shape=(-1,)), TypeError),
    ("strides-rank", dict(strides=(1, 1)), TypeError),
    ("stream-0", dict(stream=0), TypeError),
    ("not-a-dict", None, TypeError),
    ("missing-shape", "drop-shape", TypeError),
]


def fake_with(spec):
    fake = FakeCudaArray(4096)
    if spec is None:
        fake.__cuda_array_interface__ = [1, 2, 3]
    elif spec == "drop-shape":
        del fake.__cuda_array_interface__["shape"]
    else:
        fake.__cuda_array_interface__.update(spec)
    return fake


# --- always run ---------------------------------------------------------------------------------

def test_built_with_cuda(deepnvme):
    if not deepnvme._C.built_with_cuda():
        pytest.skip("this deepnvme was built without CUDA (CMake did not find the CUDA toolkit "
                    "or -DDNVME_WITH_CUDA=OFF): gds_handle always refuses")
    assert deepnvme._C.built_with_cuda() is True
    assert isinstance(deepnvme._C.cuda_unavailable_reason(), str)


def test_gds_handle_without_a_device_raises_the_reason(deepnvme):
    reason = deepnvme._C.cuda_unavailable_reason()
    if not reason:
        pytest.skip("a CUDA device is usable here; the refusal is for machines without one")
    with pytest.raises(deepnvme.GdsUnavailableError) as e:
        deepnvme.gds_handle()
    msg = str(e.value)
    assert msg and reason in msg
    assert isinstance(e.value, RuntimeError) and isinstance(e.value, OSError)
    assert e.value.errno == errno.ENODEV
    assert deepnvme.cuda_unavailable_reason() == reason
    assert reason in deepnvme.gds_unavailable_reason()
    with pytest.raises(deepnvme.GdsUnavailableError, match="not available"):
        deepnvme.gds_handle(1 << 20, 32, False, True, 4, cufile="never")
    # Bad arguments are reported as such, before the device is looked for.
    with pytest.raises(ValueError, match="block_size"):
        deepnvme.gds_handle(block_size=0)
    with pytest.raises(ValueError, match="cufile"):
        deepnvme.gds_handle(cufile="sometimes")
    with pytest.raises(TypeError):
        deepnvme.gds_handle(queue_depth="8")


@pytest.mark.parametrize("name,spec,exc", BAD_INTERFACES, ids=[c[0] for c in BAD_INTERFACES])
def test_bad_cuda_array_interface_is_refused(deepnvme, scratch, name, spec, exc):
    path = os.path.join(scratch, "never.bin")
    handles = [deepnvme.aio_handle()]
    if not deepnvme._C.cuda_unavailable_reason():
        handles.append(deepnvme.gds_handle())
    for h in handles:
        for op in (h.sync_pwrite, h.sync_pread, h.async_pwrite):
            with pytest.raises(exc):
                op(fake_with(spec), path)
        assert h.wait() == 0, name
    assert not os.path.exists(path), name


def test_read_only_cuda_array_is_not_a_read_target(deepnvme, scratch):
    fake = FakeCudaArray(4096)
    fake.__cuda_array_interface__["data"] = (fake.__cuda_array_interface__["data"][0], True)
    with pytest.raises(ValueError, match="read-only"):
        deepnvme.aio_handle().sync_pread(fake, os.path.join(scratch, "x.bin"))


def test_zero_byte_cuda_array_needs_no_cuda(deepnvme, scratch):
    # Nothing to copy: handled like an empty host buffer (the file is created), no device asked.
    h = deepnvme.aio_handle()
    path = os.path.join(scratch, "empty.bin")
    assert h.sync_pwrite(FakeCudaArray(0), path) == 1
    assert os.path.getsize(path) == 0


def test_cuda_memory_without_a_device_is_refused_with_the_reason(deepnvme, scratch):
    reason = deepnvme._C.cuda_unavailable_reason()
    h = deepnvme.aio_handle()
    path = os.path.join(scratch, "cuda.bin")
    fake = FakeCudaArray(8192)
    for op in (h.sync_pwrite, h.async_pwrite, h.sync_pread):
        if reason:
            with pytest.raises(deepnvme.GdsUnavailableError) as e:
                op(fake, path)
            assert reason in str(e.value)
        else:  # a device exists: CUDA says the pointer is host memory
            with pytest.raises(ValueError, match="not CUDA device memory"):
                op(fake, path)
    assert not os.path.exists(path)
    assert h.pending() == 0 and h.wait() == 0
    # The handle still moves host memory.
    assert h.sync_pwrite(bytearray(b"x" * 5000), path) == 1
    assert file_bytes(path) == b"x" * 5000


class RecordingMount:
    """Builds a deepnvme.Mount whose session is a stand-in daemon (tests/python/ctl_standin.py):
    `requests` are the requests the native client sent, answered like the daemon does."""

    @staticmethod
    def make(deepnvme):
        buffers = itertools.count(8)

        def answer(request):
            op = request["op"]
            if op == "hello":
                return {"protocol": 1, "version": "stand-in", "mountpoint": "/recording"}
            if op == "buffer.register":
                return {"buffer": next(buffers), "size": request["size"], "writable": True,
                        "sealed": False}
            if op == "handle.open":
                return {"handle": 3}
            if op in ("pread", "pwrite"):
                return {"bytes": request["length"], "op_id": len(daemon.requests)}
            return {}

        daemon = ctl_standin.StandInDaemon(answer)

        class Recording(deepnvme.Mount):
            def __init__(self):
                self.mountpoint = "/recording"
                self._attach(daemon.client(deepnvme._C))
                daemon.requests.clear()  # the hello

            @property
            def requests(self):
                return daemon.requests

        return Recording()


def test_register_cuda_refusals_without_talking_to_the_daemon(deepnvme):
    m = RecordingMount.make(deepnvme)
    reason = deepnvme._C.cuda_unavailable_reason()
    fake = FakeCudaArray(8192)
    if reason:
        with pytest.raises(OSError) as e:
            m.register_cuda(fake)
        assert e.value.errno == errno.ENODEV and reason in str(e.value)
    else:
        with pytest.raises(ValueError):
            m.register_cuda(fake)  # host memory behind the interface: not exportable
    with pytest.raises(ValueError, match="CUDA memory"):
        m.register_cuda(bytearray(4096))  # host memory
    with pytest.raises(ValueError, match="contiguous"):
        m.register_cuda(fake_with(dict(shape=(64, 64), typestr="<f4", strides=(4, 256))))
    with pytest.raises(ValueError, match="empty"):
        m.register_cuda(FakeCudaArray(0))
    with pytest.raises(ValueError, match="register_cuda"):
        m.pwrite(fake, "x.bin")  # CUDA memory that was never registered
    assert m.requests == []


# --- the Python half against a host-memory stand-in of the native GPU handle ------------------
# The routing (host vs CUDA memory), the merged wait() of an aio_handle, gds_handle's pin and
# pinned-buffer bookkeeping and register_cuda's request run here on any machine: CUDA is replaced
# by a stand-in whose "device memory" is host memory (FakeCudaArray) moved by an AioHandle, like
# the engine's own HostCopyEngineFactory. What CUDA itself does is left to the device tests below.

class StandInDeviceBuffer:
    def __init__(self, nbytes, device, host_buffer):
        self._mem = host_buffer(nbytes, False)
        self.nbytes, self.device, self.freed = nbytes, device, False
        self.address = self._mem.address

    @property
    def __cuda_array_interface__(self):
        if self.freed:
            raise ValueError("this DeviceBuffer was freed")
        return dict(shape=(self.nbytes,), typestr="|u1", data=(self.address, False),
                    strides=None, version=3, stream=None)


def stand_in_gds(C):
    class StandInGds:
        instances = []

        def __init__(self, block_size, queue_depth, single_submit, overlap_events,
                     intra_op_parallelism, cufile, device, cufile_compat):
            self._aio = C.AioHandle(block_size, queue_depth, single_submit, overlap_events,
                                    intra_op_parallelism)
            self.cufile, self.device, self.pins = cufile, device, {}
            self.mode, self.mode_reason = "bounce", "host-memory stand-in"
            StandInGds.instances.append(self)

        def __getattr__(self, name):  # the AioHandle calls: pread, pwrite, wait_results, ...
            return getattr(self._aio, name)

        def pin(self, address, num_bytes):
            if address in self.pins:
                raise ValueError("pin_device_buffer: this buffer is already pinned")
            self.pins[address] = num_bytes

        def unpin(self, address):
            if self.pins.pop(address, None) is None:
                raise ValueError("unpin_device_buffer: this buffer is not pinned")

        def new_pinned_device_buffer(self, num_bytes):
            b = StandInDeviceBuffer(num_bytes, self.device, C.HostBuffer)
            self.pin(b.address, num_bytes)
            return b

        def free_pinned_device_buffer(self, b):
            self.pins.pop(b.address, None)
            b.freed = True

    return StandInGds


@pytest.fixture
def stand_in(deepnvme, monkeypatch):
    C = deepnvme._C
    gds = stand_in_gds(C)
    monkeypatch.setattr(C, "cuda_unavailable_reason", lambda: "")
    monkeypatch.setattr(C, "cuda_pointer_device", lambda address: 0)
    monkeypatch.setattr(C, "GdsHandle", gds)
    monkeypatch.setattr(C, "export_cuda_ipc", lambda address: dict(
        handle="ab" * 64, offset=address % 4096, allocation_size=1 << 30, device=0))
    return gds


def fake_random(n, seed):
    fake = FakeCudaArray(n)
    fake.memory[:] = bytes((i * 7 + seed) % 251 for i in range(n))
    return fake


def test_stand_in_aio_handle_routes_and_merges_wait(deepnvme, stand_in, scratch):
    h = deepnvme.aio_handle(queue_depth=8)
    dev = fake_random((1 << 20) + 5, 1)
    host = bytes(range(256)) * 4099
    a, b, c = (os.path.join(scratch, n) for n in ("a.bin", "b.bin", "c.bin"))
    h.async_pwrite(host, a)
    h.async_pwrite(dev, b, 100)
    h.async_pwrite(memoryview(host)[:1000], c)
    assert len(stand_in.instances) == 1  # made on first CUDA use, with cufile='never'
    g = stand_in.instances[0]
    assert g.cufile == "never" and g.device == 0
    assert h.pending() == 3 and g.pending() == 1
    assert h.wait() == 3
    assert file_bytes(a) == host and file_bytes(c) == host[:1000]
    assert file_bytes(b)[100:] == bytes(dev.memory)
    r = FakeCudaArray(len(dev.memory))
    assert h.sync_pread(r, b, 100) == 1 and r.memory == dev.memory
    assert "gpu" in h.stats()
    # Failures come back in submission order over both engines, after all finished.
    short = os.path.join(scratch, "short.bin")
    with open(short, "wb") as f:
        f.write(b"s" * 10)
    missing_dir = os.path.join(scratch, "no", "dir.bin")
    h.async_pwrite(host, a)
    h.async_pread(FakeCudaArray(4096), short)  # "device" read past the end
    h.async_pread(bytearray(4096), short)  # host read past the end
    with pytest.raises(OSError) as e:
        h.wait()
    assert e.value.errno == errno.ENODATA and e.value.filename == short
    assert "2 of 3 operations failed" in str(e.value)
    with pytest.raises(FileNotFoundError):
        h.async_pwrite(dev, missing_dir)  # refused at submission: nothing queued
    assert h.pending() == 0 and h.wait() == 0
    assert len(stand_in.instances) == 1


def test_stand_in_gds_handle(deepnvme, stand_in, scratch):
    h = deepnvme.gds_handle(block_size=65536, queue_depth=4, intra_op_parallelism=2)
    g = stand_in.instances[0]
    assert (g.cufile, g.device) == ("auto", 0)
    assert h.mode == "bounce" and h.mode_reason and h.device == 0
    assert h.get_block_size() == 65536 and h.get_intra_op_parallelism() == 2
    assert repr(h).startswith("deepnvme.gds_handle(")
    dev = fake_random((3 << 20) + 1, 2)
    path = os.path.join(scratch, "g.bin")
    assert h.sync_pwrite(dev, path, 12345) == 1
    assert file_bytes(path)[12345:] == bytes(dev.memory)
    host = bytearray(len(dev.memory))
    assert h.async_pread(host, path, 12345) == 0  # host memory goes to the same handle
    r = FakeCudaArray(len(dev.memory))
    assert h.async_pread(r, path, 12345) == 0
    assert h.wait() == 2 and host == dev.memory and r.memory == dev.memory
    # pin/unpin: the whole range, kept alive while pinned, refused for host memory.
    assert h.pin_device_tensor(dev) is True
    assert g.pins == {dev.__cuda_array_interface__["data"][0]: len(dev.memory)}
    with pytest.raises(ValueError):
        h.pin_device_tensor(dev)
    with pytest.raises(ValueError, match="host memory"):
        h.pin_device_tensor(bytearray(10))
    with pytest.raises(ValueError, match="empty"):
        h.pin_device_tensor(FakeCudaArray(0))
    assert h.unpin_device_tensor(dev) is True and g.pins == {}
    with pytest.raises(ValueError):
        h.unpin_device_tensor(dev)
    # Buffers from new_pinned_device_buffer are CUDA arrays themselves.
    buf = h.new_pinned_device_buffer(5000)
    assert buf.address in g.pins
    assert h.sync_pread(buf, path) == 1
    with pytest.raises(ValueError):
        h.new_pinned_device_buffer(0)
    # A device other than the handle's is refused.
    stand_in_device = deepnvme._C.cuda_pointer_device
    try:
        deepnvme._C.cuda_pointer_device = lambda address: 1
        with pytest.raises(ValueError, match="cuda:1"):
            h.sync_pwrite(dev, path)
    finally:
        deepnvme._C.cuda_pointer_device = stand_in_device
    assert h.stats() is not None and h.wait() == 0


def test_stand_in_register_cuda(deepnvme, stand_in):
    m = RecordingMount.make(deepnvme)
    dev = fake_random(8192, 3)
    address = dev.__cuda_array_interface__["data"][0]
    buffer_id, offset = m.register_cuda(dev)
    assert offset == 0
    assert m.requests[-1] == dict(op="buffer.register", cuda_ipc="ab" * 64, device=0,
                                  offset=address % 4096, size=8192)
    view = FakeCudaArray(100)  # a part of `dev`: the same registration
    view.__cuda_array_interface__["data"] = (address + 40, False)
    assert m.register(view) == (buffer_id, 40)
    assert m.pwrite(view, "ckpt/x.bin", file_offset=8) == 100
    req = m.requests[-1]
    assert (req["op"], req["buffer"], req["buffer_offset"], req["length"], req["file_offset"]) == \
        ("pwrite", buffer_id, 40, 100, 8)
    assert m.pread(dev, "ckpt/x.bin") == 8192
    m.unregister((buffer_id, 0))
    assert m.requests[-1] == dict(op="buffer.unregister", buffer=buffer_id)
    with pytest.raises(ValueError, match="register_cuda"):
        m.pwrite(dev, "ckpt/x.bin")
    ro = fake_random(4096, 4)
    m.register_cuda(ro, writable=False)
    m.pwrite(ro, "ro.bin")
    with pytest.raises(ValueError, match="read-only"):
        m.pread(ro, "ro.bin")


# --- with a CUDA device -------------------------------------------------------------------------

SIZES = [(1 << 20) + 123, 7, (3 << 20) + 1, 4096]  # bytes (rounded down to whole elements)
OFFSETS = [0, 4096, 12345, 1]
CONFIGS = [dict(), dict(block_size=65536, queue_depth=4, intra_op_parallelism=3,
                        overlap_events=True), dict(single_submit=True, queue_depth=2)]


@pytest.mark.parametrize("kind", HANDLE_KINDS)
def test_round_trips(deepnvme, gpu, scratch, kind):
    for dtype in gpu.dtypes:
        for i, size in enumerate(SIZES):
            h = make_handle(deepnvme, kind, **CONFIGS[i % len(CONFIGS)])
            n = max(1, size // gpu.itemsize(dtype))
            t = gpu.make(dtype, n, seed=i)
            want = gpu.host_bytes(t)
            path = os.path.join(scratch, "%s_%s_%d.bin" % (kind, dtype, size))
            offset = OFFSETS[i % len(OFFSETS)]
            assert h.sync_pwrite(t, path, offset) == 1
            data = file_bytes(path)
            assert len(data) == offset + len(want), (dtype, size, offset)
            assert data[offset:] == want, (kind, dtype, size, offset)
            r = gpu.zeros(dtype, n)
            assert h.sync_pread(r, path, offset) == 1
            assert gpu.host_bytes(r) == want, (kind, dtype, size, offset)
            r2 = gpu.zeros(dtype, n)
            assert h.async_pread(r2, path, offset) == 0
            assert h.wait() == 1
            assert gpu.host_bytes(r2) == want
            assert gpu.host_bytes(t) == want  # the source is untouched


@pytest.mark.parametrize("kind", HANDLE_KINDS)
def test_async_parts_and_wait_counts(deepnvme, gpu, scratch, kind):
    h = make_handle(deepnvme, kind, intra_op_parallelism=2)
    n = (4 << 20) + 333
    t = gpu.make("uint8", n, seed=11)
    want = gpu.host_bytes(t)
    path = os.path.join(scratch, "parts.bin")
    cuts = [0, 12345, 1 << 20, (3 << 20) + 1, n]
    for a, b in zip(cuts, cuts[1:]):
        assert h.async_pwrite(t[a:b], path, a) == 0
    assert h.pending() == 4
    assert h.wait() == 4
    assert h.pending() == 0 and h.wait() == 0
    assert file_bytes(path) == want
    r = gpu.zeros("uint8", n)
    for a, b in zip(cuts, cuts[1:]):
        h.pread(r[a:b], path, False, **{"async": True}, file_offset=a)
    assert h.wait() == 4
    assert gpu.host_bytes(r) == want
    # validate=True compares with the file through the page cache.
    assert h.pwrite(t, path, True, False, 0) == 1
    assert h.pread(r, path, True, False, 0) == 1
    assert h.read(r, path) == 0 and h.write(t, path) == 0


def test_aio_handle_mixes_host_and_device_memory(deepnvme, gpu, scratch):
    h = deepnvme.aio_handle(queue_depth=8)
    dev = gpu.make("uint8", (1 << 20) + 5, seed=1)
    host = bytes(range(256)) * 4099
    a, b, c = (os.path.join(scratch, n) for n in ("a.bin", "b.bin", "c.bin"))
    h.async_pwrite(host, a)
    h.async_pwrite(dev, b, 100)
    h.async_pwrite(memoryview(host)[:1000], c)
    assert h.pending() == 3
    assert h.wait() == 3
    assert file_bytes(a) == host and file_bytes(c) == host[:1000]
    assert file_bytes(b)[100:] == gpu.host_bytes(dev)
    assert "gpu" in h.stats()
    # A failure of either kind surfaces at wait(), in submission order, after all finished.
    short = os.path.join(scratch, "short.bin")
    with open(short, "wb") as f:
        f.write(b"s" * 10)
    r = gpu.zeros("uint8", 4096)
    h.async_pwrite(host, a)
    h.async_pread(r, short)  # device read past the end of the file: fails in flight
    h.async_pread(bytearray(4096), short)  # host read: fails too
    with pytest.raises(OSError) as e:
        h.wait()
    assert e.value.errno == errno.ENODATA and e.value.filename == short
    assert "2 of 3 operations failed" in str(e.value)
    assert h.pending() == 0 and h.wait() == 0
    assert h.sync_pread(r, a) == 1 and gpu.host_bytes(r) == host[:4096]


def test_gds_handle_moves_host_memory_too(deepnvme, gpu, scratch):
    h = deepnvme.gds_handle()
    path = os.path.join(scratch, "host.bin")
    src = bytes(range(251)) * 5000
    assert h.sync_pwrite(src, path, 3) == 1
    assert file_bytes(path)[3:] == src
    dst = bytearray(len(src))
    assert h.sync_pread(dst, path, 3) == 1 and bytes(dst) == src
    t = gpu.host_array(len(src))
    h.async_pread(t, path, 3)
    assert h.wait() == 1
    assert bytes(memoryview(t.numpy() if gpu.name == "torch" else t)) == src
    assert h.stats()["bytes_host"] >= 3 * len(src)


def test_mode_and_cufile_policies(deepnvme, gpu):
    h = deepnvme.gds_handle()
    assert h.mode in ("gds", "p2pdma", "compat", "bounce")
    assert isinstance(h.mode_reason, str) and h.mode_reason
    assert deepnvme.gds_handle(cufile="never").mode == "bounce"
    try:
        r = deepnvme.gds_handle(cufile="require")
        assert r.mode in ("gds", "p2pdma")
    except deepnvme.GdsUnavailableError as e:
        assert "GPUDirect Storage required" in str(e)
    with pytest.raises(ValueError):
        deepnvme.gds_handle(cufile="bogus")
    assert "gds_handle(" in repr(h) and h.get_queue_depth() == 128


@pytest.mark.parametrize("kind", HANDLE_KINDS)
def test_errors(deepnvme, gpu, scratch, kind):
    h = make_handle(deepnvme, kind)
    t = gpu.zeros("uint8", 5000)
    missing = os.path.join(scratch, "missing.bin")
    with pytest.raises(FileNotFoundError) as e:
        h.sync_pread(t, missing, 4096)
    assert e.value.errno == errno.ENOENT and e.value.filename == missing
    assert e.value.offset == 4096
    with pytest.raises(FileNotFoundError):
        h.async_pread(t, missing)  # nothing queued
    assert h.wait() == 0
    short = os.path.join(scratch, "short.bin")
    h.sync_pwrite(t[:100], short)
    with pytest.raises(OSError) as e:
        h.sync_pread(t, short)
    assert e.value.errno == errno.ENODATA and e.value.filename == short
    with pytest.raises(IsADirectoryError):
        h.sync_pwrite(t, scratch)
    h.async_pread(t, short)
    with pytest.raises(OSError) as e:
        h.wait()
    assert e.value.errno == errno.ENODATA
    with pytest.raises(ValueError, match="contiguous"):
        h.sync_pwrite(gpu.non_contiguous(), short)
    with pytest.raises(ValueError, match="read"):
        h.read(t, short)  # 5000-byte buffer, 100-byte file
    assert h.sync_pread(t[:100], short) == 1  # still usable


def test_pin_and_unpin(deepnvme, gpu, scratch):
    h = deepnvme.gds_handle()
    t = gpu.make("float32", (1 << 18) + 3, seed=5)
    want = gpu.host_bytes(t)
    assert h.pin_device_tensor(t) is True
    assert h.stats()["buffers_pinned"] == 1
    with pytest.raises(ValueError):
        h.pin_device_tensor(t)  # already pinned
    path = os.path.join(scratch, "pinned.bin")
    h.sync_pwrite(t, path)
    assert file_bytes(path) == want
    part = t[1000:5000]  # inside the pinned range: I/O uses the registration
    h.sync_pwrite(part, path, 1 << 20)
    assert file_bytes(path)[1 << 20:] == gpu.host_bytes(part)
    r = gpu.zeros("float32", (1 << 18) + 3)
    h.pin_device_tensor(r)
    h.async_pread(r, path)
    assert h.wait() == 1
    # The file now holds t's first MiB, then `part` (written at 1 MiB, over t's last 12 bytes).
    data = file_bytes(path)
    assert data[:1 << 20] == want[:1 << 20]
    assert gpu.host_bytes(r) == data[:len(want)]
    assert h.unpin_device_tensor(t) is True and h.unpin_device_tensor(r) is True
    assert h.stats()["buffers_pinned"] == 0
    with pytest.raises(ValueError):
        h.unpin_device_tensor(t)  # not pinned
    with pytest.raises(ValueError, match="host memory"):
        h.pin_device_tensor(gpu.host_array(4096))


def test_new_pinned_device_tensor(deepnvme, torch_gpu, scratch):
    torch = torch_gpu.torch
    h = deepnvme.gds_handle()
    before = h.stats()["buffers_pinned"]
    for dtype in (torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.int64,
                  torch.bool, torch.complex64):
        n = (1 << 18) + 7
        t = h.new_pinned_device_tensor(n, torch.empty(0, dtype=dtype))
        assert t.dtype == dtype and t.numel() == n and t.is_cuda
        assert t.device.index == h.device and t.is_contiguous()
        assert not t.view(torch.uint8).any()  # zero-filled
        assert h.stats()["buffers_pinned"] == before + 1
        src = torch_gpu.make("uint8", n * t.element_size(), seed=3)
        if dtype == torch.bool:
            src = src % 2
        t.view(torch.uint8).copy_(src)
        path = os.path.join(scratch, "pinned_%s.bin" % str(dtype).split(".")[-1])
        h.sync_pwrite(t, path, 4096)
        assert file_bytes(path)[4096:] == torch_gpu.host_bytes(src)
        t.zero_()
        h.async_pread(t, path, 4096)
        assert h.wait() == 1
        assert torch.equal(t.view(torch.uint8), src)
        assert h.free_pinned_device_tensor(t) is True
        assert h.free_pinned_device_tensor(t) is False  # already released
        assert h.stats()["buffers_pinned"] == before  # unpinned at free
        # Freed by the handle but still referenced here: the memory stays valid.
        t.zero_()
        h.sync_pread(t, path, 4096)
        assert torch.equal(t.view(torch.uint8), src)
        del t
    assert h.new_pinned_device_tensor(0, torch.empty(0)).numel() == 0
    with pytest.raises(ValueError):
        h.new_pinned_device_tensor(-1, torch.empty(0))
    with pytest.raises(TypeError):
        h.new_pinned_device_tensor(10, "float32")
    # free_pinned_device_tensor of a pin_device_tensor'ed tensor unpins it (DeepSpeed's meaning).
    u = torch.zeros(4096, device=torch_gpu.device)
    h.pin_device_tensor(u)
    assert h.free_pinned_device_tensor(u) is True
    assert h.stats()["buffers_pinned"] == before


def test_new_pinned_device_buffer_and_free(deepnvme, gpu, scratch):
    h = deepnvme.gds_handle()
    n = (1 << 20) + 123
    buf = h.new_pinned_device_buffer(n)
    assert buf.nbytes == n and buf.device == h.device and buf.address and not buf.freed
    cai = buf.__cuda_array_interface__
    assert cai["shape"] == (n,) and cai["typestr"] == "|u1" and cai["data"] == (buf.address, False)
    view = gpu.view_buffer(buf)
    assert gpu.address(view) == buf.address and gpu.nbytes(view) == n
    assert gpu.host_bytes(view) == bytes(n)
    src = gpu.make("uint8", n, seed=8)
    path = os.path.join(scratch, "buf.bin")
    h.sync_pwrite(src, path)
    assert h.sync_pread(buf, path) == 1  # the buffer itself is a CUDA array
    assert gpu.host_bytes(view) == gpu.host_bytes(src)
    del view
    h._g.free_pinned_device_buffer(buf)
    assert buf.freed and buf.nbytes == 0
    with pytest.raises(ValueError, match="freed"):
        buf.__cuda_array_interface__
    with pytest.raises(ValueError):
        h._g.free_pinned_device_buffer(buf)
    with pytest.raises(ValueError):
        h.sync_pwrite(buf, path)
    with pytest.raises(ValueError):
        h.new_pinned_device_buffer(0)


def test_export_cuda_ipc(deepnvme, gpu):
    t = gpu.make("uint8", 1 << 20, seed=2)
    whole = deepnvme._C.export_cuda_ipc(gpu.address(t))
    assert len(whole["handle"]) == 128 and int(whole["handle"], 16) >= 0
    assert whole["allocation_size"] >= whole["offset"] + (1 << 20)
    part = deepnvme._C.export_cuda_ipc(gpu.address(t[4096:]))
    assert part["offset"] == whole["offset"] + 4096 and part["handle"] == whole["handle"]
    with pytest.raises(ValueError):
        deepnvme._C.export_cuda_ipc(FakeCudaArray().__cuda_array_interface__["data"][0])


def test_register_cuda_request(deepnvme, gpu):
    m = RecordingMount.make(deepnvme)
    t = gpu.make("float32", 1 << 16, seed=4)
    ipc = deepnvme._C.export_cuda_ipc(gpu.address(t))
    buffer_id, offset = m.register_cuda(t)
    assert offset == 0
    req = m.requests[-1]
    assert req == dict(op="buffer.register", cuda_ipc=ipc["handle"], device=ipc["device"],
                       offset=ipc["offset"], size=gpu.nbytes(t))
    assert m.register(t) == (buffer_id, 0)
    assert m.register(t[10:20]) == (buffer_id, 40)
    assert m.pwrite(t[10:20], "ckpt/x.bin", file_offset=8) == 40
    req = m.requests[-1]
    assert (req["op"], req["buffer"], req["buffer_offset"], req["length"], req["file_offset"]) == \
        ("pwrite", buffer_id, 40, 40, 8)
    m.pread(t, "ckpt/x.bin")
    assert m.requests[-1]["buffer"] == buffer_id
    m.unregister((buffer_id, 0))
    assert m.requests[-1] == dict(op="buffer.unregister", buffer=buffer_id)
    with pytest.raises(ValueError, match="register_cuda"):
        m.pwrite(t, "ckpt/x.bin")
    ro = gpu.make("uint8", 4096, seed=6)
    m.register_cuda(ro, writable=False)
    m.pwrite(ro, "ro.bin")
    with pytest.raises(ValueError, match="read-only"):
        m.pread(ro, "ro.bin")


def test_register_cuda_with_the_daemon(deepnvme, gpu):
    reason = mh.skip_reason()
    if reason:
        pytest.skip(reason)
    with mh.Scratch("py-gpu-mount") as s:
        with mh.Mount(s.backing, s.mnt) as mount:
            with deepnvme.Mount(s.mnt) as m:
                n = (2 << 20) + 77
                t = gpu.make("uint8", n, seed=9)
                m.register_cuda(t)  # the daemon takes cuda_ipc (fs/control/control.cc): no excuses
                assert m.pwrite(t, "gpu.bin", file_offset=4096) == n
                assert file_bytes(os.path.join(s.backing, "gpu.bin"))[4096:] == gpu.host_bytes(t)
                r = gpu.zeros("uint8", n)
                m.register_cuda(r)
                assert m.pread(r, "gpu.bin", file_offset=4096, async_op=True) >= 0
                ops = m.wait()
                assert len(ops) == 1 and ops[0]["ok"]
                assert gpu.host_bytes(r) == gpu.host_bytes(t)
            assert mount.alive() and mount.is_mounted(), mount.log_tail()
