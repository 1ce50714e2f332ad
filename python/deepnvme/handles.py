"""DeepSpeed-compatible I/O handles: ``aio_handle`` and ``gds_handle``, plus ``cast_to_byte_tensor``.

``aio_handle`` has DeepSpeed's constructor arguments, method names and argument order, so code
written for ``AsyncIOBuilder().load().aio_handle(...)`` runs with ``deepnvme.aio_handle(...)``;
``gds_handle`` is the same for ``GDSBuilder().load().gds_handle(...)``, with pin_device_tensor,
unpin_device_tensor, new_pinned_device_tensor and free_pinned_device_tensor.
Buffers are CPU torch tensors, numpy arrays or any other C-contiguous buffer (bytearray, mmap,
memoryview), of any dtype, and CUDA memory: CUDA torch tensors and any object with
``__cuda_array_interface__`` (CuPy, numba). ``aio_handle`` moves CUDA memory through pinned host
staging; ``gds_handle`` through GPUDirect Storage when the machine has it. Before touching a
CUDA buffer the handle waits for the work queued on it (torch's current stream, or the
interface's ``stream``). The engine runs with the GIL released. Failures raise ``OSError`` (or a
subclass such as ``FileNotFoundError``) whose ``errno``, ``filename`` and ``offset`` say what failed
and where; bad arguments raise ``TypeError`` / ``ValueError``. Nothing aborts the interpreter.

Differences from DeepSpeed, all on the side of reporting instead of asserting: a read past the end
of the file raises ``OSError(ENODATA)``; ``read`` of a file whose size differs from the buffer
raises ``ValueError``; ``wait`` raises for the first failed operation after all of them finished.

Thread safety: like DeepSpeed's, one handle is used by one thread at a time. Use one handle per
thread.
"""

import collections
import ctypes
import errno
import os
import re
import sys

from . import _C
from . import pinned as _pinned

_DEFAULTS = dict(block_size=1048576, queue_depth=128, single_submit=False, overlap_events=False,
                 intra_op_parallelism=1)


def _torch():
    """torch if the program imported it (a tensor cannot exist otherwise); never imports it."""
    return sys.modules.get("torch")


def _is_tensor(obj):
    torch = _torch()
    return torch is not None and isinstance(obj, torch.Tensor)


class Memory(collections.namedtuple("Memory", "address nbytes device sync")):
    """What _buffer found: the address and size of the bytes; `device` is None for host memory,
    the CUDA device index for device memory, or -1 for device memory whose device CUDA has not
    been asked about yet (an object with __cuda_array_interface__); `sync` is None or a callable
    that waits until the producer's pending GPU work on the memory is done."""

    @property
    def is_cuda(self):
        return self.device is not None


_TYPESTR = re.compile(r"^[<>|=][a-zA-Z]([0-9]+)$")


