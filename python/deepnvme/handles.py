"""DeepSpeed-compatible I/O handles: ``aio_handle`` and ``gds_handle``, plus ``cast_to_byte_tensor``.

``aio_handle`` has DeepSpeed's constructor arguments, method names and argument order, so code
written for ``AsyncIOBuilder().load().aio_handle(...)`` runs with ``deepnvme.aio_handle(...)``.
Buffers are CPU torch tensors, numpy arrays or any other C-contiguous buffer (bytearray, mmap,
memoryview), of any dtype. The engine runs with the GIL released. Failures raise ``OSError`` (or a
subclass such as ``FileNotFoundError``) whose ``errno``, ``filename`` and ``offset`` say what failed
and where; bad arguments raise ``TypeError`` / ``ValueError``. Nothing aborts the interpreter.

Differences from DeepSpeed, all on the side of reporting instead of asserting: a read past the end
of the file raises ``OSError(ENODATA)``; ``read`` of a file whose size differs from the buffer
raises ``ValueError``; ``wait`` raises for the first failed operation after all of them finished.

Thread safety: like DeepSpeed's, one handle is used by one thread at a time. Use one handle per
thread.
"""

import ctypes
import os
import sys

from . import _C

_DEFAULTS = dict(block_size=1048576, queue_depth=128, single_submit=False, overlap_events=False,
                 intra_op_parallelism=1)


def _torch():
    """torch if the program imported it (a tensor cannot exist otherwise); never imports it."""
    return sys.modules.get("torch")


def _is_tensor(obj):
    torch = _torch()
    return torch is not None and isinstance(obj, torch.Tensor)


def _buffer(obj, writable, what="buffer"):
    """(address, nbytes) of a tensor, ndarray or buffer; ValueError/TypeError when unusable."""
    if _is_tensor(obj):
        torch = _torch()
        if obj.device.type != "cpu":
            raise ValueError(
                "%s is a %s tensor; aio_handle moves CPU tensors (GPU memory needs the GPU path, "
                "deepnvme.gds_handle)" % (what, obj.device))
        if obj.layout != torch.strided:
            raise ValueError("%s is a %s tensor; only dense (strided) tensors can be moved" %
                             (what, obj.layout))
        if not obj.is_contiguous():
            raise ValueError("%s is not contiguous; pass tensor.contiguous()" % what)
        return obj.data_ptr(), obj.numel() * obj.element_size()
    np = sys.modules.get("numpy")
    if np is not None and isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise ValueError("%s is not C-contiguous; pass numpy.ascontiguousarray(a)" % what)
        if writable and not obj.flags.writeable:
            raise ValueError("%s is a read-only array and cannot be read into" % what)
        return obj.ctypes.data, obj.nbytes
    try:
        return _C.buffer_address(obj, writable)
    except TypeError:
        raise TypeError("%s must be a torch tensor, a numpy array or a buffer (bytearray, mmap, "
                        "memoryview), not %s" % (what, type(obj).__name__)) from None
    except BufferError as e:
        raise ValueError("%s cannot be used: %s" % (what, e)) from None


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
    """

    def __init__(self, block_size=1048576, queue_depth=128, single_submit=False,
                 overlap_events=False, intra_op_parallelism=1):
        for name, value in (("block_size", block_size), ("queue_depth", queue_depth),
                            ("intra_op_parallelism", intra_op_parallelism)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError("%s must be an int, not %s" % (name, type(value).__name__))
        for name, value in (("single_submit", single_submit), ("overlap_events", overlap_events)):
            if not isinstance(value, (bool, int)) or value not in (0, 1):
                raise TypeError("%s must be a bool, not %r" % (name, value))
        self._h = _C.AioHandle(block_size, queue_depth, bool(single_submit), bool(overlap_events),
                               intra_op_parallelism)
        self._in_flight = []  # buffers of async operations, alive until wait()
        self._locked = {}  # data_ptr -> HostBuffer of new_cpu_locked_tensor

    # --- settings ---------------------------------------------------------------------------
    def get_block_size(self):
        return self._h.get_block_size()

    def get_queue_depth(self):
        return self._h.get_queue_depth()

    def get_single_submit(self):
        return self._h.get_single_submit()

    def get_overlap_events(self):
        return self._h.get_overlap_events()

    def get_intra_op_parallelism(self):
        return self._h.get_intra_op_parallelism()

    # --- general form -----------------------------------------------------------------------
    def pread(self, buffer, filename, validate=False, async_op=False, file_offset=0, **kwargs):
        """Reads len(buffer) bytes of `filename` at `file_offset` into `buffer`.

        Returns 1 when synchronous, 0 when asynchronous (then wait() collects it). With validate
        the bytes are re-read through the page cache and compared.
        """
        async_op = _async_flag(async_op, kwargs, "pread")
        return self._io(True, buffer, filename, validate, async_op, file_offset)

    def pwrite(self, buffer, filename, validate=False, async_op=False, file_offset=0, **kwargs):
        """Writes `buffer` to `filename` at `file_offset` (created if missing, never truncated)."""
        async_op = _async_flag(async_op, kwargs, "pwrite")
        return self._io(False, buffer, filename, validate, async_op, file_offset)

    def _io(self, read, buffer, filename, validate, async_op, file_offset):
        address, nbytes = _buffer(buffer, writable=read)
        path = _path(filename)
        file_offset = _offset(file_offset)
        op = self._h.pread if read else self._h.pwrite
        result = op(address, nbytes, path, bool(validate), async_op, file_offset)
        if async_op:
            self._in_flight.append(buffer)
        return result

    # --- DeepSpeed's named forms ------------------------------------------------------------
    def sync_pread(self, buffer, filename, file_offset=0):
        return self.pread(buffer, filename, False, False, file_offset)

    def sync_pwrite(self, buffer, filename, file_offset=0):
        return self.pwrite(buffer, filename, False, False, file_offset)

    def async_pread(self, buffer, filename, file_offset=0):
        return self.pread(buffer, filename, False, True, file_offset)

    def async_pwrite(self, buffer, filename, file_offset=0):
        return self.pwrite(buffer, filename, False, True, file_offset)

    def read(self, buffer, filename, validate=False, file_offset=0):
        """Reads the whole file (from `file_offset`) into `buffer`, whose size must match."""
        path = _path(filename)
        _, nbytes = _buffer(buffer, writable=True)
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

        Raises OSError for the first failed one (after all have finished)."""
        try:
            return self._h.wait()
        finally:
            self._in_flight.clear()

    # --- pinned tensors ---------------------------------------------------------------------
    def new_cpu_locked_tensor(self, num_elem, example_tensor):
        """A 1-D CPU tensor of `num_elem` elements of example_tensor's dtype in page-locked,
        page-aligned memory (zero-filled)."""
        torch = _torch()
        if torch is None or not isinstance(example_tensor, torch.Tensor):
            raise TypeError("example_tensor must be a torch tensor (it gives the dtype)")
        if isinstance(num_elem, bool) or not isinstance(num_elem, int) or num_elem < 0:
            raise ValueError("num_elem must be an int >= 0, not %r" % (num_elem,))
        dtype = example_tensor.dtype
        if num_elem == 0:
            return torch.empty(0, dtype=dtype)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        memory = _C.HostBuffer(num_elem * itemsize, True)
        tensor = torch.frombuffer(memory, dtype=dtype, count=num_elem)
        self._locked[tensor.data_ptr()] = memory
        return tensor

    def free_cpu_locked_tensor(self, tensor):
        """Releases the handle's hold on a tensor from new_cpu_locked_tensor; True if it was one.

        The memory is unlocked and freed when the last view of it is gone (never under a tensor
        that is still in use)."""
        if not _is_tensor(tensor):
            raise TypeError("free_cpu_locked_tensor expects a torch tensor")
        return self._locked.pop(tensor.data_ptr(), None) is not None

    # --- extras -----------------------------------------------------------------------------
    def fsync(self, filename):
        """fsync(2) the file: after it returns, what was written is on disk."""
        self._h.fsync(_path(filename))

    def stats(self):
        """The engine's counters for this handle (dict, as `dnvme io --json`)."""
        import json
        return json.loads(self._h.stats_json())

    def __repr__(self):
        return ("deepnvme.aio_handle(block_size=%d, queue_depth=%d, single_submit=%s, "
                "overlap_events=%s, intra_op_parallelism=%d)" %
                (self.get_block_size(), self.get_queue_depth(), self.get_single_submit(),
                 self.get_overlap_events(), self.get_intra_op_parallelism()))


