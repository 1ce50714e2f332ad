"""Make an installed DeepSpeed run its NVMe I/O on deepnvme: ``deepnvme.deepspeed.activate()``.

    import deepnvme.deepspeed
    deepnvme.deepspeed.activate()      # before DeepSpeed creates its swappers / checkpoint engine
    # ... unchanged DeepSpeed code: ZeRO-Infinity, FastCheckpointEngine, ds_io ...

DeepSpeed gets its I/O ops from op builders: ``AsyncIOBuilder().load()`` (module ``async_io``:
aio_handle, aio_read, aio_write, deepspeed_memcpy), ``GDSBuilder().load()`` (gds_handle),
``PinMemoryBuilder().load()`` (pin_handle) and ``UtilsBuilder().load()`` (flatten, unflatten,
cast_to_byte_tensor, used by deepspeed.io's FastFileWriter). Each builder class JIT-compiles its
C++ op on first load, or imports a prebuilt one. ``activate`` replaces ``load`` (and
``is_compatible``) on every such builder class found in ``deepspeed.ops.op_builder`` (the CUDA
and the CPU accelerator variants alike) so that they return deepnvme's modules instead, and
marks the ops compatible in ``deepspeed.ops.__compatible_ops__``. Nothing is compiled and no
DeepSpeed file is changed; ``deactivate`` puts the originals back.

GDSBuilder is redirected only where deepnvme.gds_handle can run (a CUDA device); elsewhere it is
left alone and ``activate`` says why in its result.

DeepSpeed's decoupled checkpoint engine (``DecoupledCheckpointEngine``) saves from a process it
starts with the "spawn" method, a fresh interpreter where nothing of this process's patching
exists: ``activate`` also replaces the engine module's ``init_decoupled_checkpoint`` (the
process's target) with one that activates deepnvme with the same ops in that process first, so
its FastCheckpointEngine's writers use deepnvme too (result key "decoupled_checkpoint").

Thread safety: call activate/deactivate once, from the main thread, before DeepSpeed loads ops.
"""

import functools
import importlib
import inspect
import pkgutil
import sys
import types

_BUILDERS = {
    # builder class name -> (op NAME, attribute of deepnvme that makes the module)
    "AsyncIOBuilder": "async_io",
    "GDSBuilder": "gds",
    "PinMemoryBuilder": "pin_memory",
    "UtilsBuilder": "utils",
}

_saved = []  # (class, attribute, original value or _MISSING) to restore
_compat_saved = {}
_MISSING = object()


def _dnvme():
    import deepnvme
    return deepnvme


