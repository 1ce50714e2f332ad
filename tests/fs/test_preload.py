"""`dnvme run -- CMD` (libdnvme_preload.so, docs/preload.md) on a real mount.

Each test runs real programs (dd, cat, python3) under `dnvme run` against a dnvmefs mount and
checks their data through the mount, in BACKING_DIR, and the counters the preload library writes
(--stats: one JSON line per process), so a test cannot pass with the library doing nothing. The
broker's own checks (identity, paths, permissions) are driven by a raw client of its socket
(include/dnvme/broker.h), as an unprivileged user where the test runs as root.

The randomized comparison with a plain directory, with a preloaded process and a plain one on
the same files, is in test_model.py (ModelPreload*).
"""

import ctypes
import errno
import hashlib
import json
import mmap
import os
import random
import resource
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mount_harness as mh  # noqa: E402

KiB, MiB = 1024, 1024 * 1024
PY = "/usr/bin/python3"


def preload_skip_reason():
    """libdnvme_preload.so of a sanitizer build needs the sanitizer runtime first in every
    program it is preloaded into (python3, dd): those builds run the daemon's tests only."""
    if os.environ.get("DNVME_SANITIZED", "0") == "1":
        return "sanitizer build: a sanitized libdnvme_preload.so cannot be preloaded into " \
            "uninstrumented programs (the release build runs these tests)"
    return mh.skip_reason()


def dnvme_bin():
    return os.environ.get("DNVME_BIN") or os.path.join(os.path.dirname(mh.daemon_bin()), "dnvme")


def pattern(seed, n):
    return random.Random(seed).randbytes(n)


def slurp(path):
    with open(path, "rb") as f:
        return f.read()


def have_torch():
    return subprocess.run([PY, "-c", "import torch"], capture_output=True).returncode == 0


def read_stats(path):
    """Sums the per-process lines; returns (total, lines)."""
    lines = []
    if os.path.exists(path):
        with open(path) as f:
            lines = [json.loads(x) for x in f if x.strip()]
    total = {}
    for line in lines:
        for k, v in line.items():
            if k != "pid":
                total[k] = total.get(k, 0) + v
    return total, lines


class PreloadBase(mh.MountedTestCase):
    MIN_BYTES = "64K"

    @classmethod
    def setUpClass(cls):
        reason = preload_skip_reason()
        if reason:
            raise unittest.SkipTest(reason)
        super().setUpClass()

    def setUp(self):
        super().setUp()
        self.stats = os.path.join(self.scratch.path, "stats-%s.jsonl" % self._testMethodName)
        if os.path.exists(self.stats):
            os.unlink(self.stats)

    def run_cmd(self, argv, check=True, min_bytes=None, mount=True, options=(), **kw):
        cmd = [dnvme_bin(), "run", "--stats", self.stats,
               "--min-bytes", min_bytes or self.MIN_BYTES]
        if mount:
            cmd += ["--mount", self.mnt]
        cmd += list(options) + ["--"] + list(argv)
        if "stdout" in kw:
            p = subprocess.run(cmd, stderr=subprocess.PIPE, text=True, timeout=120, **kw)
        else:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)
        if check and p.returncode != 0:
            self.fail("%s failed (%d): %s%s" % (argv, p.returncode, p.stdout, p.stderr))
        return p

    def py(self, code, **kw):
        return self.run_cmd([PY, "-c", code], **kw)

    def child(self, code, *args, options=()):
        """A preloaded python3 running `code`, which reads lines on stdin and answers each (ask):
        the test decides what happens between the child's steps."""
        return subprocess.Popen(
            [dnvme_bin(), "run", "--stats", self.stats, "--min-bytes", "64K"] + list(options) +
            ["--", PY, "-c", code] + list(args),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, child, line):
        child.stdin.write(line + "\n")
        child.stdin.flush()
        self.assertEqual(child.stdout.readline().strip(), "ok")

    def end(self, child):
        child.stdin.close()
        self.assertEqual(child.wait(30), 0)
        child.stdout.close()

    def total(self):
        return read_stats(self.stats)[0]