class GdsUnavailableError(RuntimeError):
    """gds_handle cannot run here; the message says why (no GPU, no cuFile, no GPU build)."""


def gds_unavailable_reason():
    """Why gds_handle cannot be created in this process (a sentence), or None if it could."""
    reasons = []
    torch = _torch()
    if torch is None:
        try:
            import torch  # noqa: F401  (only to ask CUDA; deepnvme itself does not need torch)
        except ImportError:
            torch = None
    if torch is None:
        reasons.append("torch is not installed")
    elif not torch.cuda.is_available():
        reasons.append("no CUDA device (torch.cuda.is_available() is False)")
    try:
        ctypes.CDLL("libcufile.so.0")
    except OSError:
        reasons.append("libcufile.so.0 (GPUDirect Storage) cannot be loaded")
    reasons.append("this build of deepnvme has no GPU path yet (dnvme::GdsHandle, the GPU issue)")
    return "deepnvme.gds_handle is not available: " + "; ".join(reasons) + \
        ". Use deepnvme.aio_handle with CPU tensors."


class gds_handle(aio_handle):
    """DeepSpeed's ``gds_handle``: the aio_handle API for CUDA tensors through GPUDirect Storage.

    Creating one raises GdsUnavailableError with the reason while the GPU path is not available
    (no CUDA device, no libcufile, or a build without it).
    """

    def __init__(self, block_size=1048576, queue_depth=128, single_submit=False,
                 overlap_events=False, intra_op_parallelism=1):
        raise GdsUnavailableError(gds_unavailable_reason())

    def new_pinned_device_tensor(self, num_elem, example_tensor):
        raise GdsUnavailableError(gds_unavailable_reason())

    def free_pinned_device_tensor(self, tensor):
        raise GdsUnavailableError(gds_unavailable_reason())

    def pin_device_tensor(self, tensor):
        raise GdsUnavailableError(gds_unavailable_reason())

    def unpin_device_tensor(self, tensor):
        raise GdsUnavailableError(gds_unavailable_reason())


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


__all__ = ["aio_handle", "gds_handle", "GdsUnavailableError", "gds_unavailable_reason",
           "cast_to_byte_tensor"]
