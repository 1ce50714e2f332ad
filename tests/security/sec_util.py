"""Helpers of the security suite (docs/security.md): an unprivileged child driven line by line,
the daemon's threads, capabilities and memory from /proc, a small loop-mounted ext4, and the raw
broker and control-file protocols spoken from Python (standard library only).

Every test runs as root and acts as the attacker in a child dropped to uid 65534 (`Child`:
setgroups([]), setgid, setuid done by subprocess before exec, so the program is dumpable as a
login of that user would be). The mount itself is tests/fs/mount_harness.py's.
"""

import ctypes
import errno
import glob
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "fs"))
import mount_harness as mh  # noqa: E402

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
PY = "/usr/bin/python3"
NOBODY = 65534
OPTIONS = ("allow_other", "default_permissions")  # the documented mount of a shared machine

CAP_SYS_ADMIN, CAP_MKNOD = 21, 27
FALLOC_FL_COLLAPSE_RANGE, FALLOC_FL_INSERT_RANGE = 0x08, 0x20


def dnvme_bin():
    return os.environ.get("DNVME_BIN") or os.path.join(os.path.dirname(mh.daemon_bin()), "dnvme")


def preload_skip_reason():
    """Why `dnvme run` cannot be used here (None when it can)."""
    if os.environ.get("DNVME_SANITIZED", "0") == "1":
        return "sanitizer build: its libdnvme_preload.so cannot be preloaded into python3"
    if not os.access(dnvme_bin(), os.X_OK):
        return "%s not built (set DNVME_BIN)" % dnvme_bin()
    return None


# One definition for the tests and their children (CHILD_LIB carries its source).
BLOCK_PATTERN = r'''
def block_pattern(n, seed=0):
    """`n` bytes where each 4 KiB block is its own number and `seed` in hex digits, repeated:
    misplaced, lost or zero-filled blocks show, and no byte is zero."""
    blocks = (n + 4095) // 4096
    return b"".join(b"%06x:%08x\n" % (seed & 0xffffff, i) * 256 for i in range(blocks))[:n]
'''
exec(BLOCK_PATTERN)