class PreloadTest(PreloadBase):
    def test_dd_writes_and_reads_around_the_mount(self):
        src = os.path.join(self.scratch.path, "src.bin")
        with open(src, "wb") as f:
            f.write(pattern(1, 24 * MiB + 12345))
        self.run_cmd(["dd", "if=" + src, "of=" + self.m("dd.bin"), "bs=1M", "status=none"])
        t = self.total()
        self.assertEqual(t["adopted"], 1, t)  # the output; the input is not on the mount
        self.assertEqual(t["bytes_written"], 24 * MiB, t)  # the 12345-byte tail is small
        self.assertEqual(t["errors"], 0, t)
        want = slurp(src)
        self.assertEqual(slurp(self.b("dd.bin")), want)
        self.assertEqual(slurp(self.m("dd.bin")), want)
        self.assertEqual(os.stat(self.m("dd.bin")).st_size, len(want))
        # And back: cat reads 128 KiB at a time, through the engine.
        out = os.path.join(self.scratch.path, "back.bin")
        with open(out, "wb") as f:
            self.run_cmd(["cat", self.m("dd.bin")], stdout=f)
        self.assertEqual(slurp(out), want)
        self.assertGreaterEqual(self.total()["bytes_read"], 24 * MiB)

    def test_file_not_on_the_mount_is_left_alone(self):
        p = os.path.join(self.scratch.path, "plain.bin")
        self.py("import os\nfd = os.open(%r, os.O_CREAT | os.O_RDWR, 0o644)\n"
                "os.write(fd, b'x' * (4 << 20)); os.lseek(fd, 0, 0)\n"
                "assert os.read(fd, 4 << 20) == b'x' * (4 << 20)\nos.close(fd)" % p)
        t = self.total()
        self.assertEqual(t["adopted"], 0, t)
        self.assertEqual(t["bytes_written"] + t["bytes_read"], 0, t)
        self.assertEqual(os.path.getsize(p), 4 * MiB)

    def test_unaligned_buffers_and_offsets(self):
        # Buffers 3 bytes into a page, odd file offsets and lengths, vectored calls: the engine
        # bounces what O_DIRECT cannot take and writes the edges through the page cache.
        code = r"""
import os, random
p = %r
data = random.Random(5).randbytes(3 * (1 << 20) + 777)
fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o644)
buf = bytearray(len(data) + 3)
buf[3:] = data
mv = memoryview(buf)[3:]
assert os.pwrite(fd, mv, 4097) == len(data)
h = len(data) // 2
assert os.pwritev(fd, [mv[:h], mv[h:]], 9 * (1 << 20) + 1) == len(data)
back = bytearray(len(data) + 5)
got = os.preadv(fd, [memoryview(back)[5:5 + h], memoryview(back)[5 + h:]], 4097)
assert got == len(data), got
assert bytes(back[5:]) == data
os.lseek(fd, 9 * (1 << 20) + 1, 0)
assert os.read(fd, len(data) + 100) == data  # short at end of file
assert os.read(fd, 1 << 20) == b""
os.close(fd)
""" % self.m("odd.bin")
        self.py(code)
        t = self.total()
        self.assertGreaterEqual(t["bytes_written"], 2 * (3 * MiB + 777), t)
        self.assertGreaterEqual(t["bytes_read"], 2 * (3 * MiB + 777), t)
        data = pattern(5, 3 * MiB + 777)
        with open(self.m("odd.bin"), "rb") as f:
            self.assertEqual(os.pread(f.fileno(), len(data), 4097), data)
            self.assertEqual(os.pread(f.fileno(), len(data), 9 * MiB + 1), data)
        self.assertEqual(os.path.getsize(self.b("odd.bin")), 9 * MiB + 1 + len(data))

    def test_engine_workers_follow_the_cpus_and_large_reads_go_direct_or_bounce(self):
        # One engine worker per CPU the program may run on (up to 4), fewer under taskset, the
        # config file's when it names one. A large read into a buffer that agrees with the file
        # offset modulo the page goes O_DIRECT straight into its middle (the edge pages through
        # the page cache); one byte further it is bounced, each worker copying its own part.
        data = pattern(7, 40 * MiB + 4321)
        with open(self.m("big.bin"), "wb") as f:
            f.write(data)
        try:
            os.close(os.open(self.b("big.bin"), os.O_RDONLY | os.O_DIRECT))
        except OSError as e:
            self.skipTest("the backing directory takes no O_DIRECT (%s): every byte would be "
                          "buffered" % e)
        off = 555
        got = os.path.join(self.scratch.path, "got.bin")
        code = r"""
import mmap, os, sys
shift = int(sys.argv[1])
fd = os.open(%r, os.O_RDONLY)
n = os.fstat(fd).st_size - %d
m = mmap.mmap(-1, n + 2 * mmap.PAGESIZE)  # page-aligned: the buffer's place is `shift`'s
mv = memoryview(m)[%d + shift:%d + shift + n]
assert os.preadv(fd, [mv], %d) == n
os.close(fd)
open(%r, "wb").write(mv)
""" % (self.m("big.bin"), off, off, off, off, got)
        page = mmap.PAGESIZE  # the engine's edges are pages (and at least the device's block)
        head = page - off  # the first page's part, then whole pages, then the last page's part
        tail = len(data) % page
        body = len(data) - off - head - tail
        cpus = sorted(os.sched_getaffinity(0))
        cfg = os.path.join(self.scratch.path, "three.json")
        with open(cfg, "w") as f:
            json.dump({"intra_op_parallelism": 3}, f)
        one = {"preexec_fn": lambda: os.sched_setaffinity(0, cpus[:1])}
        # The engine's O_DIRECT path (--read-cache off: by default a file this small is read
        # through the page cache, PageCacheTest).
        off_ = ("--read-cache", "off")
        for name, shift, options, kw, workers in (
                ("aligned middle", 0, off_, {}, min(4, len(cpus))),
                ("bounced", 1, off_, {}, min(4, len(cpus))),
                ("bounced, taskset", 1, off_, one, 1),
                ("bounced, config", 1, off_ + ("--config", cfg), {}, 3)):
            with self.subTest(name):
                if os.path.exists(self.stats):
                    os.unlink(self.stats)
                self.run_cmd([PY, "-c", code, str(shift)], options=options, **kw)
                t = self.total()
                self.assertEqual(t["engine_workers"], workers, t)
                self.assertEqual(t["bytes_read"], len(data) - off, t)
                self.assertEqual(t["readahead_bytes"], 0, t)  # one read: the engine's
                self.assertEqual(t["errors"], 0, t)
                self.assertEqual(t["engine_bytes_buffered"], head + tail, t)
                if shift == 0:
                    self.assertEqual((t["engine_bytes_direct"], t["engine_bytes_bounce"]),
                                     (body, 0), t)
                else:
                    self.assertEqual((t["engine_bytes_direct"], t["engine_bytes_bounce"]),
                                     (0, body), t)
                self.assertEqual(slurp(got), data[off:])
                os.unlink(got)

    def test_a_plain_reader_sees_each_write_at_once(self):
        # This process keeps the file open through the mount (read-write: the daemon's read-ahead
        # serves it) while a preloaded one overwrites and extends it: every read and stat after
        # each of the child's writes must see it.
        p = self.m("shared.bin")
        with open(p, "wb") as f:
            f.write(b"a" * (4 * MiB))
        fd = os.open(p, os.O_RDWR)
        try:
            self.assertEqual(os.pread(fd, 2 * MiB, 0), b"a" * (2 * MiB))  # cached now
            child = self.child("import os, sys\nfd = os.open(%r, os.O_RDWR)\n"
                               "for line in sys.stdin:\n"
                               "    i = int(line)\n"
                               "    os.pwrite(fd, bytes([98 + i]) * (1 << 20), i * (1 << 20))\n"
                               "    print('ok', flush=True)\n" % p)
            try:
                for i in range(6):
                    self.ask(child, "%d" % i)
                    want = bytes([98 + i]) * MiB
                    self.assertEqual(os.pread(fd, MiB, i * MiB), want, "write %d not seen" % i)
                    self.assertEqual(os.fstat(fd).st_size, max(4, i + 1) * MiB)
                    self.assertEqual(os.stat(p).st_size, max(4, i + 1) * MiB)
            finally:
                self.end(child)
        finally:
            os.close(fd)
        t = self.total()
        self.assertEqual(t["bytes_written"], 6 * MiB, t)
        self.assertGreaterEqual(t["invalidations"], 6, t)  # shared: announced after each

    def test_overwrite_of_bytes_still_in_flight_lands_last(self):
        # Write-behind returns before the bytes land and the engine's requests complete in any
        # order: a second write over the same bytes must still be the one the file keeps.
        code = r"""
import os
fd = os.open(%r, os.O_CREAT | os.O_RDWR, 0o644)
for i in range(40):
    os.pwrite(fd, bytes([i]) * (8 << 20), 0)
    os.pwrite(fd, bytes([100 + i]) * (1 << 20), (i %% 7) << 20)
    os.pwrite(fd, bytes([200]) * 5000, (i %% 5) * 1234567)
    os.fsync(fd)
    want = bytearray([i]) * (8 << 20)
    want[(i %% 7) << 20:((i %% 7) + 1) << 20] = bytes([100 + i]) * (1 << 20)
    want[(i %% 5) * 1234567:(i %% 5) * 1234567 + 5000] = bytes([200]) * 5000
    with open(%r, "rb") as f:
        assert f.read() == want, i
os.close(fd)
""" % (self.m("over.bin"), self.b("over.bin"))
        self.py(code, min_bytes="4K")
        t = self.total()
        self.assertGreaterEqual(t["bytes_written"], 40 * 9 * MiB, t)
        self.assertEqual(t["errors"], 0, t)

    def test_truncation_waits_for_writes_in_flight(self):
        # A preloaded writer's pwrite returns while its bytes are still in flight (write-behind).
        # A plain process that then empties the file -- an O_TRUNC open, truncate(2) by path --
        # must find it empty and it must stay empty: on ext4 the write came first, so it may not
        # land after the truncation and re-extend the file (found by the model test, seed
        # 193413603). A fresh descriptor per round, so the lease is not already `shared` (a
        # shared lease lands every write before it returns).
        p = self.m("trunc.bin")
        child = self.child("import os, sys\n"
                           "buf = b'w' * (48 << 20)\n"
                           "for line in sys.stdin:\n"
                           "    if line.strip() == 'write':\n"
                           "        fd = os.open(%r, os.O_CREAT | os.O_RDWR, 0o644)\n"
                           "        os.pwrite(fd, buf, 0)\n"
                           "    else:\n"
                           "        os.close(fd)\n"
                           "    print('ok', flush=True)\n" % p)
        try:
            for i in range(8):
                self.ask(child, "write")
                if i % 2 == 0:
                    os.close(os.open(p, os.O_WRONLY | os.O_TRUNC))
                else:
                    os.truncate(p, 0)
                self.assertEqual(os.stat(p).st_size, 0, "round %d" % i)
                self.ask(child, "close")
                self.assertEqual(os.stat(self.b("trunc.bin")).st_size, 0,
                                 "round %d: a write that returned before the truncation landed "
                                 "after it" % i)
                self.assertEqual(os.stat(p).st_size, 0, "round %d" % i)
        finally:
            self.end(child)
        t = self.total()
        self.assertEqual(t["bytes_written"], 8 * 48 * MiB, t)  # every write went direct
        self.assertEqual(t["errors"], 0, t)

    def test_truncate_by_path_while_a_writer_streams(self):
        # A preloaded writer streaming writes keeps write-behind in flight without a break, so a
        # truncate(2) by path from someone else (a SETATTR that opens nothing) cannot wait for
        # its counter to read 0: the daemon marks the lease shared (each write then lands before
        # it returns) and the wait ends at the next gap between two writes. Before, it ran to
        # its 10 s limit and the truncation went on with writes that had returned still in flight.
        p = self.m("stream.bin")
        stop = os.path.join(self.scratch.path, "stop-streaming")
        # A slow engine (one 4 KiB request at a time): the writer's copies into its staging
        # buffers outrun the device, as on a real disk under a fast writer, so its write-behind
        # never drains on its own while it streams. Fresh offsets: a write over bytes still in
        # flight would wait for them, and that wait would drain it.
        slow = os.path.join(self.scratch.path, "slow-engine.json")
        with open(slow, "w") as f:
            json.dump({"queue_depth": 1, "block_size": "4K"}, f)
        child = self.child("import os, time\n"
                           "fd = os.open(%r, os.O_CREAT | os.O_RDWR, 0o644)\n"
                           "buf = b'w' * (1 << 20)\n"
                           "os.pwrite(fd, buf, 0)\n"
                           "print('ok', flush=True)\n"
                           "end, n = time.monotonic() + 30, 1\n"
                           "while not os.path.exists(%r) and time.monotonic() < end:\n"
                           "    os.pwrite(fd, buf, n * len(buf))\n"
                           "    n += 1\n"
                           "os.close(fd)\n"
                           "print('ok' if os.path.exists(%r) else 'ran out of time', flush=True)\n"
                           % (p, stop, stop), options=("--config", slow))
        log_before = len(self.mount.log_text())
        try:
            self.assertEqual(child.stdout.readline().strip(), "ok")
            os.truncate(p, 0)
            with open(stop, "w"):
                pass
            self.assertEqual(child.stdout.readline().strip(), "ok")
        finally:
            if not os.path.exists(stop):
                with open(stop, "w"):
                    pass
            self.end(child)
        self.assertNotIn("did not land", self.mount.log_text()[log_before:],
                         "the truncate gave up waiting for the streaming writer's writes")
        self.assertTrue(self.mount.alive())
        t = self.total()
        self.assertGreaterEqual(t["bytes_written"], 2 * MiB, t)  # the writes went direct
        self.assertEqual(t["errors"], 0, t)

    def test_appends_through_the_mount_land_after_direct_writes(self):
        p = self.m("app.bin")
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, b"a" * 100)
            self.py("import os\nfd = os.open(%r, os.O_RDWR)\n"
                    "os.pwrite(fd, b'b' * 300000, 1000000)\nos.close(fd)" % p)
            os.write(fd, b"c" * 10)
        finally:
            os.close(fd)
        data = slurp(p)
        self.assertEqual(len(data), 1300010)
        self.assertEqual(data[-10:], b"c" * 10)
        self.assertEqual(data[1000000:1300000], b"b" * 300000)

    def test_fork_and_exec(self):
        # The parent writes through the engine, a forked child writes with the inherited
        # descriptor (and adopts it again: the parent's engine threads are not in the child), then
        # an exec'd cat (preloaded too, inheriting LD_PRELOAD) reads the whole file.
        out = os.path.join(self.scratch.path, "cat.out")
        code = r"""
import os, subprocess, sys
p = %r
fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o644)
os.pwrite(fd, b'P' * (2 << 20), 0)
pid = os.fork()
if pid == 0:
    os.pwrite(fd, b'C' * (2 << 20), 2 << 20)
    os.fsync(fd)
    sys.exit(0)  # (not os._exit: the preload library writes its counters at exit)
_, st = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(st) == 0
os.pwrite(fd, b'Q' * (1 << 20), 4 << 20)
with open(%r, 'wb') as o:
    subprocess.check_call(['cat', p], stdout=o)
os.close(fd)
""" % (self.m("fork.bin"), out)
        self.py(code)
        want = b"P" * (2 * MiB) + b"C" * (2 * MiB) + b"Q" * MiB
        self.assertEqual(slurp(out), want)
        self.assertEqual(slurp(self.m("fork.bin")), want)
        total, lines = read_stats(self.stats)
        writers = [x for x in lines if x["bytes_written"] > 0]
        readers = [x for x in lines if x["bytes_read"] > 0]
        self.assertEqual(len(writers), 2, lines)  # the parent and the forked child
        self.assertEqual(sum(x["bytes_written"] for x in writers), 5 * MiB, lines)
        self.assertEqual(len(readers), 1, lines)  # cat
        self.assertEqual(total["errors"], 0, lines)

    def test_torch_save_and_load(self):
        # torch's own save and load, their writes and reads taken by the library (TorchHookTest
        # has the default, torch.save through deepnvme).
        if not have_torch():
            self.skipTest("torch is not importable by %s" % PY)
        code = r"""
import os, torch
torch.manual_seed(0)
t = {"a": torch.randn(3 << 20), "b": torch.arange(1 << 20, dtype=torch.int64), "c": torch.ones(3)}
torch.save(t, %r)
u = torch.load(%r)
assert all(torch.equal(t[k], u[k]) for k in t)
assert not getattr(torch.save, "__dnvme_hook__", False)
""" % (self.m("ck.pt"), self.m("ck.pt"))
        self.py(code, options=["--no-torch-hook"])
        t = self.total()
        self.assertGreater(t["bytes_written"], 20 * MiB, t)
        self.assertGreater(t["bytes_read"], 16 * MiB, t)
        self.assertEqual(t["errors"], 0, t)
        # A plain process (not preloaded) loads it through the mount.
        subprocess.run([PY, "-c", "import torch; u = torch.load(%r); torch.manual_seed(0); "
                        "assert torch.equal(u['a'], torch.randn(3 << 20))" % self.m("ck.pt")],
                       check=True, timeout=120)

    def test_bad_invocations(self):
        p = subprocess.run([dnvme_bin(), "run", "--mount", self.scratch.path, "--", "true"],
                           capture_output=True, text=True, timeout=30)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("not a dnvmefs mount", p.stderr)
        p = subprocess.run([dnvme_bin(), "run", "--min-bytes", "0", "--", "true"],
                           capture_output=True, text=True, timeout=30)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("--min-bytes", p.stderr)
        p = subprocess.run([dnvme_bin(), "run", "--", "/no/such/program"],
                           capture_output=True, text=True, timeout=30)
        self.assertEqual(p.returncode, 127, p.stderr)
        self.assertTrue(self.mount.alive())


