"""DeepSpeed's ``deepspeed.io`` file writers, over the deepnvme engine.

    from deepnvme.io import FastFileWriter, FastFileWriterConfig
    h = deepnvme.aio_handle(block_size=8 << 20, queue_depth=8, intra_op_parallelism=1)
    pinned = h.new_cpu_locked_tensor(64 << 20, torch.empty(0, dtype=torch.uint8))
    with FastFileWriter("/nvme/ckpt.pt", FastFileWriterConfig(dnvme_handle=h, pinned_tensor=pinned)) as f:
        torch.save(state_dict, f)

DeepSpeed's checkpoint engines (FastCheckpointEngine, DecoupledCheckpointEngine) hand these
writers to ``torch.save``; the classes have DeepSpeed's constructors, methods, return values and
stats keys. ``FastFileWriter`` streams through the caller's pinned tensor (halved when
double_buffer) into the engine's FastWriter: each full buffer is one asynchronous O_DIRECT
write; ``close`` writes the rest exactly, waits and fsyncs.

Differences from DeepSpeed, each on the side of a correct file:
  - the file is truncated when opened (DeepSpeed's O_CREAT without O_TRUNC leaves the old tail
    of a longer file behind the new checkpoint, which torch.load then rejects);
  - write failures (ENOSPC, EIO) raise OSError from write/close instead of asserting, and the
    unaligned tail is written by the engine at its offset (DeepSpeed closes the O_DIRECT fd and
    appends it with Python file I/O);
  - the pinned tensor may have any size and need not be pinned (pinned memory is faster: the
    engine writes straight from it); DeepSpeed asserts a multiple of get_alignment();
  - ``__del__`` closes an unclosed writer without asserting.

Thread safety: one writer is used by one thread, as DeepSpeed's.
"""

import struct
import time
from dataclasses import dataclass

from . import _C
from .handles import _buffer, _path, aio_handle

INVALID_FD = -1
FILE_PATH_KEY = "path"
FLUSH_COUNT_KEY = "flush"
WRITE_COUNT_KEY = "write"
CLOSE_COUNT_KEY = "close"
FILENO_COUNT_KEY = "fileno"
WRITE_BYTES_KEY = "bytes"
WRITE_SEC_KEY = "write_secs"
WRITE_SPEED_KEY = "write_GB/s"
AIO_WRITE_SEC_KEY = "aio_write_secs"
AIO_WRITE_BYTES_KEY = "aio_bytes"
AIO_SPEED_KEY = "aio_GB/s"
SLOW_WRITE_BYTES_KEY = "slow_bytes"
SLOW_WRITE_SEC_KEY = "slow_write_secs"
AIO_FILL_BUFFER_SEC_KEY = "fill_buffer_secs"
AIO_FILL_BUFFER_COUNT_KEY = "fill_buffer_count"
AIO_FILL_BUFFER_SPEED_KEY = "fill_buffer_GB/s"
SAVE_STORAGE_KEY = "save_storage"
SAVE_STORAGE_BYTES_KEY = "save_storage_bytes"
STORAGE_OBJ_SIZE = 8

BASE_STAT_KEYS = [CLOSE_COUNT_KEY, FILENO_COUNT_KEY, FLUSH_COUNT_KEY, WRITE_COUNT_KEY,
                  WRITE_BYTES_KEY, WRITE_SEC_KEY, WRITE_SPEED_KEY]
FASTIO_STAT_KEYS = [AIO_WRITE_SEC_KEY, AIO_WRITE_BYTES_KEY, AIO_SPEED_KEY, SLOW_WRITE_BYTES_KEY,
                    SLOW_WRITE_SEC_KEY, AIO_FILL_BUFFER_COUNT_KEY, AIO_FILL_BUFFER_SEC_KEY,
                    AIO_FILL_BUFFER_SPEED_KEY, SAVE_STORAGE_KEY, SAVE_STORAGE_BYTES_KEY]
GiB = 1 << 30


def _torch():
    import torch
    return torch


def _storage_bytes(storage_obj):
    """(uint8 CPU-or-device tensor over the storage's bytes, element count) of a (storage, dtype)
    pair as torch's serializer passes them to save_torch_storage_object_list."""
    torch = _torch()
    obj, dtype = storage_obj
    nbytes = obj.nbytes() if callable(getattr(obj, "nbytes", None)) else obj.size()
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if isinstance(obj, torch.storage.TypedStorage):
        obj = obj.untyped() if hasattr(obj, "untyped") else obj._storage
    byte_view = torch.empty(0, dtype=torch.uint8, device=obj.device).set_(obj)
    return byte_view.reshape(-1)[:nbytes], nbytes // itemsize


