"""FastPersist-style checkpoints: ``save``, ``load`` and the ``FastFileWriter`` stream.

``torch.save`` to a path writes the serialized stream through the page cache in many small
writes and leaves the data dirty in memory (``fsync`` then pays for all of it). ``deepnvme.save``
hands the same stream to a ``FastFileWriter``: the bytes are copied into a ring of pinned,
aligned buffers and each full buffer goes to the disk as one asynchronous O_DIRECT operation
(block_size requests, queue_depth deep) while the next one fills; the unaligned tail is written
exactly and the file is fsynced before ``save`` returns. The file is an ordinary torch.save file:
plain ``torch.load(path)`` reads it.

Data-parallel save (``data_parallel=True``, torch.distributed initialised, e.g. gloo): every rank
serializes the same (replicated) object and writes only its stripes of the stream (stripe s goes
to rank s % world_size), so each rank moves 1/world_size of the bytes. The ranks agree on the
path, rank 0 creates the file before the others open it, and the stream lengths are compared at
the end: ranks that serialized different streams make every rank raise (and rank 0 removes the
file) instead of leaving a corrupt checkpoint.

Thread safety: one FastFileWriter per thread. The default handles shared by save/load are safe to
use from several threads: both paths move data with the engine's thread-safe file operations
(FileRef), never with the handle's own async queue and wait().
"""

import inspect
import io
import logging
import os
import pickle
import re
import threading
import zipfile

from . import _C, staging, torchzip
from .handles import aio_handle, _path

MiB = 1 << 20
DEFAULT_BUFFER_BYTES = 32 * MiB
DEFAULT_NUM_BUFFERS = 3

_default_lock = threading.Lock()
_default = None
_default_read = None
_pools = {}  # (buffer_bytes, num_buffers) -> BufferPool, guarded by _default_lock


