"""Page-locked host tensors: one process-wide registry, and DeepSpeed's ``pin_handle``.

DeepSpeed 0.19 keeps one pinned-tensor manager per process: a tensor from any handle's
``new_cpu_locked_tensor`` (or from ``PinMemoryBuilder().load().pin_handle()``) is known to every
other handle, and so is any slice (``narrow``) of it. ZeRO-Infinity's swap buffer pool asserts
``aio_handle.is_pinned(buffer)`` on such slices. This module is that registry for deepnvme:
``aio_handle``, ``gds_handle`` and ``pin_handle`` all allocate, free and look up here.

Memory is page-aligned, page-locked (mlock; a refusal names RLIMIT_MEMLOCK) and zero-filled.
Freeing differs from DeepSpeed on purpose: DeepSpeed unlocks and frees the memory at once, so a
tensor (or slice) still in use reads freed memory; here ``free_cpu_locked_tensor`` removes the
registration (``is_pinned`` answers False from then on) and the memory is unlocked and freed when
the last tensor viewing it is gone.

Thread safety: every function may be called from any thread (one lock guards the registry).
"""

import bisect
import sys
import threading

from . import _C, _fork

_lock = threading.Lock()
_fork.renew_lock_in_child(globals(), "_lock")
_starts = []  # sorted base addresses of the registered regions
_regions = {}  # base address -> (nbytes, _C.HostBuffer)


def _torch_of(example, what):
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(example, torch.Tensor):
        raise TypeError("%s must be a torch tensor (it gives the dtype), not %s" %
                        (what, type(example).__name__))
    return torch


def check_new_tensor_args(num_elem, example_tensor, what="example_tensor"):
    """torch, after checking DeepSpeed's (num_elem, example_tensor) pair of the new_*_tensor
    calls: TypeError / ValueError naming the bad one."""
    torch = _torch_of(example_tensor, what)
    if isinstance(num_elem, bool) or not isinstance(num_elem, int) or num_elem < 0:
        raise ValueError("num_elem must be an int >= 0, not %r" % (num_elem,))
    return torch


def new_locked_tensor(num_elem, example_tensor, what="example_tensor"):
    """A 1-D CPU tensor of `num_elem` elements of example_tensor's dtype in registered,
    page-locked, page-aligned, zero-filled memory."""
    torch = check_new_tensor_args(num_elem, example_tensor, what)
    dtype = example_tensor.dtype
    if num_elem == 0:
        return torch.empty(0, dtype=dtype)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    memory = _C.HostBuffer(num_elem * itemsize, True)
    # torch.frombuffer keeps `memory` alive for as long as the tensor (or any view of it) lives.
    tensor = torch.frombuffer(memory, dtype=dtype, count=num_elem)
    with _lock:
        bisect.insort(_starts, memory.address)
        _regions[memory.address] = (memory.nbytes, memory)
    return tensor


def free_address(address):
    """Unregisters the region that starts at `address`; True if there was one."""
    if isinstance(address, bool) or not isinstance(address, int):
        raise TypeError("address must be an int, not %s" % type(address).__name__)
    with _lock:
        if _regions.pop(address, None) is None:
            return False
        del _starts[bisect.bisect_left(_starts, address)]
        return True


def free_tensor(tensor):
    """Unregisters the region `tensor` starts (DeepSpeed: the tensor from new_cpu_locked_tensor
    itself, not a slice); True if it was one, False for any other tensor."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(tensor, torch.Tensor):
        raise TypeError("expected a torch tensor, not %s" % type(tensor).__name__)
    if tensor.device.type != "cpu":
        return False
    return free_address(tensor.data_ptr())


def _extent(tensor):
    """(first byte address, byte length) of every element of a CPU tensor, strided or not."""
    if tensor.numel() == 0:
        return tensor.data_ptr(), 0
    itemsize = tensor.element_size()
    low = high = 0
    for size, stride in zip(tensor.shape, tensor.stride()):
        span = (size - 1) * stride
        if span < 0:
            low += span
        else:
            high += span
    return tensor.data_ptr() + low * itemsize, (high - low + 1) * itemsize


def is_registered(buffer):
    """True when all of `buffer`'s bytes lie in one registered region (so a slice of a locked
    tensor is registered; a CUDA tensor or plain memory is not)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(buffer, torch.Tensor):
        if buffer.device.type != "cpu" or buffer.layout != torch.strided:
            return False
        address, nbytes = _extent(buffer)
    else:
        try:
            address, nbytes = _C.buffer_address(buffer, False)
        except (TypeError, BufferError):
            return False
    with _lock:
        i = bisect.bisect_right(_starts, address) - 1
        if i < 0:
            return False
        base = _starts[i]
        return address + nbytes <= base + _regions[base][0]


def registered_bytes():
    """Bytes in registered regions (freed ones excluded, even while tensors still view them)."""
    with _lock:
        return sum(n for n, _ in _regions.values())


class pin_handle:
    """DeepSpeed's ``PinMemoryBuilder().load().pin_handle()``: page-locked CPU tensors from the
    process-wide registry that every ``aio_handle`` and ``gds_handle`` shares.

    pin_handle()
    """

    def new_cpu_locked_tensor(self, num_elem, example_tensor):
        """A 1-D page-locked CPU tensor of `num_elem` elements of example_tensor's dtype."""
        return new_locked_tensor(num_elem, example_tensor)

    def free_cpu_locked_tensor(self, locked_tensor):
        """Unregisters a tensor from new_cpu_locked_tensor (any handle's); True if it was one."""
        return free_tensor(locked_tensor)

    def free_cpu_locked_tensor_by_ptr(self, address):
        """free_cpu_locked_tensor by the tensor's data_ptr(); True if it was one."""
        return free_address(address)

    def is_pinned(self, buffer):
        """True for a tensor torch pinned (``tensor.is_pinned()``) and for a tensor whose bytes
        lie in memory from new_cpu_locked_tensor (slices included)."""
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(buffer, torch.Tensor) and \
                buffer.device.type == "cpu" and _torch_pinned(buffer):
            return True
        return is_registered(buffer)

    def __repr__(self):
        return "deepnvme.pin_handle()"


def _torch_pinned(tensor):
    # torch builds without CUDA answer False (or, in some versions, raise): not pinned by torch.
    try:
        return bool(tensor.is_pinned())
    except RuntimeError:
        return False


__all__ = ["pin_handle"]