class BaseFileWriter(object):
    """DeepSpeed's writer base: a path and call/byte counters (``_stats``)."""

    def __init__(self, file_path):
        self._file_path = file_path
        self._stats = {k: 0 for k in BASE_STAT_KEYS}

    def close(self):
        pass

    def fileno(self):
        pass

    def flush(self):
        pass

    def write(self, buffer):
        pass

    def file_path(self):
        return self._file_path

    def _incr_stats(self, key, incr=1):
        self._stats[key] += incr

    def stats(self):
        """A copy of the counters, with the speed keys computed."""
        self._update_speeds()
        stats = dict(self._stats)
        stats[FILE_PATH_KEY] = self.file_path()
        return stats

    def _update_speeds(self):
        if self._stats[WRITE_SEC_KEY] > 0:
            self._stats[WRITE_SPEED_KEY] = self._stats[WRITE_BYTES_KEY] / \
                self._stats[WRITE_SEC_KEY] / GiB

    def _dump_state(self):
        """Prints the stats as DeepSpeed does (its checkpoint writer factory calls this)."""
        print("stats = %s" % self.stats())


class _OpenFileWriter(BaseFileWriter):
    """What PyFileWriter and MockFileWriter share: a file opened 'wb' and counted calls."""

    def __init__(self, file_path):
        super().__init__(file_path)
        self._fp = open(file_path, "wb")

    def close(self):
        self._incr_stats(CLOSE_COUNT_KEY)
        self._fp.close()

    def fileno(self):
        self._incr_stats(FILENO_COUNT_KEY)
        return INVALID_FD

    def flush(self):
        self._incr_stats(FLUSH_COUNT_KEY)
        self._fp.flush()


class PyFileWriter(_OpenFileWriter):
    """Buffered Python file I/O (DeepSpeed's baseline writer)."""

    def write(self, buffer):
        start = time.time()
        self._fp.write(buffer)
        self._incr_stats(WRITE_SEC_KEY, time.time() - start)
        self._incr_stats(WRITE_COUNT_KEY)
        self._incr_stats(WRITE_BYTES_KEY, len(buffer))
        return len(buffer)


class MockFileWriter(_OpenFileWriter):
    """Counts what would be written and writes nothing (the file is created empty): for measuring
    the serializer alone."""

    def __init__(self, file_path):
        super().__init__(file_path)
        self._stats[SAVE_STORAGE_KEY] = 0
        self._stats[SAVE_STORAGE_BYTES_KEY] = 0

    def _write(self, num_bytes):
        self._incr_stats(WRITE_COUNT_KEY)
        self._incr_stats(WRITE_BYTES_KEY, num_bytes)
        return num_bytes

    def write(self, buffer):
        return self._write(len(buffer))

    def save_torch_storage_object_list(self, storage_obj_list, save_size):
        total = 0
        for storage_obj in storage_obj_list:
            data, _ = _storage_bytes(storage_obj)
            self._incr_stats(SAVE_STORAGE_KEY)
            self._incr_stats(SAVE_STORAGE_BYTES_KEY, data.numel())
            total += (self._write(STORAGE_OBJ_SIZE) if save_size else 0) + \
                self._write(data.numel())
        return total


@dataclass
class FastFileWriterConfig:
    """DeepSpeed's FastFileWriterConfig: the handle that writes (aio_handle or gds_handle), the
    pinned staging tensor, double buffering, and the data-parallel split of
    save_torch_storage_object_list (this writer stores bytes [writer_rank/num_parallel_writers,
    (writer_rank+1)/num_parallel_writers) of the storages)."""
    dnvme_handle: object
    pinned_tensor: object
    double_buffer: bool = True
    num_parallel_writers: int = 1
    writer_rank: int = 0
    global_rank: int = 0