def _cuda_interface(obj, writable, what):
    """Memory of an object exporting the CUDA Array Interface (CuPy, numba, torch, ...)."""
    try:
        cai = obj.__cuda_array_interface__
    except AttributeError:
        return None
    except Exception as e:  # a property that refuses (torch: requires grad, ...)
        raise ValueError("%s cannot export __cuda_array_interface__: %s" % (what, e)) from None
    if not isinstance(cai, dict):
        raise TypeError("%s.__cuda_array_interface__ must be a dict, not %s" %
                        (what, type(cai).__name__))
    for key in ("shape", "typestr", "data"):
        if key not in cai:
            raise TypeError("%s.__cuda_array_interface__ has no %r" % (what, key))
    shape, typestr, data = cai["shape"], cai["typestr"], cai["data"]
    if not isinstance(shape, (tuple, list)) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise TypeError("%s.__cuda_array_interface__: shape must be a tuple of ints >= 0, not %r" %
                        (what, shape))
    m = _TYPESTR.match(typestr) if isinstance(typestr, str) else None
    if m is None or int(m.group(1)) <= 0:
        raise TypeError("%s.__cuda_array_interface__: bad typestr %r" % (what, typestr))
    if not isinstance(data, (tuple, list)) or len(data) != 2 or isinstance(data[0], bool) or \
            not isinstance(data[0], int) or data[0] < 0:
        raise TypeError("%s.__cuda_array_interface__: data must be (pointer, read_only), not %r" %
                        (what, data))
    if cai.get("mask") is not None:
        raise ValueError("%s is a masked CUDA array; only plain arrays can be moved" % what)
    itemsize = int(m.group(1))
    count = 1
    for n in shape:
        count *= n
    nbytes = count * itemsize
    strides = cai.get("strides")
    if strides is not None and count > 0:
        if not isinstance(strides, (tuple, list)) or len(strides) != len(shape):
            raise TypeError("%s.__cuda_array_interface__: strides %r do not match shape %r" %
                            (what, strides, shape))
        expected = itemsize
        for n, stride in zip(reversed(shape), reversed(strides)):
            if n > 1 and stride != expected:
                raise ValueError("%s is not C-contiguous (shape %r, strides %r); pass a "
                                 "contiguous copy" % (what, tuple(shape), tuple(strides)))
            expected *= n
    if writable and data[1]:
        raise ValueError("%s is a read-only CUDA array and cannot be read into" % what)
    if nbytes > 0 and data[0] == 0:
        raise ValueError("%s.__cuda_array_interface__ has a null data pointer" % what)
    stream = cai.get("stream")
    if stream is not None and (isinstance(stream, bool) or not isinstance(stream, int) or
                               stream == 0):
        raise TypeError("%s.__cuda_array_interface__: bad stream %r (0 is not allowed)" %
                        (what, stream))
    sync = None if stream is None else (lambda: _sync_cuda_stream(stream))
    return Memory(data[0], nbytes, -1, sync)


_libcuda = None


def _sync_cuda_stream(stream):
    """cuStreamSynchronize on a stream named by the CUDA Array Interface (1: the legacy default
    stream, 2: the per-thread default stream, else a CUstream), through the driver that the
    producer of the array already loaded."""
    global _libcuda
    if _libcuda is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
        lib.cuStreamSynchronize.restype = ctypes.c_int
        _libcuda = lib
    rc = _libcuda.cuStreamSynchronize(ctypes.c_void_p(stream))
    if rc != 0:
        raise OSError(errno.EIO, "cuStreamSynchronize(%#x) of a __cuda_array_interface__ stream: "
                      "CUresult %d" % (stream, rc))


def _buffer(obj, writable, what="buffer"):
    """Memory(address, nbytes, device, sync) of a tensor, array or buffer (host or CUDA);
    ValueError/TypeError when unusable.

    Host: CPU torch tensors, numpy arrays, anything with the buffer protocol. CUDA: torch
    tensors on a CUDA device and any object with __cuda_array_interface__ (CuPy, numba). Both must
    be dense and C-contiguous; a read target must be writable."""
    if _is_tensor(obj):
        torch = _torch()
        if obj.layout != torch.strided:
            raise ValueError("%s is a %s tensor; only dense (strided) tensors can be moved" %
                             (what, obj.layout))
        if obj.device.type not in ("cpu", "cuda"):
            raise ValueError("%s is a %s tensor; deepnvme moves CPU and CUDA tensors" %
                             (what, obj.device))
        if not obj.is_contiguous():
            raise ValueError("%s is not contiguous; pass tensor.contiguous()" % what)
        nbytes = obj.numel() * obj.element_size()
        if obj.device.type == "cpu":
            return Memory(obj.data_ptr(), nbytes, None, None)
        device = obj.device.index if obj.device.index is not None else \
            torch.cuda.current_device()
        # The engine's copies run on streams of their own: wait for the work torch queued on the
        # tensor (it may still be producing the bytes to write, or using the memory a read fills).
        return Memory(obj.data_ptr(), nbytes, device,
                      lambda: torch.cuda.current_stream(obj.device).synchronize())
    np = sys.modules.get("numpy")
    if np is not None and isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise ValueError("%s is not C-contiguous; pass numpy.ascontiguousarray(a)" % what)
        if writable and not obj.flags.writeable:
            raise ValueError("%s is a read-only array and cannot be read into" % what)
        return Memory(obj.ctypes.data, obj.nbytes, None, None)
    cuda = _cuda_interface(obj, writable, what)
    if cuda is not None:
        return cuda
    try:
        address, nbytes = _C.buffer_address(obj, writable)
    except TypeError:
        raise TypeError("%s must be a torch tensor, a numpy array or a buffer (bytearray, mmap, "
                        "memoryview), or CUDA memory (__cuda_array_interface__), not %s" %
                        (what, type(obj).__name__)) from None
    except BufferError as e:
        raise ValueError("%s cannot be used: %s" % (what, e)) from None
    return Memory(address, nbytes, None, None)