def _utils_module():
    """DeepSpeed's utils op: flatten/unflatten dense tensors and cast_to_byte_tensor (a tensor or
    a list of tensors to uint8 views)."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
    dn = _dnvme()
    mod = types.ModuleType("deepnvme.deepspeed.utils_op")

    def cast_to_byte_tensor(src):
        if isinstance(src, (list, tuple)):
            return [dn.cast_to_byte_tensor(t) for t in src]
        return dn.cast_to_byte_tensor(src)

    mod.flatten = _flatten_dense_tensors
    mod.unflatten = _unflatten_dense_tensors
    mod.cast_to_byte_tensor = cast_to_byte_tensor
    return mod


def op_module(name):
    """The module deepnvme gives for a DeepSpeed op NAME ("async_io", "gds", "pin_memory",
    "utils"). deepnvme itself has everything async_io, gds and pin_memory name."""
    if name == "utils":
        return _utils_module()
    if name in ("async_io", "gds", "pin_memory"):
        return _dnvme()
    raise ValueError("deepnvme provides no DeepSpeed op named %r" % (name,))


def _builder_classes(op_builder):
    """Every builder class of interest in the op_builder package and its accelerator
    subpackages (cpu/, ...), found by class name."""
    found = []
    modules = [op_builder]
    path = getattr(op_builder, "__path__", None)
    if path is not None:
        for info in pkgutil.walk_packages(path, op_builder.__name__ + "."):
            try:
                modules.append(importlib.import_module(info.name))
            except Exception:  # a variant for another accelerator that cannot import here
                continue
    for module in modules:
        for name, value in vars(module).items():
            if name in _BUILDERS and inspect.isclass(value) and value not in found:
                found.append(value)
    return found


def _patch(cls, attr, value):
    _saved.append((cls, attr, cls.__dict__.get(attr, _MISSING)))
    setattr(cls, attr, value)


def activate(ops=("async_io", "gds", "pin_memory", "utils")):
    """Redirects DeepSpeed's op builders for `ops` to deepnvme. Returns {op name: "deepnvme" or
    the reason it was left to DeepSpeed}. Raises ImportError when DeepSpeed is not importable."""
    if _saved:
        deactivate()
    try:
        import deepspeed.ops.op_builder as op_builder
    except ImportError as e:
        raise ImportError("deepnvme.deepspeed.activate(): DeepSpeed is not importable (%s)" %
                          e) from None
    unknown = set(ops) - set(_BUILDERS.values())
    if unknown:
        raise ValueError("unknown op(s) %s; deepnvme provides %s" %
                         (sorted(unknown), sorted(_BUILDERS.values())))
    result = {}
    wanted = set(ops)
    if "gds" in wanted:
        reason = _dnvme().gds_unavailable_reason()
        if reason:
            wanted.discard("gds")
            result["gds"] = reason
    classes = _builder_classes(op_builder)
    # Resolved before anything is patched: a builder left to DeepSpeed that inherits from a
    # redirected one (GDSBuilder is an AsyncIOBuilder) keeps its own load.
    originals = {cls: (cls.load, cls.is_compatible) for cls in classes}
    for cls in classes:
        name = _BUILDERS[cls.__name__]
        if name not in wanted:
            if any(issubclass(cls, other) for other in classes
                   if other is not cls and _BUILDERS[other.__name__] in wanted):
                _patch(cls, "load", originals[cls][0])
                _patch(cls, "is_compatible", originals[cls][1])
            continue

        def load(self, verbose=True, _name=name):
            return op_module(_name)

        def is_compatible(self, verbose=False):
            return True

        _patch(cls, "load", load)
        _patch(cls, "is_compatible", is_compatible)
        result[name] = "deepnvme"
    for name in sorted(wanted):
        result.setdefault(name, "no %s builder class in %s" %
                          ([k for k, v in _BUILDERS.items() if v == name][0],
                           op_builder.__name__))
    ops_pkg = sys.modules.get("deepspeed.ops")
    compat = getattr(ops_pkg, "__compatible_ops__", None)
    if isinstance(compat, dict):
        for name, how in result.items():
            if how == "deepnvme":
                _compat_saved[name] = compat.get(name, _MISSING)
                compat[name] = True
    result["decoupled_checkpoint"] = _patch_decoupled(tuple(ops))
    return result


_DECOUPLED = "deepspeed.runtime.checkpoint_engine.decoupled_checkpoint_engine"


def _patch_decoupled(ops):
    """Makes the decoupled checkpoint engine's process activate deepnvme (see the module
    comment); "deepnvme" or why not."""
    try:
        module = importlib.import_module(_DECOUPLED)
    except Exception as e:  # a DeepSpeed without it, or one whose import fails here
        return "no decoupled checkpoint engine (%s: %s)" % (type(e).__name__, e)
    if not callable(getattr(module, "init_decoupled_checkpoint", None)):
        return "%s has no init_decoupled_checkpoint" % _DECOUPLED
    # A partial of a module-level function: pickled by reference for the spawned process.
    _patch(module, "init_decoupled_checkpoint", functools.partial(_decoupled_process, ops))
    return "deepnvme"


def _decoupled_process(ops, *args, **kwargs):
    """The decoupled checkpoint process's target: deepnvme activated in this fresh interpreter,
    then DeepSpeed's own init_decoupled_checkpoint (this process's import of it, unpatched)."""
    original = importlib.import_module(_DECOUPLED).init_decoupled_checkpoint
    if isinstance(original, functools.partial):  # (a fork: the parent's patch came along)
        original = _saved_original(original)
    activate(ops)
    return original(*args, **kwargs)


def _saved_original(patched):
    for owner, attr, value in _saved:
        if getattr(owner, attr, None) is patched and value is not _MISSING:
            return value
    raise RuntimeError("deepnvme.deepspeed: DeepSpeed's init_decoupled_checkpoint is lost")


def deactivate():
    """Puts DeepSpeed's own builders back (undoes activate)."""
    while _saved:
        cls, attr, original = _saved.pop()
        if original is _MISSING:
            delattr(cls, attr)
        else:
            setattr(cls, attr, original)
    ops_pkg = sys.modules.get("deepspeed.ops")
    compat = getattr(ops_pkg, "__compatible_ops__", None)
    if isinstance(compat, dict):
        for name, value in _compat_saved.items():
            if value is _MISSING:
                compat.pop(name, None)
            else:
                compat[name] = value
    _compat_saved.clear()


def active():
    """True while activate() is in effect."""
    return bool(_saved)


__all__ = ["activate", "deactivate", "active", "op_module"]
