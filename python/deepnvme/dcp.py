"""torch.distributed.checkpoint (DCP) storage whose tensor bytes move through the engine.

    import torch.distributed.checkpoint as dcp
    import deepnvme.dcp
    dcp.save(state, storage_writer=deepnvme.dcp.FileSystemWriter(path))
    dcp.load(state, storage_reader=deepnvme.dcp.FileSystemReader(path))
    future = dcp.async_save(state, storage_writer=deepnvme.dcp.FileSystemWriter(path))

The checkpoint is DCP's own layout, so DCP's FileSystemReader reads what FileSystemWriter here
writes and FileSystemReader here reads what DCP's writer wrote: a ``.metadata`` pickle and, per
rank, ``__RANK_N.distcp`` files in which every tensor is one torch.save archive (at the offset
and length the metadata records) and every other object its pickled bytes. What changes is how
the bytes move:

- write: a tensor of at least torchzip.SMALL_RECORD bytes is an archive written by
  torchzip.EmbeddedZipWriter at its place in the rank's file: its storage goes straight from the
  tensor's memory by the engine's parallel O_DIRECT requests (the record placed where file offset
  and memory agree modulo the page, so no bounce copy) while this thread computes its CRC-32;
  DCP's writer instead streams torch.save through a buffered Python file (a copy into bytes
  objects, one more into the page cache, then the fsync's writeback). Smaller tensors are
  torch.save'd into memory and written with one pwrite. Files are fsynced where DCP syncs them
  (sync_files, default True; the .metadata file by DCP's own finish()).
- read: a large tensor's record is read by the engine straight into the tensor DCP loads into,
  when that tensor is a whole contiguous CPU tensor matching the saved one (the usual
  state_dict load), else into fresh memory then copied as DCP does (resharding, dtype or device
  changes); every record's CRC-32 is checked, small ones too (verify=True; DCP's reader does not
  check them), a damaged record fails the load with OSError(EIO) instead of loading wrong
  weights (on a torch whose private loader deepnvme does not know, tensors are read as DCP
  reads them, unchecked).

dcp.async_save: stage() copies every tensor (CPU ones too, which DCP's own writer does not) into
staging memory before async_save returns, and the write runs on DCP's thread through the same
handle.

Thread safety: as DCP's: one writer or reader per save/load; the handle may be shared.
"""

import contextlib
import io
import logging
import os
import pickle

from . import _C, staging, torchzip
from .checkpoint import _native, _torch, _weights_only_refusal, default_read_handle

try:
    from torch.distributed.checkpoint import filesystem as _fs
    from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future
    _MISSING = [n for n in ("FileSystemWriter", "FileSystemReader", "_StorageInfo",
                            "_split_by_size_and_type", "DEFAULT_SUFFIX") if not hasattr(_fs, n)]
    if _MISSING:
        raise ImportError("torch.distributed.checkpoint.filesystem lacks %s" % ", ".join(_MISSING))
except ImportError as _e:
    raise ImportError("deepnvme.dcp needs torch.distributed.checkpoint's FileSystemWriter and "
                      "FileSystemReader (torch >= 2.4; this torch: %s)" % _e) from _e

try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # torch < 2.4: no public DTensor; plain tensors only
    _DTensor = None

_log = logging.getLogger("deepnvme")
SMALL_TENSOR = torchzip.SMALL_RECORD  # below this a tensor is serialized in memory, one pwrite


@contextlib.contextmanager
def _logged(what, path):
    """Logs this rank's error before DCP collects it. DCP gathers every rank's exception with
    its traceback, and on Python 3.13 a traceback summary holds code objects, which cannot be
    pickled: the ranks then all raise "TypeError: cannot pickle code objects" (torch 2.6) and
    the reason would be lost."""
    try:
        yield
    except BaseException as e:
        _log.error("deepnvme.dcp: %s of '%s' failed on this rank: %s: %s", what, path,
                   type(e).__name__, e)
        raise


def _whole_storage(tensor):
    """The tensor DCP's writer serializes: on the CPU, and alone in its storage (a view of a
    larger storage is copied, or torch.save would write all of it)."""
    tensor = tensor.detach().cpu()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


def _on_threads(calls):
    """Runs the calls on one thread each (plain threads: a concurrent.futures pool refuses work
    while the interpreter shuts down, and dcp.async_save's write may run then); their results in
    order, or the first error."""
    import threading
    results, errors = [None] * len(calls), [None] * len(calls)

    def run(i):
        try:
            results[i] = calls[i]()
        except BaseException as e:  # re-raised below, on the caller's thread
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,), name="deepnvme-dcp")
               for i in range(len(calls))]
    try:
        for t in threads:
            t.start()
    except RuntimeError:  # Python >= 3.12 starts no thread while it exits: the rest here
        for i, t in enumerate(threads):
            if t.ident is None:
                run(i)
    for t in threads:
        if t.ident is not None:
            t.join()
    for e in errors:
        if e is not None:
            raise e
    return results


