"""The control directory <mount>/.dnvme/ (ctl, stats, config) of a real dnvmefs mount: every
request and its error paths, coherence with the mount both ways, live config.set, counters, the
security cases (hostile requests from an unprivileged uid), client memory shrunk under the daemon.

Run: /usr/bin/python3 -m unittest -v tests.fs.test_ctl   (root: the security cases switch uid)
"""

import errno
import fcntl
import hashlib
import json
import mmap
import os
import select
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mount_harness as mh  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
PY = sys.executable
NOBODY = 65534


def pattern(n, seed=0):
    out = bytearray()
    i = 0
    while len(out) < n:
        out += hashlib.sha256(b"%d/%d" % (seed, i)).digest() * 128
        i += 1
    return bytes(out[:n])


class Ctl:
    """One ctl session: write one request, read the whole answer."""

    def __init__(self, mnt):
        self.fd = os.open(os.path.join(mnt, ".dnvme", "ctl"), os.O_RDWR)

    def raw(self, data):
        if isinstance(data, str):
            data = data.encode()
        n = os.write(self.fd, data)
        assert n == len(data), (n, len(data))
        out = b""
        while True:
            chunk = os.read(self.fd, 1 << 20)
            if not chunk:
                break
            out += chunk
        return json.loads(out)

    def req(self, op, **fields):
        return self.raw(json.dumps(dict(op=op, **fields)))

    def ok(self, op, **fields):
        a = self.req(op, **fields)
        assert a.get("ok") is True, "%s %s -> %s" % (op, fields, a)
        return a

    def close(self):
        os.close(self.fd)


def zero_fill(fd, size):  # pages written by their owner: the daemon transfers only into those
    z, off = bytes(min(size, 1 << 22)), 0
    while off < size:
        off += os.pwrite(fd, z[:size - off], off)


class Shm:
    """A /dev/shm object of `size` bytes mapped here."""

    def __init__(self, name, size, mode=0o600):
        self.name, self.path, self.size = name, "/dev/shm/" + name, size
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, mode)
        os.fchmod(fd, mode)
        os.ftruncate(fd, size)
        zero_fill(fd, size)
        self.map = mmap.mmap(fd, size)
        os.close(fd)

    def close(self):
        self.map.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


# A raw client of the descriptor broker (include/dnvme/broker.h), for root here and, as text, for
# the children that drop to uid 65534 (exec'd there too).
BROKER_PY = r'''
import os, socket, struct
BROKER_MAGIC, BROKER_HELLO, BROKER_OPEN = 0x444e5642, 1, 2
REQUEST = struct.Struct("=IIQQqqII4096s")  # struct Request: 4144 bytes
REPLY = struct.Struct("=IiQIIq512s")       # struct Reply: 544 bytes
def broker_connect(mnt, timeout=10.0):
    with open(os.path.join(mnt, ".dnvme", "broker")) as f:
        name = [l for l in f.read().splitlines() if l.startswith("socket @")][0][len("socket @"):]
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(timeout)
    s.connect("\0" + name)
    return s
def broker_call(s, op, path=b"", flags=0, ino=0):
    s.send(REQUEST.pack(BROKER_MAGIC, op, 0, ino, 0, 0, flags, len(path), path))
    msg, fds, _, _ = socket.recv_fds(s, REPLY.size, 4)
    for fd in fds:
        os.close(fd)
    if not msg:
        return {"error": "closed"}
    _, error, lease, slot, rflags, size, message = REPLY.unpack(msg)
    return {"error": error, "message": message.split(b"\0")[0].decode(), "fds": len(fds)}
'''
exec(BROKER_PY)

# What every child that acts as uid 65534 starts with: the identity, a ctl session class and the
# broker client; `mnt` is argv[1], `res` what it prints as JSON.
NOBODY_PY = r'''
import ctypes, json, os, sys, time
os.setgroups([]); os.setgid(65534); os.setuid(65534)
# setuid() from root left this process non-dumpable, which a login of that user would not be;
# the kernel then refuses everyone else /proc/PID/fd access. Undo it (PR_SET_DUMPABLE).
ctypes.CDLL(None, use_errno=True).prctl(4, 1, 0, 0, 0)
mnt = sys.argv[1]
class Session:
    def __init__(self):
        self.fd = os.open(os.path.join(mnt, ".dnvme", "ctl"), os.O_RDWR)
    def req(self, **kw):
        os.write(self.fd, json.dumps(kw).encode())
        out = b""
        while True:
            c = os.read(self.fd, 1 << 20)
            if not c:
                return json.loads(out)
            out += c
def code(a):
    return "OK" if a["ok"] else a["error"]["code"]
def message(a):
    return "" if a["ok"] else a["error"]["message"]
def shm(i, size=1 << 20):
    name = "dnvme-nobody-%d-%d" % (os.getpid(), i)
    fd = os.open("/dev/shm/" + name, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, size)
    z, off = bytes(min(size, 1 << 22)), 0  # written by its owner: the daemon transfers only into
    while off < size:                      # pages the client allocated
        off += os.pwrite(fd, z[:size - off], off)
    os.close(fd)
    return name
def shm_cleanup():
    for n in os.listdir("/dev/shm"):
        if n.startswith("dnvme-nobody-%d-" % os.getpid()):
            os.unlink("/dev/shm/" + n)
res = {}
''' + BROKER_PY


# A session kept busy for a while: async preads queued on a handle of 4 KiB requests one at a
# time, as many as take about `seconds` at the rate a first (synchronous) one showed; a `wait` on
# the handle then lasts about that long. Defined here and sent, as text, to the uid-65534 children.
LONG_PY = r'''
def ctl_call(fd, **kw):
    os.write(fd, json.dumps(kw).encode())
    out = b""
    while True:
        c = os.read(fd, 1 << 20)
        if not c:
            return json.loads(out)
        out += c
def queue_long_reads(fd, path, shm_name, size, seconds, max_ops=400):
    """Returns (handle, async preads queued); 3 + that many requests ran on the session."""
    h = ctl_call(fd, op="handle.open", block_size=4096, queue_depth=1,
                 intra_op_parallelism=1)["handle"]
    b = ctl_call(fd, op="buffer.register", shm=shm_name)["buffer"]
    t0 = time.monotonic()
    a = ctl_call(fd, op="pread", handle=h, buffer=b, length=size, path=path)
    assert a["ok"], a
    rate = size / max(time.monotonic() - t0, 1e-6)
    n = max(2, min(max_ops, int(seconds * rate / size) + 1))
    for _ in range(n):
        a = ctl_call(fd, op="pread", handle=h, buffer=b, length=size, path=path,
                     **{"async": True})
        assert a["ok"], a
    return h, n
'''
exec(LONG_PY)