def default_handle():
    """The process-wide aio_handle that save/load use when none is given (DeepSpeed's defaults)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = aio_handle()
        return _default


def buffer_pool(buffer_bytes=DEFAULT_BUFFER_BYTES, num_buffers=DEFAULT_NUM_BUFFERS):
    """The process's pool of pinned writer buffers of this shape, created on first use and kept:
    pinning is paid once, not at every save (about a second per GiB of buffers on a VM)."""
    key = (int(buffer_bytes), int(num_buffers))
    with _default_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = _C.BufferPool(*key)
        return pool


def _native(handle):
    if handle is None:
        handle = default_handle()
    if not isinstance(handle, aio_handle):
        raise TypeError("handle must be a deepnvme.aio_handle, not %s" % type(handle).__name__)
    return handle


class FastFileWriter(io.RawIOBase):
    """A write-only binary file that writes through pinned double buffers and O_DIRECT.

    FastFileWriter(path, handle=None, buffer_bytes=32 MiB, num_buffers=3, truncate=True,
                   fsync=True, stripe_bytes=0, stripe_count=1, stripe_index=0)

    write() copies and returns at once; close() writes the rest, waits and fsyncs, and raises
    OSError if any write failed (ENOSPC, EIO): the data is durable only when close() returned.
    flush() does nothing (it cannot make a partial buffer durable; close() does). Leaving a
    ``with`` block by an exception abandons the stream (no fsync) and re-raises. The pinned
    buffers come from the process's kept pool when the shape is the default (pool=True), from a
    given pool (deepnvme.buffer_pool(bytes, count)), or are pinned for this writer alone.
    """

    def __init__(self, path, handle=None, buffer_bytes=DEFAULT_BUFFER_BYTES,
                 num_buffers=DEFAULT_NUM_BUFFERS, truncate=True, fsync=True, stripe_bytes=0,
                 stripe_count=1, stripe_index=0, pool=True):
        super().__init__()
        self.name = _path(path)
        self._handle = _native(handle)
        if pool is True:  # the process's kept buffers for the default shape (see buffer_pool)
            default_shape = (buffer_bytes, num_buffers) == (DEFAULT_BUFFER_BYTES,
                                                             DEFAULT_NUM_BUFFERS)
            pool = buffer_pool() if default_shape else None
        self._w = _C.FastWriter(self._handle._h, self.name, int(buffer_bytes), int(num_buffers),
                                bool(truncate), bool(fsync), int(stripe_bytes), int(stripe_count),
                                int(stripe_index), pool or None)

    def writable(self):
        return True

    def readable(self):
        return False

    def seekable(self):
        return False

    def write(self, b):
        if self.closed:
            raise ValueError("write to closed file '%s'" % self.name)
        return self._w.write(b)

    def tell(self):
        return self._w.tell()

    @property
    def bytes_stored(self):
        """Bytes of the stream this writer stores (all of them unless striped)."""
        return self._w.bytes_stored

    def flush(self):
        if self.closed:
            raise ValueError("flush of closed file '%s'" % self.name)

    def close(self):
        if self.closed:
            return
        try:
            self._w.close()
        finally:
            super().close()

    def abort(self):
        """Stops without raising: waits for writes in flight; no fsync. For error paths."""
        if not self.closed:
            self._w.abort()
            super().close()

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.abort()
            return False
        self.close()
        return False

    def __del__(self):
        # Never raise from a finalizer; an unclosed writer is a caller bug the engine logs.
        try:
            self.abort()
        except Exception:
            pass


def _torch():
    import torch
    return torch


def save(obj, path, handle=None, *, buffer_bytes=DEFAULT_BUFFER_BYTES,
         num_buffers=DEFAULT_NUM_BUFFERS, fsync=True, data_parallel=False, group=None,
         stripe_bytes=None, pickle_protocol=2, blocking=True):
    """torch.save(obj) to `path`; durable when it returns (fsync unless fsync=False).

    blocking=False returns an AsyncSave (wait(), done()) as soon as `obj` is serialized and
    every tensor's bytes copied into staging memory (deepnvme.staging: pinned, kept for the next
    save): the caller may change its tensors at once, and the file, written by a background
    thread (saves in call order), is the one a blocking save would have written. An error is
    raised by wait(); one that nobody waited for is logged when the handle goes or at exit, and
    the program's exit waits for saves still running.

    The file is torch.save's zip format, written by torchzip.TorchZipWriter: torch's own pickler
    with every tensor's bytes moved from its memory by parallel O_DIRECT requests (records
    4 KiB-aligned in the file). Where this torch's private serializer is not the one deepnvme
    knows (torchzip.supported()), the stream of the public torch.save goes through a
    FastFileWriter (buffer_bytes x num_buffers pinned buffers) instead.

    With data_parallel=True (torch.distributed initialised) every rank of `group` must call it
    with the same path and the same object; each writes its share of the bytes (FastFileWriter
    stripes of stripe_bytes).
    Returns the file size in bytes.
    """
    torch = _torch()
    if not blocking:
        if data_parallel:
            raise ValueError("deepnvme.save: blocking=False is not available with "
                             "data_parallel=True")
        return _save_async(obj, _path(path), _native(handle), fsync, pickle_protocol,
                           buffer_bytes, num_buffers)
    if data_parallel:
        return _save_data_parallel(obj, path, handle, buffer_bytes, num_buffers, fsync, group,
                                   stripe_bytes or buffer_bytes, pickle_protocol)
    if torchzip.supported() is None:
        return _write_archive(_path(path), _native(handle), fsync,
                              lambda writer: torchzip.save(obj, writer, pickle, pickle_protocol))
    with FastFileWriter(path, handle, buffer_bytes, num_buffers, True, fsync) as f:
        torch.save(obj, f, pickle_protocol=pickle_protocol)
        size = f.tell()
    return size


def _write_archive(path, handle, fsync, fill):
    """`path` written by a TorchZipWriter that fill(writer) gives the records; its size. A
    failure removes the file: a partial archive must not pass for a checkpoint."""
    writer = torchzip.TorchZipWriter(path, handle, fsync)
    try:
        fill(writer)
        return writer.close()
    except BaseException:
        writer.abort()
        _unlink_quietly(path)
        raise


class _SaveState:
    """One asynchronous save's outcome and whether someone has taken its error (wait()) or it has
    been logged; shared by the AsyncSave, the save thread's done callback and the exit report.
    report() takes only this state's own lock and changes no shared container: it runs from
    AsyncSave.__del__, that is from the garbage collector, at any allocation of any thread."""

    def __init__(self, path, future):
        self.path, self.future = path, future
        self.collected = self.dropped = False
        self._lock = threading.Lock()

    def take(self):
        with self._lock:
            self.collected = True

    def report(self):
        """Logs the save's error if it failed and nobody has taken it; once."""
        with self._lock:
            if self.collected or not self.future.done() or self.future.cancelled():
                return
            self.collected = True
        error = self.future.exception()
        if error is not None:
            logging.getLogger("deepnvme").error(
                "deepnvme.save(blocking=False) of '%s' failed and nobody called wait(): %s: %s",
                self.path, type(error).__name__, error)


