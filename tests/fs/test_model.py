"""Randomized model test: the same random operations on a dnvmefs mount and on a plain directory
(the oracle: the kernel's own filesystem), compared byte for byte after every read, at checkpoints
(all files through fresh fds, BACKING_DIR after fsync) and at the end.

  DNVME_SEED=N           replay a run (the seed is printed at the start and in every failure)
  DNVME_MODEL_SECONDS=S  time budget of the main run (default 35; the small-buffer run gets 0.6x)
  DNVME_MODEL_OPS=N      cap on operations per run (default 20000)
  DNVME_HISTORY=N        how many of the last operations a failure lists (default 40; a large N
                         lists the whole run, to follow one file back to its creation)

Run: /usr/bin/python3 -m unittest -v tests.fs.test_model
"""

import collections
import ctypes
import ctypes.util
import hashlib
import json
import mmap
import os
import random
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mount_harness as mh  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE = 0x01, 0x02, 0x10


def fallocate(fd, mode, off, n):
    if _libc.fallocate(fd, mode, off, n) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
NAMES = ["f%d" % i for i in range(6)] + ["d/g%d" % i for i in range(2)]
MAX_HANDLES = 6
ALIGN = 4096

# The second process: one fd on the mount at a time, driven over stdin/stdout (JSON lines).
CHILD = r"""
import ctypes, hashlib, json, os, random, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.fdopen.restype = ctypes.c_void_p
libc.fdopen.argtypes = [ctypes.c_int, ctypes.c_char_p]
libc.fseek.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_int]
libc.fclose.argtypes = [ctypes.c_void_p]
for name in ("fread", "fwrite"):
    getattr(libc, name).restype = ctypes.c_size_t
    getattr(libc, name).argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                                    ctypes.c_void_p]
def stdio(off, data=None, n=0):
    # fread/fwrite on a FILE of a duplicate, as numpy's tofile/fromfile do.
    f = libc.fdopen(os.dup(fd), b"r+b")
    if not f or libc.fseek(f, off, 0) != 0:
        raise OSError(ctypes.get_errno(), "fdopen/fseek")
    if data is not None:
        buf = ctypes.create_string_buffer(data, len(data))
        got = libc.fwrite(buf, 1, len(data), f)
    else:
        buf = ctypes.create_string_buffer(n)
        got = libc.fread(buf, 1, n, f)
    e = ctypes.get_errno()
    if libc.fclose(f) != 0 or (data is not None and got != len(data)):
        raise OSError(ctypes.get_errno() or e, "fwrite/fclose")
    return got if data is not None else buf.raw[:got]
fd = None
for line in sys.stdin:
    c = json.loads(line)
    try:
        op = c["op"]
        if op == "open":
            if fd is not None:
                os.close(fd)
            fd = os.open(c["path"], os.O_RDWR | os.O_CREAT, 0o644)
            r = {"ok": 1}
        elif op == "pwrite":
            data = random.Random(c["seed"]).randbytes(c["n"])
            # The same bytes by pwrite, lseek + write, writev of two pieces or fwrite (what the
            # preload library intercepts, docs/preload.md); the reference always uses pwrite.
            how = c["seed"] % 4
            if how == 3:
                r = {"ok": stdio(c["off"], data=data)}
            elif how == 0:
                r = {"ok": os.pwrite(fd, data, c["off"])}
            else:
                os.lseek(fd, c["off"], os.SEEK_SET)
                if how == 1:
                    r = {"ok": os.write(fd, data)}
                else:
                    h = len(data) // 3
                    r = {"ok": os.writev(fd, [data[:h], data[h:]])}
        elif op == "pread":
            if c["n"] % 3 == 0:
                d = stdio(c["off"], n=c["n"])
            elif c["off"] % 2 == 0:
                d = os.pread(fd, c["n"], c["off"])
            else:
                os.lseek(fd, c["off"], os.SEEK_SET)
                d = os.read(fd, c["n"])
            r = {"ok": len(d), "sha": hashlib.sha256(d).hexdigest()}
        elif op == "ftruncate":
            os.ftruncate(fd, c["n"])
            r = {"ok": 1}
        elif op == "fsync":
            os.fsync(fd)
            r = {"ok": 1}
        elif op == "close":
            if fd is not None:
                os.close(fd)
            fd = None
            r = {"ok": 1}
        else:
            r = {"err": -1}
    except OSError as e:
        r = {"err": e.errno}
    sys.stdout.write(json.dumps(r) + "\n")
    sys.stdout.flush()
"""