def cuda_unavailable_reason():
    """Why no CUDA device can be used by deepnvme here (a sentence), or None when one can."""
    return _C.cuda_unavailable_reason() or None


def _unavailable(reason, what="deepnvme.gds_handle"):
    e = GdsUnavailableError("%s is not available: %s" % (what, reason))
    e.errno = errno.ENODEV
    return e


def _device_of(mem):
    """The CUDA device of device memory (asks CUDA for __cuda_array_interface__ objects)."""
    if mem.device is not None and mem.device >= 0:
        return mem.device
    reason = _C.cuda_unavailable_reason()
    if reason:
        raise _unavailable(reason, "CUDA memory I/O")
    return _C.cuda_pointer_device(mem.address)


def _new_gds(config, cufile, device, cufile_compat, what):
    """A native GdsHandle; GdsUnavailableError (with the reason) when there is no device or the
    asked-for data path is missing."""
    reason = _C.cuda_unavailable_reason()
    if reason:
        raise _unavailable(reason, what)
    try:
        return _C.GdsHandle(*config, cufile=cufile, device=device, cufile_compat=cufile_compat)
    except OSError as e:
        if e.errno in (errno.ENODEV, errno.EOPNOTSUPP):
            raise _unavailable(e.strerror or str(e), what) from None
        raise


def _failure(results):
    """OSError for the first failed (ok, errno, message, path, offset), or None."""
    failed = [r for r in results if not r[0]]
    if not failed:
        return None
    _, err, message, path, offset = failed[0]
    if len(failed) > 1:
        message += " (%d of %d operations failed; this is the first)" % (len(failed), len(results))
    e = OSError(err, message, path) if path else OSError(err, message)
    e.offset = offset
    return e


