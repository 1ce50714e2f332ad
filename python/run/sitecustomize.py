"""What `dnvme run` puts first on PYTHONPATH: Python runs it at start-up (the `site` module).

When the program imports torch, deepnvme.run_hook.patch(torch) makes torch.save of files on a
dnvmefs mount write through the engine (see that module); until then nothing is imported, so a
program without torch pays for one meta-path finder. Then it runs the sitecustomize this one
hides, if there is one further along sys.path (Debian's, a virtualenv's), so the program starts as
it would have. It never stops a program: any failure leaves torch alone (DNVME_PRELOAD_LOG=debug
says why).
"""

import os
import sys

_HERE = os.path.dirname(os.path.realpath(__file__))


def _debug(msg):
    if os.environ.get("DNVME_PRELOAD_LOG", "") in ("debug", "trace"):
        sys.stderr.write("dnvme run: %s\n" % msg)


def _patch(torch):
    # The build tree keeps the deepnvme package beside this directory (build/python); an
    # installed one is on the interpreter's own path.
    build_pkg = os.path.join(os.path.dirname(_HERE), "python")
    if os.path.isdir(os.path.join(build_pkg, "deepnvme")) and build_pkg not in sys.path:
        sys.path.append(build_pkg)
    try:
        from deepnvme import run_hook
        run_hook.patch(torch)
    except Exception as e:  # no deepnvme for this interpreter, say: torch keeps its own save
        _debug("no torch.save hook: %r" % (e,))


class _TorchFinder:
    """A meta-path finder for `torch` alone: finds it through the rest of sys.meta_path and
    patches the module once it has executed. It stays until torch has been imported: a probe
    (importlib.util.find_spec("torch"), as transformers and accelerate make before importing)
    gets a spec that is thrown away, and the import that follows asks again."""

    def __init__(self):
        import threading
        self._inside = threading.local()  # our own find_spec below must not come back here

    def find_spec(self, name, path=None, target=None):
        if name != "torch" or getattr(self._inside, "on", False):
            return None
        try:
            import importlib.util
            self._inside.on = True
            try:
                spec = importlib.util.find_spec(name)
            finally:
                self._inside.on = False
            loader = getattr(spec, "loader", None)
            if loader is None or not hasattr(loader, "exec_module"):
                return spec
            run = loader.exec_module
            finder = self

            def exec_module(module):
                if getattr(module, "__name__", None) != "torch":  # a loader shared by modules
                    return run(module)
                try:
                    del loader.exec_module  # the loader's own again
                except AttributeError:
                    pass
                run(module)
                if finder in sys.meta_path:
                    sys.meta_path.remove(finder)
                _patch(module)

            loader.exec_module = exec_module
            return spec
        except Exception as e:  # the import goes on without us
            _debug("torch.save hook: finding torch: %r" % (e,))
            return None


def _install():
    if os.environ.get("DNVME_PRELOAD_TORCH", "1") == "0" or \
            os.environ.get("DNVME_PRELOAD_DISABLE", "0") == "1":
        return
    if "torch" in sys.modules:
        _patch(sys.modules["torch"])
    else:
        sys.meta_path.insert(0, _TorchFinder())


def _chain():
    """Runs the next sitecustomize along the path, found without this directory. (The import
    system takes sys.modules[__name__] back after this module ran: the other one, or this one.)"""
    me = sys.modules.pop(__name__)
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != _HERE]
    try:
        import sitecustomize  # noqa: F401
    except ImportError as e:
        if e.name != "sitecustomize":  # its own failure: site reports it, as without us
            raise
    finally:
        sys.path[:] = saved
        sys.modules.setdefault(__name__, me)


_install()
_chain()