def _stage_tree(obj, staged):
    """A copy of a state dict's containers with every tensor (DTensor: its local shard) copied
    into `staged`."""
    torch = _torch()
    if _DTensor is not None and isinstance(obj, _DTensor):
        local = staged.copy_tensor(obj.to_local())
        return _DTensor.from_local(local, obj.device_mesh, obj.placements, run_check=False,
                                   shape=obj.shape, stride=obj.stride())
    if isinstance(obj, torch.Tensor):
        return staged.copy_tensor(obj)
    if isinstance(obj, dict):
        return type(obj)((k, _stage_tree(v, staged)) for k, v in obj.items())
    if isinstance(obj, list):
        return [_stage_tree(v, staged) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_stage_tree(v, staged) for v in obj)
    return obj


class FileSystemWriter(_fs.FileSystemWriter):
    """DCP's FileSystemWriter (same arguments, same files) writing through the engine: `handle`
    (a deepnvme.aio_handle; default deepnvme.default_handle()) moves every large tensor's bytes
    with parallel O_DIRECT requests. thread_count files per rank are written at once, as by DCP.
    """

    def __init__(self, path, single_file_per_rank=True, sync_files=True, thread_count=1,
                 per_thread_copy_ahead=10_000_000, cache_staged_state_dict=False, overwrite=True,
                 handle=None):
        if isinstance(thread_count, bool) or not isinstance(thread_count, int) or \
                thread_count < 1:
            raise ValueError("deepnvme.dcp.FileSystemWriter: thread_count must be an int >= 1, "
                             "not %r" % (thread_count,))
        kwargs = dict(single_file_per_rank=single_file_per_rank, sync_files=sync_files,
                      thread_count=thread_count, per_thread_copy_ahead=per_thread_copy_ahead,
                      cache_staged_state_dict=cache_staged_state_dict, overwrite=overwrite)
        super().__init__(path, **kwargs)
        self._handle = _native(handle)

    def stage(self, state_dict):
        """dcp.async_save's snapshot, taken before it returns: every tensor copied into staging
        memory (deepnvme.staging: pinned when it can be, kept for the next save), CPU tensors
        too. DCP's own writer hands CPU tensors on uncopied (Tensor.to("cpu") of a CPU tensor is
        itself), so a training step that changes them while the write runs changes the
        checkpoint. Other objects are kept as they are, as by DCP (they are pickled by the
        write)."""
        self.per_thread_copy_ahead = 0
        # The copies' memory stays in use while the staged tensors (or views of them) live, so
        # for as long as DCP's save holds the staged state, whatever becomes of it; then the
        # next snapshot reuses it (deepnvme.staging).
        return _stage_tree(state_dict, staging.Staged())

    def prepare_local_plan(self, plan):
        with _logged("creating the checkpoint directory", self.path):
            return super().prepare_local_plan(plan)

    def finish(self, metadata, results):
        with _logged("writing the metadata", self.path):
            return super().finish(metadata, results)

    def write_data(self, plan, planner):
        with _logged("write", self.path):
            return self._write_data(plan, planner)

    def _write_data(self, plan, planner):
        prefix = plan.storage_data.prefix
        if self.single_file_per_rank:
            buckets = _fs._split_by_size_and_type(self.thread_count, plan.items)
        else:
            buckets = [[item] for item in plan.items]
        files = [("%s%d%s" % (prefix, n, _fs.DEFAULT_SUFFIX), bucket)
                 for n, bucket in enumerate(buckets)]
        reason, save_kwargs = torchzip.save_arguments()  # once, not per tensor
        fast = save_kwargs if reason is None else None
        if self.thread_count > 1 and len(files) > 1:
            done = _on_threads([lambda f=f: self._write_file(f[0], f[1], planner, fast)
                                for f in files])
        else:
            done = [self._write_file(name, items, planner, fast) for name, items in files]
        fut = Future()
        fut.set_result([r for results in done for r in results])
        return fut

    def _write_file(self, file_name, items, planner, save_kwargs):
        """One DCP file; save_kwargs: torchzip.save_arguments()'s, None where the fast path
        cannot be used (then every tensor is torch.save'd into memory, as by DCP)."""
        torch = _torch()
        path = os.path.join(self.path, file_name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
        file = None
        try:
            file = _C.File(self._handle._h, fd, True)
            results, pos = [], 0
            # DCP's order: the pickled objects, then the tensors.
            for item in [i for i in items if i.type == WriteItemType.BYTE_IO]:
                data = planner.resolve_data(item).getbuffer()
                torchzip._pwrite_all(fd, data, pos, path)
                results.append(self._result(item, file_name, pos, len(data)))
                pos += len(data)
            for item in [i for i in items if i.type != WriteItemType.BYTE_IO]:
                tensor = _whole_storage(planner.resolve_data(item))
                if save_kwargs is not None and tensor.nbytes >= SMALL_TENSOR:
                    writer = torchzip.EmbeddedZipWriter(fd, file, path, pos)
                    try:
                        torchzip.save(tensor, writer, pickle, 2,  # torch.save's protocol
                                      save_kwargs)
                    except BaseException:
                        writer.abort()
                        raise
                    length = writer.finish()
                else:
                    buf = io.BytesIO()
                    torch.save(tensor, buf)
                    data = buf.getbuffer()
                    torchzip._pwrite_all(fd, data, pos, path)
                    length = len(data)
                results.append(self._result(item, file_name, pos, length))
                pos += length
            if self.sync_files:
                os.fsync(fd)
        finally:
            file = None  # the engine File (its own descriptor, reopened) first
            os.close(fd)
        return results

    @staticmethod
    def _result(item, file_name, offset, length):
        return WriteResult(index=item.index, size_in_bytes=length,
                           storage_data=_fs._StorageInfo(file_name, offset, length))


class FileSystemReader(_fs.FileSystemReader):
    """DCP's FileSystemReader (same checkpoint directory) reading through the engine: `handle`
    (default deepnvme's read handle) reads each large tensor's record with parallel O_DIRECT
    requests, into the tensor being loaded when it can; verify=False skips the CRC-32 check."""

    def __init__(self, path, handle=None, verify=True):
        super().__init__(path)
        self._handle = _native(handle if handle is not None else default_read_handle())
        self._verify = verify
        self.records_into_target = 0  # tensors read straight into the tensor being loaded

    def read_metadata(self):
        with _logged("reading the metadata", self.path):
            return super().read_metadata()

    def read_data(self, plan, planner):
        with _logged("read", self.path):
            return self._read_data(plan, planner)

    def _read_data(self, plan, planner):
        fast = torchzip.supported() is None  # once, not per tensor
        per_file = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path,
                                []).append(req)
        for relative_path, reqs in per_file.items():
            path = os.path.join(self.path, relative_path)
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            file = None
            try:
                file = _C.File(self._handle._h, fd, False)
                reqs.sort(key=lambda r: self.storage_data[r.storage_index].offset)
                for req in reqs:
                    self._read_item(path, fd, file, req, planner, fast)
            finally:
                file = None  # the engine File (its own descriptor, reopened) first
                os.close(fd)
        fut = Future()
        fut.set_result(None)
        return fut

    def _read_item(self, path, fd, file, req, planner, fast):
        torch = _torch()
        info = self.storage_data[req.storage_index]
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(torchzip._pread_all(fd, info.length, info.offset,
                                                                   path)))
            return
        target = planner.resolve_tensor(req).detach()
        # Large records go straight into a target that is one whole plain CPU tensor (if the
        # archive then holds anything else, or the read fails, the target has been written: a
        # failed load leaves the state partly loaded, as DCP's own does).
        whole = (info.length >= SMALL_TENSOR and target.device.type == "cpu" and
                 target.is_contiguous() and target.storage_offset() == 0 and
                 not target.is_conj() and not target.is_neg() and
                 target.untyped_storage().nbytes() == target.numel() * target.element_size() and
                 all(o == 0 for o in req.storage_offsets) and
                 tuple(req.lengths) == tuple(target.shape))
        if not fast:  # an unknown torch: DCP's own way, no CRC check
            data = torchzip._pread_all(fd, info.length, info.offset, path)
            tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        else:
            tensor = self._load_archive(path, fd, file, info, target if whole else None)
            if whole and self._shares(tensor, target):
                self.records_into_target += 1
                planner.commit_tensor(req, target)
                return
            if whole:  # the archive's tensor is not the target's: read it apart
                tensor = self._load_archive(path, fd, file, info, None)
        from torch.distributed._shard._utils import narrow_tensor_by_index
        tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
        if tensor.size() != target.size():
            raise ValueError("'%s': item %s holds %s at offset %d, the tensor to load is %s" %
                             (path, req.storage_index, tuple(tensor.size()), info.offset,
                              tuple(target.size())))
        target.copy_(tensor)
        planner.commit_tensor(req, target)

    def _load_archive(self, path, fd, file, info, target):
        """The tensor in the archive at `info` (torch.load of it, weights only, as DCP), its
        storage read by the engine, into `target`'s memory when given."""
        torch = _torch()
        reader = torchzip.TorchZipReader(path, None, self._verify,
                                         embedded=(fd, file, info.offset, info.length))
        with reader:
            if target is not None:
                reader.targets["data/0"] = target
            try:
                return torch.serialization._load(reader, "cpu",
                                                 torch.serialization._weights_only_unpickler,
                                                 encoding="utf-8")
            except (pickle.UnpicklingError, RuntimeError) as e:
                if not _weights_only_refusal(e):
                    raise
        # A refused global: torch.load says so with its explanation (as DCP's reader would).
        data = torchzip._pread_all(fd, info.length, info.offset, path)
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)

    @staticmethod
    def _shares(tensor, target):
        return (tensor.dtype == target.dtype and tensor.shape == target.shape and
                tensor.stride() == target.stride() and tensor.storage_offset() == 0 and
                tensor.untyped_storage().data_ptr() == target.untyped_storage().data_ptr())


__all__ = ["FileSystemWriter", "FileSystemReader"]