def _check_config(block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism):
    for name, value in (("block_size", block_size), ("queue_depth", queue_depth),
                        ("intra_op_parallelism", intra_op_parallelism)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError("%s must be an int, not %s" % (name, type(value).__name__))
    for name, value in (("single_submit", single_submit), ("overlap_events", overlap_events)):
        if not isinstance(value, (bool, int)) or value not in (0, 1):
            raise TypeError("%s must be a bool, not %r" % (name, value))
    config = (block_size, queue_depth, bool(single_submit), bool(overlap_events),
              intra_op_parallelism)
    _C.check_handle_config(*config)
    return config


def _path(filename):
    try:
        path = os.fspath(filename)
    except TypeError:
        raise TypeError("filename must be a str or os.PathLike, not %s" %
                        type(filename).__name__) from None
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not path:
        raise ValueError("filename is empty")
    return path


def _target(filename, fd, method):
    """("path", str) or ("fd", int): DeepSpeed passes a file either by name or, as an int in the
    same position (or as the keyword `fd`), by an open descriptor the caller owns."""
    if fd is not None:
        if filename is not None:
            raise TypeError("%s() takes a filename or an fd, not both" % method)
        filename = fd
    if filename is None:
        raise TypeError("%s() needs a filename (or fd)" % method)
    if isinstance(filename, int) and not isinstance(filename, bool):
        if filename < 0:
            raise ValueError("%s(): fd must be >= 0, not %d" % (method, filename))
        return "fd", filename
    return "path", _path(filename)


def _example(example_tensor, example_tenosr, method):
    """The example tensor of new_*_tensor, given under either spelling (DeepSpeed's keyword is
    `example_tenosr`)."""
    if example_tenosr is None:
        return example_tensor
    if example_tensor is not None:
        raise TypeError("%s() got example_tensor twice" % method)
    return example_tenosr


def _offset(file_offset):
    if isinstance(file_offset, bool) or not isinstance(file_offset, int):
        raise TypeError("file_offset must be an int, not %s" % type(file_offset).__name__)
    if file_offset < 0:
        raise ValueError("file_offset must be >= 0, not %d" % file_offset)
    return file_offset


def _async_flag(async_op, kwargs, method):
    # DeepSpeed names the argument `async` (a Python keyword): accept it through **kwargs.
    if "async" in kwargs:
        async_op = kwargs.pop("async")
    if kwargs:
        raise TypeError("%s() got an unexpected keyword argument %r" % (method, next(iter(kwargs))))
    return bool(async_op)


class aio_handle:
    """DeepSpeed's ``aio_handle`` over the dnvmefs engine (O_DIRECT libaio, every completion checked).

    aio_handle(block_size=1048576, queue_depth=128, single_submit=False, overlap_events=False,
               intra_op_parallelism=1)

    CUDA memory (a CUDA tensor, or any object with ``__cuda_array_interface__``) is accepted too:
    it moves through pinned host staging buffers and this handle's settings (a GdsHandle with
    cufile='never', made on first use, one per device). ``wait`` collects host and device
    operations together, in submission order; operations on different kinds of memory are not
    ordered against each other until then.
    """

    def __init__(self, block_size=1048576, queue_depth=128, single_submit=False,
                 overlap_events=False, intra_op_parallelism=1):
        self._config = _check_config(block_size, queue_depth, single_submit, overlap_events,
                                     intra_op_parallelism)
        self._h = _C.AioHandle(*self._config)
        self._init_state()

    def _init_state(self):
        self._bounce = {}  # CUDA device -> _C.GdsHandle (cufile='never') for device memory
        self._order = []  # engine key of each async operation since the last wait()
        self._in_flight = []  # buffers of async operations, alive until wait()

    def _primary(self):
        return self._h

    def _engines(self):
        """(key, native engine) of every engine this handle submitted to."""
        return [("host", self._h)] + sorted(self._bounce.items())

    def _engine(self, mem):
        """(key, native engine) that moves `mem`."""
        if not mem.is_cuda or mem.nbytes == 0:  # zero bytes: nothing to copy, no CUDA needed
            return "host", self._h
        device = _device_of(mem)
        engine = self._bounce.get(device)
        if engine is None:
            engine = _new_gds(self._config, "never", device, False,
                              "deepnvme.aio_handle with CUDA memory")
            self._bounce[device] = engine
        return device, engine

    # --- settings ---------------------------------------------------------------------------
    def get_block_size(self):
        return self._primary().get_block_size()

    def get_queue_depth(self):
        return self._primary().get_queue_depth()

    def get_single_submit(self):
        return self._primary().get_single_submit()

    def get_overlap_events(self):
        return self._primary().get_overlap_events()

    def get_intra_op_parallelism(self):
        return self._primary().get_intra_op_parallelism()

    def get_alignment(self):
        """DeepSpeed's value, intra_op_parallelism * 512: the unit its FastFileWriter buffers are
        sized in. deepnvme itself needs no alignment of sizes, offsets or memory."""
        return self.get_intra_op_parallelism() * 512

    # --- general form -----------------------------------------------------------------------
    def pread(self, buffer, filename=None, validate=False, async_op=False, file_offset=0, *,
              fd=None, **kwargs):
        """Reads len(buffer) bytes of `filename` (or of the open descriptor `fd`, also accepted
        as an int in filename's place) at `file_offset` into `buffer`.

        Returns 1 when synchronous, 0 when asynchronous (then wait() collects it). With validate
        the bytes are re-read through the page cache and compared.
        """
        async_op = _async_flag(async_op, kwargs, "pread")
        return self._io(True, buffer, _target(filename, fd, "pread"), validate, async_op,
                        file_offset)

    def pwrite(self, buffer, filename=None, validate=False, async_op=False, file_offset=0, *,
               fd=None, **kwargs):
        """Writes `buffer` to `filename` (or `fd`) at `file_offset` (a file is created if
        missing, never truncated)."""
        async_op = _async_flag(async_op, kwargs, "pwrite")
        return self._io(False, buffer, _target(filename, fd, "pwrite"), validate, async_op,
                        file_offset)

    def _io(self, read, buffer, target, validate, async_op, file_offset):
        mem = _buffer(buffer, writable=read)
        kind, file = target
        file_offset = _offset(file_offset)
        key, engine = self._engine(mem)
        if mem.sync is not None:
            mem.sync()
        if kind == "fd":
            op = engine.pread_fd if read else engine.pwrite_fd
        else:
            op = engine.pread if read else engine.pwrite
        result = op(mem.address, mem.nbytes, file, bool(validate), async_op, file_offset)
        if async_op:
            self._in_flight.append(buffer)
            self._order.append(key)
        return result

    # --- DeepSpeed's named forms ------------------------------------------------------------
    def sync_pread(self, buffer, filename=None, file_offset=0, *, fd=None):
        return self.pread(buffer, filename, False, False, file_offset, fd=fd)

    def sync_pwrite(self, buffer, filename=None, file_offset=0, *, fd=None):
        return self.pwrite(buffer, filename, False, False, file_offset, fd=fd)

    def async_pread(self, buffer, filename=None, file_offset=0, *, fd=None):
        return self.pread(buffer, filename, False, True, file_offset, fd=fd)

    def async_pwrite(self, buffer, filename=None, file_offset=0, *, fd=None):
        return self.pwrite(buffer, filename, False, True, file_offset, fd=fd)

    def read(self, buffer, filename, validate=False, file_offset=0):
        """Reads the whole file (from `file_offset`) into `buffer`, whose size must match."""
        path = _path(filename)
        nbytes = _buffer(buffer, writable=True).nbytes
        size = os.stat(path).st_size - _offset(file_offset)
        if nbytes != size:
            raise ValueError("read: buffer is %d bytes but '%s' has %d bytes from offset %d" %
                             (nbytes, path, size, file_offset))
        self.pread(buffer, path, validate, False, file_offset)
        return 0

    def write(self, buffer, filename, validate=False, file_offset=0):
        """Writes all of `buffer` to `filename` at `file_offset`, synchronously."""
        self.pwrite(buffer, filename, validate, False, file_offset)
        return 0

    def wait(self):
        """Waits for every asynchronous operation; returns how many completed.

        Raises OSError for the first failed one in submission order (after all have finished)."""
        try:
            results = {key: collections.deque(engine.wait_results())
                       for key, engine in self._engines()}
            merged = []
            for key in self._order:
                if results.get(key):
                    merged.append(results[key].popleft())
            for rest in results.values():  # none expected: every async op is in _order
                merged.extend(rest)
            failure = _failure(merged)
            if failure is not None:
                raise failure
            return len(merged)
        finally:
            self._order.clear()
            self._in_flight.clear()

    def pending(self):
        """Asynchronous operations submitted and not yet collected by wait()."""
        return sum(engine.pending() for _, engine in self._engines())

    # --- pinned tensors (the process-wide registry of deepnvme.pinned) ------------------------
    def new_cpu_locked_tensor(self, num_elem, example_tensor=None, *, example_tenosr=None):
        """A 1-D CPU tensor of `num_elem` elements of example_tensor's dtype in page-locked,
        page-aligned memory (zero-filled), known to every handle and pin_handle of the process.
        (DeepSpeed's keyword is spelled `example_tenosr`; both spellings are accepted.)"""
        return _pinned.new_locked_tensor(
            num_elem, _example(example_tensor, example_tenosr, "new_cpu_locked_tensor"))

    def free_cpu_locked_tensor(self, tensor):
        """Unregisters a tensor from new_cpu_locked_tensor (this or any other handle's); True if
        it was one, False for any other tensor (a slice, an ordinary or CUDA tensor).

        The memory is unlocked and freed when the last view of it is gone (never under a tensor
        that is still in use)."""
        if not _is_tensor(tensor):
            raise TypeError("free_cpu_locked_tensor expects a torch tensor")
        return _pinned.free_tensor(tensor)

    def is_pinned(self, buffer):
        """True when all of `buffer` lies in memory from new_cpu_locked_tensor (any handle's or
        pin_handle's; slices included). As in DeepSpeed, a tensor torch pinned itself is not
        counted here (pin_handle.is_pinned counts it)."""
        return _pinned.is_registered(buffer)

    # --- extras -----------------------------------------------------------------------------
    def fsync(self, filename):
        """fsync(2) the file: after it returns, what was written is on disk."""
        self._primary().fsync(_path(filename))

    def stats(self):
        """The engine's counters for this handle (dict, as `dnvme io --json`); with CUDA memory
        moved, "gpu" maps each device to its staging engine's counters."""
        import json
        stats = json.loads(self._h.stats_json())
        if self._bounce:
            stats["gpu"] = {str(d): json.loads(g.stats_json()) for d, g in self._bounce.items()}
        return stats

    def __repr__(self):
        return ("deepnvme.%s(block_size=%d, queue_depth=%d, single_submit=%s, "
                "overlap_events=%s, intra_op_parallelism=%d)" %
                (type(self).__name__, self.get_block_size(), self.get_queue_depth(),
                 self.get_single_submit(), self.get_overlap_events(),
                 self.get_intra_op_parallelism()))


class GdsUnavailableError(RuntimeError, OSError):
    """gds_handle (or CUDA memory I/O) cannot run here; the message says why (no CUDA device, no
    CUDA driver, a build without CUDA, GPUDirect Storage required but missing). errno is ENODEV.
    Both a RuntimeError and an OSError."""


def gds_unavailable_reason():
    """Why gds_handle cannot be created in this process (a sentence), or None if it can."""
    reason = _C.cuda_unavailable_reason()
    if not reason:
        return None
    return ("deepnvme.gds_handle is not available: %s. Use deepnvme.aio_handle with CPU tensors." %
            reason)


class gds_handle(aio_handle):
    """DeepSpeed's ``gds_handle``: the aio_handle API for CUDA memory, through GPUDirect Storage
    (cuFile) when the machine has it, else through the engine's parallel pinned staging path.

    gds_handle(block_size=1048576, queue_depth=128, single_submit=False, overlap_events=False,
               intra_op_parallelism=1, *, device=None, cufile="auto", cufile_compat=False)

    Buffers: CUDA tensors or ``__cuda_array_interface__`` objects on this handle's device (default:
    torch's current device, else 0), and host tensors/arrays/buffers (moved by the libaio engine).
    ``cufile``: "auto" (cuFile in GDS or P2PDMA mode when it loads, else staging), "require" (fail
    without it), "never" (staging). ``mode`` / ``mode_reason`` say which path was chosen and why.
    Creating one where no CUDA device is usable raises GdsUnavailableError with the reason.
    """

    def __init__(self, block_size=1048576, queue_depth=128, single_submit=False,
                 overlap_events=False, intra_op_parallelism=1, *, device=None, cufile="auto",
                 cufile_compat=False):
        self._config = _check_config(block_size, queue_depth, single_submit, overlap_events,
                                     intra_op_parallelism)
        if cufile not in ("auto", "require", "never"):
            raise ValueError("cufile must be 'auto', 'require' or 'never', not %r" % (cufile,))
        if device is not None and (isinstance(device, bool) or not isinstance(device, int) or
                                   device < 0):
            raise ValueError("device must be a CUDA device index >= 0, not %r" % (device,))
        reason = _C.cuda_unavailable_reason()
        if reason:
            raise _unavailable(reason)
        if device is None:
            torch = _torch()
            device = torch.cuda.current_device() if torch is not None and \
                torch.cuda.is_available() else 0
        self._g = _new_gds(self._config, cufile, device, bool(cufile_compat),
                           "deepnvme.gds_handle")
        self._device = device
        self._aio = None
        self._init_state()
        self._pinned = {}  # address -> tensor pinned by pin_device_tensor (kept alive)
        self._device_buffers = {}  # data_ptr -> _C.DeviceBuffer of new_pinned_device_tensor

    @property
    def _h(self):
        # A plain libaio engine with the same settings, only for code that needs one
        # (FastFileWriter); this handle's own operations all go through the GdsHandle.
        if self._aio is None:
            self._aio = _C.AioHandle(*self._config)
        return self._aio

    def _primary(self):
        return self._g

    def _engines(self):
        return [("gds", self._g)]

    def _engine(self, mem):
        if mem.is_cuda and mem.nbytes > 0:
            device = _device_of(mem)
            if device != self._device:
                raise ValueError("the buffer is on cuda:%d but this gds_handle serves cuda:%d "
                                 "(gds_handle(device=%d))" % (device, self._device, device))
        return "gds", self._g

    @property
    def device(self):
        """The CUDA device this handle's staging buffers and streams belong to."""
        return self._device

    @property
    def mode(self):
        """The data path for device memory: "gds", "p2pdma", "compat" (cuFile) or "bounce"."""
        return self._g.mode

    @property
    def mode_reason(self):
        """Why this mode (e.g. "nvidia-fs 2.17 loaded", or why cuFile is not used)."""
        return self._g.mode_reason

    def stats(self):
        """The handle's counters (dict): operations and bytes by path (cufile, bounce, host),
        cuFile calls, copies, pinned buffers, and the libaio engine's counters under "engine"."""
        import json
        return json.loads(self._g.stats_json())

    # --- device memory ----------------------------------------------------------------------
    def _device_memory(self, tensor, what):
        mem = _buffer(tensor, writable=False, what=what)
        if not mem.is_cuda:
            raise ValueError("%s is host memory; pinning is for CUDA memory (host tensors: "
                             "new_cpu_locked_tensor)" % what)
        if mem.nbytes == 0:
            raise ValueError("%s is empty" % what)
        self._engine(mem)  # the device check
        return mem

    def pin_device_tensor(self, tensor):
        """Registers the tensor's memory with cuFile (cuFileBufRegister) so I/O into it, or into
        any part of it, skips cuFile's internal staging; True. The tensor is kept alive until
        unpin_device_tensor. In bounce mode the range is only recorded."""
        mem = self._device_memory(tensor, "tensor")
        self._g.pin(mem.address, mem.nbytes)
        self._pinned[mem.address] = tensor
        return True

    def unpin_device_tensor(self, tensor):
        """Undoes pin_device_tensor; True. ValueError if the tensor is not pinned."""
        mem = self._device_memory(tensor, "tensor")
        self._g.unpin(mem.address)
        self._pinned.pop(mem.address, None)
        return True

    def new_pinned_device_buffer(self, num_bytes):
        """Zero-filled device memory on this handle's device, pinned: a deepnvme._C.DeviceBuffer
        with `address`, `nbytes`, `device` and __cuda_array_interface__ (torch.as_tensor(buf,
        device="cuda"), cupy.asarray(buf) view it). Freed and unpinned when the last reference
        goes."""
        if isinstance(num_bytes, bool) or not isinstance(num_bytes, int) or num_bytes <= 0:
            raise ValueError("num_bytes must be a positive int, not %r" % (num_bytes,))
        return self._g.new_pinned_device_buffer(num_bytes)

    def new_pinned_device_tensor(self, num_elem, example_tensor=None, *, example_tenosr=None):
        """A 1-D CUDA tensor of `num_elem` elements of example_tensor's dtype on this handle's
        device, zero-filled and pinned (new_pinned_device_buffer viewed by torch). DeepSpeed's
        keyword spelling `example_tenosr` is accepted too."""
        example_tensor = _example(example_tensor, example_tenosr, "new_pinned_device_tensor")
        torch = _pinned.check_new_tensor_args(num_elem, example_tensor)
        if not torch.cuda.is_available():
            raise RuntimeError("new_pinned_device_tensor: this torch cannot use CUDA (torch %s, "
                               "CUDA %s); view new_pinned_device_buffer() with CuPy instead" %
                               (torch.__version__, torch.version.cuda))
        dtype = example_tensor.dtype
        device = torch.device("cuda", self._device)
        if num_elem == 0:
            return torch.empty(0, dtype=dtype, device=device)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        memory = self._g.new_pinned_device_buffer(num_elem * itemsize)
        # The tensor holds a reference to `memory` (torch keeps the interface's owner alive).
        tensor = torch.as_tensor(memory, device=device)
        if dtype != torch.uint8:
            tensor = tensor.view(dtype)
        if tensor.data_ptr() != memory.address:
            raise RuntimeError("new_pinned_device_tensor: torch copied the buffer")  # a bug
        self._device_buffers[tensor.data_ptr()] = memory
        return tensor

    def free_pinned_device_tensor(self, tensor):
        """Unpins a tensor from new_pinned_device_tensor (or pin_device_tensor) and drops the
        handle's hold on it; True if it was one. The memory is freed when the last view of it is
        gone (never under a tensor that is still in use)."""
        if not _is_tensor(tensor):
            raise TypeError("free_pinned_device_tensor expects a torch tensor")
        memory = self._device_buffers.pop(tensor.data_ptr(), None)
        if memory is not None:
            self._g.unpin(memory.address)
            return True
        if tensor.data_ptr() in self._pinned:
            return self.unpin_device_tensor(tensor)
        return False


def cast_to_byte_tensor(tensor):
    """A zero-copy 1-D uint8 view of all the bytes of a contiguous tensor (any dtype, any device)."""
    torch = _torch()
    if torch is None or not isinstance(tensor, torch.Tensor):
        raise TypeError("cast_to_byte_tensor expects a torch tensor, not %s" %
                        type(tensor).__name__)
    if tensor.layout != torch.strided or not tensor.is_contiguous():
        raise ValueError("cast_to_byte_tensor needs a dense contiguous tensor")
    if tensor.dtype == torch.uint8:
        return tensor.reshape(-1)
    flat = tensor.reshape(-1)  # a view for a contiguous tensor
    view = flat.view(torch.uint8)
    if view.numel() != tensor.numel() * tensor.element_size() or (
            tensor.numel() > 0 and view.data_ptr() != tensor.data_ptr()):
        raise RuntimeError("cast_to_byte_tensor: torch returned a copy, not a view")  # a bug
    return view


def _whole_file(what, buffer, filename, block_size, queue_depth, single_submit, overlap_events,
                validate):
    handle = aio_handle(block_size, queue_depth, single_submit, overlap_events, 1)
    op = handle.read if what == "read" else handle.write
    return op(buffer, filename, bool(validate))


def aio_read(buffer, filename, block_size, queue_depth, single_submit, overlap_events, validate):
    """DeepSpeed's async_io.aio_read: reads all of `filename` into `buffer` (same size) with a
    one-worker handle of these settings; returns 0. Failures raise (DeepSpeed returns -1 or
    asserts)."""
    return _whole_file("read", buffer, filename, block_size, queue_depth, single_submit,
                       overlap_events, validate)


def aio_write(buffer, filename, block_size, queue_depth, single_submit, overlap_events,
              validate):
    """DeepSpeed's async_io.aio_write: writes all of `buffer` to `filename` at offset 0 (created
    if missing, not truncated); returns 0. Failures raise."""
    return _whole_file("write", buffer, filename, block_size, queue_depth, single_submit,
                       overlap_events, validate)


def deepspeed_memcpy(dest, src):
    """DeepSpeed's async_io.deepspeed_memcpy: copies the bytes of `src` into `dest` (contiguous
    CPU tensors of equal byte size; DeepSpeed assumes float32 and copies dest.size(0)
    elements, which for its float32 1-D use is the same); returns 0."""
    torch = _torch()
    for name, t in (("dest", dest), ("src", src)):
        if torch is None or not isinstance(t, torch.Tensor):
            raise TypeError("deepspeed_memcpy: %s must be a torch tensor, not %s" %
                            (name, type(t).__name__))
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("deepspeed_memcpy: %s must be a contiguous CPU tensor" % name)
    nbytes = dest.numel() * dest.element_size()
    if src.numel() * src.element_size() != nbytes:
        raise ValueError("deepspeed_memcpy: dest is %d bytes but src is %d bytes" %
                         (nbytes, src.numel() * src.element_size()))
    if nbytes:
        cast_to_byte_tensor(dest).copy_(cast_to_byte_tensor(src))
    return 0


__all__ = ["aio_handle", "gds_handle", "GdsUnavailableError", "gds_unavailable_reason",
           "cuda_unavailable_reason", "cast_to_byte_tensor", "aio_read", "aio_write",
           "deepspeed_memcpy"]
