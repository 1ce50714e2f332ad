"""Staging memory: copies of a program's tensors taken at once, so that it may change them while
their bytes are being written (deepnvme.save(blocking=False); deepnvme.dcp's writer for
dcp.async_save).

The copies go into page-locked (pinned) host memory when it can be pinned (RLIMIT_MEMLOCK),
else into plain page-aligned memory (the warning says so once). Memory is kept for the next
snapshot when the save that used it is over: allocating and first touching memory costs more
than copying into it (on a VM every fresh page is a fault and a zeroing, about as long as the
copy itself), so a training loop that checkpoints every N steps pays it once.
release_staging_memory() gives what is kept back.

Thread safety: the pool is guarded by a lock; a Staged copy belongs to one save.
"""

import ctypes
import logging
import threading

from . import _C

_log = logging.getLogger("deepnvme")
_lock = threading.Lock()
_free = []  # HostBuffers not in use, kept for the next snapshot
_warned_unpinned = False
PAGE = 4096


def _take(nbytes):
    """A HostBuffer of at least nbytes: a kept one when one is large enough and at most twice
    the size (the smallest such), else a new one."""
    global _warned_unpinned
    with _lock:
        fits = [b for b in _free if nbytes <= b.nbytes <= 2 * nbytes + PAGE]
        if fits:
            best = min(fits, key=lambda b: b.nbytes)
            _free.remove(best)
            return best
    try:
        return _C.HostBuffer(nbytes, True)
    except (OSError, MemoryError, RuntimeError) as e:
        if not _warned_unpinned:
            _warned_unpinned = True
            _log.warning("deepnvme: staging memory cannot be pinned (%s); using plain memory "
                         "(raise `ulimit -l` to pin it)", e)
        return _C.HostBuffer(nbytes, False)


def _give_back(buffers):
    with _lock:
        _free.extend(buffers)


def release_staging_memory():
    """Frees the staging memory kept for later snapshots; returns how many bytes it held."""
    with _lock:
        held = sum(b.nbytes for b in _free)
        _free.clear()
    return held


def kept_staging_bytes():
    with _lock:
        return sum(b.nbytes for b in _free)


def _byte_tensor(torch, address, nbytes):
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=torch.uint8)


class Staged:
    """The staging memory of one snapshot. copy_bytes / copy_tensor copy into it; release()
    returns the memory to the pool (after the save that reads it is over)."""

    def __init__(self):
        self._buffers = []

    def copy_bytes(self, address, nbytes, residue=None):
        """Copies nbytes at `address` (CPU memory) into staging memory that starts at the same
        offset within its page (or at `residue`); returns the copy's address."""
        import torch
        shift = (address if residue is None else residue) % PAGE
        buf = _take(nbytes + shift)
        self._buffers.append(buf)
        dst = buf.address + shift
        if nbytes:
            _byte_tensor(torch, dst, nbytes).copy_(_byte_tensor(torch, address, nbytes))
        return dst

    def copy_tensor(self, tensor):
        """A contiguous CPU copy of `tensor` (on any device) in staging memory."""
        import torch
        nbytes = tensor.numel() * tensor.element_size()
        buf = _take(max(nbytes, 1))
        self._buffers.append(buf)
        out = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes) if nbytes else \
            torch.empty(0, dtype=torch.uint8)
        out = out.view(tensor.dtype).view(tensor.shape)
        out.copy_(tensor.detach())
        return out

    @property
    def nbytes(self):
        return sum(b.nbytes for b in self._buffers)

    def release(self):
        buffers, self._buffers = self._buffers, []
        _give_back(buffers)


__all__ = ["Staged", "release_staging_memory", "kept_staging_bytes"]
