"""Mount harness for the dnvmefs mount tests (standard library only).

Mount(backing, mnt, options=[], foreground=True) starts the daemon, waits (bounded) until the mount
is in /proc/self/mountinfo and, on exit, ALWAYS unmounts (fusermount3 -u, then a lazy unmount) and
stops the daemon (SIGTERM, then SIGKILL after a bounded wait) and reaps it, even when the test
failed. A module-level atexit hook does the same for anything still mounted when the interpreter
exits, and SIGTERM/SIGHUP on the test process run that hook too.

A watchdog (re-armed before every MountedTestCase test) aborts the FUSE connection (fusectl
.../abort) when a test hangs inside a syscall on the mount for longer than `watchdog_s`; the hung call then fails with ENOTCONN and the
test fails instead of hanging the whole run. The watchdog firing is recorded on the Mount.

Environment:
  DNVMEFS_BIN     the daemon (default: <repo>/build/bin/dnvmefs)
  DNVME_TEST_DIR  scratch root (default: /var/tmp/dnvmefs-tests); each Scratch is removed after use
"""

import atexit
import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FSTYPE = "fuse.dnvmefs"
MOUNT_WAIT_S = 10.0
STOP_WAIT_S = 10.0
FUSECTL = "/sys/fs/fuse/connections"


def daemon_bin():
    return os.path.abspath(os.environ.get("DNVMEFS_BIN") or
                           os.path.join(REPO_ROOT, "build", "bin", "dnvmefs"))


def test_root():
    return os.environ.get("DNVME_TEST_DIR") or "/var/tmp/dnvmefs-tests"


def log(msg):
    sys.stderr.write("[mount_harness] %s\n" % msg)
    sys.stderr.flush()


# ---------------------------------------------------------------------------------------------
# /proc/self/mountinfo


def _unescape(field):
    # mountinfo escapes space, tab, newline and backslash as \ooo.
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 4 <= len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mountinfo():
    """List of dicts: mountpoint, fstype, source, dev ('maj:min'), options."""
    entries = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.rstrip("\n").partition(" - ")
            lf, rf = left.split(" "), right.split(" ")
            entries.append({
                "dev": lf[2],
                "mountpoint": _unescape(lf[4]),
                "options": lf[5],
                "fstype": rf[0] if rf else "",
                "source": _unescape(rf[1]) if len(rf) > 1 else "",
                "super_options": rf[2] if len(rf) > 2 else "",
            })
    return entries


def mounts_at(path):
    """Every mountinfo entry whose mount point is `path` (already a real path)."""
    return [e for e in mountinfo() if e["mountpoint"] == path]


def wait_unmounted(path, timeout=5.0):
    """True once nothing is mounted at `path`. As root the daemon has dropped CAP_SYS_ADMIN and
    cannot unmount itself: the fusermount3 of auto_unmount does it when it sees the daemon's
    socket close, a moment after the daemon exited. So poll, bounded."""
    deadline = time.monotonic() + timeout
    while mounts_at(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def is_mounted(path, fstype=FSTYPE):
    return any(fstype is None or e["fstype"] == fstype for e in mounts_at(path))


def ensure_fusectl():
    """The watchdog aborts connections through fusectl; mount it (as systemd does) when it is
    missing and we are root. Returns True when it is available."""
    if any(e["fstype"] == "fusectl" for e in mountinfo()):
        return True
    if os.geteuid() != 0 or not os.path.isdir(FUSECTL):
        return False
    r = subprocess.run(["mount", "-t", "fusectl", "fusectl", FUSECTL], capture_output=True)
    if r.returncode == 0:
        log("mounted fusectl at %s (for the hang watchdog)" % FUSECTL)
    return r.returncode == 0


def _abort_connection(path):
    """Aborts every FUSE connection mounted at `path` via fusectl; returns True if one was."""
    done = False
    for e in mounts_at(path):
        if not e["fstype"].startswith("fuse"):
            continue
        minor = e["dev"].split(":")[1]
        abort = os.path.join(FUSECTL, minor, "abort")
        try:
            with open(abort, "w") as f:
                f.write("1")
            done = True
        except OSError:
            pass
    return done


def force_unmount(path, timeout=10.0):
    """Unmounts every mount at `path`: fusermount3 -u, then a lazy unmount. Never raises.

    Returns a list of what was tried, for logs."""
    tried = []
    for _ in range(8):
        if not mounts_at(path):
            return tried
        for cmd in (["fusermount3", "-u", "-q", path], ["umount", path],
                    ["fusermount3", "-u", "-z", "-q", path], ["umount", "-l", path]):
            if not mounts_at(path):
                break
            try:
                r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   timeout=timeout)
                tried.append("%s -> %d" % (" ".join(cmd[:-1]), r.returncode))
            except (OSError, subprocess.TimeoutExpired) as exc:
                tried.append("%s -> %s" % (" ".join(cmd[:-1]), exc))
                # A hung daemon can block an unmount: cut the connection and go on.
                _abort_connection(path)
    if mounts_at(path):
        log("could not unmount %s (tried: %s)" % (path, "; ".join(tried)))
    return tried