class Handle:
    def __init__(self, name, flags, mfd, rfd):
        self.name, self.flags, self.mfd, self.rfd = name, flags, mfd, rfd
        self.direct = bool(flags & os.O_DIRECT)
        self.append = bool(flags & os.O_APPEND)
        self.writable = (flags & os.O_ACCMODE) != os.O_RDONLY


class ModelRun:
    def __init__(self, tc, mnt, ref, backing, seed, seconds, max_ops):
        self.tc, self.mnt, self.ref, self.backing = tc, mnt, ref, backing
        self.seed, self.seconds, self.max_ops = seed, seconds, max_ops
        self.rng = random.Random(seed)
        self.handles = []
        self.history = collections.deque(maxlen=int(os.environ.get("DNVME_HISTORY", "40")))
        self.nops = 0
        self.counts = collections.Counter()
        self.child = None
        self.child_name = None
        self.child_rfd = None
        self.dbuf = mmap.mmap(-1, 4 * MiB + ALIGN)  # page-aligned for O_DIRECT
        self.rbuf = mmap.mmap(-1, 4 * MiB + ALIGN)

    # --- reporting -------------------------------------------------------------------------------
    def fail(self, msg):
        self.tc.fail("%s\n  seed=%d (replay: DNVME_SEED=%d), op #%d\n  last ops:\n    %s" %
                     (msg, self.seed, self.seed, self.nops, "\n    ".join(self.history)))

    def note(self, s):
        self.history.append("#%d %s" % (self.nops, s))

    def same_outcome(self, what, fm, fr):
        """Runs fm() (mount) and fr() (ref); both must succeed or fail with the same errno."""
        rm = rr = em = er = None
        try:
            rm = fm()
        except OSError as e:
            em = e.errno
        try:
            rr = fr()
        except OSError as e:
            er = e.errno
        if em is not None:
            self.counts["errno " + mh.errno_name(em)] += 1
        if em != er:
            self.fail("%s: mount %s, reference %s" % (
                what, "errno %s" % mh.errno_name(em) if em else "succeeded (%r)" % (rm,),
                "errno %s" % mh.errno_name(er) if er else "succeeded (%r)" % (rr,)))
        return rm, rr, em

    def mp(self, name):
        return os.path.join(self.mnt, name)

    def rp(self, name):
        return os.path.join(self.ref, name)

    # --- size choices ----------------------------------------------------------------------------
    def rand_size(self):
        r = self.rng.random()
        if r < 0.35:
            return self.rng.randint(1, 300)
        if r < 0.75:
            return self.rng.randint(1, 64 * KiB)
        if r < 0.95:
            return self.rng.randint(64 * KiB, MiB + 4097)
        return self.rng.randint(MiB, 4 * MiB)

    def rand_off(self, size_hint):
        r = self.rng.random()
        if size_hint > 48 * MiB and r >= 0.8:  # keep files (and the comparisons) bounded
            return self.rng.randint(0, size_hint)
        if r < 0.1:
            return 0
        if r < 0.8:
            return self.rng.randint(0, max(0, size_hint + 4 * KiB))
        if r < 0.95:
            return self.rng.randint(0, size_hint + 2 * MiB)
        return size_hint + self.rng.randint(4 * MiB, 24 * MiB)  # a hole

    def ref_size(self, name):
        try:
            return os.stat(self.rp(name)).st_size
        except FileNotFoundError:
            return 0

    # --- operations ------------------------------------------------------------------------------
    def op_open(self):
        if len(self.handles) >= MAX_HANDLES:
            return self.op_close()
        name = self.rng.choice(NAMES)
        kind = self.rng.random()
        if kind < 0.2:
            flags = os.O_RDWR | os.O_DIRECT
        elif kind < 0.35:
            flags = os.O_RDWR | os.O_APPEND
        elif kind < 0.4:
            flags = os.O_RDONLY | os.O_DIRECT  # passthrough under the default policy
        elif kind < 0.45:
            flags = os.O_RDONLY
        elif kind < 0.55:
            flags = os.O_WRONLY
        else:
            flags = os.O_RDWR
        if self.rng.random() < 0.7:
            flags |= os.O_CREAT
        if flags & os.O_ACCMODE != os.O_RDONLY and self.rng.random() < 0.05:
            flags |= os.O_TRUNC
        self.note("open %s flags=%#o" % (name, flags))
        mfd, rfd, err = self.same_outcome(
            "open(%s, %#o)" % (name, flags), lambda: os.open(self.mp(name), flags, 0o644),
            lambda: os.open(self.rp(name), flags & ~os.O_DIRECT, 0o644))
        if err is None:
            self.handles.append(Handle(name, flags, mfd, rfd))

    def op_close(self):
        if not self.handles:
            return self.op_open()
        h = self.handles.pop(self.rng.randrange(len(self.handles)))
        self.note("close %s" % h.name)
        self.same_outcome("close(%s)" % h.name, lambda: os.close(h.mfd), lambda: os.close(h.rfd))

    def pick(self, writable=None):
        hs = [h for h in self.handles if writable is None or h.writable == writable]
        return self.rng.choice(hs) if hs else None

    def op_write(self):
        h = self.pick(writable=True)
        if h is None:
            return self.op_open()
        size_now = os.fstat(h.rfd).st_size
        if h.direct:
            n = self.rng.randint(1, 1024) * ALIGN if self.rng.random() < 0.9 else \
                self.rng.randint(1, 8) * ALIGN
            off = (self.rand_off(size_now) // ALIGN) * ALIGN
            seed = self.rng.getrandbits(32)
            data = random.Random(seed).randbytes(n)
            self.dbuf[0:n] = data
            self.note("write(direct) %s off=%d n=%d" % (h.name, off, n))
            wm, wr, _ = self.same_outcome(
                "O_DIRECT pwrite %s off=%d n=%d" % (h.name, off, n),
                lambda: os.pwritev(h.mfd, [memoryview(self.dbuf)[:n]], off),
                lambda: os.pwrite(h.rfd, data, off))
        else:
            n = self.rand_size()
            off = self.rand_off(size_now)
            data = self.rng.randbytes(n)
            if h.append:
                self.note("write(append) %s n=%d" % (h.name, n))
                wm, wr, _ = self.same_outcome("append write %s n=%d" % (h.name, n),
                                              lambda: os.write(h.mfd, data),
                                              lambda: os.write(h.rfd, data))
            else:
                self.note("pwrite %s off=%d n=%d" % (h.name, off, n))
                wm, wr, _ = self.same_outcome("pwrite %s off=%d n=%d" % (h.name, off, n),
                                              lambda: os.pwrite(h.mfd, data, off),
                                              lambda: os.pwrite(h.rfd, data, off))
        if wm != wr:
            self.fail("write on %s returned %r on the mount, %r on the reference" %
                      (h.name, wm, wr))

    def op_read(self):
        h = self.pick()
        if h is None:
            return self.op_open()
        if h.flags & os.O_ACCMODE == os.O_WRONLY:
            self.note("read on O_WRONLY %s" % h.name)
            self.same_outcome("read on O_WRONLY", lambda: os.pread(h.mfd, 10, 0),
                              lambda: os.pread(h.rfd, 10, 0))
            return
        size_now = os.fstat(h.rfd).st_size
        if h.direct:
            n = self.rng.randint(1, 1024) * ALIGN
            off = (self.rng.randint(0, size_now + 8 * KiB) // ALIGN) * ALIGN
            self.note("read(direct) %s off=%d n=%d" % (h.name, off, n))
            got, want, err = self.same_outcome(
                "O_DIRECT pread %s off=%d n=%d" % (h.name, off, n),
                lambda: os.preadv(h.mfd, [memoryview(self.rbuf)[:n]], off),
                lambda: os.pread(h.rfd, n, off))
            if err is None:
                got = bytes(self.rbuf[:got])
        else:
            n = self.rand_size()
            off = self.rng.randint(0, size_now + 4 * KiB) if self.rng.random() < 0.9 else 0
            self.note("pread %s off=%d n=%d" % (h.name, off, n))
            got, want, err = self.same_outcome(
                "pread %s off=%d n=%d" % (h.name, off, n), lambda: os.pread(h.mfd, n, off),
                lambda: os.pread(h.rfd, n, off))
        if err is None and got != want:
            self.diff("pread %s off=%d n=%d" % (h.name, off, n), got, want, off)

    def diff(self, what, got, want, base=0):
        n = min(len(got), len(want))
        first = next((i for i in range(n) if got[i] != want[i]), n)
        self.fail("%s: data differs: got %d bytes, want %d; first difference at file offset %d "
                  "(got %r, want %r)" % (what, len(got), len(want), base + first,
                                         got[first:first + 12], want[first:first + 12]))

    def op_truncate(self):
        name = self.rng.choice(NAMES)
        size_now = self.ref_size(name)
        r = self.rng.random()
        new = 0 if r < 0.1 else self.rng.randint(0, size_now + 2 * MiB) if r < 0.9 else \
            self.rng.randint(0, size_now)
        h = self.pick(writable=True)
        if h is not None and self.rng.random() < 0.5:
            self.note("ftruncate %s %d" % (h.name, new))
            self.same_outcome("ftruncate %s %d" % (h.name, new), lambda: os.ftruncate(h.mfd, new),
                              lambda: os.ftruncate(h.rfd, new))
        else:
            self.note("truncate %s %d" % (name, new))
            self.same_outcome("truncate(%s, %d)" % (name, new),
                              lambda: os.truncate(self.mp(name), new),
                              lambda: os.truncate(self.rp(name), new))

    def op_fallocate(self):
        h = self.pick(writable=True)
        if h is None:
            return self.op_open()
        size_now = os.fstat(h.rfd).st_size
        mode = self.rng.choice([FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE,
                                FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE, 0])
        off = self.rng.randint(0, size_now + 64 * KiB)
        n = self.rng.randint(1, 3 * MiB)
        self.note("fallocate %s mode=%#x off=%d n=%d" % (h.name, mode, off, n))
        self.same_outcome("fallocate %s mode=%#x off=%d n=%d" % (h.name, mode, off, n),
                          lambda: fallocate(h.mfd, mode, off, n),
                          lambda: fallocate(h.rfd, mode, off, n))

    def op_copy(self):
        src, dst = self.pick(), self.pick(writable=True)
        if src is None or dst is None or src.direct or dst.direct:
            return self.op_write()
        ssize = os.fstat(src.rfd).st_size
        n = self.rand_size()
        soff = self.rng.randint(0, ssize + KiB)
        doff = self.rand_off(os.fstat(dst.rfd).st_size)
        if src.name == dst.name and abs(soff - doff) < n:
            doff = soff + n  # overlapping ranges of one file are EINVAL; keep them apart
        self.note("copy_file_range %s@%d -> %s@%d n=%d" % (src.name, soff, dst.name, doff, n))

        def copy(sfd, dfd):
            done = 0
            while done < n:
                c = os.copy_file_range(sfd, dfd, n - done, soff + done, doff + done)
                if c == 0:
                    break
                done += c
            return done

        cm, cr, _ = self.same_outcome("copy_file_range %s -> %s" % (src.name, dst.name),
                                      lambda: copy(src.mfd, dst.mfd),
                                      lambda: copy(src.rfd, dst.rfd))
        if cm != cr:
            self.fail("copy_file_range copied %r bytes on the mount, %r on the reference" %
                      (cm, cr))

    def op_rename(self):
        a, b = self.rng.choice(NAMES), self.rng.choice(NAMES)
        self.note("rename %s -> %s" % (a, b))
        self.same_outcome("rename %s -> %s" % (a, b), lambda: os.rename(self.mp(a), self.mp(b)),
                          lambda: os.rename(self.rp(a), self.rp(b)))

    def op_unlink(self):
        a = self.rng.choice(NAMES)
        self.note("unlink %s" % a)
        self.same_outcome("unlink %s" % a, lambda: os.unlink(self.mp(a)),
                          lambda: os.unlink(self.rp(a)))

    def op_fsync(self):
        h = self.pick(writable=True)
        if h is None:
            return
        self.note("fsync %s" % h.name)
        self.same_outcome("fsync %s" % h.name, lambda: os.fsync(h.mfd), lambda: os.fsync(h.rfd))

    def op_stat(self):
        name = self.rng.choice(NAMES)
        self.note("stat %s" % name)
        sm, sr, err = self.same_outcome("stat %s" % name, lambda: os.stat(self.mp(name)),
                                        lambda: os.stat(self.rp(name)))
        if err is None and sm.st_size != sr.st_size:
            self.fail("stat %s: size %d on the mount, %d on the reference" %
                      (name, sm.st_size, sr.st_size))
        h = self.pick()
        if h is not None:
            zm, zr = os.fstat(h.mfd).st_size, os.fstat(h.rfd).st_size
            if zm != zr:
                self.fail("fstat %s: size %d on the mount, %d on the reference" % (h.name, zm, zr))

    # --- the second process ----------------------------------------------------------------------
    def child_call(self, **cmd):
        self.child.stdin.write(json.dumps(cmd) + "\n")
        self.child.stdin.flush()
        line = self.child.stdout.readline()
        if not line:
            self.fail("second process died (rc %s) on %r" % (self.child.poll(), cmd))
        return json.loads(line)

    def op_child(self):
        if self.child is None:
            prefix = list(getattr(self.tc, "child_prefix", lambda: [])())
            self.child = subprocess.Popen(prefix + [sys.executable, "-c", CHILD],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        r = self.rng.random()
        if self.child_name is None or r < 0.1:
            name = self.rng.choice(NAMES)
            self.note("child open %s" % name)
            res = self.child_call(op="open", path=self.mp(name))
            try:
                rfd = os.open(self.rp(name), os.O_RDWR | os.O_CREAT, 0o644)
                rerr = None
            except OSError as e:
                rfd, rerr = None, e.errno
            if res.get("err") != rerr:
                self.fail("child open %s: mount %r, reference errno %s" % (name, res, rerr))
            if self.child_rfd is not None:
                os.close(self.child_rfd)
                self.child_rfd, self.child_name = None, None
            if rfd is not None:
                self.child_rfd, self.child_name = rfd, name
            return
        size_now = os.fstat(self.child_rfd).st_size
        if r < 0.55:
            n, off, seed = self.rand_size(), self.rand_off(size_now), self.rng.getrandbits(32)
            self.note("child pwrite %s off=%d n=%d" % (self.child_name, off, n))
            res = self.child_call(op="pwrite", off=off, n=n, seed=seed)
            want = os.pwrite(self.child_rfd, random.Random(seed).randbytes(n), off)
            if res.get("ok") != want:
                self.fail("child pwrite off=%d n=%d: mount %r, reference %d" % (off, n, res, want))
        elif r < 0.9:
            n, off = self.rand_size(), self.rng.randint(0, size_now + 4 * KiB)
            self.note("child pread %s off=%d n=%d" % (self.child_name, off, n))
            res = self.child_call(op="pread", off=off, n=n)
            want = os.pread(self.child_rfd, n, off)
            if res.get("ok") != len(want) or res.get("sha") != hashlib.sha256(want).hexdigest():
                got = os.pread(os.open(self.mp(self.child_name), os.O_RDONLY), n, off) \
                    if os.path.exists(self.mp(self.child_name)) else b"?"
                self.fail("child pread %s off=%d n=%d: mount gave %r bytes (sha %s), want %d "
                          "(parent re-read through the mount: %s)" %
                          (self.child_name, off, n, res.get("ok"), res.get("sha"), len(want),
                           "same as reference" if got == want else "differs too"))
        elif r < 0.97:
            new = self.rng.randint(0, size_now + MiB)
            self.note("child ftruncate %s %d" % (self.child_name, new))
            res = self.child_call(op="ftruncate", n=new)
            os.ftruncate(self.child_rfd, new)
            if "err" in res:
                self.fail("child ftruncate %d failed: %s" % (new, mh.errno_name(res["err"])))
        else:
            self.note("child fsync %s" % self.child_name)
            res = self.child_call(op="fsync")
            if "err" in res:
                self.fail("child fsync failed: %s" % mh.errno_name(res["err"]))

    # --- checks ----------------------------------------------------------------------------------
    def listing(self, root):
        out = set()
        for dp, dns, fns in os.walk(root):
            rel = os.path.relpath(dp, root)
            for n in fns + dns:
                out.add(os.path.normpath(os.path.join(rel, n)))
        return out

    def compare_tree(self, other, what):
        want = self.listing(self.ref)
        got = self.listing(other)
        if got != want:
            self.fail("%s: names differ: only there %s, missing %s" %
                      (what, sorted(got - want), sorted(want - got)))
        for name in sorted(want):
            rp = self.rp(name)
            if os.path.isdir(rp):
                continue
            with open(rp, "rb") as f:
                w = f.read()
            with open(os.path.join(other, name), "rb") as f:
                g = f.read()
            if g != w:
                self.diff("%s: file %s" % (what, name), g, w)

    def checkpoint(self, sync_backing):
        self.note("checkpoint (backing=%s)" % sync_backing)
        self.compare_tree(self.mnt, "checkpoint through the mount")
        if sync_backing:
            for h in self.handles:
                if h.writable:
                    os.fsync(h.mfd)
            if self.child is not None and self.child_name is not None:
                res = self.child_call(op="fsync")
                if "err" in res:
                    self.fail("child fsync failed: %s" % mh.errno_name(res["err"]))
            self.compare_tree(self.backing, "BACKING_DIR after fsync of every open handle")

    # --- main loop -------------------------------------------------------------------------------
    def run(self):
        os.makedirs(self.rp("d"))
        os.makedirs(self.mp("d"))
        ops = [(self.op_write, 30), (self.op_read, 28), (self.op_open, 8), (self.op_close, 7),
               (self.op_truncate, 5), (self.op_rename, 3), (self.op_unlink, 1),
               (self.op_fsync, 3), (self.op_stat, 6),
               (self.op_child, getattr(self.tc, "CHILD_WEIGHT", 9)),
               (self.op_fallocate, 2), (self.op_copy, 2)]
        fns = [f for f, _ in ops]
        weights = [w for _, w in ops]
        deadline = time.monotonic() + self.seconds
        try:
            while self.nops < self.max_ops and time.monotonic() < deadline:
                self.nops += 1
                fn = self.rng.choices(fns, weights)[0]
                self.counts[fn.__name__[3:]] += 1
                fn()
                if self.nops % 400 == 0:
                    self.checkpoint(sync_backing=(self.nops % 1200 == 0))
            self.checkpoint(sync_backing=True)
        finally:
            for h in self.handles:
                for fd in (h.mfd, h.rfd):
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            self.handles = []
            if self.child is not None:
                try:
                    self.child_call(op="close")
                except Exception:
                    pass
                self.child.stdin.close()
                self.child.wait(timeout=30)
                self.child.stdout.close()
            if self.child_rfd is not None:
                os.close(self.child_rfd)
        # Everything closed: the mount and BACKING_DIR must equal the reference.
        self.compare_tree(self.mnt, "end, through the mount")
        self.compare_tree(self.backing, "end, BACKING_DIR")
        mh.drop_caches()
        self.compare_tree(self.mnt, "end, through the mount after dropping caches")
        return self.nops


def seconds_budget():
    return float(os.environ.get("DNVME_MODEL_SECONDS", "35"))


class ModelTest(mh.MountedTestCase):
    MOUNT_OPTIONS = ()
    BUDGET_FACTOR = 1.0

    def test_random_ops_match_plain_directory(self):
        seed = int(os.environ["DNVME_SEED"]) if os.environ.get("DNVME_SEED") else \
            random.SystemRandom().getrandbits(32)
        sys.stderr.write("\n[%s] DNVME_SEED=%d options=%s\n" %
                         (type(self).__name__, seed, ",".join(self.MOUNT_OPTIONS) or "-"))
        ref = self.scratch.sub("ref")
        run = ModelRun(self, self.mnt, ref, self.backing, seed,
                       seconds_budget() * self.BUDGET_FACTOR,
                       int(os.environ.get("DNVME_MODEL_OPS", "20000")))
        nops = run.run()
        sys.stderr.write("[%s] seed %d: %d ops OK %s\n" %
                         (type(self).__name__, seed, nops, dict(run.counts)))
        self.assertGreater(nops, 100, "too few operations ran to mean anything")


class ModelSmallBuffersTest(ModelTest):
    """Small write-behind / read-ahead windows and small engine blocks: many flushes and
    partial-buffer edges. No passthrough: read-only opens are read by the daemon too."""
    MOUNT_OPTIONS = ("write_behind=512K", "write_chunk=128K", "read_ahead=64K", "block_size=64K",
                     "queue_depth=4", "intra_op_parallelism=2", "passthrough=off")
    BUDGET_FACTOR = 0.6


class ModelReadReceiveTest(ModelTest):
    """Page-cache writers (-o direct_io=off) with requests read(2) into the daemon instead of
    spliced (the mode of such a daemon that cannot size 2 MiB pipes): aligned write payloads are written from the buffers they were received in
    (fs/transport/request_buffer.h), nothing goes through the splice writer. Two loop threads only: no
    handler may wait for another request to be served. READ replies are spliced (-o
    splice_reply=1) here, written by writev in the other runs; no passthrough, so read-only opens
    are read by the daemon too."""
    MOUNT_OPTIONS = ("direct_io=off", "splice_read=0", "loop_threads=2", "splice_reply=1",
                     "passthrough=off")
    BUDGET_FACTOR = 0.5


class ModelPageCacheSpliceTest(ModelTest):
    """Writers through the kernel's page cache (-o direct_io=off), whose WRITEs the loop then
    splices: page references go from the request pipe to write-behind pipes and on to the disk
    with no copy in the daemon (datapath/splice_io.h). The main run gives every open for writing
    direct_io (the default) and reads requests."""
    MOUNT_OPTIONS = ("direct_io=off",)
    BUDGET_FACTOR = 0.5


class ModelWriteOnlyDirectTest(ModelTest):
    """direct_io for write-only opens only, spliced requests on: O_RDWR opens write through the
    page cache (spliced), O_WRONLY ones from the callers' pages, and the loop steers between
    splice and read(2) by the policy (SpliceSteering)."""
    MOUNT_OPTIONS = ("direct_io=wronly", "splice_read=1")
    BUDGET_FACTOR = 0.3


class ModelLibfuseTransportTest(ModelTest):
    """libfuse's own loop (clone_fd=1, the kLibfuse transport): its buffers, so payloads are
    copied, never adopted or spliced, and no write_flags reach the handlers."""
    MOUNT_OPTIONS = ("clone_fd=1",)
    BUDGET_FACTOR = 0.4


class ModelLargeRequestsTest(ModelTest):
    """Requests of up to 4 MiB (-o max_request=4M, the kernel's fs.fuse.max_pages_limit raised to
    1024 for the test and put back after): larger spliced and read(2) WRITEs, larger READs; the
    stats must show requests above 1 MiB, or the test is not testing them. Replies are spliced
    (-o splice_reply=1: 4 MiB replies need 8 MiB pipes). No passthrough: the READs must reach
    the daemon."""
    MOUNT_OPTIONS = ("max_request=4M", "splice_reply=1", "passthrough=off")
    BUDGET_FACTOR = 0.4
    LIMIT = "/proc/sys/fs/fuse/max_pages_limit"
    PIPE_MAX = "/proc/sys/fs/pipe-max-size"

    @classmethod
    def setUpClass(cls):
        cls.saved = {}
        for path, want in ((cls.LIMIT, 1024), (cls.PIPE_MAX, 8 << 20)):
            try:
                with open(path) as f:
                    cur = int(f.read())
                if cur < want:
                    with open(path, "w") as f:
                        f.write(str(want))
                    cls.saved[path] = cur
            except OSError as e:
                cls.restore()
                raise unittest.SkipTest("cannot raise %s to %d (%s): the kernel would clamp "
                                        "requests to 1 MiB" % (path, want, e))
        try:
            super().setUpClass()
        except BaseException:  # a skip or a failed mount: no tearDownClass follows
            cls.restore()
            raise

    @classmethod
    def restore(cls):
        for path, value in cls.saved.items():
            with open(path, "w") as f:
                f.write(str(value))
        cls.saved = {}

    @classmethod
    def tearDownClass(cls):
        try:
            super().tearDownClass()
        finally:
            cls.restore()

    def test_requests_above_one_mib_arrive(self):
        path = os.path.join(self.mnt, "large-requests.bin")
        data = os.urandom(16 << 20)
        with open(path, "wb") as f:  # one 16 MiB write(2): the kernel cuts it into 4 MiB requests
            f.write(data)
            os.fsync(f.fileno())
        with open(os.path.join(self.backing, "large-requests.bin"), "rb") as f:
            self.assertTrue(f.read() == data, "BACKING_DIR holds what was written")
        drop = "/proc/sys/vm/drop_caches"
        with open(drop, "w") as f:
            f.write("3\n")
        with open(path, "rb") as f:
            self.assertTrue(f.read() == data, "read back through the mount")
        with open(os.path.join(self.mnt, ".dnvme", "stats")) as f:
            stats = json.load(f)
        self.assertEqual(stats["mount"]["max_request"], 4 << 20)
        self.assertGreater(stats["fuse"]["largest_write"], 1 << 20)
        self.assertGreater(stats["fuse"]["largest_read"], 1 << 20)
        self.assertLessEqual(stats["fuse"]["largest_write"], 4 << 20)
        self.assertGreater(stats["fuse"]["replies_spliced"], 0, "no reply was spliced")


class ModelPassthroughDirectTest(ModelTest):
    """-o passthrough=direct (fs/fuse/passthrough.h): read-only O_DIRECT opens are served by the
    kernel from the backing file, every other open by the daemon (the default, `read`, is the
    main run); the daemon's write-behind and read-ahead must stay coherent across the
    switches."""
    MOUNT_OPTIONS = ("passthrough=direct",)
    BUDGET_FACTOR = 0.3  # two policies: together they add 0.6 of the main run to the suite

    def test_random_ops_match_plain_directory(self):
        reason = mh.passthrough_skip_reason(self.mnt)
        if reason:
            self.skipTest(reason)
        super().test_random_ops_match_plain_directory()
        self.assertGreater(mh.stats(self.mnt)["fuse"]["passthrough_opens"], 0,
                           "no open went passthrough: the policy was not exercised")


class ModelPassthroughAllTest(ModelPassthroughDirectTest):
    """-o passthrough=all: every open of an inode nobody else has open goes passthrough."""
    MOUNT_OPTIONS = ("passthrough=all",)


class ModelUringTest(ModelTest):
    """FUSE over io_uring (fs/transport/uring_loop.h): requests reach the daemon through ring
    entries, one queue per CPU; the module's enable_uring is switched on for the class and put
    back after."""
    MOUNT_OPTIONS = ("io_uring=1",)
    BUDGET_FACTOR = 0.3
    saved = None

    @classmethod
    def setUpClass(cls):
        cls.saved = mh.set_kernel_uring(True)
        try:
            super().setUpClass()
        except BaseException:
            mh.restore_kernel_uring(cls.saved)
            raise

    @classmethod
    def tearDownClass(cls):
        try:
            super().tearDownClass()
        finally:
            mh.restore_kernel_uring(cls.saved)

    def test_random_ops_match_plain_directory(self):
        super().test_random_ops_match_plain_directory()
        t = mh.stats(self.mnt)["transport"]
        self.assertEqual(t["kind"], "uring")
        self.assertGreater(t["requests_ring"], 1000, "the ring served few requests: %r" % t)
        self.assertEqual(t["ring_errors"], 0)


class ModelSynchronousTest(ModelTest):
    """No write-behind and no read-ahead: every write is written before its reply, straight from
    the request in memory at any alignment (the engine bounces what O_DIRECT cannot take); every
    read read by the engine on demand (no passthrough)."""
    MOUNT_OPTIONS = ("write_behind=0", "read_ahead=0", "splice_read=0", "passthrough=off")
    BUDGET_FACTOR = 0.4


class ModelPreloadTest(ModelTest):
    """The second process runs under `dnvme run` (libdnvme_preload.so, docs/preload.md): its
    transfers of 4 KiB and more go to the backing file through its own engine, by pwrite,
    write, writev, pread and read, while this process reads, writes, truncates, renames and
    copies the same files through the mount. The child's share of the operations is raised so the
    direct path carries real traffic; its counters must show it did."""
    CHILD_WEIGHT = 40
    MIN_BYTES = "4K"
    BUDGET_FACTOR = 0.6

    @classmethod
    def setUpClass(cls):
        if os.environ.get("DNVME_SANITIZED", "0") == "1":
            raise unittest.SkipTest("sanitizer build: a sanitized libdnvme_preload.so cannot be "
                                    "preloaded into an uninstrumented python3 (the release build "
                                    "runs this test)")
        super().setUpClass()

    def child_prefix(self):
        self.stats_file = os.path.join(self.scratch.path, "preload-stats.jsonl")
        dnvme = os.environ.get("DNVME_BIN") or os.path.join(os.path.dirname(mh.daemon_bin()),
                                                           "dnvme")
        return [dnvme, "run", "--mount", self.mnt, "--min-bytes", self.MIN_BYTES,
                "--stats", self.stats_file, "--"]

    def test_random_ops_match_plain_directory(self):
        super().test_random_ops_match_plain_directory()
        with open(self.stats_file) as f:
            lines = [json.loads(line) for line in f if line.strip()]
        self.assertTrue(lines, "the preloaded child wrote no counters")
        total = collections.Counter()
        for line in lines:
            total.update({k: v for k, v in line.items() if k != "pid"})
        sys.stderr.write("[%s] preloaded child: %s\n" % (type(self).__name__, dict(total)))
        self.assertGreater(total["adopted"], 0, "the child never adopted a file")
        self.assertGreater(total["bytes_written"], 0, "no direct write happened")
        self.assertGreater(total["bytes_read"], 0, "no direct read happened")
        self.assertEqual(total["errors"], 0)


class ModelPreloadEveryTransferTest(ModelPreloadTest):
    """As above with every child transfer direct (1 byte and up: unaligned heads and tails through
    the backing file's page cache), and no passthrough: this process's reads of the same files go
    through the daemon's read-ahead, which the child's writes must invalidate."""
    MIN_BYTES = "1"
    MOUNT_OPTIONS = ("passthrough=off",)
    BUDGET_FACTOR = 0.5


if __name__ == "__main__":
    unittest.main(verbosity=2)