class AsyncSave:
    """What deepnvme.save(..., blocking=False) returns: the save of `path` running on deepnvme's
    save thread. wait() returns the file size or raises the save's error; done() says whether
    it is over. An error nobody took with wait() is logged (logger "deepnvme", level ERROR) when
    this object goes (or, if it goes first, when the save ends) and at exit, so it is never
    lost. Thread-safe."""

    def __init__(self, state):
        self._state = state
        self.path = state.path

    def done(self):
        return self._state.future.done()

    def wait(self, timeout=None):
        """The file size once the save is over (durable, as a blocking save's); raises its
        error, or concurrent.futures.TimeoutError after `timeout` seconds."""
        try:
            return self._state.future.result(timeout)
        finally:
            if self._state.future.done():
                self._state.take()

    def __del__(self):
        state = getattr(self, "_state", None)
        if state is not None:
            state.dropped = True
            state.report()  # if it is over; else the done callback does


_async_lock = threading.Lock()
_async_executor = None
_async_states = []  # every save not yet known to be over and taken or reported (exit report)


def _after_fork_in_child():
    # A forked child has the parent's objects but none of their threads: the save executor would
    # queue saves forever and the engine refuses the parent's handles there (ECHILD). The child
    # makes its own on first use; the pools go too (a buffer the parent had in flight would stay
    # taken).
    global _async_lock, _async_executor, _async_states, _default, _default_read, _default_lock
    global _pools
    _async_lock = threading.Lock()
    _async_executor = None
    _async_states = []
    _default_lock = threading.Lock()
    _default = _default_read = None
    _pools = {}


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _async_exit_report():
    # Runs after the interpreter has joined the save thread (concurrent.futures joins its
    # workers before atexit callbacks): every save is over; errors nobody took are said.
    with _async_lock:
        states = list(_async_states)
    for state in states:
        state.report()


def _save_async(obj, path, handle, fsync, pickle_protocol, buffer_bytes, num_buffers):
    global _async_executor
    torch = _torch()
    staged = staging.Staged()
    try:
        if torchzip.supported() is None:
            snapshot = torchzip.SnapshotZipWriter(staged)
            torchzip.save(obj, snapshot, pickle, pickle_protocol)
        else:
            # An unknown torch: its public torch.save into memory, written out as it is.
            buf = io.BytesIO()
            torch.save(obj, buf, pickle_protocol=pickle_protocol)
            snapshot = buf.getvalue()
    except BaseException:
        staged.release()
        raise

    def write():
        try:
            if isinstance(snapshot, bytes):
                with FastFileWriter(path, handle, buffer_bytes, num_buffers, True, fsync) as f:
                    f.write(snapshot)
                    return f.tell()
            return _write_archive(path, handle, fsync, snapshot.replay)
        finally:
            staged.release()

    import concurrent.futures
    with _async_lock:
        if _async_executor is None:
            import atexit
            _async_executor = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="deepnvme-save")
            atexit.register(_async_exit_report)
        # Forget the saves already over and taken or reported (not from report(): see there).
        _async_states[:] = [s for s in _async_states if not (s.collected and s.future.done())]
        try:
            future = _async_executor.submit(write)
        except RuntimeError:  # the interpreter is shutting down (an atexit handler saving)
            future = None
    if future is None:
        # No thread will take it: this save is written now, before returning (not under the
        # lock, which other threads' saves need meanwhile).
        future = concurrent.futures.Future()
        try:
            future.set_result(write())
        except BaseException as e:
            future.set_exception(e)
    state = _SaveState(path, future)
    with _async_lock:
        _async_states.append(state)
    future.add_done_callback(lambda _: state.report() if state.dropped else None)
    return AsyncSave(state)


def _unlink_quietly(path):
    try:
        os.unlink(path)
    except OSError:
        pass


def _agree(dist, group, local_error, what):
    """Every rank learns every rank's error; raises the same RuntimeError on all if any failed."""
    world = dist.get_world_size(group)
    errors = [None] * world
    dist.all_gather_object(errors, None if local_error is None else repr(local_error), group=group)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        detail = "; ".join("rank %d: %s" % (r, e) for r, e in failed)
        if local_error is not None:
            raise RuntimeError("deepnvme.save(data_parallel=True): %s failed: %s" %
                               (what, detail)) from local_error
        raise RuntimeError("deepnvme.save(data_parallel=True): %s failed: %s" % (what, detail))