# -------------------------------------------------------------------------------------------------
# The broker, spoken to directly (include/dnvme/broker.h).
REQ = struct.Struct("=IIQQqqII4096s")
REP = struct.Struct("=IiQIIq512s")
MAGIC = 0x444e5642
OP_HELLO, OP_OPEN = 1, 2

BROKER_CLIENT = r"""
import json, os, socket, struct, sys
REQ = struct.Struct("=IIQQqqII4096s")
REP = struct.Struct("=IiQIIq512s")
MAGIC = 0x444e5642
args = json.loads(sys.argv[1])
if args.get("uid") is not None:
    os.setgroups([]); os.setgid(args["uid"]); os.setuid(args["uid"])
name = open(os.path.join(args["mnt"], ".dnvme/broker")).read().split("socket @")[1].split()[0]
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect("\0" + name)
def call(op, path=b"", flags=0, ino=0):
    s.send(REQ.pack(MAGIC, op, 0, ino, 0, 0, flags, len(path), path))
    msg, anc, _, _ = s.recvmsg(REP.size, socket.CMSG_SPACE(16))
    fds = []
    for lvl, typ, data in anc:
        if lvl == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
            fds += list(struct.unpack("%di" % (len(data) // 4), data[:len(data) - len(data) % 4]))
    _, err, lease, slot, fl, size, text = REP.unpack(msg)
    return err, fds, size, text.split(b"\0")[0].decode()
out = []
resize = []
page = call(1)[1]
if args.get("resize"):
    # A hostile client: grow, then shrink, the lease page it was sent (the daemon maps it too).
    for n in (1 << 20, 0):
        try:
            os.ftruncate(page[0], n)
            resize.append(0)
        except OSError as e:
            resize.append(e.errno)
for r in args["requests"]:
    err, fds, size, text = call(2, r["path"].encode(), r["flags"], r["ino"])
    first = b""
    if fds:
        first = os.pread(fds[0], 16, 0)
    for fd in fds:
        os.close(fd)
    out.append({"err": err, "nfds": len(fds), "size": size, "text": text, "first": first.hex()})
print(json.dumps({"replies": out, "resize": resize}))
"""


# A preloaded writer that dies right after its large write() returned: by os._exit (no atexit,
# no close) or by SIGKILL from outside. argv: path, "exit" or "wait".
DIE_AFTER_WRITE = r"""
import os, random, sys, time
data = random.Random(11).randbytes(48 << 20)
fd = os.open(sys.argv[1], os.O_CREAT | os.O_WRONLY, 0o644)
assert os.write(fd, data) == len(data)
if sys.argv[2] == "exit":
    os._exit(0)
print("written", flush=True)
time.sleep(60)
"""

# fallocate(2) with a mode the FUSE kernel refuses (COLLAPSE_RANGE, INSERT_RANGE), under dnvme run,
# after a large write still in write-behind. argv: path.
SHIFT_RANGES = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
COLLAPSE, INSERT = 0x08, 0x20
fd = os.open(sys.argv[1], os.O_RDWR)
assert os.pwrite(fd, b"w" * (4 << 20), 8 << 20) == 4 << 20  # still in flight, must land first
if libc.fallocate(fd, COLLAPSE, 2 << 20, 1 << 20) != 0:
    raise OSError(ctypes.get_errno(), "collapse: " + os.strerror(ctypes.get_errno()))
if libc.fallocate(fd, INSERT, 4 << 20, 3 << 20) != 0:
    raise OSError(ctypes.get_errno(), "insert: " + os.strerror(ctypes.get_errno()))
# This process sees the change through the mount at once (a small read is the mount's).
assert os.fstat(fd).st_size == 18 << 20, os.fstat(fd).st_size
assert os.pread(fd, 100, (4 << 20) + 5) == bytes(100)
os.close(fd)
"""


class AcknowledgedWriteTest(PreloadBase):
    """A write() that returned under dnvme run is as safe as on ext4: every byte is in the kernel
    before the call returns, so it survives the writer's exit, _exit and kill -9 (before, the
    write-behind queued it to the process's engine threads, which died with it, and the file had
    already been extended: up to 40 of 48 MiB read back as zeros)."""

    def check_survived(self, name):
        want = pattern(11, 48 * MiB)
        for root in (self.backing, self.mnt):
            got = slurp(os.path.join(root, name))
            self.assertEqual(len(got), len(want), root)
            if got != want:
                first = next(i for i in range(len(want)) if got[i] != want[i])
                zeros = got.count(0) - want.count(0)
                self.fail("%s: bytes differ from offset %d (%d more zero bytes than written)"
                          % (root, first, zeros))

    def test_write_survives_os_exit(self):
        self.run_cmd([PY, "-c", DIE_AFTER_WRITE, self.m("exit.bin"), "exit"])
        self.check_survived("exit.bin")

    def test_write_survives_kill9_right_after_it_returned(self):
        w = subprocess.Popen([dnvme_bin(), "run", "--stats", self.stats, "--min-bytes", "64K",
                              "--", PY, "-c", DIE_AFTER_WRITE, self.m("kill.bin"), "wait"],
                             stdout=subprocess.PIPE, text=True)
        self.addCleanup(lambda: w.poll() is None and w.kill())
        self.assertEqual(w.stdout.readline().strip(), "written")
        w.send_signal(signal.SIGKILL)
        w.wait(30)
        w.stdout.close()
        self.check_survived("kill.bin")

    def test_extending_writes_leave_no_space_reserved_past_the_end(self):
        # Space is reserved ahead of a writer extending its file (fallocate past the end); what
        # is left of it goes when the file is closed.
        self.py("import os\nfd = os.open(%r, os.O_CREAT | os.O_WRONLY, 0o644)\n"
                "for i in range(5):\n    os.write(fd, b'r' * ((3 << 20) + 5))\n"
                "os.close(fd)" % self.m("resv.bin"))
        st = os.stat(self.b("resv.bin"))
        self.assertEqual(st.st_size, 5 * (3 * MiB + 5))
        self.assertLessEqual(st.st_blocks * 512, st.st_size + 64 * KiB,
                             "blocks reserved past the end were left allocated")
        self.assertEqual(slurp(self.m("resv.bin")), b"r" * st.st_size)

    def test_fallocate_collapse_and_insert_range(self):
        # The FUSE kernel refuses these modes (EOPNOTSUPP) before the daemon sees them; under
        # dnvme run they go to the backing file, and the mount's view follows: this process
        # holds the file open through the mount with its pages cached, and sees the new layout.
        p = self.m("shift.bin")
        data = bytearray(pattern(21, 16 * MiB))
        with open(p, "wb") as f:
            f.write(data)
        fd = os.open(p, os.O_RDONLY)
        try:
            self.assertEqual(os.pread(fd, len(data), 0), data)  # cached by the kernel now
            self.run_cmd([PY, "-c", SHIFT_RANGES, p])
            data[8 * MiB:12 * MiB] = b"w" * (4 * MiB)
            del data[2 * MiB:3 * MiB]
            data[4 * MiB:4 * MiB] = bytes(3 * MiB)
            self.assertEqual(os.stat(p).st_size, len(data))
            self.assertEqual(os.fstat(fd).st_size, len(data))
            self.assertEqual(os.pread(fd, len(data) + 1, 0), data, "read through the mount")
        finally:
            os.close(fd)
        self.assertEqual(slurp(self.b("shift.bin")), data)
        self.assertEqual(slurp(p), data)


class PreloadMemlockTest(PreloadBase):
    """`dnvme run` as a user without CAP_IPC_LOCK (other users reach the mount: allow_other)."""
    MOUNT_OPTIONS = ("allow_other",)

    def test_unprivileged_reader_under_eight_mib_memlock(self):
        # The common RLIMIT_MEMLOCK of a user without CAP_IPC_LOCK: the read-ahead buffers (32
        # MiB) cannot be pinned, the engine's bounce buffers (8 MiB among all workers) can, and a
        # large read into an unaligned buffer is bounced. When something else took the limit first
        # (here 8 MiB of read-ahead), the mount serves such a read: whole, never ENOMEM.
        if os.geteuid() != 0:
            self.skipTest("needs root to act as another user")
        nobody = 65534
        os.chmod(self.scratch.path, 0o755)  # nobody must reach the mount
        out = os.path.join(self.scratch.path, "nobody")
        os.makedirs(out, exist_ok=True)
        os.chmod(out, 0o777)
        data = pattern(11, 24 * MiB + 999)
        with open(self.m("pub.bin"), "wb") as f:
            f.write(data)
        os.chmod(self.m("pub.bin"), 0o644)
        got = os.path.join(out, "got.bin")
        code = r"""