def nonzero_pattern(n, seed=1):
    """`n` bytes with no zero byte (a zero-filled tail cannot pass for data)."""
    one = bytes(((i * 7 + seed) % 255) + 1 for i in range(4093))  # period coprime to 4 KiB
    return (one * (n // len(one) + 1))[:n]


def first_difference(got, want):
    n = min(len(got), len(want))
    i = next((k for k in range(0, n, 4096) if got[k:k + 4096] != want[k:k + 4096]), None)
    if i is None:
        return n if len(got) != len(want) else None
    return next(k for k in range(i, min(n, i + 4096)) if got[k] != want[k])


# ---------------------------------------------------------------------------------------------
# The daemon, from /proc (root reads it; the tests never trust what the daemon says of itself)


def threads(pid):
    try:
        return sorted(int(t) for t in os.listdir("/proc/%d/task" % pid))
    except OSError:
        return []


def settled_threads(pid, timeout=5.0):
    """The daemon's thread count once it stopped changing for half a second (bounded): its loop
    threads start after the mount appears, and a count taken too early would blame them on a
    test's client."""
    deadline = time.monotonic() + timeout
    last, since = len(threads(pid)), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < 0.5:
        time.sleep(0.05)
        n = len(threads(pid))
        if n != last:
            last, since = n, time.monotonic()
    return last


def status_field(path, key):
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cap_eff(pid, tid):
    v = status_field("/proc/%d/task/%d/status" % (pid, tid), "CapEff")
    return None if v is None else int(v, 16)


def vm_kib(pid, key):
    v = status_field("/proc/%d/status" % pid, key)
    return int(v.split()[0]) if v else 0


def pinned_bytes(pid):
    """mlock'ed plus pinned memory of the daemon (VmLck, VmPin)."""
    return (vm_kib(pid, "VmLck") + vm_kib(pid, "VmPin")) * KiB


def mem_total():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * KiB
    raise RuntimeError("no MemTotal in /proc/meminfo")


def broker_socket(mnt):
    """The broker's abstract socket name (without '@'), from <mnt>/.dnvme/broker."""
    with open(os.path.join(mnt, ".dnvme", "broker")) as f:
        text = f.read()
    if "socket @" not in text:
        return None
    return text.split("socket @", 1)[1].split()[0]


# ---------------------------------------------------------------------------------------------
# The unprivileged child

# A control-file session (one write per request, the answer read to its end): the children's and
# the root side's, one definition for both.
CTL_CLIENT = r'''
class Ctl:
    def __init__(self, mnt):
        self.fd = os.open(os.path.join(mnt, ".dnvme", "ctl"), os.O_RDWR)
    def req(self, op, **kw):
        kw["op"] = op
        try:
            os.write(self.fd, json.dumps(kw).encode())
        except OSError as e:
            return {"ok": False, "error": {"code": errno.errorcode.get(e.errno, str(e.errno)),
                                           "errno": e.errno, "message": "write: " + str(e)}}
        out = b""
        while True:
            c = os.read(self.fd, 1 << 20)
            if not c:
                return json.loads(out)
            out += c
    def ok(self, op, **kw):
        a = self.req(op, **kw)
        if not a.get("ok"):
            raise RuntimeError("%s %s -> %s" % (op, kw, a))
        return a
    def close(self):
        os.close(self.fd)
'''

# Prepended to every child's code: `A` (its JSON argument), emit(tag, **fields) (one line to the
# test), ask() (the next line the test sends), Ctl (a control-file session), block_pattern (as
# the test's) and Broker (a raw broker connection, include/dnvme/broker.h).
CHILD_LIB = r'''
import ctypes, errno, json, mmap, os, socket, struct, sys, threading, time
A = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
def emit(tag, **kw):
    kw["tag"] = tag
    kw["t"] = time.monotonic()
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()
def ask():
    line = sys.stdin.readline()
    if not line:
        os._exit(3)
    return line.strip()
''' + CTL_CLIENT + BLOCK_PATTERN + r'''
def code(a):
    return "OK" if a.get("ok") else a["error"]["code"]
def shm(size, name=None, sparse=False):
    name = name or "dnvme-sec-%d-%d" % (os.getpid(), time.monotonic_ns())
    fd = os.open("/dev/shm/" + name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, size)
    z, off = bytes(min(size, 1 << 22)), 0  # written by its owner: the daemon transfers only into
    while off < size and not sparse:       # pages the client allocated
        off += os.pwrite(fd, z[:size - off], off)
    os.close(fd)
    return name
REQ = struct.Struct("=IIQQqqII4096s")
REP = struct.Struct("=IiQIIq512s")
MAGIC = 0x444e5642
class Broker:
    def __init__(self, mnt, timeout=None):
        text = open(os.path.join(mnt, ".dnvme", "broker")).read()
        self.name = text.split("socket @")[1].split()[0]
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.s.settimeout(timeout)
        self.s.connect("\0" + self.name)
    def send(self, op, path=b"", flags=0, ino=0, lease=0, offset=0, length=0):
        self.s.send(REQ.pack(MAGIC, op, lease, ino, offset, length, flags, len(path), path))
    def recv(self):
        """(error, lease, slot, size, message, fds); error None when the daemon closed."""
        msg, anc, _, _ = self.s.recvmsg(REP.size, socket.CMSG_SPACE(4 * 4))
        fds = []
        for lvl, typ, data in anc:
            if lvl == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
                fds += list(struct.unpack("%di" % (len(data) // 4),
                                          data[:len(data) - len(data) % 4]))
        if not msg:
            return None, 0, 0, 0, "", fds
        _, err, lease, slot, fl, size, text = REP.unpack(msg)
        return err, lease, slot, size, text.split(b"\0")[0].decode(errors="replace"), fds
    def call(self, op, **kw):
        self.send(op, **kw)
        return self.recv()
'''


class Child:
    """A python3 program run as `uid` (65534 by default) that talks JSON lines on stdout and reads
    commands on stdin. `argv_prefix` runs it under another program (`dnvme run ... --`)."""

    def __init__(self, code, args=None, uid=NOBODY, argv_prefix=(), env=None):
        self.errf = tempfile.TemporaryFile()
        kw = {}
        if uid is not None and uid != os.geteuid():
            kw = dict(user=uid, group=uid, extra_groups=[])
        self.p = subprocess.Popen(list(argv_prefix) + [PY, "-c", CHILD_LIB + code,
                                                       json.dumps(args or {})],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self.errf, env=env, start_new_session=True, **kw)
        self.buf = b""
        self.lines = []

    def stderr(self):
        self.errf.seek(0)
        return self.errf.read().decode(errors="replace")[-4000:]

    def next(self, timeout=60.0):
        """The next JSON line; None when the child exited or `timeout` passed."""
        deadline = time.monotonic() + timeout
        fd = self.p.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            r, _, _ = select.select([fd], [], [], left)
            if not r:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        msg = json.loads(line)
        self.lines.append(msg)
        return msg

    def expect(self, tag, timeout=60.0):
        msg = self.next(timeout)
        if msg is None or msg.get("tag") != tag:
            raise AssertionError("child: expected %r, got %r (exit %s); stderr:\n%s" %
                                 (tag, msg, self.p.poll(), self.stderr()))
        return msg

    def send(self, line):
        self.p.stdin.write((line + "\n").encode())
        self.p.stdin.flush()

    def wait(self, timeout=60.0):
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self):
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.p.wait(30)
        for f in (self.p.stdin, self.p.stdout):
            try:
                f.close()
            except OSError:
                pass
        self.errf.close()
        # Shared-memory objects the child made with shm() and did not remove (it was killed).
        for name in glob.glob("/dev/shm/dnvme-sec-%d-*" % self.p.pid):
            try:
                os.unlink(name)
            except OSError:
                pass


def run_child(code, args=None, uid=NOBODY, timeout=120.0):
    """Runs a child to its end; returns its JSON lines by tag (the last of each tag wins)."""
    c = Child(code, args, uid)
    try:
        rc = c.wait(timeout)
        out = {}
        for line in c.p.stdout.read().decode().splitlines():
            if line.strip():
                msg = json.loads(line)
                out[msg["tag"]] = msg
        if rc != 0:
            raise AssertionError("child exited %s; stderr:\n%s" % (rc, c.stderr()))
        return out
    finally:
        c.kill()


# ---------------------------------------------------------------------------------------------
# A small ext4 on a loop device


def ext4_skip_reason():
    if os.geteuid() != 0:
        return "needs root to mount a loop device"
    for tool in ("mkfs.ext4", "losetup", "mount", "umount"):
        if shutil.which(tool) is None and not os.path.exists("/usr/sbin/" + tool):
            return "%s is missing" % tool
    if not os.path.exists("/dev/loop-control") and not os.path.exists("/dev/loop0"):
        return "no loop devices (/dev/loop-control missing)"
    return None


def mount_ext4(test, where, size_mib, reserved_pct=0, inodes=None):
    """Makes an ext4 image of `size_mib` MiB (4 KiB blocks, no journal, `reserved_pct` % for
    root), mounts it on `where` (a new directory, mode 0755) and registers its unmount with the
    test. Skips the test with the reason when that cannot be done."""
    reason = ext4_skip_reason()
    if reason:
        test.skipTest(reason)
    img = where + ".img"
    with open(img, "wb") as f:
        f.truncate(size_mib * MiB)
    mkfs = ["mkfs.ext4", "-q", "-F", "-b", "4096", "-m", str(reserved_pct), "-O", "^has_journal"]
    if inodes:
        mkfs += ["-N", str(inodes)]
    r = subprocess.run(mkfs + [img], capture_output=True, text=True)
    if r.returncode != 0:
        test.skipTest("mkfs.ext4 failed: %s" % r.stderr.strip())
    os.makedirs(where, exist_ok=True)
    r = subprocess.run(["mount", "-o", "loop", img, where], capture_output=True, text=True)
    if r.returncode != 0:
        test.skipTest("cannot mount a loop device: %s" % r.stderr.strip())
    test.addCleanup(_umount, where)
    os.chmod(where, 0o755)
    return where


def _umount(where):
    if subprocess.run(["umount", where], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", where], capture_output=True)


def avail_bytes(path):
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def free_bytes(path):
    st = os.statvfs(path)
    return st.f_bfree * st.f_frsize


def fallocate(fd, mode, offset, length):
    """fallocate(2) through libc; returns 0 or the errno."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    if libc.fallocate(fd, mode, offset, length) != 0:
        return ctypes.get_errno()
    return 0


def timed(fn, bound):
    """Runs fn() in a thread; returns (seconds, result or exception), or (None, None) when it had
    not returned after `bound` seconds (the thread is left to finish on its own)."""
    box = {}

    def run():
        t0 = time.monotonic()
        try:
            box["r"] = fn()
        except BaseException as e:  # reported to the caller
            box["r"] = e
        box["t"] = time.monotonic() - t0

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(bound)
    if th.is_alive():
        return None, None
    return box["t"], box["r"]


def suite_skip_reason():
    """Why nothing here can run (None when it can): the mount needs root and FUSE, and uid 65534
    must be able to reach the scratch root (DNVME_TEST_DIR)."""
    reason = mh.skip_reason(need_root=True)
    if reason:
        return reason
    d = os.path.realpath(mh.test_root())
    while not os.path.isdir(d):
        d = os.path.dirname(d)
    while True:
        if not os.stat(d).st_mode & 0o001:
            return "%s is not searchable by other users: uid %d cannot reach the mounts (set " \
                "DNVME_TEST_DIR)" % (d, NOBODY)
        if d == "/":
            return None
        d = os.path.dirname(d)


# ---------------------------------------------------------------------------------------------
# The test case


# The root side's control-file sessions: the same client the children use.
exec(CTL_CLIENT)


class SecurityCase(unittest.TestCase):
    """One scratch directory per test (reachable by uid 65534: the attacker must reach the
    mount) and mounts made with mount(); everything is unmounted and removed after the test."""

    maxDiff = 4000

    def setUp(self):
        reason = mh.skip_reason(need_root=True)
        if reason:
            self.skipTest(reason)
        self.scratch = mh.Scratch("sec-" + self._testMethodName[5:30])
        self.addCleanup(self.scratch.cleanup)
        os.chmod(self.scratch.path, 0o755)
        d = os.path.dirname(self.scratch.path)
        while d != "/":
            if not os.stat(d).st_mode & 0o001:
                self.skipTest("%s is not searchable by other users: uid %d cannot reach the "
                              "mount (set DNVME_TEST_DIR)" % (d, NOBODY))
            d = os.path.dirname(d)
        self.backing, self.mnt = self.scratch.backing, self.scratch.mnt
        os.chmod(self.backing, 0o755)
        os.chmod(self.mnt, 0o755)

    def mount(self, backing=None, mnt=None, options=OPTIONS, **kw):
        m = mh.Mount(backing or self.backing, mnt or self.mnt, options=options, **kw)
        self.addCleanup(m.stop)
        m.start()
        return m

    def child(self, code, args=None, uid=NOBODY, argv_prefix=(), env=None):
        c = Child(code, args, uid, argv_prefix, env)
        self.addCleanup(c.kill)
        return c

    def m(self, *parts):
        return os.path.join(self.mnt, *parts)

    def b(self, *parts):
        return os.path.join(self.backing, *parts)

    def public_dir(self, name="pub"):
        """A root-owned sticky 1777 directory made through the mount (the user's playground)."""
        os.mkdir(self.m(name))
        os.chmod(self.m(name), 0o1777)
        return self.m(name)

    def write_file(self, path, data, mode=0o644):
        with open(path, "wb") as f:
            f.write(data)
        os.chmod(path, mode)

    def read_file(self, path):
        with open(path, "rb") as f:
            return f.read()

    def assertAllBytes(self, got, want, what):
        i = first_difference(got, want)
        if i is not None:
            self.fail("%s: %d bytes, want %d; first difference at offset %d (got %r, want %r)" %
                      (what, len(got), len(want), i, got[i:i + 16], want[i:i + 16]))

    def alive(self, m):
        self.assertTrue(m.alive(), "the daemon died; log tail:\n%s" % m.log_tail())
