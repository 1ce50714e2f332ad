"""torch.save on the engine for unmodified programs under `dnvme run` (docs/preload.md).

libdnvme_preload.so already sends a program's large writes of files on a dnvmefs mount to its
engine, but torch.save spends most of its time before the write: it computes each record's
CRC-32 with miniz in the saving thread and streams every tensor through small write calls. So
`dnvme run` also puts a `sitecustomize` on PYTHONPATH (python/run/sitecustomize.py) that calls
patch() once torch is imported (and loads deepnvme only then): `torch.save(obj, path)` of a path
on a dnvmefs mount writes
through torchzip.MountZipWriter (torch's own pickler and archive layout, the CRC computed fast
and beside the write, every large record one pwritev that the preload library takes). Anything
else goes to torch's own save unchanged: file objects, paths elsewhere, the legacy format
(_use_new_zipfile_serialization=False), arguments this module does not know, a torch whose
private serializer differs (torchzip.supported()).

DNVME_PRELOAD_TORCH=0 (`dnvme run --no-torch-hook`) or DNVME_PRELOAD_DISABLE=1 leaves torch
alone. The hook never stops a program: a failure to install it is logged (DNVME_PRELOAD_LOG
at debug) and torch keeps its own save.

Thread safety: patch() runs once, inside torch's import; the patched save is as thread-safe as
torch's.
"""

import functools
import inspect
import os
import re
import sys

# What the patched save has done, for tests and --stats-like checks.
counters = {"saves": 0, "fallbacks": 0}

_KNOWN = {"obj", "f", "pickle_module", "pickle_protocol", "_use_new_zipfile_serialization",
          "_disable_byteorder_record"}


def _debug(msg):
    if os.environ.get("DNVME_PRELOAD_LOG", "") in ("debug", "trace"):
        sys.stderr.write("dnvme run: %s\n" % msg)


def _dnvmefs_devices():
    """st_dev of every dnvmefs mount this process sees (DNVME_PRELOAD_MOUNTS narrows them, as it
    does for the preload library)."""
    wanted = [m for m in os.environ.get("DNVME_PRELOAD_MOUNTS", "").split(":") if m]
    devs = set()
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return devs
    for line in lines:
        fields = line.split(" ")
        try:
            sep = fields.index("-")
        except ValueError:
            continue
        if fields[sep + 1] != "fuse.dnvmefs":
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        if wanted and point not in wanted:
            continue
        major, minor = fields[2].split(":")
        devs.add(os.makedev(int(major), int(minor)))
    return devs


def _on_mount(path):
    """True when `path` (a file to be created or replaced) is on a dnvmefs mount."""
    try:
        st = os.stat(os.path.dirname(os.path.abspath(path)) or "/")
    except OSError:
        return False
    return st.st_dev in _dnvmefs_devices()


def _fast_args(original, args, kwargs):
    """(obj, path, pickle_module, pickle_protocol) when this call can take the fast path."""
    try:
        bound = inspect.signature(original).bind(*args, **kwargs)
    except TypeError:
        return None  # torch's own save reports the mistake
    bound.apply_defaults()
    a = bound.arguments
    if set(a) - _KNOWN or not a.get("_use_new_zipfile_serialization", True) or \
            a.get("_disable_byteorder_record", False):
        return None
    f = a["f"]
    if isinstance(f, bytes):
        f = os.fsdecode(f)
    if not isinstance(f, (str, os.PathLike)):
        return None
    path = os.fspath(f)
    if not _on_mount(path):
        return None
    return a["obj"], path, a["pickle_module"], a["pickle_protocol"]


def patch(torch):
    """Replaces torch.save (and torch.serialization.save) by the mount-aware one; called by
    `dnvme run`'s sitecustomize when torch has been imported."""
    original = torch.serialization.save
    if getattr(original, "__dnvme_hook__", False):
        return
    from . import torchzip  # deepnvme (and its _C) only now: a program without torch pays nothing
    reason = torchzip.supported()
    if reason is not None:
        _debug("torch.save stays torch's: %s" % reason)
        return

    @functools.wraps(original)
    def save(*args, **kwargs):
        fast = _fast_args(original, args, kwargs)
        if fast is None:
            counters["fallbacks"] += 1
            return original(*args, **kwargs)
        obj, path, pickle_module, pickle_protocol = fast
        writer = torchzip.MountZipWriter(path)
        try:
            torchzip.save(obj, writer, pickle_module, pickle_protocol)
            writer.close()
        except BaseException:
            writer.abort()
            raise
        counters["saves"] += 1

    save.__dnvme_hook__ = True
    torch.serialization.save = save
    torch.save = save