# ---------------------------------------------------------------------------------------------
# process helpers


def pid_alive(pid):
    """True while `pid` exists and is not a zombie."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return False


def find_daemon_pids(mnt):
    """pids of dnvmefs processes whose command line names `mnt` (for the daemonized mode)."""
    binary = os.path.basename(daemon_bin())
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open("/proc/%s/cmdline" % d, "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        if not argv:
            continue
        names = {os.path.basename(a) for a in argv[:2]}
        if binary in names and any(os.path.realpath(a) == mnt for a in argv[1:]
                                   if a.startswith("/")):
            found.append(int(d))
    return found


_libc = None


def _set_pdeathsig():
    """preexec_fn: the daemon gets SIGTERM if the test process dies (even of SIGKILL), so a
    killed test run does not leave a daemon serving a mount nobody will unmount."""
    global _libc
    try:
        import ctypes
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        _libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def clean_stale_mounts(root=None):
    """Unmounts dnvmefs mounts under the scratch root that no live daemon serves (left by a test
    run that was SIGKILLed). Mounts of concurrently running suites have a live daemon and stay."""
    root = os.path.realpath(root or test_root())
    for e in mountinfo():
        mp = e["mountpoint"]
        if e["fstype"] == FSTYPE and mp.startswith(root + "/") and not find_daemon_pids(mp):
            log("unmounting stale %s (no daemon serves it)" % mp)
            force_unmount(mp)


def _wait_pid_gone(pid, proc, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None:
            if proc.poll() is not None:
                return True
        elif not pid_alive(pid):
            return True
        time.sleep(0.02)
    return False


# ---------------------------------------------------------------------------------------------
# safety net

_live = {}  # id -> Mount
_live_lock = threading.Lock()


_scratches = {}  # id -> Scratch not yet cleaned up


def _cleanup_all():
    with _live_lock:
        mounts = list(_live.values())
        scratches = list(_scratches.values())
    for m in mounts:
        try:
            m.stop()
        except Exception as exc:  # the safety net must never raise
            log("atexit cleanup of %s failed: %r" % (m.mnt, exc))
    for sc in scratches:
        try:
            sc.cleanup()
        except Exception as exc:
            log("atexit cleanup of %s failed: %r" % (sc.path, exc))


atexit.register(_cleanup_all)


_stopping = False


def _on_signal(signum, _frame):
    # unittest would catch a SystemExit raised here as a test error and go on mounting, so clean
    # up, then die of the same signal.
    global _stopping
    _stopping = True
    log("signal %d: cleaning up mounts, then exiting" % signum)
    _cleanup_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


for _sig in (signal.SIGTERM, signal.SIGHUP):
    try:
        if signal.getsignal(_sig) in (signal.SIG_DFL, None):
            signal.signal(_sig, _on_signal)
    except (ValueError, OSError):  # not the main thread
        pass


# ---------------------------------------------------------------------------------------------
# skip logic


def skip_reason(need_root=False):
    """None when a dnvmefs mount can work here, else a sentence saying why not."""
    if not sys.platform.startswith("linux"):
        return "dnvmefs needs Linux (platform is %s)" % sys.platform
    if need_root and os.geteuid() != 0:
        return "needs root"
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing (no FUSE in this kernel/container)"
    try:
        fd = os.open("/dev/fuse", os.O_RDWR)
        os.close(fd)
    except OSError as exc:
        return "cannot open /dev/fuse: %s" % exc.strerror
    b = daemon_bin()
    if not os.path.exists(b):
        return "daemon binary %s not found (build target dnvmefs, or set DNVMEFS_BIN)" % b
    if not os.access(b, os.X_OK):
        return "daemon binary %s is not executable" % b
    if os.geteuid() != 0 and shutil.which("fusermount3") is None:
        return "not root and fusermount3 is missing: mounting is not permitted"
    if shutil.which("fusermount3") is None and shutil.which("umount") is None:
        return "neither fusermount3 nor umount found: mounts could not be cleaned up"
    return None


# ---------------------------------------------------------------------------------------------
# scratch directories


class Scratch:
    """A fresh directory under DNVME_TEST_DIR with `backing` and `mnt` inside; removed on exit
    (after unmounting anything still mounted under it)."""

    _stale_checked = False

    def __init__(self, prefix="t"):
        root = test_root()
        os.makedirs(root, exist_ok=True)
        if not Scratch._stale_checked:
            Scratch._stale_checked = True
            clean_stale_mounts(root)
        self.path = os.path.realpath(tempfile.mkdtemp(prefix=prefix + "-", dir=root))
        self.backing = os.path.join(self.path, "backing")
        self.mnt = os.path.join(self.path, "mnt")
        os.mkdir(self.backing)
        os.mkdir(self.mnt)
        with _live_lock:
            _scratches[id(self)] = self

    def sub(self, name):
        p = os.path.join(self.path, name)
        os.makedirs(p, exist_ok=True)
        return p

    def cleanup(self):
        for e in list(mountinfo()):
            if e["mountpoint"] == self.path or e["mountpoint"].startswith(self.path + "/"):
                force_unmount(e["mountpoint"])
        shutil.rmtree(self.path, ignore_errors=True)
        with _live_lock:
            _scratches.pop(id(self), None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.cleanup()
        return False


# ---------------------------------------------------------------------------------------------
# the mount


class MountError(Exception):
    pass


class Mount:
    """Context manager: one dnvmefs daemon serving `backing` at `mnt`.

    Attributes after start: pid, proc (Popen in foreground mode, else None), returncode (once the
    daemon exited and was reaped by us; None when it is not our child), log_path, watchdog_fired.
    """

    def __init__(self, backing, mnt, options=(), foreground=True, extra_args=(),
                 watchdog_s=150.0, mount_wait_s=MOUNT_WAIT_S, log_path=None):
        self.backing = backing
        self.mnt = os.path.realpath(mnt)
        self.options = list(options)
        self.foreground = foreground
        self.extra_args = list(extra_args)
        # -d implies -f: such a daemon stays our child even when we did not pass -f.
        self.stays_foreground = foreground or "-d" in self.extra_args
        self.watchdog_s = watchdog_s
        self.mount_wait_s = mount_wait_s
        self.log_path = log_path or os.path.join(os.path.dirname(self.mnt),
                                                 "daemon-%s.log" % os.path.basename(self.mnt))
        self.stop_wait_s = STOP_WAIT_S
        self.proc = None
        self.pid = None
        self.returncode = None
        self.watchdog_fired = False
        self._timer = None
        self._stopped = False

    # argv -------------------------------------------------------------------------------------
    def argv(self):
        a = [daemon_bin(), self.backing, self.mnt]
        if self.foreground:
            a.append("-f")
        a += self.extra_args
        if self.options:
            a += ["-o", ",".join(self.options)]
        return a

    def log_text(self):
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def log_tail(self, n=4000):
        return self.log_text()[-n:]

    # start ------------------------------------------------------------------------------------
    def start(self):
        if _stopping:
            raise MountError("the test process is being stopped")
        if is_mounted(self.mnt, None):
            raise MountError("%s is already a mount point before the test started" % self.mnt)
        logf = open(self.log_path, "ab")
        with _live_lock:
            _live[id(self)] = self
        try:
            self.proc = subprocess.Popen(self.argv(), stdin=subprocess.DEVNULL, stdout=logf,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_set_pdeathsig)
        finally:
            logf.close()
        if self.stays_foreground:
            self.pid = self.proc.pid
            self._wait_mounted()
        else:
            try:
                rc = self.proc.wait(timeout=self.mount_wait_s)
            except subprocess.TimeoutExpired:
                self.stop()
                raise MountError("daemonizing parent did not exit within %.0f s; log:\n%s" %
                                 (self.mount_wait_s, self.log_tail()))
            self.returncode = rc
            if rc != 0:
                self.stop()
                raise MountError("daemonizing parent exited %d; log:\n%s" % (rc, self.log_tail()))
            # Contract: the parent exits 0 only once the mount is live.
            if not is_mounted(self.mnt):
                self.stop()
                raise MountError("parent exited 0 but %s is not mounted as %s" %
                                 (self.mnt, FSTYPE))
            pids = find_daemon_pids(self.mnt)
            self.pid = pids[0] if pids else None
            self.proc = None
        if self.watchdog_s and not ensure_fusectl():
            log("fusectl unavailable: the watchdog cannot abort a hung mount")
        self.rearm_watchdog()
        return self

    def rearm_watchdog(self):
        """(Re)starts the watchdog period; MountedTestCase calls it before every test."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.watchdog_s:
            self._timer = threading.Timer(self.watchdog_s, self._watchdog)
            self._timer.daemon = True
            self._timer.start()

    def _wait_mounted(self):
        deadline = time.monotonic() + self.mount_wait_s
        while time.monotonic() < deadline:
            if is_mounted(self.mnt):
                return
            if self.proc.poll() is not None:
                self.returncode = self.proc.returncode
                self.stop()
                raise MountError("daemon exited with %d before mounting; argv %s; log:\n%s" %
                                 (self.returncode, self.argv(), self.log_tail()))
            time.sleep(0.02)
        others = [e["fstype"] for e in mounts_at(self.mnt)]
        self.stop()
        raise MountError("%s not mounted as %s within %.0f s (mounts there: %s); log:\n%s" %
                         (self.mnt, FSTYPE, self.mount_wait_s, others, self.log_tail()))

    def _watchdog(self):
        if self.is_mounted():
            self.watchdog_fired = True
            log("WATCHDOG: test still running on %s after %.0f s: aborting the FUSE connection" %
                (self.mnt, self.watchdog_s))
            _abort_connection(self.mnt)

    # state ------------------------------------------------------------------------------------
    def is_mounted(self):
        return is_mounted(self.mnt)

    def alive(self):
        if self.proc is not None:
            return self.proc.poll() is None
        return self.pid is not None and pid_alive(self.pid)

    def wait_exit(self, timeout):
        """Waits for the daemon to exit; returns its exit code (None if not our child or still
        running after `timeout`)."""
        if self.pid is None:
            return None
        if _wait_pid_gone(self.pid, self.proc, timeout):
            if self.proc is not None:
                self.returncode = self.proc.returncode
            return self.returncode
        return None

    # signals ------------------------------------------------------------------------------------
    def send_signal(self, sig):
        if self.pid is not None and self.alive():
            os.kill(self.pid, sig)

    def terminate_and_wait(self, timeout=STOP_WAIT_S, sig=signal.SIGTERM):
        """Sends `sig` and waits for the daemon to exit by itself. Returns (exited, returncode)."""
        self.send_signal(sig)
        exited = _wait_pid_gone(self.pid, self.proc, timeout) if self.pid else True
        if exited and self.proc is not None:
            self.returncode = self.proc.returncode
        return exited, self.returncode

    def kill9(self):
        self.send_signal(signal.SIGKILL)
        _wait_pid_gone(self.pid, self.proc, STOP_WAIT_S)
        if self.proc is not None and self.proc.poll() is not None:
            self.returncode = self.proc.returncode

    # stop ---------------------------------------------------------------------------------------
    def stop(self):
        """Unmount, stop and reap. Idempotent; never raises."""
        if self._timer is not None:
            self._timer.cancel()
        if self.is_mounted() or mounts_at(self.mnt):
            force_unmount(self.mnt)
        if self.pid is not None and self.alive():
            # After an unmount the daemon should leave by itself; give it a moment, then insist.
            if not _wait_pid_gone(self.pid, self.proc, 2.0):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGTERM)
                if not _wait_pid_gone(self.pid, self.proc, self.stop_wait_s):
                    log("daemon %d ignored SIGTERM for %.0f s: SIGKILL" %
                        (self.pid, self.stop_wait_s))
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(self.pid, signal.SIGKILL)
                    _wait_pid_gone(self.pid, self.proc, STOP_WAIT_S)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=STOP_WAIT_S)
                self.returncode = self.proc.returncode
            except subprocess.TimeoutExpired:
                log("daemon %d could not be reaped" % self.proc.pid)
        if mounts_at(self.mnt):
            force_unmount(self.mnt)
        with _live_lock:
            _live.pop(id(self), None)
        self._stopped = True

    def __enter__(self):
        return self.start()

    def __exit__(self, exc_type, exc, tb):
        self.stop()
        return False