class NobodyChild:
    """NOBODY_PY + LONG_PY + `body` running as uid 65534 alongside the test: it prints JSON lines
    ({"tag": ..., "t": its time.monotonic(), ...}) and reads lines the test sends."""

    def __init__(self, mnt, body, *args):
        self.p = subprocess.Popen([PY, "-c", NOBODY_PY + LONG_PY + body, mnt] +
                                  [str(a) for a in args], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.buf = b""
        self.seen = {}

    def expect(self, tag, timeout=120.0):
        """The line tagged `tag` (others read meanwhile are kept for later)."""
        deadline = time.monotonic() + timeout
        while tag not in self.seen:
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                msg = json.loads(line)
                self.seen[msg["tag"]] = msg
            if tag in self.seen:
                break
            left = deadline - time.monotonic()
            r = select.select([self.p.stdout], [], [], max(left, 0))[0] if left > 0 else []
            chunk = os.read(self.p.stdout.fileno(), 65536) if r else b""
            if not chunk:
                self.p.kill()
                raise AssertionError("uid 65534 child: no %r line (exit %s): %s" % (
                    tag, self.p.wait(), self.p.stderr.read().decode()[-3000:]))
            self.buf += chunk
        return self.seen[tag]

    def send(self, line):
        self.p.stdin.write(line.encode() + b"\n")
        self.p.stdin.flush()

    def close(self):
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()
        for f in (self.p.stdin, self.p.stdout, self.p.stderr):
            f.close()


class CtlCase(mh.MountedTestCase):
    MOUNT_OPTIONS = ("allow_other", "default_permissions")

    def setUp(self):
        super().setUp()
        self.ctl = Ctl(self.mnt)
        self.shms = []

    def tearDown(self):
        self.ctl.close()
        for s in self.shms:
            s.close()
        super().tearDown()

    def shm(self, size, mode=0o600):
        s = Shm("dnvme-test-%d-%d" % (os.getpid(), len(self.shms)), size, mode)
        self.shms.append(s)
        return s

    def assertErr(self, answer, code, what=""):
        self.assertIs(answer.get("ok"), False, "%s: expected %s, got %s" % (what, code, answer))
        self.assertEqual(answer["error"]["code"], code, "%s: %s" % (what, answer))
        self.assertEqual(answer["error"]["errno"], getattr(errno, code), answer)
        self.assertTrue(answer["error"]["message"], answer)

    def write_direct(self, path, data):
        """One O_DIRECT write(2) of `data` from page-aligned memory, then fsync."""
        buf = mmap.mmap(-1, len(data))
        try:
            buf[:] = data
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
            try:
                self.assertEqual(os.write(fd, buf), len(data))
                os.fsync(fd)
            finally:
                os.close(fd)
        finally:
            buf.close()

    def stats(self):
        return self.ctl.ok("stats")["stats"]

    def reachable_by_nobody(self):
        """Opens the scratch directory to uid 65534; skips when a directory above it is not."""
        os.chmod(self.scratch.path, 0o755)
        d = os.path.dirname(self.scratch.path)
        while d != "/":
            if not os.stat(d).st_mode & 0o001:
                self.skipTest("%s is not searchable by other users" % d)
            d = os.path.dirname(d)

    def as_nobody(self, body, *args, timeout=60):
        """Runs NOBODY_PY + `body` as uid 65534 (argv: the mount, then `args`); returns the JSON
        it prints. Skips when the scratch directory is not reachable by other users."""
        self.reachable_by_nobody()
        r = subprocess.run([PY, "-c", NOBODY_PY + body, self.mnt] + [str(a) for a in args],
                           capture_output=True, timeout=timeout)
        self.assertEqual(r.returncode, 0, r.stderr.decode())
        # Its sessions are released (and their charges given back) after the child exited.
        self.wait_sessions(1)
        return json.loads(r.stdout)

    def wait_sessions(self, n, timeout=60.0):
        """RELEASE of a closed file reaches the daemon asynchronously (and a session's release
        waits for its transfers): poll the stats until only `n` sessions are open."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.stats()["ctl"]
            if st["sessions_open"] == n:
                return st
            if time.monotonic() > deadline:
                self.fail("sessions still open after %.0fs: %s" % (timeout, st))
            time.sleep(0.05)

    def backing_snapshot(self):
        out = {}
        for root, dirs, files in os.walk(self.backing):
            for f in files:
                p = os.path.join(root, f)
                if not os.path.isfile(p) or os.path.islink(p):
                    continue  # fifos would block, links point elsewhere
                with open(p, "rb") as fh:
                    out[os.path.relpath(p, self.backing)] = hashlib.sha256(fh.read()).hexdigest()
        return out


class ControlDirectoryTest(CtlCase):
    def test_directory_is_virtual_hidden_and_protected(self):
        st = os.stat(self.m(".dnvme"))
        self.assertTrue(st.st_mode & 0o040000)
        # `broker` is there because the preload broker is on by default (-o preload=1).
        self.assertEqual(sorted(os.listdir(self.m(".dnvme"))), ["broker", "config", "ctl", "stats"])
        self.assertNotIn(".dnvme", os.listdir(self.mnt), "hidden from the root listing")
        self.assertFalse(os.path.exists(self.b(".dnvme")), "never stored in BACKING_DIR")
        for what, call, code in [
                ("mkdir in it", lambda: os.mkdir(self.m(".dnvme", "x")), errno.EPERM),
                ("create in it", lambda: open(self.m(".dnvme", "x"), "w"), errno.EPERM),
                ("unlink ctl", lambda: os.unlink(self.m(".dnvme", "ctl")), errno.EPERM),
                ("rmdir it", lambda: os.rmdir(self.m(".dnvme")), errno.EPERM),
                ("rename it", lambda: os.rename(self.m(".dnvme"), self.m("x")), errno.EPERM),
                ("mkdir over it", lambda: os.mkdir(self.m(".dnvme")), errno.EEXIST),
                ("chmod ctl", lambda: os.chmod(self.m(".dnvme", "ctl"), 0o600), errno.EPERM),
                ("write stats", lambda: open(self.m(".dnvme", "stats"), "w"), errno.EACCES),
                ("write broker", lambda: open(self.m(".dnvme", "broker"), "w"), errno.EACCES)]:
            with self.assertRaises(OSError, msg=what) as cm:
                call()
            self.assertEqual(cm.exception.errno, code, what)
        self.assertFalse(os.path.exists(self.b(".dnvme")))

    def test_stats_and_config_documents(self):
        with open(self.m(".dnvme", "stats")) as f:
            s = json.load(f)
        for key in ("mount", "config", "fuse", "engine", "ctl"):
            self.assertIn(key, s)
        for key in ("bytes_direct", "bytes_bounce", "bytes_buffered", "inflight_requests",
                    "max_inflight_requests", "ops_failed"):
            self.assertIn(key, s["engine"])
        for key in ("bytes_written_behind", "bytes_read_ahead_hit", "errors", "write_ops"):
            self.assertIn(key, s["fuse"])
        self.assertEqual(s["mount"]["backing"], os.path.realpath(self.backing))
        with open(self.m(".dnvme", "config")) as f:
            c = json.load(f)
        self.assertEqual(c, s["config"])
        self.assertEqual(c, self.ctl.ok("config.get")["config"])
        # The same fd re-read from 0 gets fresh numbers.
        fd = os.open(self.m(".dnvme", "stats"), os.O_RDONLY)
        try:
            a = json.loads(os.pread(fd, 1 << 20, 0))
            self.write(self.m("statbump"), b"z" * MiB)
            b = json.loads(os.pread(fd, 1 << 20, 0))
        finally:
            os.close(fd)
        self.assertGreater(b["fuse"]["write_ops"], a["fuse"]["write_ops"])


class StatsCountingTest(CtlCase):
    # The read must reach the daemon's engine (read-ahead, on demand): no passthrough for
    # read-only opens, and no page cache for what the engine can read (read_cache=off).
    MOUNT_OPTIONS = CtlCase.MOUNT_OPTIONS + ("passthrough=off", "read_cache=off")

    def test_fuse_and_engine_counters_follow_the_data(self):
        size = 16 * MiB
        data = pattern(size, 11)
        s0 = self.stats()
        with open(self.m("counted"), "wb") as f:
            for off in range(0, size, MiB):
                f.write(data[off:off + MiB])
        s1 = self.stats()
        f0, f1 = s0["fuse"], s1["fuse"]
        written = (f1["bytes_written_behind"] - f0["bytes_written_behind"] +
                   f1["bytes_written_sync"] - f0["bytes_written_sync"])
        self.assertEqual(written, size, "every byte written through FUSE counted once")
        # At least one request per MiB (an unaligned user buffer spans 257 pages and the kernel
        # splits such a write in two).
        self.assertGreaterEqual(f1["write_ops"] - f0["write_ops"], 16)
        self.assertGreater(f1["bytes_written_behind"], f0["bytes_written_behind"],
                           "a sequential writer goes through write-behind")
        # Each byte reached the disk once: through the engine, or spliced from the kernel's
        # pages when the daemon receives requests with splice (datapath/splice_io.h).
        e0, e1 = s0["engine"], s1["engine"]
        spliced = f1["bytes_written_spliced"] - f0["bytes_written_spliced"]
        self.assertEqual(e1["bytes_written"] - e0["bytes_written"] + spliced, size)
        if s1["mount"]["splice_pipes"] == 0:
            self.assertEqual(spliced, 0, "no pipes, nothing spliced")
        self.assertEqual(f1["bytes_splice_fallback"], f0["bytes_splice_fallback"],
                         "page-aligned pages: the kernel took every spliced extent as is")
        self.assertEqual(e1["ops_failed"], e0["ops_failed"])
        self.assertEqual(e1["inflight_requests"], 0, "nothing in flight after close")
        # Whatever the writer left in the page cache goes, so the read comes from the daemon.
        fd = os.open(self.m("counted"), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        self.assertBytesEqual(self.read(self.m("counted")), data, "read back")
        s2 = self.stats()
        f2 = s2["fuse"]
        served = (f2["bytes_read_ahead_hit"] - f1["bytes_read_ahead_hit"] +
                  f2["bytes_read_engine"] - f1["bytes_read_engine"])
        self.assertGreaterEqual(served, size, "read-ahead hits + on-demand reads cover the file")
        self.assertGreater(f2["bytes_read_ahead_hit"], f1["bytes_read_ahead_hit"],
                           "a sequential reader hits the read-ahead window")
        self.assertGreaterEqual(s2["engine"]["bytes_read"] - e1["bytes_read"], size)
        self.assertEqual(s2["ctl"]["bytes_written"], s0["ctl"]["bytes_written"],
                         "nothing of this went through ctl")


class RequestErrorsTest(CtlCase):
    """Every malformed or hostile request gets a JSON error with a code; the daemon stays up
    and BACKING_DIR does not change."""

    def test_bad_requests(self):
        self.write(self.m("keep"), pattern(3 * MiB, 1))
        os.mkdir(self.m("adir"))
        os.mkfifo(self.m("afifo"))
        before = self.backing_snapshot()
        h = self.ctl.ok("handle.open")["handle"]
        s = self.shm(MiB)
        b = self.ctl.ok("buffer.register", shm=s.name)["buffer"]
        good = dict(handle=h, buffer=b, length=4096, path="keep")
        cases = [
            ("not json", "{op: hello", "EBADMSG"),
            ("empty", " ", "EBADMSG"),
            ("array", "[1, 2]", "EBADMSG"),
            ("string", '"hello"', "EBADMSG"),
            ("no op", "{}", "EINVAL"),
            ("op not a string", '{"op": 7}', "EINVAL"),
            ("unknown op", '{"op": "format.disk"}', "EOPNOTSUPP"),
            ("unknown field", json.dumps(dict(op="stats", verbose=True)), "EINVAL"),
            ("bad id", json.dumps(dict(op="stats", id=[1])), "EINVAL"),
            ("too deep", '{"op": "stats", "x": ' + "[" * 50 + "]" * 50 + "}", "EINVAL"),
            ("over-long", json.dumps(dict(op="stats", pad="x" * (70 * KiB))), "E2BIG"),
            ("length as string", json.dumps(dict(good, op="pread", length="4096")), "EINVAL"),
            ("length float", json.dumps(dict(good, op="pread", length=4096.5)), "EINVAL"),
            ("negative length", json.dumps(dict(good, op="pread", length=-1)), "EINVAL"),
            ("negative offset", json.dumps(dict(good, op="pwrite", file_offset=-4096)), "EINVAL"),
            ("huge offset", json.dumps(dict(good, op="pwrite", file_offset=2 ** 63)), "EINVAL"),
            ("huge length", json.dumps(dict(good, op="pread", length=2 ** 70)), "EINVAL"),
            ("async not bool", json.dumps(dict(good, op="pread", **{"async": "yes"})), "EINVAL"),
            ("missing path", json.dumps(dict(op="pread", handle=h, buffer=b, length=1)), "EINVAL"),
            ("dotdot", json.dumps(dict(good, op="pwrite", path="../escape")), "EINVAL"),
            ("inner dotdot", json.dumps(dict(good, op="pwrite", path="a/../../x")), "EINVAL"),
            ("absolute outside", json.dumps(dict(good, op="pwrite", path="/etc/passwd")), "EXDEV"),
            ("control dir", json.dumps(dict(good, op="pwrite", path=".dnvme/ctl")), "EPERM"),
            ("slash", json.dumps(dict(good, op="pwrite", path="/")), "EXDEV"),
            ("mount root", json.dumps(dict(good, op="pwrite", path=self.mnt)), "EISDIR"),
            ("NUL in path", json.dumps(dict(good, op="pwrite", path="a\u0000b")), "EINVAL"),
            ("unknown handle", json.dumps(dict(good, op="pread", handle=99)), "EBADF"),
            ("unknown buffer", json.dumps(dict(good, op="pread", buffer=99)), "EBADF"),
            ("past buffer end", json.dumps(dict(good, op="pread", buffer_offset=MiB - 10)),
             "EINVAL"),
            ("missing file", json.dumps(dict(good, op="pread", path="nothere")), "ENOENT"),
            ("dot", json.dumps(dict(good, op="pwrite", path=".")), "EISDIR"),
            ("directory", json.dumps(dict(good, op="pwrite", path="adir")), "EISDIR"),
            ("fifo", json.dumps(dict(good, op="pread", path="afifo")), "EINVAL"),
            ("close unknown handle", json.dumps(dict(op="handle.close", handle=42)), "EBADF"),
            ("wait unknown handle", json.dumps(dict(op="wait", handle=42)), "EBADF"),
            ("unregister unknown", json.dumps(dict(op="buffer.unregister", buffer=42)), "EBADF"),
            ("bad handle config", json.dumps(dict(op="handle.open", queue_depth=0)), "EINVAL"),
            ("bad handle key", json.dumps(dict(op="handle.open", num_threads=4)), "EINVAL"),
            ("config.set not object", json.dumps(dict(op="config.set", config=5)), "EINVAL"),
            ("config.set bad key", json.dumps(dict(op="config.set", config={"qd": 1})),
             "EINVAL"),
            ("config.set string bool",
             json.dumps(dict(op="config.set", config={"single_submit": "true"})), "EINVAL"),
            ("register both", json.dumps(dict(op="buffer.register", shm="a", source="/dev/shm/a")),
             "EINVAL"),
            ("register none", json.dumps(dict(op="buffer.register")), "EINVAL"),
            ("register slash", json.dumps(dict(op="buffer.register", shm="../etc")), "EINVAL"),
            ("register a disk file", json.dumps(dict(op="buffer.register", source="/etc/passwd")),
             "EINVAL"),
            ("register missing", json.dumps(dict(op="buffer.register", shm="dnvme-none-x")),
             "ENOENT"),
            ("register unaligned offset", json.dumps(dict(op="buffer.register", shm=s.name,
                                                           offset=100)), "EINVAL"),
            ("register past end", json.dumps(dict(op="buffer.register", shm=s.name,
                                                   size=2 * MiB)), "EINVAL"),
            ("cuda_ipc short", json.dumps(dict(op="buffer.register", cuda_ipc="ab" * 63)),
             "EINVAL"),
            ("cuda_ipc not hex", json.dumps(dict(op="buffer.register", cuda_ipc="zz" * 64)),
             "EINVAL"),
            ("cuda_ipc and shm", json.dumps(dict(op="buffer.register", cuda_ipc="00" * 64,
                                                 shm=s.name)), "EINVAL"),
            ("device without cuda_ipc", json.dumps(dict(op="buffer.register", shm=s.name,
                                                        device=0)), "EINVAL"),
        ]
        for what, text, code in cases:
            self.assertErr(self.ctl.raw(text), code, what)
        # The id is echoed on errors and answers alike.
        self.assertEqual(self.ctl.raw('{"op": "nope", "id": "abc"}')["id"], "abc")
        self.assertEqual(self.ctl.req("hello", id=7)["id"], 7)
        self.assertTrue(self.mount.alive())
        self.assertEqual(self.backing_snapshot(), before, "a refused request changed BACKING_DIR")
        st = self.stats()["ctl"]
        self.assertGreaterEqual(st["request_errors"], len(cases))

    def test_request_split_by_the_kernel_is_refused(self):
        # More than max_write (1 MiB) in one write(): the kernel sends it in pieces, and each is
        # refused on its own: E2BIG for the full pieces, the tail as not JSON.
        before = self.backing_snapshot()
        a = self.ctl.raw(json.dumps(dict(op="config.set", config={"queue_depth": 1},
                                         pad="y" * (3 * MiB))))
        self.assertIs(a["ok"], False, a)
        self.assertIn(a["error"]["code"], ("E2BIG", "EBADMSG"), a)
        self.assertIs(self.ctl.req("hello")["ok"], True)
        self.assertEqual(self.ctl.ok("config.get")["config"]["queue_depth"], 128)
        self.assertEqual(self.backing_snapshot(), before)


class CudaIpcTest(CtlCase):
    """buffer.register with a CUDA IPC handle. A GPU machine is exercised end to end by
    tests/python/test_gpu.py (a CUDA client process exports real memory); here a handle that
    names no real allocation must be refused cleanly and leave the daemon serving."""

    def test_unusable_handle_is_refused_and_the_daemon_lives(self):
        h = self.ctl.ok("handle.open")["handle"]
        a = self.ctl.req("buffer.register", cuda_ipc="5a" * 64, device=0, size=4096)
        self.assertIs(a.get("ok"), False, a)
        if not any(n.startswith("nvidia") for n in os.listdir("/dev")):
            # No GPU: ENODEV, and the message carries the CUDA runtime's reason.
            self.assertErr(a, "ENODEV", "cuda_ipc without a GPU")
            self.assertIn("CUDA", a["error"]["message"])
        a = self.ctl.req("buffer.register", cuda_ipc="5a" * 64, device=4000)
        self.assertIs(a.get("ok"), False, a)
        # The failed registrations left nothing behind; ordinary transfers still work.
        self.assertEqual(self.stats()["ctl"]["buffers_registered"], 0)
        s = self.shm(MiB)
        b = self.ctl.ok("buffer.register", shm=s.name)["buffer"]
        self.ctl.ok("pwrite", handle=h, buffer=b, length=MiB, path="after_cuda")
        self.assertEqual(os.path.getsize(self.b("after_cuda")), MiB)
        self.assertTrue(self.mount.alive())


class TransferTest(CtlCase):
    def test_sync_round_trip_offsets_and_stats(self):
        size = 8 * MiB + 12345
        s = self.shm(16 * MiB)
        data = pattern(size, 2)
        s.map[100:100 + size] = data
        h = self.ctl.ok("handle.open", block_size=262144, queue_depth=8,
                        intra_op_parallelism=2)["handle"]
        b = self.ctl.ok("buffer.register", shm=s.name)["buffer"]
        before = self.stats()
        a = self.ctl.ok("pwrite", handle=h, buffer=b, buffer_offset=100, length=size,
                        path="f", file_offset=4096)
        self.assertEqual(a["bytes"], size)
        self.assertBytesEqual(self.read(self.b("f"))[4096:], data, "backing file")
        self.assertEqual(self.read(self.b("f"))[:4096], b"\0" * 4096)
        s.map[:] = b"\0" * s.size
        a = self.ctl.ok("pread", handle=h, buffer=b, buffer_offset=3, length=size,
                        path=os.path.join(self.mnt, "f"), file_offset=4096)
        self.assertEqual(a["bytes"], size)
        self.assertBytesEqual(bytes(s.map[3:3 + size]), data, "read back")
        after = self.stats()
        self.assertEqual(after["ctl"]["bytes_written"] - before["ctl"]["bytes_written"], size)
        self.assertEqual(after["ctl"]["bytes_read"] - before["ctl"]["bytes_read"], size)
        self.assertEqual(after["ctl"]["ops_written"] - before["ctl"]["ops_written"], 1)
        self.assertEqual(after["ctl"]["ops_read"] - before["ctl"]["ops_read"], 1)
        eng_b, eng_a = before["ctl"]["engine"], after["ctl"]["engine"]
        moved = sum(eng_a[k] - eng_b[k] for k in ("bytes_direct", "bytes_bounce",
                                                   "bytes_buffered"))
        self.assertEqual(moved, 2 * size, "every byte counted once on one path")
        self.assertGreater(eng_a["bytes_bounce"], eng_b["bytes_bounce"],
                           "buffer_offset 3 is misaligned: bounce path")
        self.assertGreater(eng_a["max_inflight_requests"], 0)
        self.assertLessEqual(eng_a["max_inflight_requests"], 8 * 2 * 2,
                             "queue depth in use within qd x workers (two handles at most)")

    def test_async_many_then_wait_reports_each(self):
        s = self.shm(4 * MiB)
        s.map[:] = pattern(4 * MiB, 3)
        h = self.ctl.ok("handle.open")["handle"]
        b = self.ctl.ok("buffer.register", shm=s.name)["buffer"]
        ids = []
        for i in range(4):
            ids.append(self.ctl.ok("pwrite", handle=h, buffer=b, buffer_offset=i * MiB,
                                   length=MiB, path="parts", file_offset=i * MiB,
                                   **{"async": True})["op_id"])
        # A read past the end of a file fails in wait, with its own status.
        self.write(self.m("short"), b"s" * 1000)
        bad = self.ctl.ok("pread", handle=h, buffer=b, length=MiB, path="short",
                          **{"async": True})["op_id"]
        busy = self.ctl.req("buffer.unregister", buffer=b)
        self.assertErr(busy, "EBUSY", "unregister with transfers not collected")
        w = self.ctl.ok("wait", handle=h)
        self.assertEqual(w["completed"], 5)
        self.assertEqual(w["failed"], 1)
        by_id = {o["op_id"]: o for o in w["ops"]}
        for i in ids:
            self.assertTrue(by_id[i]["ok"], by_id[i])
            self.assertEqual(by_id[i]["bytes"], MiB)
        self.assertFalse(by_id[bad]["ok"])
        self.assertIn(by_id[bad]["error"]["code"], ("ENODATA", "EIO"), by_id[bad])
        self.assertBytesEqual(self.read(self.m("parts")), pattern(4 * MiB, 3), "parts")
        self.assertEqual(self.ctl.ok("wait", handle=h)["completed"], 0, "nothing left")
        self.ctl.ok("fsync", path="parts")
        self.ctl.ok("buffer.unregister", buffer=b)
        self.assertErr(self.ctl.req("buffer.unregister", buffer=b), "EBADF", "twice")
        self.ctl.ok("handle.close", handle=h)
        self.assertErr(self.ctl.req("handle.close", handle=h), "EBADF", "twice")

    def test_session_close_with_transfers_in_flight(self):
        s = self.shm(32 * MiB)
        c = Ctl(self.mnt)
        h = c.ok("handle.open", block_size=65536, queue_depth=4)["handle"]
        b = c.ok("buffer.register", shm=s.name)["buffer"]
        for i in range(8):
            c.ok("pwrite", handle=h, buffer=b, length=32 * MiB, path="inflight%d" % i,
                 **{"async": True})
        c.close()  # release waits for the transfers, then unmaps and frees the handle
        st = self.wait_sessions(1)
        self.assertEqual(st["buffers_registered"], 0, st)
        self.assertEqual(st["handles_open"], 0, st)
        for i in range(8):
            self.assertEqual(os.stat(self.m("inflight%d" % i)).st_size, 32 * MiB)


class CoherenceTest(CtlCase):
    def test_pread_sees_data_still_in_write_behind(self):
        data = pattern(6 * MiB + 77, 4)
        s = self.shm(8 * MiB)
        h = self.ctl.ok("handle.open")["handle"]
        b = self.ctl.ok("buffer.register", shm=s.name)["buffer"]
        fd = os.open(self.m("wb"), os.O_CREAT | os.O_WRONLY, 0o644)
        try:
            os.write(fd, data)  # accepted into write-behind; not closed, not fsynced
            self.ctl.ok("pread", handle=h, buffer=b, length=len(data), path="wb")
            self.assertBytesEqual(bytes(s.map[:len(data)]), data, "ctl pread of write-behind")
        finally:
            os.close(fd)

    def test_pwrite_is_seen_by_mount_readers_with_cached_pages(self):
        old, new = pattern(4 * MiB, 5), pattern(4 * MiB, 6)
        self.write(self.m("cached"), old)
        with open(self.m("cached"), "rb") as reader:
            self.assertEqual(reader.read(), old)  # pages now in the kernel's cache
            s = self.shm(4 * MiB)
            s.map[:] = new
            h = self.ctl.ok("handle.open")["handle"]
            b = self.ctl.ok("buffer.register", shm=s.name)["buffer"]
            self.ctl.ok("pwrite", handle=h, buffer=b, length=4 * MiB, path="cached")
            reader.seek(0)
            self.assertBytesEqual(reader.read(), new, "open reader after ctl pwrite")
        self.assertBytesEqual(self.read(self.m("cached")), new, "new open")
        # An async pwrite is visible after wait.
        s.map[:MiB] = b"q" * MiB
        self.ctl.ok("pwrite", handle=h, buffer=b, length=MiB, path="cached", file_offset=MiB,
                    **{"async": True})
        self.ctl.ok("wait", handle=h)
        self.assertEqual(self.read(self.m("cached"))[MiB:2 * MiB], b"q" * MiB)

    def test_pwrite_creates_a_file_the_mount_sees_at_once(self):
        self.assertFalse(os.path.exists(self.m("later")))  # a negative entry in the kernel
        os.mkdir(self.m("dir"))
        self.assertFalse(os.path.exists(self.m("dir", "later")))
        s = self.shm(MiB)
        s.map[:] = pattern(MiB, 7)
        h = self.ctl.ok("handle.open")["handle"]
        b = self.ctl.ok("buffer.register", shm=s.name)["buffer"]
        for p in ("later", "dir/later"):
            self.ctl.ok("pwrite", handle=h, buffer=b, length=MiB, path=p)
            self.assertTrue(os.path.exists(self.m(p)), p)
            self.assertBytesEqual(self.read(self.m(p)), pattern(MiB, 7), p)
            self.assertEqual(os.stat(self.b(p)).st_uid, 0)


class SpliceTest(CtlCase):
    """Page-cache writes spliced to the disk (datapath/splice_io.h), checked byte for byte in
    BACKING_DIR, next to the cases that must not be spliced."""

    def setUp(self):
        super().setUp()
        if self.stats()["mount"]["splice_pipes"] == 0:
            self.skipTest("the daemon reads requests instead of splicing them: it could not size "
                          "2 MiB pipes (no CAP_SYS_RESOURCE and fs.pipe-max-size < 2 MiB; "
                          "scripts/run-tests.sh raises it when it can)")

    def test_page_cache_writer_is_spliced_and_lands_intact(self):
        size = 24 * MiB
        data = pattern(size, 21)
        s0 = self.stats()["fuse"]
        with open(self.m("spliced.bin"), "wb") as f:  # write-only, page cache: spliced
            for off in range(0, size, MiB):
                f.write(data[off:off + MiB])
            f.flush()
            os.fsync(f.fileno())
        s1 = self.stats()["fuse"]
        spliced = s1["bytes_written_spliced"] - s0["bytes_written_spliced"]
        self.assertGreater(spliced, 0, "a sequential page-cache writer is spliced")
        self.assertLessEqual(spliced, size)
        self.assertEqual(s1["bytes_splice_fallback"], s0["bytes_splice_fallback"])
        self.assertEqual(s1["errors"], s0["errors"])
        self.assertBytesEqual(self.read(self.b("spliced.bin")), data, "BACKING_DIR after fsync")

    def test_overwrite_and_truncate_while_extents_are_pending(self):
        size = 8 * MiB
        first, second = pattern(size, 31), pattern(2 * MiB, 32)
        with open(self.m("pending.bin"), "wb") as f:
            f.write(first)
            # Another handle rewrites the middle (the same page-cache pages the pending extent
            # holds), then the file is cut to an unaligned length; no fsync in between.
            with open(self.m("pending.bin"), "r+b") as g:
                g.seek(3 * MiB)
                g.write(second)
            f.truncate(5 * MiB + 123)
            f.flush()
            os.fsync(f.fileno())
        want = bytearray(first[:5 * MiB + 123])
        want[3 * MiB:5 * MiB] = second
        self.assertBytesEqual(self.read(self.b("pending.bin")), bytes(want), "BACKING_DIR")
        self.assertBytesEqual(self.read(self.m("pending.bin")), bytes(want), "through the mount")

    def test_o_direct_writer_is_not_spliced(self):
        # The kernel sends an O_DIRECT writer's own pages; the daemon copies those (a splice
        # would make the kernel copy them into the pipe first).
        data = pattern(4 * MiB, 41)
        s0 = self.stats()["fuse"]
        self.write_direct(self.m("direct.bin"), data)
        s1 = self.stats()["fuse"]
        self.assertEqual(s1["bytes_written_spliced"], s0["bytes_written_spliced"])
        self.assertBytesEqual(self.read(self.b("direct.bin")), data, "BACKING_DIR")

    def test_transport_steers_itself_by_the_writes_it_receives(self):
        # The splice transport reads (read(2)) while large O_DIRECT WRITEs dominate and splices
        # again once page-cache WRITEs do (fs/transport/splice_loop.h), learning it from the
        # requests' headers alone.
        t = self.stats()["transport"]
        self.assertEqual(t["kind"], "splice")
        self.assertEqual(t["threads"], 32)
        self.write_direct(self.m("steer-direct.bin"), pattern(64 * MiB, 42))
        t1 = self.stats()["transport"]
        self.assertFalse(t1["splicing_now"], "O_DIRECT writers: requests are read")
        self.assertGreater(t1["requests_read"] - t["requests_read"], 16)
        # More requests than loop threads: those that chose read(2) before the switch take the
        # first ones.
        with open(self.m("steer-cache.bin"), "wb") as f:
            for off in range(0, 96 * MiB, MiB):
                f.write(pattern(MiB, off))
            os.fsync(f.fileno())
        t2 = self.stats()["transport"]
        self.assertTrue(t2["splicing_now"], "page-cache writers: requests are spliced")
        self.assertGreater(t2["requests_spliced"], t1["requests_spliced"])


class AdoptTest(CtlCase):
    """WRITEs the daemon reads (O_DIRECT writers always; every writer when it does not splice)
    are written to disk from the buffer they were received in (fs/transport/request_buffer.h), checked
    byte for byte in BACKING_DIR while other writes and a truncate race the pending extents."""

    def setUp(self):
        super().setUp()
        # A daemon that splices switches its loop threads to read(2) after a few O_DIRECT
        # WRITEs, but each thread chooses before it blocks: up to loop_threads (32) requests
        # after the switch still arrive spliced, and those are copied. Warm up past them once.
        if not type(self).__dict__.get("warmed_up"):  # once per mount (subclasses mount anew)
            self.write_direct(self.m("warm-up.bin"), pattern(64 * MiB, 50))
            type(self).warmed_up = True

    def adopted(self):
        return self.stats()["fuse"]["bytes_written_adopted"]

    def test_o_direct_writer_is_adopted_and_lands_intact(self):
        size = 24 * MiB
        data = pattern(size, 51)
        a0 = self.adopted()
        self.write_direct(self.m("adopted.bin"), data)
        adopted = self.adopted() - a0
        self.assertGreaterEqual(adopted, size // 2, "aligned O_DIRECT payloads are not copied")
        self.assertLessEqual(adopted, size)
        self.assertEqual(adopted % (4 * KiB), 0)
        self.assertBytesEqual(self.read(self.b("adopted.bin")), data, "BACKING_DIR after fsync")

    def test_pending_adopted_extents_with_overwrites_and_truncate(self):
        size = 8 * MiB
        first = pattern(size, 52)
        buf = mmap.mmap(-1, size)
        buf[:] = first
        fd = os.open(self.m("pending-adopted.bin"), os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
        try:
            a0 = self.adopted()
            self.assertEqual(os.write(fd, buf), size)  # accepted, not necessarily on disk
            self.assertGreater(self.adopted(), a0)
            # Through the page cache of another handle: an unaligned overwrite across an
            # adopted extent, then an aligned one (itself adopted when requests are read).
            with open(self.m("pending-adopted.bin"), "r+b") as g:
                g.seek(MiB + 100)
                g.write(b"u" * 5000)
                g.seek(4 * MiB)
                g.write(b"v" * MiB)
                g.flush()
            # O_DIRECT again over the start, then cut to an unaligned length; no fsync before.
            buf[:MiB] = b"w" * MiB
            self.assertEqual(os.pwrite(fd, memoryview(buf)[:MiB], 0), MiB)
            os.ftruncate(fd, 6 * MiB + 7)
            os.fsync(fd)
        finally:
            os.close(fd)
            buf.close()
        want = bytearray(first[:6 * MiB + 7])
        want[MiB + 100:MiB + 5100] = b"u" * 5000
        want[4 * MiB:5 * MiB] = b"v" * MiB
        want[:MiB] = b"w" * MiB
        self.assertBytesEqual(self.read(self.b("pending-adopted.bin")), bytes(want), "BACKING_DIR")
        self.assertBytesEqual(self.read(self.m("pending-adopted.bin")), bytes(want), "the mount")

    def test_small_o_direct_writes_are_gathered_not_adopted(self):
        # Each adopted payload would be its own disk write in a 1 MiB buffer: 4 KiB writes are
        # gathered into chunks instead (kAdoptMinBytes in datapath/write_behind.cc).
        n, size = 512, 4 * KiB
        data = pattern(n * size, 55)
        buf = mmap.mmap(-1, size)
        s0 = self.stats()["fuse"]
        fd = os.open(self.m("small-direct.bin"), os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
        try:
            for i in range(n):
                buf[:] = data[i * size:(i + 1) * size]
                self.assertEqual(os.write(fd, buf), size)
            os.fsync(fd)
        finally:
            os.close(fd)
            buf.close()
        s1 = self.stats()["fuse"]
        self.assertEqual(s1["bytes_written_adopted"], s0["bytes_written_adopted"])
        self.assertEqual(s1["bytes_written_behind"] - s0["bytes_written_behind"], n * size)
        self.assertLessEqual(s1["write_behind_flushes"] - s0["write_behind_flushes"], 4,
                             "2 MiB of sequential 4 KiB writes go out in a few chunk flushes")
        self.assertBytesEqual(self.read(self.b("small-direct.bin")), data, "BACKING_DIR")

    def test_unaligned_o_direct_offsets_are_copied(self):
        # A page-aligned buffer written at a file offset that is not page-aligned: an O_DIRECT
        # write from the request buffer would start mid-page, so the payload is copied (the
        # synchronous path) and still lands intact.
        data = pattern(2 * MiB, 53)
        with open(self.m("odd.bin"), "wb") as f:
            f.write(b"\0" * 4 * MiB)
        buf = mmap.mmap(-1, 2 * MiB)
        buf[:] = data
        fd = os.open(self.m("odd.bin"), os.O_RDWR | os.O_DIRECT)
        try:
            a0 = self.adopted()
            self.assertEqual(os.pwrite(fd, buf, 512), 2 * MiB)
            os.fsync(fd)
            self.assertEqual(self.adopted(), a0)
        finally:
            os.close(fd)
            buf.close()
        want = bytearray(4 * MiB)
        want[512:512 + 2 * MiB] = data
        self.assertBytesEqual(self.read(self.b("odd.bin")), bytes(want), "BACKING_DIR")


class AdoptScarceTest(AdoptTest):
    """The same with a write-behind budget of 2 MiB: two spare request buffers, so writers wait
    for their own flushes to hand buffers back, or copy."""

    MOUNT_OPTIONS = CtlCase.MOUNT_OPTIONS + ("write_behind=2M", "write_chunk=1M")


class NoAdoptTest(CtlCase):
    """libfuse's own loop (clone_fd) reads requests into its buffers: nothing is adopted."""

    MOUNT_OPTIONS = CtlCase.MOUNT_OPTIONS + ("clone_fd=1",)

    def test_clone_fd_copies(self):
        data = pattern(8 * MiB, 54)
        s0 = self.stats()["fuse"]
        self.write_direct(self.m("copied.bin"), data)
        s1 = self.stats()["fuse"]
        self.assertEqual(s1["bytes_written_adopted"], 0)
        self.assertEqual(s1["bytes_written_behind"] - s0["bytes_written_behind"], 8 * MiB)
        self.assertBytesEqual(self.read(self.b("copied.bin")), data, "BACKING_DIR")

    def test_what_clone_fd_turns_off_is_said(self):
        # Not silently: the stats name the transport and the log says what it leaves out.
        self.assertEqual(self.stats()["transport"]["kind"], "libfuse")
        log = self.mount.log_text()
        self.assertIn("clone_fd=1: libfuse's loop", log)
        self.assertIn("no request-buffer adoption", log)


class LiveConfigTest(CtlCase):
    def test_config_set_changes_stats_and_behaviour(self):
        def requests_for_8m():
            # O_DIRECT from an aligned buffer: the data goes through the engine whether or not
            # the daemon splices page-cache writes past it.
            e0 = self.stats()["engine"]
            self.write_direct(self.m("cfg.bin"), pattern(8 * MiB, 8))
            e1 = self.stats()["engine"]
            return e1["requests"] - e0["requests"]

        base = requests_for_8m()
        a = self.ctl.ok("config.set", config={"block_size": "128K"})
        self.assertEqual(a["config"]["block_size"], 128 * KiB)
        self.assertEqual(self.stats()["config"]["block_size"], 128 * KiB)
        small = requests_for_8m()
        self.assertGreaterEqual(small, 64, "8 MiB in 128 KiB requests")
        self.assertGreater(small, 2 * base, "block_size took effect on new I/O")
        self.assertBytesEqual(self.read(self.b("cfg.bin")), pattern(8 * MiB, 8), "data")
        # The config file takes the same JSON; a bad one is refused with EINVAL.
        with open(self.m(".dnvme", "config"), "w") as f:
            f.write('{"block_size": 1048576, "queue_depth": 64}\n')
        with open(self.m(".dnvme", "config")) as f:
            c = json.load(f)
        self.assertEqual((c["block_size"], c["queue_depth"]), (MiB, 64))
        with self.assertRaises(OSError) as cm:
            with open(self.m(".dnvme", "config"), "w") as f:
                f.write('{"queue_depth": "deep"}')
        self.assertEqual(cm.exception.errno, errno.EINVAL)
        self.assertEqual(self.ctl.ok("config.get")["config"]["queue_depth"], 64, "unchanged")
        self.assertGreaterEqual(self.stats()["ctl"]["config_changes"], 2)
        self.ctl.ok("config.set", config={"queue_depth": 128})


class LimitsTest(CtlCase):
    MOUNT_OPTIONS = ("allow_other", "default_permissions", "ctl_max_handles=2",
                     "ctl_max_bytes=3M")

    def test_handle_and_byte_limits_per_uid(self):
        self.ctl.ok("handle.open")
        other = Ctl(self.mnt)  # a second session of the same uid shares the limit
        try:
            other.ok("handle.open")
            self.assertErr(other.req("handle.open"), "EMFILE", "third handle of the uid")
            s1, s2 = self.shm(2 * MiB), self.shm(2 * MiB)
            self.ctl.ok("buffer.register", shm=s1.name)
            self.assertErr(other.req("buffer.register", shm=s2.name), "ENOMEM", "past 3M")
            other.ok("buffer.register", shm=s2.name, size=MiB)  # what is left fits
        finally:
            other.close()
        # The closed session gave its share back.
        self.wait_sessions(1)
        self.ctl.ok("handle.open")


HOSTILE = r"""
import ctypes, json, os, sys
os.setgroups([]); os.setgid(%(uid)d); os.setuid(%(uid)d)
# setuid() from root left this process non-dumpable, which a login of that user would not be;
# the kernel then refuses everyone else /proc/PID/fd access. Undo it (PR_SET_DUMPABLE).
ctypes.CDLL(None, use_errno=True).prctl(4, 1, 0, 0, 0)
mnt = sys.argv[1]
fd = os.open(os.path.join(mnt, ".dnvme", "ctl"), os.O_RDWR)
def req(**kw):
    os.write(fd, json.dumps(kw).encode())
    out = b""
    while True:
        c = os.read(fd, 1 << 20)
        if not c:
            return json.loads(out)
        out += c
def code(a):
    return "OK" if a["ok"] else a["error"]["code"]
res = {}
h = req(op="handle.open")["handle"]
mine = "dnvme-nobody-%%d" %% os.getpid()
sfd = os.open("/dev/shm/" + mine, os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(sfd, 1 << 20)
os.pwrite(sfd, bytes(1 << 20), 0)
b = req(op="buffer.register", shm=mine)["buffer"]
memfd = os.memfd_create("nobody", os.MFD_ALLOW_SEALING)
os.ftruncate(memfd, 1 << 20)
m = req(op="buffer.register", source="/proc/%%d/fd/%%d" %% (os.getpid(), memfd))
res["memfd"] = code(m)
res["memfd_sealed"] = m.get("sealed")
res["read_secret"] = code(req(op="pread", handle=h, buffer=b, length=4096, path="secret"))
res["write_rootfile"] = code(req(op="pwrite", handle=h, buffer=b, length=4096, path="rootfile"))
res["create_in_rootdir"] = code(req(op="pwrite", handle=h, buffer=b, length=4096,
                                    path="rootdir/new"))
res["symlink_out"] = code(req(op="pread", handle=h, buffer=b, length=4096, path="link_out"))
res["fsync_secret"] = code(req(op="fsync", path="secret"))
res["root_shm"] = code(req(op="buffer.register", shm=sys.argv[2]))
ro = req(op="buffer.register", shm=sys.argv[3])
res["readable_shm"] = code(ro)
res["readable_shm_writable"] = ro.get("writable")
if ro["ok"]:
    res["pread_into_readonly"] = code(req(op="pread", handle=h, buffer=ro["buffer"],
                                          length=4096, path="pub"))
# Files that are not memory objects, lent through /proc: refused before mapping (one on disk,
# one on this very mount, which the daemon must never map).
disk = os.open("/var/tmp/dnvme-nobody-%%d" %% os.getpid(), os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(disk, 1 << 20)
res["disk_file"] = code(req(op="buffer.register", source="/proc/%%d/fd/%%d" %% (os.getpid(), disk)))
os.unlink("/var/tmp/dnvme-nobody-%%d" %% os.getpid())
onmount = os.open(os.path.join(mnt, "pub"), os.O_RDONLY)
res["mount_file"] = code(req(op="buffer.register",
                             source="/proc/%%d/fd/%%d" %% (os.getpid(), onmount)))
res["proc_of_init"] = code(req(op="buffer.register", source="/proc/1/fd/0"))
res["config_set"] = code(req(op="config.set", config={"queue_depth": 1}))
res["write_public"] = code(req(op="pwrite", handle=h, buffer=b, length=4096, path="pubdir/mine"))
try:
    open(os.path.join(mnt, ".dnvme", "config"), "w")
    res["config_file"] = "OK"
except PermissionError:
    res["config_file"] = "EACCES"
os.unlink("/dev/shm/" + mine)
print(json.dumps(res))
"""


class SecurityTest(CtlCase):
    NEED_ROOT = True

    def test_hostile_requests_from_an_unprivileged_uid(self):
        os.chmod(self.scratch.path, 0o755)
        d = os.path.dirname(self.scratch.path)
        while d != "/":
            if not os.stat(d).st_mode & 0o001:
                self.skipTest("%s is not searchable by other users" % d)
            d = os.path.dirname(d)
        self.write(self.m("secret"), b"root only" * 1000)
        os.chmod(self.m("secret"), 0o600)
        self.write(self.m("rootfile"), b"r" * 8192)
        os.chmod(self.m("rootfile"), 0o644)
        os.mkdir(self.m("rootdir"), 0o755)
        os.mkdir(self.m("pubdir"))
        os.chmod(self.m("pubdir"), 0o777)
        self.write(self.m("pub"), b"p" * 8192)
        os.chmod(self.m("pub"), 0o644)
        os.symlink("/etc/shadow", self.m("link_out"))
        secret_shm = self.shm(MiB, 0o600)
        public_shm = self.shm(MiB, 0o644)
        before = self.backing_snapshot()
        r = subprocess.run([PY, "-c", HOSTILE % {"uid": NOBODY}, self.mnt, secret_shm.name,
                            public_shm.name], capture_output=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr.decode())
        res = json.loads(r.stdout)
        self.assertEqual(res["memfd"], "OK", "the caller's own memfd through /proc")
        self.assertTrue(res["memfd_sealed"], "sealed against shrinking")
        self.assertEqual(res["read_secret"], "EACCES")
        self.assertEqual(res["write_rootfile"], "EACCES")
        self.assertEqual(res["create_in_rootdir"], "EACCES")
        self.assertEqual(res["symlink_out"], "ELOOP", "symlinks are never followed")
        self.assertEqual(res["fsync_secret"], "EACCES")
        self.assertEqual(res["root_shm"], "EACCES")
        self.assertEqual(res["readable_shm"], "OK")
        self.assertIs(res["readable_shm_writable"], False)
        self.assertEqual(res["pread_into_readonly"], "EACCES")
        self.assertIn(res["proc_of_init"], ("EACCES", "EPERM"))
        self.assertEqual(res["disk_file"], "EINVAL", "not a memory object")
        self.assertEqual(res["mount_file"], "EINVAL", "a file of the mount itself")
        self.assertEqual(res["config_set"], "EPERM")
        self.assertEqual(res["config_file"], "EACCES")
        self.assertEqual(res["write_public"], "OK")
        after = self.backing_snapshot()
        self.assertEqual(after.pop(os.path.join("pubdir", "mine")), hashlib.sha256(
            b"\0" * 4096).hexdigest())
        self.assertEqual(after, before, "hostile requests changed BACKING_DIR")
        self.assertEqual(os.stat(self.b("pubdir", "mine")).st_uid, NOBODY, "owned by the caller")
        self.assertEqual(self.ctl.ok("config.get")["config"]["queue_depth"], 128)
        self.assertTrue(self.mount.alive())


    def test_proc_descriptors_of_the_daemon_are_refused(self):
        """/proc/<daemon>/fd/N would reach every client's lease page (the kernel skips the ptrace
        check within a thread group): refused for the daemon and each of its threads; other
        /proc shapes are refused before anything is opened; a user's own memfd still works."""
        conn = broker_connect(self.mnt)  # the daemon now holds this connection's lease page
        try:
            self.assertEqual(broker_call(conn, BROKER_HELLO)["error"], 0)
            pid = self.mount.pid
            lease_fd = None
            for n in os.listdir("/proc/%d/fd" % pid):
                try:
                    if "dnvmefs-leases" in os.readlink("/proc/%d/fd/%s" % (pid, n)):
                        lease_fd = int(n)
                except OSError:
                    pass
            self.assertIsNotNone(lease_fd, "no lease page among the daemon's descriptors")
            tid = [int(t) for t in os.listdir("/proc/%d/task" % pid) if int(t) != pid][0]
            res = self.as_nobody(PROC_BODY, pid, tid, lease_fd)
        finally:
            conn.close()
        self.assertEqual(res["daemon_fd"], "EACCES", res)
        self.assertIn("daemon itself", res["daemon_fd_message"])
        self.assertEqual(res["daemon_thread_fd"], "EACCES", res)
        self.assertEqual(res["self_link"], "EINVAL")
        self.assertEqual(res["proc_mem"], "EINVAL")
        self.assertEqual(res["own_memfd"], "OK")
        self.assertTrue(self.mount.alive())

    def test_ctl_pwrite_by_a_user_clears_setid(self):
        """A control-file pwrite clears set-user-ID / set-group-ID as a write through the mount
        does (ext4's rule), though the daemon writes with CAP_FSETID; root's keeps them."""
        for name, mode in [("suid", 0o4777), ("sgid_x", 0o2777), ("sgid_nx", 0o2766),
                           ("sgid_mine", 0o2766), ("root_suid", 0o4777)]:
            self.write(self.m(name), b"s" * 8192)
            if name == "sgid_mine":
                os.chown(self.m(name), NOBODY, NOBODY)
            os.chmod(self.m(name), mode)
        res = self.as_nobody(SETID_BODY)
        for name, want in [("suid", 0o777), ("sgid_x", 0o777), ("sgid_nx", 0o766),
                           ("sgid_mine", 0o2766)]:
            self.assertEqual(res[name], "OK", name)
            self.assertEqual(stat.S_IMODE(os.stat(self.b(name)).st_mode), want, name)
            self.assertEqual(stat.S_IMODE(os.stat(self.m(name)).st_mode), want,
                             name + " as the mount shows it")
        s = self.shm(MiB)
        h = self.ctl.ok("handle.open")["handle"]
        b = self.ctl.ok("buffer.register", shm=s.name)["buffer"]
        self.ctl.ok("pwrite", handle=h, buffer=b, length=4096, path="root_suid")
        self.assertEqual(stat.S_IMODE(os.stat(self.b("root_suid")).st_mode), 0o4777)

    def test_broker_refuses_a_fifo_without_blocking(self):
        """A broker open of a FIFO sat in open(2) until someone wrote to it, and the daemon could
        then not stop: now it is opened O_NONBLOCK and refused as not a regular file."""
        os.mkfifo(self.m("fifo"))
        os.chmod(self.m("fifo"), 0o666)
        ino = os.stat(self.m("fifo")).st_ino
        try:
            res = self.as_nobody(FIFO_BODY, ino)
        finally:
            # A broker thread stuck in open(2) (the bug) lets go once a writer comes.
            try:
                os.close(os.open(self.b("fifo"), os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        self.assertEqual(res["hello"], 0)
        self.assertEqual(res["read_open"], errno.EINVAL, res)
        self.assertIn("not a regular file", res["read_message"])
        self.assertLess(res["read_s"], 5.0)
        self.assertNotIn(res["write_open"], (0, "TIMEOUT"), res)
        self.assertTrue(self.mount.alive())

    def test_ctl_file_lets_writers_in_parallel(self):
        """The kernel serialises direct writes past EOF and appends on the ctl inode; ctl claims
        a size no write reaches and refuses O_APPEND, so writers share the inode's lock."""
        self.assertGreaterEqual(os.stat(self.m(".dnvme", "ctl")).st_size, 1 << 31)
        with self.assertRaises(OSError) as cm:
            os.open(self.m(".dnvme", "ctl"), os.O_RDWR | os.O_APPEND)
        self.assertEqual(cm.exception.errno, errno.EINVAL)
        fd = os.open(self.m(".dnvme", "ctl"), os.O_RDWR)
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, os.O_APPEND)
            with self.assertRaises(OSError) as cm:
                os.write(fd, b'{"op": "hello"}')
            self.assertEqual(cm.exception.errno, errno.EINVAL)
        finally:
            os.close(fd)
        self.assertIs(self.ctl.req("hello")["ok"], True)

    def test_a_shared_mapping_of_ctl_runs_nothing_and_reads_zeros(self):
        """The dirty pages of a MAP_SHARED mapping of ctl come back as writeback, which the kernel
        sends as uid 0 through a file of its choosing: a user's config.set written into one
        changed the live configuration. Writeback is acknowledged and dropped (refused, it became
        the mapping's error and root's next ctl write failed with EIO); a fault reads zeros (a
        session's answer never lands in the page cache every opener shares) and leaves ctl's
        size alone; the session's own answer stays whole for its read()."""
        self.reachable_by_nobody()
        child = NobodyChild(self.mnt, MAPPED_BODY)
        try:
            res = child.expect("written_back")
            # The kernel flushes ctl's mapping before root's direct write and hands it the error
            # of that writeback, if any.
            self.assertIs(self.ctl.req("hello")["ok"], True)
            child.send("go")
            res.update(child.expect("done"))
            self.assertEqual(child.p.wait(60), 0, child.p.stderr.read().decode())
        finally:
            child.close()
        self.assertEqual(res["page"], "zeros", res)
        self.assertGreaterEqual(res["size"], 1 << 31, "a fault shrank the kernel's size of ctl")
        self.assertEqual(res["writeback"], 0, res)
        self.assertTrue(res["answer_whole"], res)
        self.assertEqual(res["hello"], "OK")
        self.assertEqual(self.ctl.ok("config.get")["config"]["queue_depth"], 128,
                         "a user's writeback ran config.set as root")
        self.assertTrue(self.mount.alive())

    LONG_SIZE = 16 * MiB  # each async pread of the user's
    LONG_SECONDS = 3.0  # the user's `wait` is sized to last about this long

    def ctl_requests(self):
        """Control requests started so far, from the stats file (another inode than ctl: never
        held by a ctl write)."""
        with open(self.m(".dnvme", "stats")) as f:
            return json.load(f)["ctl"]["requests"]

    def roots_requests_pass_a_users_long_wait(self, mode):
        """uid 65534 runs a long `wait` in a session of its own while it holds ctl the way `mode`
        says; root's hello and stats (write and read, another session) must be answered while
        that wait still runs. Ordering, not timing: root's answers before the user's."""
        self.reachable_by_nobody()
        self.write(self.m("big"), pattern(self.LONG_SIZE, 8))
        os.chmod(self.m("big"), 0o644)
        base = self.ctl_requests()
        child = NobodyChild(self.mnt, LONG_WAIT_BODY, mode, self.LONG_SIZE, self.LONG_SECONDS)
        try:
            n = child.expect("waiting")["n"]
            # The user's `wait` has started (the counter counts a request as it starts).
            deadline = time.monotonic() + 60
            while self.ctl_requests() < base + 3 + n + 1:
                self.assertLess(time.monotonic(), deadline, "the user's wait never started")
                time.sleep(0.01)
            if mode == "append":
                child.send("go")
                child.expect("appending")
                time.sleep(0.3)  # its write reaches the kernel's inode lock (not an assertion)
            self.assertEqual(self.ctl.ok("hello")["protocol"], 1)
            self.assertIn("ctl", self.ctl.ok("stats")["stats"])
            root_done = time.monotonic()
            waited = child.expect("waited", timeout=300)
            self.assertEqual(waited["code"], "OK", waited)
            self.assertEqual(waited["completed"], n)
            self.assertLess(root_done, waited["t"],
                            "root's hello and stats were answered only after uid 65534's wait "
                            "of %d x %d bytes ended: root waited for another user (%s)" %
                            (n, self.LONG_SIZE, mode))
            if mode == "append":
                self.assertEqual(child.expect("appended")["code"], "EINVAL")
            self.assertEqual(child.p.wait(60), 0, child.p.stderr.read().decode())
        finally:
            child.close()
        self.assertTrue(self.mount.alive())

    def test_a_users_mapping_of_ctl_does_not_hold_roots_request(self):
        """While a user maps ctl MAP_SHARED, the kernel takes the ctl inode's lock exclusively
        for every write: a write answered only after its request ran held everyone's writes
        for the whole of a user's `wait`. Writes are answered once queued."""
        self.roots_requests_pass_a_users_long_wait("mmap")

    def test_a_users_o_append_write_does_not_hold_roots_request(self):
        """A write on a ctl descriptor made O_APPEND wants the inode's lock exclusively: it waited
        behind the user's own long request (which held the lock shared while it ran), and root's
        write queued behind it. Writes are answered once queued; the append is refused."""
        self.roots_requests_pass_a_users_long_wait("append")


LONG_WAIT_BODY = r"""
import errno, fcntl, mmap, threading
def emit(tag, **kw):
    kw["tag"], kw["t"] = tag, time.monotonic()
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()
mode, size, seconds = sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
s = Session()
if mode == "mmap":
    # Mapped: the kernel keeps the ctl inode in its caching mode until this file is closed, and
    # every write to ctl, anybody's, takes the inode's lock exclusively.
    mapped = mmap.mmap(s.fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ)
h, n = queue_long_reads(s.fd, "big", shm(0, size), size, seconds)
def append():
    sys.stdin.readline()  # the test says when: once the wait below runs
    fd = os.open(os.path.join(mnt, ".dnvme", "ctl"), os.O_RDWR)
    fcntl.fcntl(fd, fcntl.F_SETFL, os.O_APPEND)
    emit("appending")
    try:
        os.write(fd, b'{"op": "hello"}')
        res = "OK"
    except OSError as e:
        res = errno.errorcode.get(e.errno, str(e.errno))
    emit("appended", code=res)
    os.close(fd)
if mode == "append":
    th = threading.Thread(target=append)
    th.start()
emit("waiting", n=n)
w = s.req(op="wait", handle=h)
emit("waited", code=code(w), completed=w.get("completed"))
if mode == "append":
    th.join()
shm_cleanup()
"""

PROC_BODY = r"""
pid, tid, n = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
s = Session()
a = s.req(op="buffer.register", source="/proc/%d/fd/%d" % (pid, n))
res["daemon_fd"], res["daemon_fd_message"] = code(a), message(a)
res["daemon_thread_fd"] = code(s.req(op="buffer.register", source="/proc/%d/fd/%d" % (tid, n)))
res["self_link"] = code(s.req(op="buffer.register", source="/proc/self/fd/0"))
res["proc_mem"] = code(s.req(op="buffer.register", source="/proc/%d/mem" % pid))
memfd = os.memfd_create("nobody", os.MFD_ALLOW_SEALING)
os.ftruncate(memfd, 1 << 20)
res["own_memfd"] = code(s.req(op="buffer.register",
                             source="/proc/%d/fd/%d" % (os.getpid(), memfd)))
print(json.dumps(res))
"""

MAPPED_BODY = r"""
import mmap
def emit(tag, **kw):
    kw["tag"] = tag
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()
s = Session()
os.write(s.fd, json.dumps({"op": "stats"}).encode())  # an answer longer than a page, unread
mm = mmap.mmap(s.fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
page = mm[:4096]
res["page"] = "zeros" if page == bytes(4096) else page[:64].decode(errors="replace")
res["size"] = os.fstat(s.fd).st_size
req = json.dumps({"op": "config.set", "config": {"queue_depth": 7}}).encode()
mm[:len(req)] = req
# Written back (SYNC_FILE_RANGE_WRITE) but not waited for: the outcome stays with the mapping for
# whoever flushes it next.
res["writeback"] = ctypes.CDLL(None, use_errno=True).sync_file_range(
    s.fd, ctypes.c_longlong(0), ctypes.c_longlong(4096), 2)
emit("written_back", **res)
sys.stdin.readline()
res = {}
mm.close()
out = b""
while True:
    c = os.read(s.fd, 1 << 20)
    if not c:
        break
    out += c
try:
    res["answer_whole"] = "stats" in json.loads(out)
except ValueError:
    res["answer_whole"] = False
res["hello"] = code(s.req(op="hello"))
emit("done", **res)
"""

SETID_BODY = r"""
s = Session()
h = s.req(op="handle.open")["handle"]
b = s.req(op="buffer.register", shm=shm(0))["buffer"]
for name in ("suid", "sgid_x", "sgid_nx", "sgid_mine"):
    res[name] = code(s.req(op="pwrite", handle=h, buffer=b, length=4096, path=name))
shm_cleanup()
print(json.dumps(res))
"""

FIFO_BODY = r"""
ino = int(sys.argv[2])
c = broker_connect(mnt, timeout=8.0)
res["hello"] = broker_call(c, BROKER_HELLO)["error"]
t = time.monotonic()
try:
    r = broker_call(c, BROKER_OPEN, b"fifo", os.O_RDONLY, ino)
    res["read_open"], res["read_message"] = r["error"], r.get("message", "")
except TimeoutError:
    res["read_open"], res["read_message"] = "TIMEOUT", ""
res["read_s"] = time.monotonic() - t
try:
    res["write_open"] = broker_call(c, BROKER_OPEN, b"fifo", os.O_WRONLY, ino)["error"]
except TimeoutError:
    res["write_open"] = "TIMEOUT"
print(json.dumps(res))
"""


class CtlQueueTest(CtlCase):
    """Each write(2) of ctl is queued in its session and answered at once; the requests run in
    order on the writer's lane, and the read of the answer waits for the last of them."""

    def read_all(self, fd, timeout=60.0):
        """Reads an answer to its end on another thread, failing if that takes over `timeout`."""
        got = []

        def reader():
            out = b""
            while True:
                c = os.read(fd, 1 << 20)
                if not c:
                    break
                out += c
            got.append(out)
        t = threading.Thread(target=reader, daemon=True)
        t.start()
        t.join(timeout)
        self.assertFalse(t.is_alive(), "a read of ctl was not answered in %.0fs" % timeout)
        return got[0]

    def test_writes_without_reads_run_in_order(self):
        self.write(self.m("ordered"), pattern(64 * KiB, 9))
        s = self.shm(MiB)
        c = Ctl(self.mnt)
        try:
            # Handle and buffer ids start at 1 in a session: the pread needs both requests before
            # it to have run.
            for r in (dict(op="handle.open", id="open"), dict(op="buffer.register", shm=s.name),
                      dict(op="pread", handle=1, buffer=1, length=64 * KiB, path="ordered",
                           id="pread")):
                data = json.dumps(r).encode()
                self.assertEqual(os.write(c.fd, data), len(data))
            a = json.loads(self.read_all(c.fd))
            self.assertEqual(a.get("id"), "pread", a)
            self.assertIs(a["ok"], True, a)
            self.assertEqual(a["bytes"], 64 * KiB)
            self.assertBytesEqual(bytes(s.map[:64 * KiB]), pattern(64 * KiB, 9), "pread")
        finally:
            c.close()

    def test_a_read_with_nothing_queued_answers_at_once(self):
        c = Ctl(self.mnt)
        try:
            self.assertEqual(self.read_all(c.fd, timeout=10), b"", "a new session has no answer")
            self.assertIs(c.req("hello")["ok"], True)
            self.assertEqual(self.read_all(c.fd, timeout=10), b"", "the answer was read")
        finally:
            c.close()

    def test_session_queue_is_bounded(self):
        """While a long `wait` runs, the session takes CtlSession::kMaxQueued (64) requests more
        and refuses the next write (EAGAIN); the read then answers the last one queued."""
        size = 16 * MiB
        self.write(self.m("long"), pattern(size, 10))
        s = self.shm(size)
        c = Ctl(self.mnt)
        try:
            h, n = queue_long_reads(c.fd, "long", s.name, size, 2.0)
            os.write(c.fd, json.dumps(dict(op="wait", handle=h)).encode())
            accepted, refused = 0, None
            for i in range(100):
                try:
                    os.write(c.fd, json.dumps(dict(op="hello", id=i)).encode())
                    accepted += 1
                except OSError as e:
                    refused = e.errno
                    break
            self.assertEqual(refused, errno.EAGAIN, "no refusal after %d requests" % accepted)
            # 64 queued behind the running wait (63 when the wait had not left the queue yet).
            self.assertIn(accepted, (63, 64))
            a = json.loads(self.read_all(c.fd, timeout=300))
            self.assertEqual(a.get("id"), accepted - 1, a)
            self.assertEqual(c.req("hello")["ok"], True, "the session goes on")
        finally:
            c.close()

    def test_close_with_requests_queued(self):
        """Requests written and never read still run after the file is closed (a pwrite lands),
        and the session goes away afterwards."""
        s = self.shm(MiB)
        s.map[:4096] = pattern(4096, 11)
        c = Ctl(self.mnt)
        for r in (dict(op="handle.open"), dict(op="buffer.register", shm=s.name),
                  dict(op="pwrite", handle=1, buffer=1, length=4096, path="queued_then_closed")):
            os.write(c.fd, json.dumps(r).encode())
        c.close()
        deadline = time.monotonic() + 60
        while not os.path.exists(self.b("queued_then_closed")) or \
                os.path.getsize(self.b("queued_then_closed")) < 4096:
            self.assertLess(time.monotonic(), deadline, "the queued pwrite never ran")
            time.sleep(0.02)
        self.assertBytesEqual(self.read(self.m("queued_then_closed")), pattern(4096, 11))
        self.wait_sessions(1)


class PerUidLimitsTest(CtlCase):
    """What one user may make the daemon hold (docs/security.md, "Per-uid limits"): each limit
    refuses that user alone, names its option, and root goes on."""
    NEED_ROOT = True
    MOUNT_OPTIONS = ("allow_other", "default_permissions", "ctl_max_buffers=4",
                     "ctl_max_pending=3", "ctl_max_pinned=64M", "broker_max_conns_per_uid=3")

    def test_buffer_limit_per_uid_then_root_still_registers(self):
        res = self.as_nobody(r"""
a, b = Session(), Session()
res["first"] = [code(a.req(op="buffer.register", shm=shm(i))) for i in range(3)]
res["other_session"] = code(b.req(op="buffer.register", shm=shm(3)))
past = b.req(op="buffer.register", shm=shm(4))
res["past"], res["past_message"] = code(past), message(past)
res["unregister"] = code(a.req(op="buffer.unregister", buffer=1))
res["again"] = code(b.req(op="buffer.register", shm=shm(5)))
shm_cleanup()
print(json.dumps(res))
""")
        self.assertEqual(res["first"], ["OK"] * 3)
        self.assertEqual(res["other_session"], "OK")
        self.assertEqual(res["past"], "EMFILE", res)
        self.assertIn("ctl_max_buffers=4", res["past_message"])
        self.assertEqual((res["unregister"], res["again"]), ("OK", "OK"))
        for i in range(4):  # root's own share
            self.ctl.ok("buffer.register", shm=self.shm(MiB).name)

    def test_pending_limit_per_uid_not_per_handle(self):
        self.write(self.m("pend"), pattern(MiB, 3))
        os.chmod(self.m("pend"), 0o644)
        res = self.as_nobody(r"""
a, b = Session(), Session()
# Small bounce pools: two handles stay inside this mount's ctl_max_pinned.
small = {"bounce_bytes_per_worker": 1 << 20}
ha, hb = a.req(op="handle.open", **small)["handle"], b.req(op="handle.open", **small)["handle"]
ba = a.req(op="buffer.register", shm=shm(0))["buffer"]
bb = b.req(op="buffer.register", shm=shm(1))["buffer"]
def apread(s, h, buf):
    return s.req(**{"op": "pread", "handle": h, "buffer": buf, "length": 4096, "path": "pend",
                    "async": True})
res["three"] = [code(apread(a, ha, ba)), code(apread(a, ha, ba)), code(apread(b, hb, bb))]
past = apread(b, hb, bb)
res["past"], res["past_message"] = code(past), message(past)
res["wait"] = a.req(op="wait", handle=ha)["completed"]
res["after_wait"] = code(apread(b, hb, bb))
shm_cleanup()
print(json.dumps(res))
""")
        self.assertEqual(res["three"], ["OK"] * 3)
        self.assertEqual(res["past"], "EAGAIN", res)
        self.assertIn("ctl_max_pending=3", res["past_message"])
        self.assertEqual((res["wait"], res["after_wait"]), (2, "OK"))
        # Root's transfers are not held back by the user's.
        s = self.shm(MiB)
        h = self.ctl.ok("handle.open")["handle"]
        b = self.ctl.ok("buffer.register", shm=s.name)["buffer"]
        for _ in range(3):
            self.ctl.ok("pread", handle=h, buffer=b, length=4096, path="pend", **{"async": True})
        self.assertEqual(self.ctl.ok("wait", handle=h)["completed"], 3)

    def test_pinned_memory_of_handles_is_bounded(self):
        res = self.as_nobody(r"""
s = Session()
def opened(**cfg):
    a = s.req(op="handle.open", **cfg)
    return [code(a), message(a)]
res["huge_block"] = opened(block_size=128 << 20)
res["huge_bounce"] = opened(bounce_bytes_per_worker=2 << 30)
res["over_pinned"] = opened(block_size=16 << 20, queue_depth=8, intra_op_parallelism=2,
                            bounce_bytes_per_worker=64 << 20)
res["default"] = opened()          # 64 bounce buffers of 1 MiB: exactly 64M
res["second"] = opened()           # the uid's sum would pass 64M
print(json.dumps(res))
""")
        self.assertEqual(res["huge_block"][0], "EINVAL", res)
        self.assertIn("block_size", res["huge_block"][1])
        self.assertEqual(res["huge_bounce"][0], "EINVAL", res)
        self.assertEqual(res["over_pinned"][0], "ENOMEM", res)
        self.assertIn("ctl_max_pinned", res["over_pinned"][1])
        self.assertEqual(res["default"][0], "OK", res)
        self.assertEqual(res["second"][0], "ENOMEM", res)
        self.ctl.ok("handle.open")  # root's own share

    def test_broker_connections_per_uid(self):
        res = self.as_nobody(r"""
conns = [broker_connect(mnt) for _ in range(3)]
res["hellos"] = [broker_call(c, BROKER_HELLO)["error"] for c in conns]
extra = broker_connect(mnt)
r = broker_call(extra, BROKER_HELLO)
res["fourth"], res["fourth_message"] = r["error"], r.get("message", "")
conns.pop().close()
deadline = time.monotonic() + 10
while True:  # the closed connection's place comes back once the daemon saw it go
    c = broker_connect(mnt)
    r = broker_call(c, BROKER_HELLO)
    if r["error"] == 0 or time.monotonic() > deadline:
        break
    c.close()
    time.sleep(0.1)
res["after_close"] = r["error"]
print(json.dumps(res))
""")
        self.assertEqual(res["hellos"], [0, 0, 0])
        self.assertEqual(res["fourth"], errno.EMFILE, res)
        self.assertIn("broker_max_conns_per_uid=3", res["fourth_message"])
        self.assertEqual(res["after_close"], 0)
        c = broker_connect(self.mnt)  # root's own share
        try:
            self.assertEqual(broker_call(c, BROKER_HELLO)["error"], 0)
        finally:
            c.close()


class FilesLimitTest(CtlCase):
    """Uncollected async transfers keep their files open in the daemon: they count against the
    uid's max_files_per_uid (one user brought the daemon to its descriptor limit)."""
    NEED_ROOT = True
    MOUNT_OPTIONS = ("allow_other", "default_permissions", "ctl_max_pending=100",
                     "max_files_per_uid=2")

    def test_async_transfers_count_as_files(self):
        self.write(self.m("held"), pattern(MiB, 4))
        os.chmod(self.m("held"), 0o644)
        res = self.as_nobody(r"""
s = Session()
h = s.req(op="handle.open")["handle"]
b = s.req(op="buffer.register", shm=shm(0))["buffer"]
def apread():
    return s.req(**{"op": "pread", "handle": h, "buffer": b, "length": 4096, "path": "held",
                    "async": True})
res["two"] = [code(apread()), code(apread())]
past = apread()
res["past"], res["past_message"] = code(past), message(past)
res["sync"] = code(s.req(op="pread", handle=h, buffer=b, length=4096, path="held"))
res["wait"] = s.req(op="wait", handle=h)["completed"]
res["after_wait"] = code(apread())
shm_cleanup()
print(json.dumps(res))
""")
        self.assertEqual(res["two"], ["OK", "OK"])
        self.assertEqual(res["past"], "EMFILE", res)
        self.assertIn("max_files_per_uid=2", res["past_message"])
        self.assertEqual(res["sync"], "OK", "a synchronous transfer holds nothing afterwards")
        self.assertEqual((res["wait"], res["after_wait"]), (2, "OK"))

    def test_mount_opens_count_as_files(self):
        """Each open of a file or directory through the mount holds descriptors in the daemon:
        a user holding max_files_per_uid of them is refused the next (EMFILE), root is not, and
        a close gives the share back."""
        for name in ("a", "b", "c"):
            self.write(self.m(name), b"x")
            os.chmod(self.m(name), 0o644)
        res = self.as_nobody(r"""
import errno
mnt = sys.argv[1]
fds = [os.open(os.path.join(mnt, n), os.O_RDONLY) for n in ("a", "b")]
try:
    os.open(os.path.join(mnt, "c"), os.O_RDONLY)
    res["third"] = "OK"
except OSError as e:
    res["third"] = errno.errorcode[e.errno]
try:
    os.listdir(mnt)
    res["opendir"] = "OK"
except OSError as e:
    res["opendir"] = errno.errorcode[e.errno]
os.close(fds.pop())
time.sleep(0.2)  # the RELEASE reaches the daemon after close returns
fds.append(os.open(os.path.join(mnt, "c"), os.O_RDONLY))
res["after_close"] = "OK"
for fd in fds:
    os.close(fd)
print(json.dumps(res))
""")
        self.assertEqual((res["third"], res["opendir"], res["after_close"]),
                         ("EMFILE", "EMFILE", "OK"), res)
        held = [os.open(self.m(n), os.O_RDONLY) for n in ("a", "b", "c")]
        for fd in held:
            os.close(fd)


class ShrunkBufferTest(CtlCase):
    """A client truncates its registered /dev/shm object: the daemon survives (SIGBUS repaired)
    and the transfer reports EFAULT."""

    def test_truncated_shm_under_transfer(self):
        self.write(self.m("src"), pattern(4 * MiB, 9))
        s = self.shm(4 * MiB)
        h = self.ctl.ok("handle.open")["handle"]
        b = self.ctl.ok("buffer.register", shm=s.name)["buffer"]
        self.assertFalse(self.ctl.ok("buffer.register", shm=s.name, size=4096)["sealed"])
        os.truncate(s.path, 0)
        for what, fields in [
                ("pread aligned", dict(op="pread", path="src", buffer_offset=0)),
                ("pwrite aligned", dict(op="pwrite", path="dst", buffer_offset=0)),
                ("pwrite misaligned (bounce copy)", dict(op="pwrite", path="dst2",
                                                         buffer_offset=1)),
                ("pread misaligned (bounce copy)", dict(op="pread", path="src",
                                                        buffer_offset=1))]:
            op = fields.pop("op")
            a = self.ctl.req(op, handle=h, buffer=b, length=2 * MiB, **fields)
            self.assertIs(a["ok"], False, "%s: %s" % (what, a))
            self.assertIn(a["error"]["code"], ("EFAULT", "EIO"), "%s: %s" % (what, a))
            self.assertTrue(self.mount.alive(), "daemon died on %s" % what)
        self.assertBytesEqual(self.read(self.m("src")), pattern(4 * MiB, 9), "source intact")
        self.assertIs(self.ctl.req("hello")["ok"], True)


def dnvme_bin():
    return os.environ.get("DNVME_BIN") or os.path.join(os.path.dirname(mh.daemon_bin()), "dnvme")


class CliTest(CtlCase):
    """`dnvme ctl` (the C++ client) against the live mount."""

    def run_cli(self, *args):
        r = subprocess.run([dnvme_bin(), "-v", "warn", "ctl"] + list(args), capture_output=True,
                           timeout=120)
        return r.returncode, r.stdout.decode(), r.stderr.decode()

    def test_config_stats_call_and_bench(self):
        if not os.path.exists(dnvme_bin()):
            self.skipTest("%s not built" % dnvme_bin())
        cfg = os.path.join(self.scratch.path, "tuned.json")
        with open(cfg, "w") as f:
            json.dump({"block_size": 524288, "queue_depth": 48, "overlap_events": True}, f)
        rc, out, err = self.run_cli(self.mnt, "config", "set", cfg)
        self.assertEqual(rc, 0, err)
        self.assertEqual(json.loads(out)["queue_depth"], 48)
        rc, out, err = self.run_cli(self.mnt, "config", "get")
        self.assertEqual((rc, json.loads(out)["block_size"]), (0, 524288), err)
        rc, out, err = self.run_cli(self.mnt, "stats")
        self.assertEqual(rc, 0, err)
        self.assertEqual(json.loads(out)["config"]["queue_depth"], 48)
        rc, out, err = self.run_cli(self.mnt, "call", '{"op": "hello"}')
        self.assertEqual((rc, json.loads(out)["protocol"]), (0, 1), err)
        rc, out, err = self.run_cli(self.mnt, "bench", "--size", "8M", "--loops", "2", "--json",
                                    "--file", "clibench.dat")
        self.assertEqual(rc, 0, err)
        j = json.loads(out)
        self.assertGreater(j["write_gibps"], 0)
        self.assertGreater(j["read_gibps"], 0)
        self.assertFalse(os.path.exists(self.b("clibench.dat")), "removed unless --keep")
        # Bad input: exit 2 with one message; a missing mount: exit 1.
        rc, out, err = self.run_cli(self.mnt, "config", "set", '{"queue_depth": "deep"}')
        self.assertEqual(rc, 2, err)
        self.assertIn("queue_depth", err)
        rc, out, err = self.run_cli(self.mnt, "bench", "--size", "0")
        self.assertEqual(rc, 2, err)
        rc, out, err = self.run_cli(os.path.join(self.scratch.path, "nomount"), "stats")
        self.assertEqual(rc, 1, err)
        self.assertIn("No such file", err)
        rc, out, err = self.run_cli(self.mnt, "call", '{"op": "wait", "handle": 9}')
        self.assertEqual(rc, 1, err)
        self.assertIn("no handle 9", err)
        self.run_cli(self.mnt, "config", "set", '{"block_size": 1048576, "queue_depth": 128, '
                     '"overlap_events": false}')


if __name__ == "__main__":
    unittest.main()