def _remove_on_rank0(rank, path):
    # A failed data-parallel save must not leave a file that looks like a checkpoint.
    if rank == 0:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _save_data_parallel(obj, path, handle, buffer_bytes, num_buffers, fsync, group,
                        stripe_bytes, pickle_protocol):
    torch = _torch()
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("deepnvme.save(data_parallel=True) needs torch.distributed initialised "
                           "(torch.distributed.init_process_group)")
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    path = os.path.abspath(_path(path))
    paths = [None] * world
    dist.all_gather_object(paths, path, group=group)
    if len(set(paths)) != 1:
        raise ValueError("deepnvme.save(data_parallel=True): ranks name different paths: %s" %
                         paths)

    def open_writer():
        return FastFileWriter(path, handle, buffer_bytes, num_buffers, truncate=(rank == 0),
                              fsync=fsync, stripe_bytes=stripe_bytes, stripe_count=world,
                              stripe_index=rank)

    # Rank 0 creates (and truncates) the file before anyone else opens it.
    writer, error = None, None
    if rank == 0:
        try:
            writer = open_writer()
        except Exception as e:  # reported to every rank by _agree
            error = e
    _agree(dist, group, error, "creating '%s'" % path)
    if rank != 0:
        try:
            writer = open_writer()
        except Exception as e:
            error = e
    try:
        _agree(dist, group, error, "opening '%s'" % path)
    except Exception:
        if writer is not None:
            writer.abort()
        raise

    length = -1
    try:
        torch.save(obj, writer, pickle_protocol=pickle_protocol)
        length = writer.tell()
        writer.close()
    except Exception as e:
        error = e
        writer.abort()
    try:
        _agree(dist, group, error, "writing '%s'" % path)
    except RuntimeError:
        _remove_on_rank0(rank, path)
        raise

    lengths = [None] * world
    dist.all_gather_object(lengths, length, group=group)
    if len(set(lengths)) != 1:
        _remove_on_rank0(rank, path)
        raise RuntimeError("deepnvme.save(data_parallel=True): the ranks serialized streams of "
                           "different lengths %s: the object is not the same on every rank; "
                           "'%s' was removed" % (lengths, path))
    return length


def read_file(path, handle=None):
    """The whole file read with parallel O_DIRECT into fresh page-aligned memory (a memoryview)."""
    handle = _native(handle)
    path = _path(path)
    size = os.stat(path).st_size
    if size == 0:
        return memoryview(b"")
    memory = _C.HostBuffer(size, False)
    handle.sync_pread(memory, path)
    return memoryview(memory)


class _DirectReader(io.RawIOBase):
    """A seekable file that reads large requests (a tensor's storage: torch.load reads each
    record straight into the storage it allocated) with the handle's parallel O_DIRECT reads,
    and small ones (zip headers, the pickle) with plain pread."""

    LARGE = 1 << 20

    def __init__(self, path, handle):
        super().__init__()
        self.name = path
        self._handle = handle
        # Before the open: a reader whose open failed is still collected (IOBase.__del__ calls
        # close), and close must find no descriptor rather than no attribute.
        self._fd = -1
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self._size = os.fstat(self._fd).st_size
        self._pos = 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def readinto(self, b):
        n = min(len(b), self._size - self._pos)
        if n <= 0:
            return 0
        view = memoryview(b).cast("B")[:n]
        if n >= self.LARGE:
            self._handle.sync_pread(view, self.name, self._pos)
        else:
            torchzip.pread_into(self._fd, view, self._pos, self.name)
        self._pos += n
        return n

    def seek(self, offset, whence=io.SEEK_SET):
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError("negative seek position %d" % (base + offset))
        self._pos = base + offset
        return self._pos

    def tell(self):
        return self._pos

    def close(self):
        if not self.closed and self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        super().close()


def default_read_handle():
    """The handle load() uses when none is given: two workers, because the fallback reader
    (_DirectReader) reads into storages torch allocated, not page-aligned, so its large reads
    land through pinned bounce buffers and the copy out of them is CPU work worth spreading
    (docs/performance-journal.md). The zip reader needs no bounce copy (its memory agrees with each
    record modulo the page)."""
    global _default_read
    with _default_lock:
        if _default_read is None:
            _default_read = aio_handle(intra_op_parallelism=2)
        return _default_read


