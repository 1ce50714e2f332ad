"""Shared fixtures for the deepnvme Python tests (pytest, run with Debian's /usr/bin/python3).

Environment (set by ctest, see tests/CMakeLists.txt):
  PYTHONPATH      must reach build/python (the deepnvme package of the build tree)
  DNVME_TEST_DIR  scratch root on a disk with O_DIRECT (default /var/tmp/dnvmefs-tests)
  DNVMEFS_BIN     the daemon, for the mount tests
  DNVME_BUILD_DIR the build tree, for the `cmake --install` test

Anything missing (the module, torch, numpy, FUSE) makes the tests that need it skip with the
reason; `pytest -rs` prints the reasons.
"""

import os
import shutil
import sys
import tempfile

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)  # for tests.fs.mount_harness


def _import(name, hint):
    try:
        return __import__(name)
    except ImportError as e:
        pytest.skip("%s is not importable (%s): %s" % (name, e, hint), allow_module_level=True)


@pytest.fixture(scope="session")
def deepnvme():
    return _import("deepnvme", "build the project and set PYTHONPATH=build/python")


@pytest.fixture(scope="session")
def torch():
    return _import("torch", "apt-get install python3-torch and run /usr/bin/python3")


@pytest.fixture(scope="session")
def np():
    return _import("numpy", "apt-get install python3-numpy")


def scratch_root():
    return os.environ.get("DNVME_TEST_DIR") or "/var/tmp/dnvmefs-tests"


@pytest.fixture
def scratch():
    """A fresh directory on the scratch disk (O_DIRECT capable), removed afterwards."""
    root = scratch_root()
    os.makedirs(root, exist_ok=True)
    path = tempfile.mkdtemp(prefix="py-", dir=root)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def small_tmpfs(scratch):
    """A 1 MiB tmpfs (for ENOSPC); skips without root or when mount(2) is refused."""
    import ctypes
    import subprocess
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a 1 MiB tmpfs (euid %d)" % os.geteuid())
    target = os.path.join(scratch, "tiny")
    os.mkdir(target)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", target],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip("cannot mount tmpfs here: %s" % r.stderr.strip())
    try:
        yield target
    finally:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.umount2(target.encode(), 2) != 0:  # MNT_DETACH: never leave it behind
            raise OSError(ctypes.get_errno(), "umount2 " + target)