import mmap, os
fd = os.open(%r, os.O_RDONLY)
n = os.fstat(fd).st_size
m = mmap.mmap(-1, n + 2 * mmap.PAGESIZE)
mv = memoryview(m)[3:3 + n]
assert os.preadv(fd, [mv], 0) == n
os.close(fd)
open(%r, "wb").write(mv)
""" % (self.m("pub.bin"), got)

        def as_nobody():
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (8 * MiB, 8 * MiB))
            os.setgroups([])
            os.setgid(nobody)
            os.setuid(nobody)

        for name, readahead, fallbacks in (("bounced", None, 0), ("through the mount", 8 * MiB, 1)):
            with self.subTest(name):
                stats = os.path.join(out, "stats-%d.jsonl" % fallbacks)
                env = dict(os.environ)
                if readahead is not None:
                    env["DNVME_PRELOAD_READAHEAD"] = str(readahead)
                # The engine's path (by default this file would come through the page cache).
                p = subprocess.run([dnvme_bin(), "run", "--stats", stats, "--mount", self.mnt,
                                    "--read-cache", "off", "--", PY, "-c", code],
                                   preexec_fn=as_nobody, env=env,
                                   capture_output=True, text=True, timeout=120)
                self.assertEqual(p.returncode, 0, p.stderr)
                t = read_stats(stats)[0]
                self.assertEqual(t["mount_fallbacks"], fallbacks, t)
                # The engine's refusal is counted where it happened; the program saw none.
                self.assertEqual(t["errors"], fallbacks, t)
                if fallbacks:
                    self.assertIn("such reads go through the mount", p.stderr)
                    self.assertEqual(t["engine_bytes_bounce"], 0, t)
                else:
                    self.assertEqual(t["bytes_read"], len(data), t)
                    self.assertGreater(t["engine_bytes_bounce"], 0, t)
                self.assertEqual(slurp(got), data)
                os.unlink(got)


class BrokerTest(PreloadBase):
    MOUNT_OPTIONS = ("allow_other",)  # as a shared mount is run: other users reach it

    def ask(self, requests, uid=None, resize=False):
        p = subprocess.run([PY, "-c", BROKER_CLIENT,
                            json.dumps({"mnt": self.mnt, "uid": uid, "requests": requests,
                                        "resize": resize})],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 0, p.stderr + self.mount.log_tail())
        got = json.loads(p.stdout)
        return (got["replies"], got["resize"]) if resize else got["replies"]

    def test_lease_page_cannot_be_resized(self):
        # The client gets its lease page read-write (it counts its writes in flight there). Had
        # it shrunk the memfd, the daemon's next store to the page (the open below resets the
        # lease's word) would fault with SIGBUS and take the mount down for every user.
        with open(self.m("f.bin"), "wb") as f:
            f.write(b"x" * 4096)
        ino = os.stat(self.m("f.bin")).st_ino
        with open(self.m("f.bin"), "rb"):
            got, resize = self.ask([{"path": "f.bin", "flags": os.O_RDONLY, "ino": ino}],
                                   resize=True)
        self.assertEqual(resize, [errno.EPERM, errno.EPERM])
        self.assertEqual(got[0]["err"], 0, got)
        self.assertTrue(self.mount.alive())
        self.assertEqual(self.read(self.m("f.bin")), b"x" * 4096)

    def test_hands_out_the_file_the_client_has_open(self):
        with open(self.m("f.bin"), "wb") as f:
            f.write(b"hello broker" + b"\0" * 8192)
        ino = os.stat(self.m("f.bin")).st_ino
        with open(self.m("f.bin"), "rb"):  # the kernel knows the inode
            got = self.ask([{"path": "f.bin", "flags": os.O_RDONLY, "ino": ino},
                            {"path": "f.bin", "flags": os.O_RDWR, "ino": ino}])
        for g in got:
            self.assertEqual(g["err"], 0, g)
            self.assertEqual(g["nfds"], 2, g)  # buffered + O_DIRECT
            self.assertEqual(g["size"], 12 + 8192)
            self.assertEqual(bytes.fromhex(g["first"]), b"hello broker\0\0\0\0")

    def test_refuses_what_the_caller_may_not_have(self):
        with open(self.m("f.bin"), "wb") as f:
            f.write(b"x" * 4096)
        ino = os.stat(self.m("f.bin")).st_ino
        with open(self.m("f.bin"), "rb"):
            got = self.ask([
                {"path": "../f.bin", "flags": os.O_RDONLY, "ino": ino},
                {"path": "/etc/passwd", "flags": os.O_RDONLY, "ino": ino},
                {"path": ".dnvme/ctl", "flags": os.O_RDWR, "ino": ino},
                {"path": "f.bin", "flags": os.O_RDONLY, "ino": ino + 1},  # not the client's file
                {"path": "nothere", "flags": os.O_RDONLY, "ino": ino},
                {"path": "f.bin", "flags": 3, "ino": ino},  # no such access mode
            ])
        want = [errno.EINVAL, errno.EINVAL, errno.EINVAL, errno.ESTALE, errno.ENOENT,
                errno.EINVAL]
        self.assertEqual([g["err"] for g in got], want, got)
        self.assertTrue(all(g["nfds"] == 0 for g in got), got)
        self.assertTrue(self.mount.alive())

    def test_opens_as_the_caller(self):
        if os.geteuid() != 0:
            self.skipTest("needs root to act as another user")
        nobody = 65534
        os.chmod(self.scratch.path, 0o755)  # nobody must reach the mount
        with open(self.m("secret.bin"), "wb") as f:
            f.write(b"s" * 4096)
        os.chmod(self.m("secret.bin"), 0o600)
        with open(self.m("public.bin"), "wb") as f:
            f.write(b"p" * 4096)
        os.chmod(self.m("public.bin"), 0o644)
        si, pi = os.stat(self.m("secret.bin")).st_ino, os.stat(self.m("public.bin")).st_ino
        with open(self.m("secret.bin"), "rb"), open(self.m("public.bin"), "rb"):
            got = self.ask([{"path": "secret.bin", "flags": os.O_RDONLY, "ino": si},
                            {"path": "public.bin", "flags": os.O_RDWR, "ino": pi},
                            {"path": "public.bin", "flags": os.O_RDONLY, "ino": pi}], uid=nobody)
        self.assertEqual([g["err"] for g in got], [errno.EACCES, errno.EACCES, 0], got)
        self.assertEqual([g["nfds"] for g in got], [0, 0, 2], got)
        self.assertEqual(bytes.fromhex(got[2]["first"]), b"p" * 16)
        # And through `dnvme run`: the secret stays closed to nobody, at the mount already.
        p = subprocess.run(
            [PY, "-c", "import os, subprocess, sys\nos.setgroups([]); os.setgid(%d); "
             "os.setuid(%d)\nsys.exit(subprocess.run([%r, 'run', '--', 'dd', 'if=%s', "
             "'of=/dev/null', 'bs=1M', 'status=none']).returncode)" %
             (nobody, nobody, dnvme_bin(), self.m("secret.bin"))],
            capture_output=True, text=True, timeout=60)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("Permission denied", p.stderr)


# A preloaded reader driven line by line: "r OFF LEN" reads (printing the bytes' sha256),
# "w OFF LEN BYTE" writes (large: direct), "s OFF BYTE" writes 10 bytes (small: through the mount),
# "t SIZE" truncates.
READER = r"""
import hashlib, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
for line in sys.stdin:
    op, *a = line.split()
    a = [int(x) for x in a]
    if op == "r":
        print(hashlib.sha256(os.pread(fd, a[1], a[0])).hexdigest(), flush=True)
        continue
    if op == "w":
        os.pwrite(fd, bytes([a[2]]) * a[1], a[0])
    elif op == "s":
        os.pwrite(fd, bytes([a[1]]) * 10, a[0])
    elif op == "t":
        os.ftruncate(fd, a[0])
    print("ok", flush=True)