_PICKLE_LOAD_ARGS = {"encoding", "errors", "fix_imports"}  # what _load passes to the Unpickler


def _env_flag(name):
    return os.environ.get(name, "").strip().lower() in ("1", "y", "yes", "true")


def _default_weights_only(torch, default):
    """torch.load's own answer when weights_only is not given: False before torch 2.4; None from
    2.4 means torch decides: True from 2.6 (unless TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD), False in 2.4
    and 2.5; TORCH_FORCE_WEIGHTS_ONLY_LOAD forces True."""
    if default is not None:
        return bool(default)
    if _env_flag("TORCH_FORCE_WEIGHTS_ONLY_LOAD"):
        return True
    if _env_flag("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"):
        return False
    version = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
    return version >= (2, 6)


def _fast_load_pickle_module(torch, kwargs):
    """The pickle module torch.load would unpickle with for these arguments, or None when the
    fast path cannot honour them all (then torch.load itself runs: mmap=, a weights-only load
    with a pickle module, ...). Consumes weights_only and pickle_module from kwargs."""
    param = inspect.signature(torch.load).parameters.get("weights_only")
    weights_only = kwargs.pop("weights_only", None)
    if weights_only is None:
        weights_only = _default_weights_only(torch, param.default if param else False)
    if set(kwargs) - _PICKLE_LOAD_ARGS - {"pickle_module"}:
        return None
    if weights_only:
        if "pickle_module" in kwargs:
            return None  # torch refuses the combination; let it say so
        return getattr(torch.serialization, "_weights_only_unpickler", None)
    return kwargs.pop("pickle_module", pickle)


def _weights_only_refusal(error):
    """Whether `error` is torch's weights-only unpickler refusing the pickle: an UnpicklingError
    (torch 2.x) or a RuntimeError raised in torch._weights_only_unpickler (torch 1.13)."""
    if isinstance(error, pickle.UnpicklingError):
        return True
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and \
        os.path.basename(tb.tb_frame.f_code.co_filename) == "_weights_only_unpickler.py"


def load(path, map_location=None, handle=None, verify=True, **torch_load_kwargs):
    """torch.load of a torch.save file with every tensor's bytes read by the handle's parallel
    O_DIRECT requests into fresh page-aligned memory, then handed to torch as the storage (no
    intermediate copy); the CRC-32 of every record is checked (torch's reader does not; a damaged
    record raises OSError(EIO); verify=False skips it). map_location, weights_only (torch's
    default for the installed version), pickle_module, encoding work as in torch.load; other
    torch.load arguments, files that are not zip archives (torch's legacy format) and torch
    versions whose private loader deepnvme does not know are read through torch.load on a reader
    that does the large reads the same way; mmap=True is torch.load of the path itself (a mapping
    is filled by the kernel's page faults, not by reads).
    """
    torch = _torch()
    if handle is None:
        handle = default_read_handle()
    handle = _native(handle)
    path = _path(path)
    kwargs = dict(torch_load_kwargs)
    pickle_module = _fast_load_pickle_module(torch, kwargs) \
        if torchzip.supported() is None else None
    if pickle_module is not None and zipfile.is_zipfile(path):
        kwargs.setdefault("encoding", "utf-8")
        weights_only = pickle_module is getattr(torch.serialization, "_weights_only_unpickler",
                                                None)
        with torchzip.TorchZipReader(path, handle, verify) as reader:
            try:
                return torch.serialization._load(reader, map_location, pickle_module, **kwargs)
            except (pickle.UnpicklingError, RuntimeError) as e:
                if not (weights_only and _weights_only_refusal(e)):
                    raise
        # A weights-only refusal: torch.load words it around its own _load (the global that
        # was refused, and how to allow it or load with weights_only=False), so torch.load says
        # it, on the same reader as below; the refusal comes from the pickle, before any tensor.
    if torch_load_kwargs.get("mmap"):
        # A mapping of the file is the kernel's (its pages are faulted in, not read), and torch
        # maps only a path it opens itself: hand it the path (torch without mmap= says so).
        return torch.load(path, map_location=map_location, **torch_load_kwargs)
    with _DirectReader(path, handle) as f:
        return torch.load(f, map_location=map_location, **torch_load_kwargs)


__all__ = ["FastFileWriter", "AsyncSave", "save", "load", "read_file", "default_handle",
           "buffer_pool"]