def run_daemon(args, timeout=15.0):
    """Runs the daemon with `args` expecting it to fail fast; returns CompletedProcess. If it is
    still running after `timeout`, it is killed (and whatever it mounted is unmounted by the
    caller's Scratch)."""
    try:
        return subprocess.run([daemon_bin()] + list(args), stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout,
                              start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        return subprocess.CompletedProcess(exc.cmd, None, exc.stdout or b"", exc.stderr or b"")


def drop_caches():
    """Best effort: write back and drop the page cache (root only)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


# The page cache and memory cgroups (evict, resident_bytes, io_read_bytes, MemoryCgroup): one
# copy, bench/benchlib.py's, for the benchmarks and the tests alike.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "bench"))
from benchlib import MemoryCgroup, evict, io_read_bytes, resident_bytes  # noqa: E402,F401


def stats(mnt):
    """The mount's .dnvme/stats document."""
    with open(os.path.join(mnt, ".dnvme", "stats")) as f:
        return json.load(f)


def passthrough_skip_reason(mnt):
    """Why FUSE passthrough cannot be on at `mnt` (a kernel before 6.9, no CAP_SYS_ADMIN), from
    what the daemon negotiated; None when it is on."""
    k = stats(mnt)["kernel"]
    p = k["passthrough"]
    if not p["offered"]:
        return "the kernel does not offer FUSE passthrough (protocol %s; needs 6.9+ with " \
               "CONFIG_FUSE_PASSTHROUGH)" % (k["kernel_protocol"] or "?")
    if not p["on"]:
        return "the daemon cannot register backing files (needs root with CAP_SYS_ADMIN)"
    return None


URING_PARAM = "/sys/module/fuse/parameters/enable_uring"


def set_kernel_uring(on):
    """Sets the fuse module's enable_uring (root); returns the previous value ("Y"/"N") for
    restore_kernel_uring. Raises unittest.SkipTest with the reason when it cannot."""
    try:
        with open(URING_PARAM) as f:
            prev = f.read().strip()
        with open(URING_PARAM, "w") as f:
            f.write("Y" if on else "N")
    except OSError as e:
        raise unittest.SkipTest("cannot set %s (%s): FUSE over io_uring needs kernel 6.14+ "
                                "with CONFIG_FUSE_IO_URING, and root" % (URING_PARAM, e))
    return prev


def restore_kernel_uring(prev):
    if prev is not None:
        with open(URING_PARAM, "w") as f:
            f.write(prev)


def errno_name(e):
    return errno.errorcode.get(e, str(e))


# ---------------------------------------------------------------------------------------------
# unittest glue


class MountedTestCase(unittest.TestCase):
    """One scratch dir + one mount per test class (setUpClass); skipped with the reason from
    skip_reason() when mounting cannot work here. Subclasses may set MOUNT_OPTIONS."""

    MOUNT_OPTIONS = ()
    NEED_ROOT = False

    @classmethod
    def setUpClass(cls):
        reason = skip_reason(need_root=cls.NEED_ROOT)
        if reason:
            raise unittest.SkipTest(reason)
        cls.scratch = Scratch(cls.__name__)
        cls.backing, cls.mnt = cls.scratch.backing, cls.scratch.mnt
        try:
            cls.mount = Mount(cls.backing, cls.mnt, options=cls.MOUNT_OPTIONS).start()
        except BaseException:
            cls.scratch.cleanup()
            raise

    @classmethod
    def tearDownClass(cls):
        try:
            cls.mount.stop()
        finally:
            cls.scratch.cleanup()

    def setUp(self):
        if not self.mount.alive() or not self.mount.is_mounted():
            self.fail("daemon died or mount vanished before this test (an earlier test killed "
                      "it?); log tail:\n%s" % self.mount.log_tail())
        self.mount.rearm_watchdog()

    def tearDown(self):
        if self.mount.watchdog_fired:
            self.fail("watchdog aborted the FUSE connection (a syscall on the mount hung)")

    def m(self, *parts):
        return os.path.join(self.mnt, *parts)

    def b(self, *parts):
        return os.path.join(self.backing, *parts)

    def read(self, path):
        with open(path, "rb") as f:
            return f.read()

    def write(self, path, data, mode="wb"):
        with open(path, mode) as f:
            f.write(data)

    def assertBytesEqual(self, got, want, what=""):
        """Like assertEqual for bytes, but reports the first differing offset, not a dump."""
        if got == want:
            return
        n = min(len(got), len(want))
        first = next((i for i in range(n) if got[i] != want[i]), n)
        self.fail("%s: bytes differ: len got %d want %d, first difference at offset %d "
                  "(got %r want %r)" % (what, len(got), len(want), first,
                                         got[first:first + 16], want[first:first + 16]))
