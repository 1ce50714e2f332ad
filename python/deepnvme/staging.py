"""Staging memory: copies of a program's tensors taken at once, so that it may change them while
their bytes are being written (deepnvme.save(blocking=False); deepnvme.dcp's writer for
dcp.async_save).

The copies go into page-locked (pinned) host memory when it can be pinned (RLIMIT_MEMLOCK),
else into plain page-aligned memory (the warning says so once). Memory is kept for the next
snapshot once nothing uses it any more (no save holds it, no staged tensor views it: see
_FREE_REFS), so no caller has to say when a snapshot is over: allocating and first touching memory costs more
than copying into it (on a VM every fresh page is a fault and a zeroing, about as long as the
copy itself), so a training loop that checkpoints every N steps pays it once.
release_staging_memory() gives what is kept back.

Thread safety: the pool is guarded by a lock; a Staged copy belongs to one save. A buffer taken
from the pool is in use from the moment _take returns it (the caller's reference), so two
threads never get the same one.
"""

import ctypes
import logging
import sys
import threading

from . import _C, _fork

_log = logging.getLogger("deepnvme")
_lock = threading.Lock()
_fork.renew_lock_in_child(globals(), "_lock")
_pool = []  # every HostBuffer kept for snapshots, in use or not
_warned_unpinned = False
PAGE = 4096


def _refcounts(buffers):
    """sys.getrefcount of each buffer, counted the same way for the probe below and the pool."""
    return [sys.getrefcount(b) for b in buffers]


# A buffer is free when nothing but the pool refers to it: no Staged holding it for a save, no
# tensor over it (torch.frombuffer keeps the buffer referenced as long as any tensor, view or
# storage uses its memory). The count of a buffer referred to by the pool alone, measured once:
_FREE_REFS = _refcounts([object()])[0]


def _take(nbytes):
    """A free pooled HostBuffer of at least nbytes and at most about twice that (the smallest),
    else a new one, added to the pool. The caller's reference makes it in use."""
    global _warned_unpinned
    with _lock:
        counts = _refcounts(_pool)
        fits = [b for b, n in zip(_pool, counts) if n <= _FREE_REFS and
                nbytes <= b.nbytes <= 2 * nbytes + PAGE]
        del counts
        if fits:
            return min(fits, key=lambda b: b.nbytes)
    try:
        buf = _C.HostBuffer(nbytes, True)
    except (OSError, MemoryError, RuntimeError) as e:
        if not _warned_unpinned:
            _warned_unpinned = True
            _log.warning("deepnvme: staging memory cannot be pinned (%s); using plain memory "
                         "(raise `ulimit -l` to pin it)", e)
        buf = _C.HostBuffer(nbytes, False)
    with _lock:
        _pool.append(buf)
    return buf


def _free_buffers():
    counts = _refcounts(_pool)
    return [b for b, n in zip(_pool, counts) if n <= _FREE_REFS]


def release_staging_memory():
    """Frees the staging memory kept for later snapshots (what no save or staged tensor still
    uses); returns how many bytes it held."""
    with _lock:
        free = _free_buffers()
        held = sum(b.nbytes for b in free)
        ids = set(map(id, free))
        _pool[:] = [b for b in _pool if id(b) not in ids]
    return held


def kept_staging_bytes():
    """Bytes of staging memory kept and free for the next snapshot."""
    with _lock:
        return sum(b.nbytes for b in _free_buffers())


def _byte_tensor(torch, address, nbytes):
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=torch.uint8)


class Staged:
    """The staging memory of one snapshot. copy_bytes() copies into memory this object holds
    until release() (the save that reads it is over); copy_tensor() returns a tensor over memory
    that stays in use for as long as that tensor (or a view of it) lives, whatever happens to
    this object."""

    def __init__(self):
        self._buffers = []

    def copy_bytes(self, address, nbytes):
        """Copies nbytes at `address` (CPU memory) into staging memory that starts at the same
        offset within its page; returns the copy's address."""
        import torch
        shift = address % PAGE
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
        if nbytes == 0:
            return torch.empty(tensor.shape, dtype=tensor.dtype)
        buf = _take(nbytes)
        out = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)
        out = out.view(tensor.dtype).view(tensor.shape)
        out.copy_(tensor.detach())
        return out

    def release(self):
        """The memory copy_bytes() filled is free for the next snapshot."""
        self._buffers = []


__all__ = ["Staged", "release_staging_memory", "kept_staging_bytes"]