os.close(fd)
"""


def sha(b):
    return hashlib.sha256(b).hexdigest()


class ReadAheadTest(PreloadBase):
    """A sequential reader's next bytes are read ahead into pinned buffers (the kernel's
    read-ahead for O_DIRECT): they must never be served once the file changed under them."""

    def test_sequential_reader_is_read_ahead_and_exact(self):
        want = pattern(11, 40 * MiB + 4321)
        with open(self.b("seq.bin"), "wb") as f:
            f.write(want)
        out = os.path.join(self.scratch.path, "seq.out")
        for ra in ("33554432", "0"):
            if os.path.exists(self.stats):
                os.unlink(self.stats)
            env = dict(os.environ, DNVME_PRELOAD_READAHEAD=ra)
            self.run_cmd(["dd", "if=" + self.m("seq.bin"), "of=" + out, "bs=1M", "status=none"],
                         env=env, options=("--read-cache", "off"))
            self.assertEqual(slurp(out), want, "readahead=" + ra)
            t = self.total()
            self.assertEqual(t["errors"], 0, t)
            self.assertGreaterEqual(t["bytes_read"], 40 * MiB, t)
            if ra == "0":
                self.assertEqual(t["readahead_bytes"], 0, t)
            else:
                # Only the first 1 MiB read waits for the disk: the rest was read ahead.
                self.assertGreaterEqual(t["readahead_bytes"], 38 * MiB, t)
        # A reader that jumps about is not read ahead, but for its first read: the first read
        # of a read-only open starts a sequence wherever it is (a loader that seeks past a
        # header first), served from a window of one chunk; every later jump is a seek.
        if os.path.exists(self.stats):
            os.unlink(self.stats)
        self.py("import os\nfd = os.open(%r, os.O_RDONLY)\n"
                "for off in (30, 2, 17, 9, 25):\n"
                "    assert os.pread(fd, 1 << 20, off << 20) == "
                "open(%r, 'rb').read()[off << 20:(off + 1) << 20]\n" % (
                    self.m("seq.bin"), self.b("seq.bin")), options=("--read-cache", "off"))
        self.assertEqual(self.total()["readahead_bytes"], 1 * MiB, self.total())

    def start_reader(self, path, policy):
        child = self.child(READER, path, options=("--read-cache", policy))
        self.addCleanup(lambda: (child.kill(), child.wait(30)) if child.poll() is None else None)

        def ask(line):
            child.stdin.write(line + "\n")
            child.stdin.flush()
            got = child.stdout.readline().strip()
            self.assertTrue(got, "reader died at " + line)
            return got
        return child, ask

    # Both read policies: the engine's read-ahead window (off), and the page cache of the backing
    # file, which the process's own O_DIRECT writes, truncates and the mount's write-behind must
    # keep exact too (auto).
    def test_own_writes_and_truncates_after_read_ahead(self):
        for policy in ("off", "auto"):
            with self.subTest(policy):
                if os.path.exists(self.stats):
                    os.unlink(self.stats)
                self.own_writes_and_truncates(policy)

    def own_writes_and_truncates(self, policy):
        p = self.m("own.bin")
        data = bytearray(pattern(12, 16 * MiB))
        with open(self.b("own.bin"), "wb") as f:
            f.write(data)
        child, ask = self.start_reader(p, policy)
        self.assertEqual(ask("r 0 %d" % MiB), sha(data[:MiB]))  # the next 15 MiB are read ahead
        self.assertEqual(ask("w %d %d 65" % (4 * MiB, MiB)), "ok")  # direct, into read-ahead
        data[4 * MiB:5 * MiB] = b"A" * MiB
        for i in range(1, 6):
            self.assertEqual(ask("r %d %d" % (i * MiB, MiB)), sha(data[i * MiB:(i + 1) * MiB]),
                             "MiB %d after a direct write" % i)
        self.assertEqual(ask("s %d 66" % (7 * MiB + 5)), "ok")  # 10 bytes through the mount
        data[7 * MiB + 5:7 * MiB + 15] = b"B" * 10
        for i in range(6, 9):
            self.assertEqual(ask("r %d %d" % (i * MiB, MiB)), sha(data[i * MiB:(i + 1) * MiB]),
                             "MiB %d after a small write" % i)
        self.assertEqual(ask("t %d" % (10 * MiB)), "ok")
        self.assertEqual(ask("t %d" % (12 * MiB)), "ok")
        data[10 * MiB:] = bytes(2 * MiB)
        for i in range(9, 12):
            self.assertEqual(ask("r %d %d" % (i * MiB, MiB)), sha(data[i * MiB:(i + 1) * MiB]),
                             "MiB %d after truncate and extend" % i)
        child.stdin.close()
        self.assertEqual(child.wait(30), 0)
        t = self.total()
        self.assertEqual(t["errors"], 0, t)
        # Each policy's source was there to be wrong.
        self.assertGreater(t["readahead_bytes" if policy == "off" else "cached_bytes"], 0, t)
        self.assertEqual(slurp(self.b("own.bin")), bytes(data))

    def test_writer_through_the_mount_after_read_ahead(self):
        for policy in ("off", "auto"):
            with self.subTest(policy):
                self.writer_through_the_mount(policy)

    def writer_through_the_mount(self, policy):
        p = self.m("other.bin")
        data = bytearray(pattern(13, 16 * MiB))
        with open(self.b("other.bin"), "wb") as f:
            f.write(data)
        child, ask = self.start_reader(p, policy)
        self.assertEqual(ask("r 0 %d" % MiB), sha(data[:MiB]))
        self.assertEqual(ask("r %d %d" % (MiB, MiB)), sha(data[MiB:2 * MiB]))
        # Another process, plain, writes ahead of the reader through the mount.
        fd = os.open(p, os.O_WRONLY)
        try:
            os.pwrite(fd, b"C" * (3 * MiB), 3 * MiB)
            data[3 * MiB:6 * MiB] = b"C" * (3 * MiB)
            for i in range(2, 8):
                self.assertEqual(ask("r %d %d" % (i * MiB, MiB)),
                                 sha(data[i * MiB:(i + 1) * MiB]), "MiB %d" % i)
        finally:
            os.close(fd)
        child.stdin.close()
        self.assertEqual(child.wait(30), 0)
        self.assertEqual(self.total()["errors"], 0)


# Reads a file in 1 MiB pieces when told to ("go"), then prints the SHA-256 of what it read and
# the bytes the kernel fetched from the storage layer for it (/proc/self/io read_bytes).
SHARED_READER = r"""
import hashlib, os, sys
sys.stdin.readline()
h = hashlib.sha256()
with open(sys.argv[1], "rb", buffering=0) as f:
    while True:
        b = f.read(1 << 20)
        if not b:
            break
        h.update(b)
with open("/proc/self/io") as f:
    io = dict(line.split(": ") for line in f.read().splitlines())
print(h.hexdigest(), int(io["read_bytes"]), flush=True)
"""


class PageCacheTest(PreloadBase):
    """The read policy (datapath/read_policy.h, --read-cache): by default a file that fits in
    memory is read through the backing file's page cache, so a second read, or readers at once,
    come from memory as on plain ext4; a file larger than the process's memory goes O_DIRECT and
    leaves the cache alone. Residency is the kernel's (fincore), the device's work /proc/PID/io's
    read_bytes: what each process made the kernel fetch."""

    def setUp(self):
        super().setUp()
        if shutil.which("fincore") is None:
            self.skipTest("no fincore (util-linux) to see the page cache with")

    def read_once(self, name, policy, readers=1, **kw):
        """`readers` processes under dnvme run read the file at once; returns (stats of all of
        them, [read_bytes of each])."""
        if os.path.exists(self.stats):
            os.unlink(self.stats)
        kids = [subprocess.Popen(
            [dnvme_bin(), "run", "--stats", self.stats, "--mount", self.mnt, "--read-cache",
             policy, "--", PY, "-c", SHARED_READER, self.m(name)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, **kw)
            for _ in range(readers)]
        for k in kids:
            k.stdin.write("go\n")
            k.stdin.flush()
        fetched = []
        for k in kids:
            out, _ = k.communicate(timeout=120)
            self.assertEqual(k.returncode, 0, out)
            digest, got = out.split()
            self.assertEqual(digest, self.want, "%s read wrong bytes" % policy)
            fetched.append(int(got))
        return self.total(), fetched

    def make(self, name, size, seed):
        data = pattern(seed, size)
        with open(self.b(name), "wb") as f:
            f.write(data)
        self.want = hashlib.sha256(data).hexdigest()
        mh.evict(self.b(name))
        self.assertEqual(mh.resident_bytes(self.b(name)), 0, "the file should start cold")

    def pin(self, name):
        """Locks the backing file's pages in memory (a shared mapping, mlock'ed) until the
        returned function is called: a busy machine's reclaim cannot evict them between a read
        that cached them and the read that must find them there. None where mlock is refused."""
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        size = os.path.getsize(self.b(name))
        fd = os.open(self.b(name), os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        finally:
            os.close(fd)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        if libc.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(size)) != 0:
            libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
            return None
        done = []

        def unpin():
            if not done:
                done.append(True)
                libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))  # unlocks as well
        self.addCleanup(unpin)
        return unpin

    def test_a_file_read_again_comes_from_the_page_cache(self):
        size = 48 * MiB + 4321
        self.make("again.bin", size, 21)
        t, fetched = self.read_once("again.bin", "auto")
        self.assertEqual((t["cached_bytes"], t["engine_read_bytes"], t["readahead_bytes"]),
                         (size, 0, 0), t)
        self.assertGreaterEqual(fetched[0], size - 4096, "the first read fetched the file")
        self.assertGreaterEqual(mh.resident_bytes(self.b("again.bin")), size - 4096,
                                "and left it in the page cache")
        # What the code decides is asserted (every byte through the page cache); what the kernel
        # then fetched depends on what it kept, so its pages are pinned for the reads that must
        # find them cached (issue 54: on a loaded machine it evicted part of the file between the
        # reads), and where pinning is refused, what it evicted meanwhile is allowed for.
        unpin = self.pin("again.bin")
        kept = mh.resident_bytes(self.b("again.bin"))
        t, fetched = self.read_once("again.bin", "auto")
        self.assertEqual(t["cached_bytes"], size, t)
        self.assertLess(fetched[0], MiB + (size - kept),
                        "the second read came from memory (%d of %d bytes were cached before it)"
                        % (kept, size))
        # resident: the same, from what is cached; then cold, from the device, uncached.
        kept = mh.resident_bytes(self.b("again.bin"))
        t, fetched = self.read_once("again.bin", "resident")
        self.assertGreaterEqual(t["cached_bytes"], kept - 4096, t)
        self.assertEqual(t["cached_bytes"] + t["engine_read_bytes"] + t["readahead_bytes"], size,
                         t)
        self.assertLess(fetched[0], MiB + (size - kept), t)
        if unpin is not None:
            unpin()
        else:
            print("page-cache test: mlock refused; allowed for evictions instead", file=sys.stderr)
        mh.evict(self.b("again.bin"))
        t, fetched = self.read_once("again.bin", "resident")
        # The engine reads a partial last page through the page cache: it may then be cached.
        self.assertLess(t["cached_bytes"], 4096, t)
        self.assertEqual(t["engine_read_bytes"] + t["readahead_bytes"] + t["cached_bytes"], size,
                         t)
        self.assertLess(mh.resident_bytes(self.b("again.bin")), 2 * MiB,
                        "O_DIRECT left the cache alone (but for the edge pages)")
        # off: the device even when everything is cached.
        subprocess.run(["cat", self.b("again.bin")], stdout=subprocess.DEVNULL, check=True)
        t, fetched = self.read_once("again.bin", "off")
        self.assertEqual(t["cached_bytes"], 0, t)
        self.assertGreaterEqual(fetched[0], size - 2 * 4096, "off reads the device")

    def test_readers_at_once_read_the_device_once(self):
        size = 64 * MiB
        self.make("shared.bin", size, 22)
        t, fetched = self.read_once("shared.bin", "auto", readers=4)
        self.assertEqual(t["cached_bytes"], 4 * size, t)
        self.assertLessEqual(sum(fetched), size + size // 2,
                             "four readers at once fetched the file about once: %s" % fetched)
        self.assertGreaterEqual(sum(fetched), size - 4096, fetched)
        mh.evict(self.b("shared.bin"))
        t, fetched = self.read_once("shared.bin", "off", readers=4)
        self.assertGreaterEqual(sum(fetched), 4 * (size - 2 * 4096),
                                "O_DIRECT readers each read the device: %s" % fetched)

    def test_a_file_larger_than_the_readers_memory_is_read_o_direct(self):
        if os.geteuid() != 0:
            self.skipTest("needs root for a memory cgroup")
        size = 160 * MiB
        self.make("big.bin", size, 23)
        hot = pattern(24, 8 * MiB)
        with open(self.b("hot.bin"), "wb") as f:
            f.write(hot)
        with mh.MemoryCgroup(128 * MiB) as cg:
            if cg.preexec is None:
                self.skipTest(cg.reason)
            # In the cgroup, half of 128 MiB less the interpreter's memory: less than the file.
            t, _ = self.read_once("big.bin", "auto", preexec_fn=cg.preexec)
        self.assertEqual(t["cached_bytes"], 0, t)
        self.assertEqual(t["engine_read_bytes"] + t["readahead_bytes"], size, t)
        self.assertLess(mh.resident_bytes(self.b("big.bin")), 2 * MiB, "nothing cached")
        self.assertEqual(mh.resident_bytes(self.b("hot.bin")), len(hot),
                         "what else was cached is still there")
        # The same reader outside the cgroup: the file fits, through the page cache.
        mh.evict(self.b("big.bin"))
        t, _ = self.read_once("big.bin", "auto")
        self.assertEqual(t["cached_bytes"], size, t)


# The safetensors package on the mount: save_file, or load_file and safe_open checked against the
# tensors it saves (seeded), metadata and a slice included.
SAFETENSORS = r"""
import sys, torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
op, path = sys.argv[1], sys.argv[2]
g = torch.Generator().manual_seed(5)
want = {"w%02d" % i: torch.rand((1 << 20) if i % 2 else 333333, generator=g) for i in range(12)}
want["i64"] = torch.arange(1000, dtype=torch.int64)
if op == "save":
    save_file(want, path, metadata={"who": "dnvmefs"})
    sys.exit(0)