class FastFileWriter(BaseFileWriter):
    """DeepSpeed's FastFileWriter(file_path, config): a write-only file for ``torch.save`` that
    writes through the config's pinned tensor with parallel O_DIRECT (see the module doc)."""

    def __init__(self, file_path, config):
        super().__init__(_path(file_path))
        for k in FASTIO_STAT_KEYS:
            self._stats[k] = 0
        self._check_config(config)
        self._config = config
        handle = config.dnvme_handle
        engine = handle._h if isinstance(handle, aio_handle) else None
        if engine is None:
            raise TypeError("FastFileWriterConfig.dnvme_handle must be a deepnvme.aio_handle or "
                            "gds_handle, not %s" % type(handle).__name__)
        mem = _buffer(config.pinned_tensor, writable=True, what="pinned_tensor")
        if mem.is_cuda:
            raise ValueError("FastFileWriterConfig.pinned_tensor must be host memory (it stages "
                             "the serialized stream), not CUDA memory")
        num_buffers = 2 if config.double_buffer else 1
        buffer_bytes = mem.nbytes // num_buffers
        if buffer_bytes == 0:
            raise ValueError("pinned_tensor of %d bytes is too small for %d buffer(s)" %
                             (mem.nbytes, num_buffers))
        self._pinned = config.pinned_tensor  # the writer's buffers: alive as long as it
        self._w = _C.FastWriter(engine, self._file_path, buffer_bytes, num_buffers, True, True, 0,
                                1, 0, None, mem.address)
        self._closed = False

    @staticmethod
    def _check_config(config):
        if not isinstance(config, FastFileWriterConfig):
            raise TypeError("config must be a deepnvme.io.FastFileWriterConfig, not %s" %
                            type(config).__name__)
        n, rank = config.num_parallel_writers, config.writer_rank
        for name, value in (("num_parallel_writers", n), ("writer_rank", rank),
                            ("global_rank", config.global_rank)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError("FastFileWriterConfig.%s must be an int, not %r" % (name, value))
        if n < 1 or not 0 <= rank < n:
            raise ValueError("FastFileWriterConfig: writer_rank %d is not in [0, "
                             "num_parallel_writers=%d)" % (rank, n))

    @property
    def closed(self):
        return self._closed

    def writable(self):
        return True

    def write(self, buffer):
        """Appends the bytes (bytes, bytearray, memoryview, numpy array); returns their count."""
        if self._closed:
            raise ValueError("write to closed file '%s'" % self._file_path)
        start = time.time()
        n = self._w.write(buffer)
        elapsed = time.time() - start
        self._incr_stats(WRITE_COUNT_KEY)
        self._incr_stats(WRITE_BYTES_KEY, n)
        self._incr_stats(WRITE_SEC_KEY, elapsed)
        self._incr_stats(AIO_FILL_BUFFER_COUNT_KEY)
        self._incr_stats(AIO_FILL_BUFFER_SEC_KEY, elapsed)
        return n

    def _write_tensor(self, byte_tensor):
        if byte_tensor.numel() == 0:
            return 0
        if byte_tensor.device.type != "cpu":
            byte_tensor = byte_tensor.cpu()
        return self.write(byte_tensor.contiguous().numpy())

    def save_torch_storage_object_list(self, storage_obj_list, save_size):
        """Writes each (storage, dtype) pair's bytes, each preceded by its element count as a
        little-endian int64 when save_size; with num_parallel_writers > 1 only this writer's
        contiguous share of those bytes (the earlier ranks take one more byte each when they do
        not divide evenly). Returns the bytes written."""
        pieces = []
        for storage_obj in storage_obj_list:
            data, count = _storage_bytes(storage_obj)
            if save_size:
                size = _torch().frombuffer(bytearray(struct.pack("<q", count)),
                                           dtype=_torch().uint8)
                pieces.append(size)
            pieces.append(data)
        total = sum(p.numel() for p in pieces)
        n, rank = self._config.num_parallel_writers, self._config.writer_rank
        share, extra = divmod(total, n)
        begin = rank * share + min(rank, extra)
        end = begin + share + (1 if rank < extra else 0)
        written, at = 0, 0
        for piece in pieces:
            lo, hi = max(begin, at), min(end, at + piece.numel())
            if lo < hi:
                written += self._write_tensor(piece.narrow(0, lo - at, hi - lo))
            at += piece.numel()
        self._incr_stats(SAVE_STORAGE_KEY, len(storage_obj_list))
        self._incr_stats(SAVE_STORAGE_BYTES_KEY, written)
        return written

    def close(self):
        """Writes the rest, waits, fsyncs and closes; raises OSError if any write failed."""
        if self._closed:
            return
        self._closed = True
        start = time.time()
        try:
            self._w.close()
        finally:
            elapsed = time.time() - start
            self._incr_stats(AIO_WRITE_SEC_KEY, elapsed)
            self._incr_stats(WRITE_SEC_KEY, elapsed)
            self._stats[AIO_WRITE_BYTES_KEY] = self._w.bytes_stored
            self._incr_stats(CLOSE_COUNT_KEY)

    def fileno(self):
        """-1, as DeepSpeed's: torch must not write around the buffers with the raw fd."""
        self._incr_stats(FILENO_COUNT_KEY)
        return INVALID_FD

    def flush(self):
        """Counts the call; data is durable when close() returns (as DeepSpeed's)."""
        self._incr_stats(FLUSH_COUNT_KEY)

    def tell(self):
        return self._w.tell()

    def _update_speeds(self):
        super()._update_speeds()
        if self._stats[AIO_WRITE_SEC_KEY] > 0:
            self._stats[AIO_SPEED_KEY] = self._stats[AIO_WRITE_BYTES_KEY] / \
                self._stats[AIO_WRITE_SEC_KEY] / GiB
        if self._stats[AIO_FILL_BUFFER_SEC_KEY] > 0:
            self._stats[AIO_FILL_BUFFER_SPEED_KEY] = self._stats[WRITE_BYTES_KEY] / \
                self._stats[AIO_FILL_BUFFER_SEC_KEY] / GiB

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self._abort()
            return False
        self.close()
        return False

    def _abort(self):
        if not self._closed:
            self._closed = True
            self._w.abort()

    def __del__(self):
        # Never raise from a finalizer: an unclosed writer is closed without fsync and the engine
        # logs it.
        try:
            self._abort()
        except Exception:
            pass


__all__ = ["BaseFileWriter", "PyFileWriter", "MockFileWriter", "FastFileWriter",
           "FastFileWriterConfig"]