got = load_file(path)
assert set(got) == set(want), sorted(got)
assert all(torch.equal(got[k], want[k]) for k in want)
with safe_open(path, "pt") as f:
    assert f.metadata() == {"who": "dnvmefs"}, f.metadata()
    assert all(torch.equal(f.get_tensor(k), want[k]) for k in want)
    assert torch.equal(f.get_slice("w01")[100:200], want["w01"][100:200])
print("ok")
"""


class SafetensorsTest(PreloadBase):
    """safetensors' save_file, load_file and safe_open (python3-safetensors: Debian 13's, so the
    torch 2.6 lane runs this) through the mount and under `dnvme run`, both read policies."""

    @classmethod
    def setUpClass(cls):
        if subprocess.run([PY, "-c", "import safetensors.torch"],
                          capture_output=True).returncode != 0:
            raise unittest.SkipTest("no safetensors package for %s (python3-safetensors is "
                                    "Debian 13's: the torch 2.6 lane runs these)" % PY)
        super().setUpClass()

    def test_save_and_load_through_the_mount_and_under_dnvme_run(self):
        plain = subprocess.run([PY, "-c", SAFETENSORS, "save", self.m("a.safetensors")],
                               capture_output=True, text=True, timeout=120)
        self.assertEqual(plain.returncode, 0, plain.stderr)
        self.run_cmd([PY, "-c", SAFETENSORS, "save", self.m("b.safetensors")])
        self.assertEqual(slurp(self.b("a.safetensors")), slurp(self.b("b.safetensors")),
                         "the same file saved through the mount and under dnvme run")
        for name in ("a.safetensors", "b.safetensors"):
            p = subprocess.run([PY, "-c", SAFETENSORS, "load", self.m(name)],
                               capture_output=True, text=True, timeout=120)
            self.assertEqual((p.returncode, p.stdout.strip()), (0, "ok"), p.stderr)
            for policy in ("auto", "off"):
                with self.subTest(name=name, policy=policy):
                    mh.evict(self.b(name))
                    r = self.run_cmd([PY, "-c", SAFETENSORS, "load", self.m(name)],
                                     options=("--read-cache", policy))
                    self.assertEqual(r.stdout.strip(), "ok")
                    self.assertEqual(self.total().get("errors", 0), 0, self.total())


# A stdio program, run through ctypes so its FILE calls are libc's (and, under `dnvme run`, the
# preload's): prints one JSON line of everything a caller can observe -- return values, ftell,
# feof/ferror, hashes of what it read -- so a run on the mount under `dnvme run` and a plain run
# on a plain directory can be compared line for line.
STDIO = r"""
import ctypes, hashlib, json, os, random, sys
libc = ctypes.CDLL(None, use_errno=True)
P, L = ctypes.c_void_p, ctypes.c_long
libc.fopen.restype = P; libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
for name in ("fread", "fwrite"):
    getattr(libc, name).restype = ctypes.c_size_t
    getattr(libc, name).argtypes = [P, ctypes.c_size_t, ctypes.c_size_t, P]
libc.ftell.restype = L; libc.ftell.argtypes = [P]
libc.fseek.argtypes = [P, L, ctypes.c_int]
for name in ("fclose", "feof", "ferror", "clearerr", "fflush", "fgetc"):
    getattr(libc, name).argtypes = [P]
libc.fputs.argtypes = [ctypes.c_char_p, P]
libc.ungetc.argtypes = [ctypes.c_int, P]
path = sys.argv[1]
trace = []
def data(seed, n):
    return random.Random(seed).randbytes(n)
def w(f, b, size=1):
    buf = ctypes.create_string_buffer(b, len(b))
    trace.append(("w", len(b), libc.fwrite(buf, size, len(b) // size, f), libc.ftell(f)))
def r(f, n, size=1):
    buf = ctypes.create_string_buffer(n)
    got = libc.fread(buf, size, n // size, f)
    trace.append(("r", n, got, hashlib.sha256(buf.raw[:got * size]).hexdigest()[:16],
                  libc.ftell(f), libc.feof(f), libc.ferror(f)))
f = libc.fopen(path.encode(), b"w+b")
w(f, data(1, 100))                   # small: in the FILE's buffer
w(f, data(2, (1 << 20) + 333))       # large: the header is flushed first
libc.fputs(b"a line between large writes\n", f)
w(f, data(3, 300 << 10))
w(f, data(4, 256 << 10), size=4096)  # items
libc.fseek(f, 50, 0)
r(f, 10)                             # small: fills the buffer
r(f, 700 << 10)                      # large: buffer first, then the rest
trace.append(("ungetc", libc.ungetc(0x41, f), libc.ftell(f)))
r(f, 200 << 10)                      # the pushed-back byte, then the file
libc.fseek(f, -1000, 2)
r(f, 512 << 10)                      # short at the end of file: feof
r(f, 128 << 10)                      # sticky end of file
libc.clearerr(f)
libc.fseek(f, 3000, 0)
w(f, data(5, 400 << 10))             # overwrite in the middle
libc.fseek(f, 0, 1)
r(f, 300 << 10, size=4096)           # items, from where the write ended
libc.fseek(f, (1 << 20) + 500, 0)
trace.append(("getc", libc.fgetc(f), libc.ftell(f)))
w(f, data(6, 200 << 10))             # after a read, no seek: glibc allows it
trace.append(("close", libc.fclose(f)))
f = libc.fopen(path.encode(), b"ab")
w(f, data(7, 300 << 10))             # append mode: the end of file, through the mount
trace.append(("close", libc.fclose(f)))
f = libc.fopen(path.encode(), b"rb")
r(f, 4 << 20)                        # the whole file, short
trace.append(("close", libc.fclose(f)))
f = libc.fopen(path.encode(), b"rb")  # and in large items after a partial small read
r(f, 7)
r(f, 1 << 20, size=1000)
trace.append(("close", libc.fclose(f)))
print(json.dumps(trace))
"""


class StdioTest(PreloadBase):
    """fread/fwrite of large blocks go to the engine with the FILE's buffer honoured; numpy's
    np.save/np.load (tofile/fromfile through fdopen) are such programs."""

    def test_stream_matches_a_plain_file(self):
        plain = os.path.join(self.scratch.path, "stdio-plain.bin")
        want = subprocess.run([PY, "-c", STDIO, plain], capture_output=True, text=True,
                              timeout=120, check=True).stdout
        got = self.run_cmd([PY, "-c", STDIO, self.m("stdio.bin")]).stdout
        self.assertEqual(json.loads(got), json.loads(want))
        self.assertEqual(slurp(self.m("stdio.bin")), slurp(plain))
        self.assertEqual(slurp(self.b("stdio.bin")), slurp(plain))
        t = self.total()
        self.assertEqual(t["errors"], 0, t)
        # The large fwrite and fread calls, not the appends, went to the engine.
        self.assertGreaterEqual(t["bytes_written"], (1 << 20) + 333 + (956 << 10), t)
        self.assertGreaterEqual(t["bytes_read"], 2 << 20, t)

    def test_numpy_save_and_load(self):
        code = r"""
import numpy as np, sys
a = np.random.default_rng(7).standard_normal(12 << 20, dtype=np.float32)  # 48 MiB
np.save(sys.argv[1], a)
b = np.load(sys.argv[1])
assert b.dtype == a.dtype and b.shape == a.shape and np.array_equal(a, b)
with open(sys.argv[1], "rb") as f:  # np.fromfile from a Python file object, past a header
    f.seek(128)
    c = np.fromfile(f, dtype=np.float32, count=a.size)
    assert np.array_equal(a, c)
"""
        plain = os.path.join(self.scratch.path, "np-plain.npy")
        subprocess.run([PY, "-c", code, plain], check=True, timeout=120)
        self.run_cmd([PY, "-c", code, self.m("a.npy")])
        self.assertEqual(slurp(self.b("a.npy")), slurp(plain))
        t = self.total()
        self.assertEqual(t["errors"], 0, t)
        self.assertGreaterEqual(t["bytes_written"], 48 * MiB, t)
        # Both loads, but for what glibc's fseek read into the FILE's buffer (a block each).
        self.assertGreaterEqual(t["bytes_read"], 2 * 48 * MiB - 64 * KiB, t)


class DescriptorTest(PreloadBase):
    def test_fcntl_dup_shares_the_file_and_o_append_leaves_the_engine(self):
        code = r"""
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o644)
fd2 = os.dup(fd)  # F_DUPFD_CLOEXEC
assert os.write(fd, b"a" * (4 << 20)) == 4 << 20
assert os.write(fd2, b"b" * (4 << 20)) == 4 << 20  # the shared offset: after the first
fcntl.fcntl(fd2, fcntl.F_SETFL, os.O_APPEND)
os.lseek(fd, 0, 0)
assert os.write(fd, b"c" * (1 << 20)) == 1 << 20  # O_APPEND: at the end, through the mount
assert os.lseek(fd, 0, 1) == 9 << 20
os.close(fd)
os.close(fd2)
"""
        self.run_cmd([PY, "-c", code, self.m("dup.bin")])
        t = self.total()
        self.assertEqual(t["adopted"], 1, t)  # one open file, one record
        self.assertEqual(t["bytes_written"], 8 * MiB, t)  # not the append
        self.assertEqual(slurp(self.b("dup.bin")), b"a" * (4 * MiB) + b"b" * (4 * MiB) + b"c" * MiB)

    def test_copy_and_sendfile_see_direct_writes(self):
        old, new = pattern(21, 4 * MiB), pattern(22, 4 * MiB)
        with open(self.b("cp.bin"), "wb") as f:
            f.write(old)
        out = os.path.join(self.scratch.path, "cp-out")
        code = r"""
import os, sys
src, out = sys.argv[1], sys.argv[2]
fd = os.open(src, os.O_RDWR)
while os.read(fd, 32 << 10):  # small reads: the mount's, into the kernel's cache
    pass
new = open(sys.argv[3], "rb").read()
assert os.pwrite(fd, new, 0) == len(new)  # direct, not yet announced
o = os.open(out + ".sendfile", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
assert os.sendfile(o, fd, 0, len(new)) == len(new)
os.close(o)
assert os.pwrite(fd, new[::-1], 0) == len(new)
o = os.open(sys.argv[4], os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
n = 0
while n < len(new):
    got = os.copy_file_range(fd, o, len(new) - n, n, n)
    assert got > 0
    n += got
os.close(o)
os.close(fd)
"""
        newfile = os.path.join(self.scratch.path, "cp-new")
        with open(newfile, "wb") as f:
            f.write(new)
        # copy_file_range stays on one file system: its copy is on the mount too.
        self.run_cmd([PY, "-c", code, self.m("cp.bin"), out, newfile, self.m("cp.cfr")])
        self.assertEqual(slurp(out + ".sendfile"), new)
        self.assertEqual(slurp(self.m("cp.cfr")), new[::-1])
        self.assertEqual(slurp(self.b("cp.cfr")), new[::-1])
        self.assertGreaterEqual(self.total()["bytes_written"], 8 * MiB, self.total())


class TorchHookTest(PreloadBase):
    """`dnvme run` puts deepnvme's sitecustomize on PYTHONPATH: a Python program's torch.save of
    a file on the mount writes through deepnvme.torchzip.MountZipWriter (deepnvme/run_hook.py),
    and everything else stays torch's. The files are read back by plain torch.load, outside
    `dnvme run`."""

    @classmethod
    def setUpClass(cls):
        if not have_torch():
            raise unittest.SkipTest("torch is not importable by %s" % PY)
        super().setUpClass()

    PROGRAM = r"""
import io, json, pathlib, sys, torch
torch.manual_seed(0)
state = {"w": torch.randn(3 << 20), "i": torch.arange(1 << 20),
         "small": [torch.ones(7) * k for k in range(50)], "meta": {"step": 3, "name": "x"}}
on, on2, off, legacy = sys.argv[1:5]
torch.save(state, on)                                   # on the mount: deepnvme
torch.save(state, pathlib.Path(on2))                    # a PathLike on the mount: deepnvme
torch.save(state, off)                                  # elsewhere: torch's own
buf = io.BytesIO(); torch.save(state, buf)              # a file object: torch's own
torch.save(state, legacy, _use_new_zipfile_serialization=False)  # legacy format: torch's own
try:
    torch.save(state)                                   # torch's own error, not ours
except TypeError as e:
    print("TypeError", e, file=sys.stderr)
else:
    raise SystemExit("no TypeError")
hooked = getattr(torch.save, "__dnvme_hook__", False)
counters = sys.modules["deepnvme.run_hook"].counters if hooked else {}
print(json.dumps({"hooked": hooked, "counters": counters,
                  "same": torch.save is torch.serialization.save}))
"""

    def run_program(self, *extra):
        files = [self.m("on.pt"), self.m("on2.pt"), os.path.join(self.scratch.path, "off.pt"),
                 self.m("legacy.pt")]
        cmd = [dnvme_bin(), "run", "--stats", self.stats, "--mount", self.mnt] + list(extra) + \
            ["--", PY, "-c", self.PROGRAM] + files
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        # Every file loads in a plain process and holds the state.
        check = ("import sys, torch\ntorch.manual_seed(0)\n"
                 "w = torch.randn(3 << 20)\n"
                 "for f in sys.argv[1:]:\n"
                 "    s = torch.load(f)\n"
                 "    assert torch.equal(s['w'], w) and torch.equal(s['i'], torch.arange(1 << 20)), f\n"
                 "    assert [float(t[0]) for t in s['small']] == list(range(50)), f\n"
                 "    assert s['meta'] == {'step': 3, 'name': 'x'}, f\n")
        subprocess.run([PY, "-c", check] + files, check=True, timeout=180)
        return json.loads(p.stdout.strip().splitlines()[-1])

    def test_torch_save_on_the_mount_goes_through_deepnvme(self):
        out = self.run_program()
        self.assertTrue(out["hooked"], out)
        self.assertTrue(out["same"], out)
        # Two saves on the mount; the other three calls (and the bad one) went to torch.
        self.assertEqual(out["counters"], {"saves": 2, "fallbacks": 4}, out)
        t = self.total()
        # Both archives' large records went to the engine (20 MiB of tensors each).
        self.assertGreaterEqual(t["bytes_written"], 2 * 20 * MiB, t)
        self.assertEqual(t["errors"], 0, t)

    def test_no_torch_hook_leaves_torch_alone(self):
        out = self.run_program("--no-torch-hook")
        self.assertFalse(out["hooked"], out)

    def test_other_programs_and_sitecustomize_are_untouched(self):
        # A program that never imports torch loads neither torch nor deepnvme, and a
        # sitecustomize of its own further along PYTHONPATH still runs.
        own = os.path.join(self.scratch.path, "own-site")
        os.makedirs(own, exist_ok=True)
        with open(os.path.join(own, "sitecustomize.py"), "w") as f:
            f.write("import builtins\nbuiltins.OWN_SITE = True\n")
        env = dict(os.environ, PYTHONPATH=own)
        p = self.run_cmd([PY, "-c", "import builtins, sys\n"
                          "print(getattr(builtins, 'OWN_SITE', False), 'torch' in sys.modules, "
                          "'deepnvme' in sys.modules)"], env=env)
        self.assertEqual(p.stdout.split(), ["True", "False", "False"], p.stdout + p.stderr)
        # And torch, once imported, is patched all the same -- also after a probe for it
        # (transformers and accelerate call find_spec before they import).
        p = self.run_cmd([PY, "-c", "import builtins, importlib.util\n"
                          "assert importlib.util.find_spec('torch') is not None\n"
                          "import torch\n"
                          "print(getattr(builtins, 'OWN_SITE', False), "
                          "getattr(torch.save, '__dnvme_hook__', False))"], env=env)
        self.assertEqual(p.stdout.split(), ["True", "True"], p.stdout + p.stderr)
        # A sitecustomize that fails still fails as Python reports it, after ours.
        with open(os.path.join(own, "sitecustomize.py"), "w") as f:
            f.write("import no_such_module_here\n")
        p = self.run_cmd([PY, "-c", "print('ran')"], env=env)
        self.assertEqual(p.stdout.strip(), "ran", p.stdout + p.stderr)
        self.assertIn("no_such_module_here", p.stderr)


class PreloadOffTest(PreloadBase):
    MOUNT_OPTIONS = ("preload=0",)

    def test_no_broker(self):
        self.assertEqual(slurp(self.m(".dnvme", "broker")), b"")
        p = self.run_cmd(["true"], check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("preload=0", p.stderr)
        # Without --mount the program runs, all through the mount.
        self.run_cmd(["dd", "if=/dev/zero", "of=" + self.m("z.bin"), "bs=1M", "count=4",
                      "status=none"], mount=False)
        t = self.total()
        self.assertEqual(t["adopted"], 0, t)
        self.assertEqual(os.path.getsize(self.b("z.bin")), 4 * MiB)


# -------------------------------------------------------------------------------------------------
WRITER = r"""
import os, random, sys
p = sys.argv[1]
data = random.Random(7).randbytes(8 << 20)
fd = os.open(p, os.O_CREAT | os.O_WRONLY, 0o644)
off, rng = 0, random.Random(3)
try:
    while True:
        n = rng.randint(64 << 10, 2 << 20)
        start = off % len(data)
        piece = (data[start:] + data)[:n]
        os.pwrite(fd, piece, off)
        off += n
        if rng.random() < 0.3:
            os.fsync(fd)
            print("acked", off, flush=True)
except OSError as e:
    print("stopped", e.errno, flush=True)
"""


def expected(n):
    data = pattern(7, 8 * MiB)
    out = bytearray()
    while len(out) < n:
        out += data
    return bytes(out[:n])


class PreloadCrashTest(unittest.TestCase):
    """kill -9 of a preloaded writer, and of the daemon under one: no fsync-acknowledged byte is
    lost (the bytes went to the backing file directly; fsync through the mount made them
    durable), and with the daemon gone the writer's next fsync fails instead of succeeding."""

    def setUp(self):
        reason = preload_skip_reason()
        if reason:
            self.skipTest(reason)
        self.scratch = mh.Scratch(type(self).__name__)
        self.addCleanup(self.scratch.cleanup)
        self.mount = mh.Mount(self.scratch.backing, self.scratch.mnt)
        self.addCleanup(self.mount.stop)
        self.mount.start()

    def start_writer(self, name):
        stats = os.path.join(self.scratch.path, "stats.jsonl")
        w = subprocess.Popen([dnvme_bin(), "run", "--stats", stats, "--", PY, "-c", WRITER,
                              os.path.join(self.scratch.mnt, name)],
                             stdout=subprocess.PIPE, text=True)
        self.addCleanup(lambda: w.poll() is None and w.kill())
        return w

    def wait_acks(self, w, count):
        acked = 0
        for _ in range(count):
            line = w.stdout.readline().split()
            self.assertEqual(line[0], "acked", line)
            acked = int(line[1])
        return acked

    def test_kill9_of_the_client(self):
        w = self.start_writer("c.bin")
        acked = self.wait_acks(w, 6)
        w.send_signal(signal.SIGKILL)
        w.wait(30)
        for root in (self.scratch.mnt, self.scratch.backing):
            with open(os.path.join(root, "c.bin"), "rb") as f:
                got = f.read(acked)
            self.assertEqual(got, expected(acked), "lost acknowledged bytes under %s" % root)
        self.assertGreaterEqual(os.path.getsize(os.path.join(self.scratch.mnt, "c.bin")), acked)
        self.assertTrue(self.mount.alive())

    def test_kill9_of_the_daemon(self):
        w = self.start_writer("d.bin")
        acked = self.wait_acks(w, 6)
        self.mount.kill9()
        # The writer goes on until its next fsync through the dead mount fails.
        last = None
        for line in w.stdout:
            last = line.split()
            if last[0] == "acked":
                acked = int(last[1])  # the fsync covered the backing file before the kill
            else:
                break
        w.wait(60)
        self.assertIsNotNone(last)
        self.assertEqual(last[0], "stopped", last)
        self.assertIn(int(last[1]), (errno.ENOTCONN, errno.ECONNABORTED, errno.EIO), last)
        with open(os.path.join(self.scratch.backing, "d.bin"), "rb") as f:
            got = f.read(acked)
        self.assertEqual(got, expected(acked), "lost acknowledged bytes")


# Writes 2 MiB, then argv[2] MiB more in one write(), on a file system too small for the second,
# then 1 MiB writes until one fails (what was left after the page-rounded second: a few file
# system blocks); prints what the second returned (or its error), the failure, the free bytes
# before the second and what the 1 MiB writes returned.
NO_SPACE_TAIL = r"""
import os, sys
fd = os.open(sys.argv[1], os.O_CREAT | os.O_WRONLY, 0o644)
assert os.write(fd, b"a" * (2 << 20)) == 2 << 20
before = os.statvfs(sys.argv[1]).f_bavail * os.statvfs(sys.argv[1]).f_frsize
try:
    second = "returned %d" % os.write(fd, b"b" * (int(sys.argv[2]) << 20))
except OSError as e:
    second = "error %d" % e.errno
extra, third = 0, "none"
for _ in range(8):
    try:
        extra += os.write(fd, b"c" * (1 << 20))
    except OSError as e:
        third = "error %d" % e.errno
        break
print(second, third, before, extra, flush=True)
os.close(fd)
"""


class PreloadNoSpaceTest(unittest.TestCase):
    """ENOSPC from the backing file reaches the preloaded writer at the call, and the mount
    keeps serving. BACKING_DIR is an 8 MiB tmpfs."""

    def small_fs(self, where):
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", where], check=True)
        self.addCleanup(subprocess.run, ["umount", "-l", where])

    def setUp(self):
        reason = preload_skip_reason() or mh.skip_reason(need_root=True)
        if reason:
            self.skipTest(reason)
        self.scratch = mh.Scratch(type(self).__name__)
        self.addCleanup(self.scratch.cleanup)
        self.small_fs(self.scratch.backing)
        self.mount = mh.Mount(self.scratch.backing, self.scratch.mnt)
        self.addCleanup(self.mount.stop)
        self.mount.start()

    def test_enospc_at_the_write_leaves_no_zero_tail(self):
        # As on the file system itself: the write that does not fit returns the part that fits
        # (its space reserved before the file is extended, datapath/space.h), the next one fails
        # with ENOSPC, and the file holds exactly what the writes returned. Issue 34's main
        # extended the file first (ftruncate), the write returned, and the space ran out under
        # the write-behind: a zero-filled tail and the error at close; 030fd42 refused the whole
        # write.
        p = os.path.join(self.scratch.mnt, "tail")
        r = subprocess.run([dnvme_bin(), "run", "--", PY, "-c", NO_SPACE_TAIL, p, "64"],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        out = r.stdout.split()
        self.assertEqual(out[0], "returned", r.stdout + r.stderr)
        got, before, extra = int(out[1]), int(out[4]), int(out[5])
        self.assertLessEqual(got, before, r.stdout)
        self.assertGreaterEqual(got, before - 64 * KiB, "the part that fit: %s" % r.stdout)
        self.assertEqual(out[2:4], ["error", str(errno.ENOSPC)], r.stdout + r.stderr)
        self.assertLess(extra, 64 * KiB, r.stdout)
        for path in (p, os.path.join(self.scratch.backing, "tail")):
            self.assertEqual(os.stat(path).st_size, 2 * MiB + got + extra, path)
            self.assertEqual(slurp(path), b"a" * (2 * MiB) + b"b" * got + b"c" * extra, path)
        self.assertTrue(self.mount.alive())

    def test_enospc_at_the_write(self):
        p = subprocess.run([dnvme_bin(), "run", "--", "dd", "if=/dev/zero",
                            "of=" + os.path.join(self.scratch.mnt, "big"), "bs=1M", "count=32"],
                           capture_output=True, text=True, timeout=60)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("No space left on device", p.stderr)
        self.assertTrue(self.mount.alive())
        os.unlink(os.path.join(self.scratch.mnt, "big"))
        # The kernel sends dd's RELEASE asynchronously (FUSE releases every file that way but on
        # fuseblk), so the daemon may still hold the unlinked file, and its space, a moment after
        # dd exited: wait (bounded) until the space is back, then the mount must serve a write.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            st = os.statvfs(self.scratch.backing)
            if st.f_bavail * st.f_frsize >= MiB:
                break
            time.sleep(0.05)
        with open(os.path.join(self.scratch.mnt, "small"), "wb") as f:
            f.write(b"ok")

    def test_enospc_at_torch_save(self):
        if not have_torch():
            self.skipTest("torch is not importable by %s" % PY)
        code = ("import errno, sys, torch\n"
                "try:\n"
                "    torch.save({'x': torch.zeros(8 << 20)}, sys.argv[1])\n"
                "except OSError as e:\n"
                "    assert e.errno == errno.ENOSPC, e\n"
                "    print('ENOSPC')\n"
                "assert getattr(torch.save, '__dnvme_hook__', False)\n")
        p = subprocess.run([dnvme_bin(), "run", "--", PY, "-c", code,
                            os.path.join(self.scratch.mnt, "ck.pt")],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertEqual(p.stdout.strip(), "ENOSPC", p.stdout + p.stderr)
        self.assertTrue(self.mount.alive())

    def test_enospc_at_fwrite_or_fclose(self):
        code = r"""
import ctypes, errno, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.fopen.restype = ctypes.c_void_p
libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
libc.fwrite.restype = ctypes.c_size_t
libc.fwrite.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
f = libc.fopen(sys.argv[1].encode(), b"wb")
buf = ctypes.create_string_buffer(b"z" * (1 << 20))
failed = []
for i in range(32):
    if libc.fwrite(buf, 1, 1 << 20, f) != 1 << 20:
        failed.append(("fwrite", i, ctypes.get_errno()))
        break
if libc.fclose(f) != 0:
    failed.append(("fclose", ctypes.get_errno()))
print(failed)
assert failed and failed[0][-1] == errno.ENOSPC, failed
"""
        p = subprocess.run([dnvme_bin(), "run", "--", PY, "-c", code,
                            os.path.join(self.scratch.mnt, "big")],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertTrue(self.mount.alive())


class PreloadNoSpaceExt4Test(PreloadNoSpaceTest):
    """The same on a 24 MiB ext4 (a loop device): ext4's fallocate keeps what it allocated before
    it ran out, and its O_DIRECT writes into reserved (unwritten) extents are ext4's own path."""

    def small_fs(self, where):
        if shutil.which("mkfs.ext4") is None:
            self.skipTest("mkfs.ext4 is not installed")
        image = os.path.join(self.scratch.path, "ext4.img")
        with open(image, "wb") as f:
            f.truncate(24 * MiB)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", image], check=True)
        r = subprocess.run(["mount", "-o", "loop", image, where], capture_output=True, text=True)
        if r.returncode != 0:
            self.skipTest("cannot mount a loop device: %s" % r.stderr.strip())
        self.addCleanup(subprocess.run, ["umount", "-l", where])


if __name__ == "__main__":
    unittest.main(verbosity=2)
