"""POSIX behaviour through a dnvmefs mount, checked against expectations and against BACKING_DIR.

Run: /usr/bin/python3 -m unittest -v tests.fs.test_posix   (from the repo root; root for chown)
"""

import ctypes
import ctypes.util
import errno
import fcntl
import hashlib
import mmap
import os
import random
import stat
import subprocess
import sys
import threading
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mount_harness as mh  # noqa: E402

MiB = 1 << 20
PY = sys.executable

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
SYS_renameat2 = {"x86_64": 316, "aarch64": 276}.get(os.uname().machine)
AT_FDCWD = -100
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2


def renameat2(old, new, flags):
    if SYS_renameat2 is None:
        raise unittest.SkipTest("renameat2 syscall number unknown for %s" % os.uname().machine)
    r = _libc.syscall(SYS_renameat2, AT_FDCWD, os.fsencode(old), AT_FDCWD, os.fsencode(new),
                      flags)
    if r != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), old)


def child(code, *args, timeout=60):
    """Runs `code` in a second Python process; returns (rc, stdout, stderr)."""
    r = subprocess.run([PY, "-c", code] + [str(a) for a in args], capture_output=True,
                       timeout=timeout)
    return r.returncode, r.stdout.decode(), r.stderr.decode()


def pattern(n, seed=0):
    """Deterministic, non-repeating-per-4K bytes."""
    block = hashlib.sha256(b"seed%d" % seed).digest() * 128  # 4096 bytes
    out = bytearray()
    i = 0
    while len(out) < n:
        out += hashlib.sha256(b"%d/%d" % (seed, i)).digest()[:8] + block[8:]
        i += 1
    return bytes(out[:n])



_libc.statx.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint,
                       ctypes.c_void_p]
STATX_MODE = 0x2


def statx_mode(path):
    """The mode statx reports when asked for the mode alone (struct statx: stx_mode at 28)."""
    buf = ctypes.create_string_buffer(256)
    if _libc.statx(AT_FDCWD, os.fsencode(path), 0, STATX_MODE, buf) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), path)
    return int.from_bytes(buf.raw[28:30], "little")


def run_threads(n, work):
    """Runs work(0) .. work(n-1) on n threads at once and waits for all of them."""
    ts = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()

class PosixTest(mh.MountedTestCase):

    # --- files -----------------------------------------------------------------------------------
    def test_create_write_read_close(self):
        data = pattern(3 * MiB + 123, 1)
        fd = os.open(self.m("f1"), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
        try:
            self.assertEqual(os.write(fd, data), len(data))
            # Size is visible before any flush (write-behind must not hide it).
            self.assertEqual(os.fstat(fd).st_size, len(data))
            self.assertEqual(os.stat(self.m("f1")).st_size, len(data))
            self.assertBytesEqual(os.pread(fd, len(data) + 10, 0), data, "pread same fd")
        finally:
            os.close(fd)
        with self.assertRaises(FileExistsError):
            os.open(self.m("f1"), os.O_CREAT | os.O_EXCL | os.O_RDWR)
        self.assertBytesEqual(self.read(self.m("f1")), data, "mount read")
        self.assertBytesEqual(self.read(self.b("f1")), data, "backing after close")
        self.assertEqual(stat.S_IMODE(os.stat(self.b("f1")).st_mode), 0o644 & ~self._umask())

    def _umask(self):
        u = os.umask(0)
        os.umask(u)
        return u

    def test_open_missing_and_trunc(self):
        with self.assertRaises(FileNotFoundError):
            open(self.m("nope"), "rb")
        self.write(self.m("t1"), b"x" * 10000)
        fd = os.open(self.m("t1"), os.O_WRONLY | os.O_TRUNC)
        os.close(fd)
        self.assertEqual(os.stat(self.m("t1")).st_size, 0)
        self.assertEqual(os.stat(self.b("t1")).st_size, 0)

    def test_stat_chmod_utimens(self):
        self.write(self.m("s1"), b"hello")
        os.chmod(self.m("s1"), 0o600)
        self.assertEqual(stat.S_IMODE(os.stat(self.m("s1")).st_mode), 0o600)
        self.assertEqual(stat.S_IMODE(os.stat(self.b("s1")).st_mode), 0o600)
        ns = (1_000_000_123_456_789, 1_100_000_987_654_321)
        os.utime(self.m("s1"), ns=ns)
        for p in (self.m("s1"), self.b("s1")):
            st = os.stat(p)
            self.assertEqual((st.st_atime_ns, st.st_mtime_ns), ns, p)
        st_m, st_b = os.stat(self.m("s1")), os.stat(self.b("s1"))
        self.assertEqual((st_m.st_size, st_m.st_mode, st_m.st_uid, st_m.st_gid, st_m.st_nlink),
                         (st_b.st_size, st_b.st_mode, st_b.st_uid, st_b.st_gid, st_b.st_nlink))
        self.assertTrue(stat.S_ISREG(st_m.st_mode))

    def test_futimens_after_write_survives_close(self):
        # cp -p / tar / rsync: write, set times on the open fd, close. A write-behind flush at
        # close must not bump mtime past the value the program set.
        ns = (1_200_000_000_000_000_000, 1_300_000_000_000_000_000)
        fd = os.open(self.m("ut"), os.O_CREAT | os.O_WRONLY, 0o644)
        try:
            os.write(fd, pattern(2 * MiB, 2))
            os.utime(fd, ns=ns)
        finally:
            os.close(fd)
        for p in (self.m("ut"), self.b("ut")):
            st = os.stat(p)
            self.assertEqual(st.st_mtime_ns, ns[1], "%s: mtime changed after close" % p)
            self.assertEqual(st.st_size, 2 * MiB, p)

    def test_chown(self):
        if os.geteuid() != 0:
            self.skipTest("chown to another uid needs root")
        self.write(self.m("o1"), b"data")
        os.chown(self.m("o1"), 1234, 5678)
        for p in (self.m("o1"), self.b("o1")):
            st = os.stat(p)
            self.assertEqual((st.st_uid, st.st_gid), (1234, 5678), p)
        os.chown(self.m("o1"), -1, 42)
        self.assertEqual(os.stat(self.b("o1")).st_gid, 42)
        self.assertEqual(os.stat(self.b("o1")).st_uid, 1234)

    def test_truncate(self):
        data = pattern(MiB + 5000, 3)
        self.write(self.m("tr"), data)
        os.truncate(self.m("tr"), 100_000)
        self.assertBytesEqual(self.read(self.m("tr")), data[:100_000], "shrink")
        os.truncate(self.m("tr"), 3 * MiB)
        want = data[:100_000] + b"\0" * (3 * MiB - 100_000)
        self.assertBytesEqual(self.read(self.m("tr")), want, "grow")
        with open(self.m("tr"), "r+b") as f:
            f.truncate(7)
            self.assertEqual(os.fstat(f.fileno()).st_size, 7)
        self.assertBytesEqual(self.read(self.b("tr")), data[:7], "backing")

    def test_truncate_after_buffered_write(self):
        # Data still in write-behind must not resurrect bytes past a later truncate.
        fd = os.open(self.m("tw"), os.O_CREAT | os.O_RDWR, 0o644)
        try:
            os.write(fd, pattern(4 * MiB, 4))
            os.ftruncate(fd, 4096 + 17)
            self.assertEqual(os.fstat(fd).st_size, 4096 + 17)
            os.pwrite(fd, b"END", 10000)
        finally:
            os.close(fd)
        want = pattern(4 * MiB, 4)[:4113] + b"\0" * (10000 - 4113) + b"END"
        self.assertBytesEqual(self.read(self.m("tw")), want, "mount")
        self.assertBytesEqual(self.read(self.b("tw")), want, "backing")

    # --- namespace -------------------------------------------------------------------------------
    def test_mkdir_rmdir_unlink(self):
        os.mkdir(self.m("d1"), 0o750)
        self.assertTrue(os.path.isdir(self.b("d1")))
        self.write(self.m("d1", "f"), b"abc")
        with self.assertRaises(OSError) as cm:
            os.rmdir(self.m("d1"))
        self.assertEqual(cm.exception.errno, errno.ENOTEMPTY)
        with self.assertRaises(FileExistsError):
            os.mkdir(self.m("d1"))
        with self.assertRaises(NotADirectoryError):
            os.mkdir(self.m("d1", "f", "x"))
        os.unlink(self.m("d1", "f"))
        self.assertFalse(os.path.exists(self.b("d1", "f")))
        with self.assertRaises(FileNotFoundError):
            os.stat(self.m("d1", "f"))
        os.rmdir(self.m("d1"))
        self.assertFalse(os.path.exists(self.b("d1")))
        self.assertFalse(os.path.exists(self.m("d1")))

    def test_unlink_while_open(self):
        data = pattern(MiB + 1, 5)
        fd = os.open(self.m("uo"), os.O_CREAT | os.O_RDWR, 0o644)
        try:
            os.write(fd, data)
            os.unlink(self.m("uo"))
            self.assertFalse(os.path.exists(self.m("uo")))
            self.assertBytesEqual(os.pread(fd, len(data), 0), data, "read after unlink")
            os.pwrite(fd, b"more", len(data))
            self.assertEqual(os.fstat(fd).st_size, len(data) + 4)
        finally:
            os.close(fd)
        self.assertNotIn("uo", os.listdir(self.backing))

    def test_rename(self):
        self.write(self.m("r_a"), b"AAAA")
        self.write(self.m("r_b"), b"BB")
        os.rename(self.m("r_a"), self.m("r_c"))
        self.assertEqual(self.read(self.m("r_c")), b"AAAA")
        self.assertFalse(os.path.exists(self.m("r_a")))
        self.assertEqual(self.read(self.b("r_c")), b"AAAA")
        os.rename(self.m("r_c"), self.m("r_b"))  # replaces
        self.assertEqual(self.read(self.m("r_b")), b"AAAA")
        self.assertEqual(self.read(self.b("r_b")), b"AAAA")
        os.mkdir(self.m("r_d"))
        self.write(self.m("r_d", "in"), b"inside")
        os.rename(self.m("r_d"), self.m("r_e"))
        self.assertEqual(self.read(self.m("r_e", "in")), b"inside")
        self.assertEqual(self.read(self.b("r_e", "in")), b"inside")

    def test_rename_with_buffered_data(self):
        # Rename while the file is open with unflushed data: the data must land under the new name.
        data = pattern(3 * MiB + 7, 6)
        fd = os.open(self.m("rb_old"), os.O_CREAT | os.O_WRONLY, 0o644)
        try:
            os.write(fd, data)
            os.rename(self.m("rb_old"), self.m("rb_new"))
            os.write(fd, b"tail")
        finally:
            os.close(fd)
        self.assertFalse(os.path.exists(self.b("rb_old")))
        self.assertBytesEqual(self.read(self.b("rb_new")), data + b"tail", "backing")
        self.assertBytesEqual(self.read(self.m("rb_new")), data + b"tail", "mount")

    def test_rename_noreplace(self):
        self.write(self.m("nr_a"), b"a")
        self.write(self.m("nr_b"), b"b")
        with self.assertRaises(OSError) as cm:
            renameat2(self.m("nr_a"), self.m("nr_b"), RENAME_NOREPLACE)
        self.assertEqual(cm.exception.errno, errno.EEXIST, mh.errno_name(cm.exception.errno))
        self.assertEqual(self.read(self.m("nr_b")), b"b")
        renameat2(self.m("nr_a"), self.m("nr_c"), RENAME_NOREPLACE)
        self.assertEqual(self.read(self.b("nr_c")), b"a")
        self.assertFalse(os.path.exists(self.b("nr_a")))

    def test_rename_exchange(self):
        self.write(self.m("x_a"), b"first")
        os.mkdir(self.m("x_b"))
        renameat2(self.m("x_a"), self.m("x_b"), RENAME_EXCHANGE)
        self.assertTrue(os.path.isdir(self.m("x_a")))
        self.assertEqual(self.read(self.m("x_b")), b"first")
        self.assertTrue(os.path.isdir(self.b("x_a")))
        self.assertEqual(self.read(self.b("x_b")), b"first")
        with self.assertRaises(OSError) as cm:
            renameat2(self.m("x_b"), self.m("x_missing"), RENAME_EXCHANGE)
        self.assertEqual(cm.exception.errno, errno.ENOENT, mh.errno_name(cm.exception.errno))

    def test_symlink_readlink_link(self):
        self.write(self.m("l_t"), b"target")
        os.symlink("l_t", self.m("l_s"))
        self.assertEqual(os.readlink(self.m("l_s")), "l_t")
        self.assertEqual(os.readlink(self.b("l_s")), "l_t")
        self.assertTrue(stat.S_ISLNK(os.lstat(self.m("l_s")).st_mode))
        self.assertEqual(self.read(self.m("l_s")), b"target")
        os.symlink("/nonexistent/dangling", self.m("l_d"))
        self.assertEqual(os.readlink(self.m("l_d")), "/nonexistent/dangling")
        self.assertEqual(os.stat(self.m("l_t")).st_nlink, 1)
        os.link(self.m("l_t"), self.m("l_h"))
        self.assertEqual(os.stat(self.m("l_t")).st_nlink, 2)
        self.assertEqual(os.stat(self.m("l_h")).st_nlink, 2)
        self.assertEqual(os.stat(self.m("l_t")).st_ino, os.stat(self.m("l_h")).st_ino)
        self.assertEqual(os.stat(self.b("l_t")).st_ino, os.stat(self.b("l_h")).st_ino)
        self.write(self.m("l_h"), b"via hard link")
        self.assertEqual(self.read(self.m("l_t")), b"via hard link")
        os.unlink(self.m("l_t"))
        self.assertEqual(os.stat(self.m("l_h")).st_nlink, 1)
        self.assertEqual(self.read(self.b("l_h")), b"via hard link")

    def test_readdir(self):
        os.mkdir(self.m("rd"))
        names = {"f%03d" % i for i in range(300)} | {"with space", "ünïcödé", "a" * 255}
        for n in names:
            self.write(self.m("rd", n), n.encode())
        os.mkdir(self.m("rd", "sub"))
        os.symlink("f000", self.m("rd", "lnk"))
        want = names | {"sub", "lnk"}
        self.assertEqual(set(os.listdir(self.m("rd"))), want)
        self.assertEqual(set(os.listdir(self.b("rd"))), want)
        kinds = {e.name: (e.is_dir(follow_symlinks=False), e.is_symlink())
                 for e in os.scandir(self.m("rd"))}
        self.assertEqual(kinds["sub"], (True, False))
        self.assertEqual(kinds["lnk"], (False, True))
        self.assertEqual(kinds["f001"], (False, False))
        self.assertEqual(self.read(self.m("rd", "ünïcödé")), "ünïcödé".encode())

    def test_statfs(self):
        vm, vb = os.statvfs(self.mnt), os.statvfs(self.backing)
        self.assertGreater(vm.f_bsize, 0)
        self.assertGreater(vm.f_frsize, 0)
        self.assertGreater(vm.f_blocks, 0)
        self.assertLessEqual(vm.f_bfree, vm.f_blocks)
        self.assertLessEqual(vm.f_bavail, vm.f_bfree)
        self.assertGreaterEqual(vm.f_namemax, 255)
        total_m, total_b = vm.f_blocks * vm.f_frsize, vb.f_blocks * vb.f_frsize
        # A passthrough reports its backing filesystem's capacity.
        self.assertLess(abs(total_m - total_b), total_b // 100 + 1,
                        "mount reports %d bytes total, backing %d" % (total_m, total_b))

    def test_xattr(self):
        self.write(self.m("xa"), b"x")
        try:
            os.setxattr(self.m("xa"), "user.dnvme", b"value\0bin")
        except OSError as exc:
            if exc.errno == errno.ENOTSUP and self._backing_lacks_xattr():
                self.skipTest("backing filesystem has no user xattrs")
            raise
        self.assertEqual(os.getxattr(self.m("xa"), "user.dnvme"), b"value\0bin")
        self.assertEqual(os.getxattr(self.b("xa"), "user.dnvme"), b"value\0bin")
        self.assertIn("user.dnvme", os.listxattr(self.m("xa")))
        with self.assertRaises(OSError) as cm:
            os.setxattr(self.m("xa"), "user.dnvme", b"v2", os.XATTR_CREATE)
        self.assertEqual(cm.exception.errno, errno.EEXIST)
        os.removexattr(self.m("xa"), "user.dnvme")
        with self.assertRaises(OSError) as cm:
            os.getxattr(self.m("xa"), "user.dnvme")
        self.assertEqual(cm.exception.errno, errno.ENODATA)
        self.assertNotIn("user.dnvme", os.listxattr(self.b("xa")))

    def _backing_lacks_xattr(self):
        p = self.b("xa_probe")
        self.write(p, b"")
        try:
            os.setxattr(p, "user.p", b"1")
            return False
        except OSError:
            return True
        finally:
            os.unlink(p)

    def test_fallocate(self):
        fd = os.open(self.m("fa"), os.O_CREAT | os.O_RDWR, 0o644)
        try:
            os.write(fd, b"head")
            os.posix_fallocate(fd, 0, 8 * MiB)
            self.assertEqual(os.fstat(fd).st_size, 8 * MiB)
            self.assertEqual(os.pread(fd, 8, 0), b"head\0\0\0\0")
            os.fsync(fd)
        finally:
            os.close(fd)
        st = os.stat(self.b("fa"))
        self.assertEqual(st.st_size, 8 * MiB)
        self.assertGreaterEqual(st.st_blocks * 512, 8 * MiB, "backing space not allocated")
        self.assertEqual(self.read(self.b("fa"))[:4], b"head")

    def test_seek_data_hole(self):
        fd = os.open(self.m("sp"), os.O_CREAT | os.O_RDWR, 0o644)
        try:
            os.pwrite(fd, b"D" * 4096, 0)
            os.pwrite(fd, b"E" * 4096, 4 * MiB)
            os.ftruncate(fd, 8 * MiB)
            os.fsync(fd)
            bfd = os.open(self.b("sp"), os.O_RDONLY)
            try:
                bh = os.lseek(bfd, 0, os.SEEK_HOLE)
                bd = os.lseek(bfd, bh, os.SEEK_DATA)
            finally:
                os.close(bfd)
            if bh >= 8 * MiB:
                self.skipTest("backing filesystem reports no holes")
            self.assertEqual(os.lseek(fd, 0, os.SEEK_DATA), 0)
            self.assertEqual(os.lseek(fd, 0, os.SEEK_HOLE), bh)
            self.assertEqual(os.lseek(fd, bh, os.SEEK_DATA), bd)
            self.assertLessEqual(bd, 4 * MiB)
            with self.assertRaises(OSError) as cm:
                os.lseek(fd, 4 * MiB + 4096 + 1, os.SEEK_DATA)  # only a hole up to EOF
            self.assertEqual(cm.exception.errno, errno.ENXIO)
            with self.assertRaises(OSError) as cm:
                os.lseek(fd, 9 * MiB, os.SEEK_HOLE)
            self.assertEqual(cm.exception.errno, errno.ENXIO)
            self.assertBytesEqual(os.pread(fd, 8192, 4 * MiB - 4096),
                                  b"\0" * 4096 + b"E" * 4096, "sparse read")
        finally:
            os.close(fd)

    # --- locks -----------------------------------------------------------------------------------
    LOCK_CHILD = r"""
import fcntl, os, struct, sys
fd = os.open(sys.argv[1], os.O_RDWR)
kind = sys.argv[2]
try:
    if kind == "flock":
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    else:
        start, length = int(sys.argv[3]), int(sys.argv[4])
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, length, start)
    print("GOT")
except OSError as e:
    print("BLOCKED", e.errno)
"""

    def test_flock_conflict(self):
        self.write(self.m("lk1"), b"lock")
        fd = os.open(self.m("lk1"), os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            rc, out, err = child(self.LOCK_CHILD, self.m("lk1"), "flock")
            self.assertEqual(rc, 0, err)
            self.assertTrue(out.startswith("BLOCKED"), "second process got the flock: " + out)
            fcntl.flock(fd, fcntl.LOCK_UN)
            rc, out, err = child(self.LOCK_CHILD, self.m("lk1"), "flock")
            self.assertEqual(out.strip(), "GOT", err)
        finally:
            os.close(fd)

    def test_posix_lock_conflict(self):
        self.write(self.m("lk2"), b"\0" * 1000)
        fd = os.open(self.m("lk2"), os.O_RDWR)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX, 100, 0)  # bytes [0, 100)
            rc, out, err = child(self.LOCK_CHILD, self.m("lk2"), "posix", 50, 10)
            self.assertTrue(out.startswith("BLOCKED"), "overlapping lock granted: %s %s" %
                            (out, err))
            self.assertIn(int(out.split()[1]), (errno.EAGAIN, errno.EACCES))
            rc, out, err = child(self.LOCK_CHILD, self.m("lk2"), "posix", 200, 10)
            self.assertEqual(out.strip(), "GOT", "disjoint lock refused: " + err)
            fcntl.lockf(fd, fcntl.LOCK_UN, 100, 0)
            rc, out, err = child(self.LOCK_CHILD, self.m("lk2"), "posix", 50, 10)
            self.assertEqual(out.strip(), "GOT", "lock still held after unlock: " + err)
        finally:
            os.close(fd)

    # --- special files ---------------------------------------------------------------------------
    def test_mkfifo(self):
        os.mkfifo(self.m("fifo"), 0o600)
        self.assertTrue(stat.S_ISFIFO(os.stat(self.m("fifo")).st_mode))
        self.assertTrue(stat.S_ISFIFO(os.stat(self.b("fifo")).st_mode))
        rfd = os.open(self.m("fifo"), os.O_RDONLY | os.O_NONBLOCK)
        try:
            wfd = os.open(self.m("fifo"), os.O_WRONLY)
            os.write(wfd, b"ping")
            os.close(wfd)
            self.assertEqual(os.read(rfd, 100), b"ping")
        finally:
            os.close(rfd)

    # --- data paths ------------------------------------------------------------------------------
    def test_o_direct_round_trip(self):
        n = 4 * MiB + 8192
        wbuf = mmap.mmap(-1, n)
        wbuf.write(pattern(n, 7))
        rbuf = mmap.mmap(-1, n)
        try:
            fd = os.open(self.m("od"), os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o644)
        except OSError as exc:
            self.fail("open(O_DIRECT) on the mount failed: %s" % mh.errno_name(exc.errno))
        try:
            self.assertEqual(os.pwritev(fd, [wbuf], 0), n)
            self.assertEqual(os.pwritev(fd, [memoryview(wbuf)[:4096]], n + 4096), 4096)
            self.assertEqual(os.fstat(fd).st_size, n + 8192)
            self.assertEqual(os.preadv(fd, [rbuf], 0), n)
            self.assertBytesEqual(bytes(rbuf), bytes(wbuf), "O_DIRECT read back")
            os.fsync(fd)
        finally:
            os.close(fd)
        want = bytes(wbuf) + b"\0" * 4096 + bytes(wbuf[:4096])
        self.assertBytesEqual(self.read(self.m("od")), want, "buffered read of O_DIRECT data")
        self.assertBytesEqual(self.read(self.b("od")), want, "backing")
        wbuf.close()
        rbuf.close()

    def test_o_direct_and_buffered_fds_coherent(self):
        n = 2 * MiB
        buf = mmap.mmap(-1, n)
        buf.write(pattern(n, 8))
        bfd = os.open(self.m("mix"), os.O_CREAT | os.O_RDWR, 0o644)
        dfd = os.open(self.m("mix"), os.O_RDWR | os.O_DIRECT)
        try:
            os.write(bfd, b"b" * (n + 100))  # buffered, maybe still in write-behind
            os.pwritev(dfd, [buf], 0)  # direct over it
            self.assertBytesEqual(os.pread(bfd, n + 100, 0), bytes(buf) + b"b" * 100,
                                  "buffered fd sees direct write")
            os.pwrite(bfd, b"Z" * 4096, 4096)  # buffered over the direct data
            rb = mmap.mmap(-1, n)
            os.preadv(dfd, [rb], 0)
            self.assertBytesEqual(bytes(rb[4096:8192]), b"Z" * 4096, "direct fd sees buffered")
            rb.close()
        finally:
            os.close(dfd)
            os.close(bfd)
        want = bytearray(bytes(buf) + b"b" * 100)
        want[4096:8192] = b"Z" * 4096
        self.assertBytesEqual(self.read(self.b("mix")), bytes(want), "backing")
        buf.close()

    def test_o_append(self):
        fd1 = os.open(self.m("ap"), os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o644)
        fd2 = os.open(self.m("ap"), os.O_WRONLY | os.O_APPEND)
        fd3 = os.open(self.m("ap"), os.O_WRONLY)
        try:
            os.write(fd1, b"one.")
            os.write(fd2, b"two..")
            os.pwrite(fd3, b"X" * 100_000, 9)  # extends through a non-append fd
            os.write(fd1, b"three")
            self.assertEqual(os.lseek(fd1, 0, os.SEEK_CUR), 100_014)
        finally:
            for fd in (fd1, fd2, fd3):
                os.close(fd)
        want = b"one.two.." + b"X" * 100_000 + b"three"
        self.assertBytesEqual(self.read(self.m("ap")), want, "mount")
        self.assertBytesEqual(self.read(self.b("ap")), want, "backing")
        with open(self.m("ap"), "ab") as f:
            f.write(b"!")
        self.assertEqual(os.stat(self.b("ap")).st_size, len(want) + 1)

    def test_large_sequential_sha256(self):
        total, chunk = 256 * MiB, MiB
        base = bytearray(pattern(chunk, 9))
        h = hashlib.sha256()
        with open(self.m("big"), "wb", buffering=0) as f:
            for i in range(total // chunk):
                base[0:8] = i.to_bytes(8, "little")
                base[chunk // 2:chunk // 2 + 8] = (i * 7919).to_bytes(8, "little")
                f.write(base)
                h.update(base)
        want = h.hexdigest()
        self.assertEqual(os.stat(self.m("big")).st_size, total)
        mh.drop_caches()
        self.assertEqual(self._sha(self.m("big")), want, "read back through the mount")
        self.assertEqual(self._sha(self.b("big")), want, "backing file")
        os.unlink(self.m("big"))

    @staticmethod
    def _sha(path):
        h = hashlib.sha256()
        with open(path, "rb", buffering=0) as f:
            while True:
                b = f.read(4 * MiB)
                if not b:
                    return h.hexdigest()
                h.update(b)

    def test_coherence_fds_and_processes(self):
        data = pattern(5 * MiB + 3, 10)
        wfd = os.open(self.m("co"), os.O_CREAT | os.O_WRONLY, 0o644)
        rfd = os.open(self.m("co"), os.O_RDONLY)
        try:
            os.write(wfd, data)
            self.assertBytesEqual(os.pread(rfd, len(data) + 1, 0), data, "second fd")
            code = ("import hashlib,sys;print(hashlib.sha256(open(sys.argv[1],'rb').read())"
                    ".hexdigest())")
            rc, out, err = child(code, self.m("co"))
            self.assertEqual(rc, 0, err)
            self.assertEqual(out.strip(), hashlib.sha256(data).hexdigest(),
                             "another process reads stale data while the writer holds it open")
            # Populate read-ahead, then overwrite the middle from another process.
            self.assertBytesEqual(os.pread(rfd, 1 << 16, MiB), data[MiB:MiB + (1 << 16)], "ra")
            code2 = ("import os,sys;fd=os.open(sys.argv[1],os.O_WRONLY);"
                     "os.pwrite(fd,b'Q'*10000,%d);os.close(fd)" % (MiB + 100))
            rc, out, err = child(code2, self.m("co"))
            self.assertEqual(rc, 0, err)
            got = os.pread(rfd, 1 << 16, MiB)
            want = bytearray(data[MiB:MiB + (1 << 16)])
            want[100:10100] = b"Q" * 10000
            self.assertBytesEqual(got, bytes(want), "read after another process overwrote")
            os.pwrite(wfd, b"W" * 3, 5)
        finally:
            os.close(wfd)
            os.close(rfd)
        final = bytearray(data)
        final[MiB + 100:MiB + 10100] = b"Q" * 10000
        final[5:8] = b"WWW"
        self.assertBytesEqual(self.read(self.m("co")), bytes(final), "final mount")
        self.assertBytesEqual(self.read(self.b("co")), bytes(final), "final backing")

    def test_fsync_puts_data_in_backing(self):
        data = pattern(3 * MiB + 11, 11)
        fd = os.open(self.m("fs"), os.O_CREAT | os.O_WRONLY, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
            # Still open: after fsync() returns the bytes are in BACKING_DIR.
            self.assertBytesEqual(self.read(self.b("fs")), data, "backing after fsync")
            os.write(fd, b"more")
            os.fdatasync(fd)
            self.assertBytesEqual(self.read(self.b("fs")), data + b"more", "after fdatasync")
        finally:
            os.close(fd)

    def test_concurrent_writers_threads(self):
        # Four threads write disjoint 1 MiB regions of one file through separate fds.
        n = 4
        datas = [pattern(MiB, 20 + i) for i in range(n)]
        errors = []

        def work(i):
            try:
                fd = os.open(self.m("cw"), os.O_WRONLY | os.O_CREAT, 0o644)
                try:
                    for k in range(0, MiB, 65536 + 3):
                        os.pwrite(fd, datas[i][k:k + 65536 + 3], i * MiB + k)
                finally:
                    os.close(fd)
            except Exception as exc:  # reported below
                errors.append(exc)

        run_threads(n, work)
        self.assertEqual(errors, [])
        self.assertBytesEqual(self.read(self.m("cw")), b"".join(datas), "mount")
        self.assertBytesEqual(self.read(self.b("cw")), b"".join(datas), "backing")


class WriteBehindSemanticsTest(mh.MountedTestCase):
    """POSIX orderings that write-behind and read-ahead must not change: a write that returned is
    ordered before every later operation by anyone, on the same inode (not the same name)."""

    def test_o_trunc_open_discards_earlier_pending_writes(self):
        fd1 = os.open(self.m("ot"), os.O_CREAT | os.O_WRONLY, 0o644)
        try:
            os.write(fd1, pattern(2 * MiB + 5, 30))  # may still sit in write-behind
            fd2 = os.open(self.m("ot"), os.O_WRONLY | os.O_TRUNC)
            os.write(fd2, b"x")
            os.close(fd2)
        finally:
            os.close(fd1)  # a late flush of fd1's data would resurrect 2 MiB
        self.assertEqual(self.read(self.m("ot")), b"x")
        self.assertEqual(self.read(self.b("ot")), b"x")

    def test_ftruncate_other_fd_orders_after_pending_writes(self):
        fd1 = os.open(self.m("ft"), os.O_CREAT | os.O_WRONLY, 0o644)
        fd2 = os.open(self.m("ft"), os.O_WRONLY)
        try:
            os.write(fd1, pattern(3 * MiB, 31))
            os.ftruncate(fd2, 1000)
        finally:
            os.close(fd2)
            os.close(fd1)
        self.assertBytesEqual(self.read(self.b("ft")), pattern(3 * MiB, 31)[:1000], "backing")
        self.assertBytesEqual(self.read(self.m("ft")), pattern(3 * MiB, 31)[:1000], "mount")

    def test_pending_writes_follow_the_inode_not_the_name(self):
        # Unlink + recreate the name while the old file has unflushed data: the flush must go to
        # the old (now nameless) inode, not to whatever file has the name now.
        fd1 = os.open(self.m("inode"), os.O_CREAT | os.O_WRONLY, 0o644)
        try:
            os.write(fd1, pattern(2 * MiB + 3, 32))
            os.unlink(self.m("inode"))
            self.write(self.m("inode"), b"new file")
            os.write(fd1, b"more old data")
        finally:
            os.close(fd1)
        self.assertEqual(self.read(self.m("inode")), b"new file")
        self.assertEqual(self.read(self.b("inode")), b"new file")

    def test_punch_hole_after_pending_write(self):
        # A hole punched after a write that returned must stay a hole (no late flush refill).
        data = pattern(4 * MiB, 36)
        fd = os.open(self.m("ph"), os.O_CREAT | os.O_RDWR, 0o644)
        try:
            os.write(fd, data)
            if _libc.fallocate(fd, 0x03, ctypes.c_int64(MiB), ctypes.c_int64(MiB)) != 0:
                e = ctypes.get_errno()
                self.fail("fallocate(PUNCH_HOLE|KEEP_SIZE) on the mount: %s" % mh.errno_name(e))
            want = data[:MiB] + b"\0" * MiB + data[2 * MiB:]
            self.assertBytesEqual(os.pread(fd, 4 * MiB, 0), want, "read after punch")
        finally:
            os.close(fd)
        self.assertBytesEqual(self.read(self.b("ph")), want, "backing after close")
        self.assertBytesEqual(self.read(self.m("ph")), want, "mount after close")

    def test_write_updates_mtime_before_close(self):
        old = 978307200 * 10**9  # 2001-01-01
        fd = os.open(self.m("mt"), os.O_CREAT | os.O_WRONLY, 0o644)
        try:
            os.utime(fd, ns=(old, old))
            os.write(fd, b"y" * 100_000)
            st = os.stat(self.m("mt"))
            self.assertGreater(st.st_mtime_ns, old, "write() did not update mtime (stat by path)")
            self.assertGreater(st.st_ctime_ns, old)
            self.assertEqual(st.st_size, 100_000)
        finally:
            os.close(fd)
        self.assertGreater(os.stat(self.b("mt")).st_mtime_ns, old)

    def test_copy_file_range_sees_unflushed_source(self):
        src = pattern(3 * MiB + 77, 33)
        sfd = os.open(self.m("cfr_src"), os.O_CREAT | os.O_RDWR, 0o644)
        dfd = os.open(self.m("cfr_dst"), os.O_CREAT | os.O_RDWR, 0o644)
        try:
            os.write(sfd, src)  # possibly still in write-behind
            done = 0
            while done < len(src):
                n = os.copy_file_range(sfd, dfd, len(src) - done, done, done)
                if n == 0:
                    break
                done += n
            self.assertEqual(done, len(src))
            self.assertBytesEqual(os.pread(dfd, len(src) + 1, 0), src, "destination via fd")
        finally:
            os.close(sfd)
            os.close(dfd)
        self.assertBytesEqual(self.read(self.m("cfr_dst")), src, "destination through mount")
        self.assertBytesEqual(self.read(self.b("cfr_dst")), src, "destination in backing")

    def test_read_ahead_sees_later_writes_and_truncate(self):
        data = pattern(8 * MiB, 34)
        self.write(self.m("ra"), data)
        mh.drop_caches()
        rfd = os.open(self.m("ra"), os.O_RDONLY)
        try:
            got = b"".join(os.pread(rfd, 65536, o) for o in range(0, MiB, 65536))
            self.assertBytesEqual(got, data[:MiB], "sequential start")
            # Another process overwrites ahead of the reader, then shrinks the file.
            code = ("import os,sys;fd=os.open(sys.argv[1],os.O_WRONLY);"
                    "os.pwrite(fd,b'Z'*70000,%d);os.close(fd)" % (2 * MiB + 10))
            rc, _, err = child(code, self.m("ra"))
            self.assertEqual(rc, 0, err)
            got = b"".join(os.pread(rfd, 65536, o) for o in range(MiB, 3 * MiB, 65536))
            want = bytearray(data[MiB:3 * MiB])
            want[MiB + 10:MiB + 70010] = b"Z" * 70000
            self.assertBytesEqual(got, bytes(want), "read-ahead served data older than a write")
            rc, _, err = child("import os,sys;os.truncate(sys.argv[1], %d)" % (3 * MiB + 100),
                               self.m("ra"))
            self.assertEqual(rc, 0, err)
            self.assertEqual(os.pread(rfd, 65536, 3 * MiB + 100), b"",
                             "read past a truncate returned stale read-ahead bytes")
            self.assertBytesEqual(os.pread(rfd, 65536, 3 * MiB), data[3 * MiB:3 * MiB + 100],
                                  "read up to the new end")
        finally:
            os.close(rfd)

    def test_mmap_shared_coherent(self):
        n = 2 * MiB
        self.write(self.m("mm"), pattern(n, 35))
        fd = os.open(self.m("mm"), os.O_RDWR)
        try:
            try:
                mm = mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as exc:
                self.fail("shared writable mmap refused on the mount: %s" %
                          mh.errno_name(exc.errno))
            try:
                self.assertBytesEqual(mm[:n], pattern(n, 35), "mmap sees file data")
                mm[4096:8192] = b"M" * 4096
                os.pwrite(fd, b"W" * 100, 100_000)  # write() seen by the mapping
                self.assertEqual(mm[100_000:100_100], b"W" * 100)
                mm.flush()
            finally:
                mm.close()
            self.assertEqual(os.pread(fd, 4096, 4096), b"M" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
        want = bytearray(pattern(n, 35))
        want[4096:8192] = b"M" * 4096
        want[100_000:100_100] = b"W" * 100
        self.assertBytesEqual(self.read(self.b("mm")), bytes(want), "backing after msync+fsync")

    def test_many_files_open_with_pending_writes(self):
        # Write-behind memory is capped: hundreds of files each holding unflushed data must still
        # all end up complete (no ENOMEM / EMFILE, no lost file).
        os.mkdir(self.m("many"))
        fds = []
        try:
            for i in range(300):
                fd = os.open(self.m("many", "f%d" % i), os.O_CREAT | os.O_WRONLY, 0o644)
                fds.append(fd)
                os.write(fd, pattern(100_000 + i, 1000 + i))
        finally:
            for fd in fds:
                os.close(fd)
        for i in range(300):
            self.assertBytesEqual(self.read(self.b("many", "f%d" % i)),
                                  pattern(100_000 + i, 1000 + i), "many/f%d" % i)


class MoreDataPathTest(mh.MountedTestCase):

    def test_fsync_of_any_fd_flushes_the_file(self):
        # fsync() is about the file: data written through fd1 and still open must be in
        # BACKING_DIR once fsync() on another fd of the same file (even read-only) returns.
        data = pattern(3 * MiB + 9, 40)
        fd1 = os.open(self.m("fa"), os.O_CREAT | os.O_WRONLY, 0o644)
        try:
            os.write(fd1, data)
            fd2 = os.open(self.m("fa"), os.O_RDONLY)
            try:
                os.fsync(fd2)
            finally:
                os.close(fd2)
            self.assertBytesEqual(self.read(self.b("fa")), data,
                                  "BACKING_DIR after fsync on a second (read-only) fd")
        finally:
            os.close(fd1)

    def test_large_offsets(self):
        # Offsets past 4 GiB (32-bit truncation) on a sparse file.
        offs = [(4 << 30) + 4096, (5 << 30) - 3, (17 << 30) + 123]
        fd = os.open(self.m("huge"), os.O_CREAT | os.O_RDWR, 0o644)
        try:
            for i, o in enumerate(offs):
                self.assertEqual(os.pwrite(fd, pattern(70_000, 50 + i), o), 70_000)
            self.assertEqual(os.fstat(fd).st_size, offs[-1] + 70_000)
            for i, o in enumerate(offs):
                self.assertBytesEqual(os.pread(fd, 70_000, o), pattern(70_000, 50 + i),
                                      "pread at %d" % o)
            self.assertEqual(os.pread(fd, 4096, 1 << 30), b"\0" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
        with open(self.b("huge"), "rb") as f:
            for i, o in enumerate(offs):
                f.seek(o)
                self.assertBytesEqual(f.read(70_000), pattern(70_000, 50 + i), "backing %d" % o)
        os.unlink(self.m("huge"))

    def test_reader_sees_appends_after_eof(self):
        # tail -f: a sequential reader hits EOF, the file grows, the reader must see the new bytes
        # (no cached end-of-file in read-ahead).
        data = pattern(6 * MiB, 41)
        with open(self.m("tail"), "wb") as f:
            f.write(data[:2 * MiB])
        wfd = os.open(self.m("tail"), os.O_WRONLY | os.O_APPEND)
        rfd = os.open(self.m("tail"), os.O_RDONLY)
        try:
            got = bytearray()
            for step in range(2, 6):
                while True:
                    b = os.read(rfd, 128 * 1024)
                    if not b:
                        break
                    got += b
                self.assertBytesEqual(bytes(got), data[:step * MiB], "reader at EOF, step %d" %
                                      step)
                os.write(wfd, data[step * MiB:(step + 1) * MiB])
            while True:
                b = os.read(rfd, 128 * 1024)
                if not b:
                    break
                got += b
            self.assertBytesEqual(bytes(got), data, "reader after the last append")
        finally:
            os.close(rfd)
            os.close(wfd)

    def test_parallel_preads_same_fd(self):
        data = pattern(16 * MiB, 42)
        with open(self.m("par"), "wb") as f:
            f.write(data)
        mh.drop_caches()
        fd = os.open(self.m("par"), os.O_RDONLY)
        bad = []

        def reader(k):
            rng = random.Random(k)
            for _ in range(60):
                off = rng.randrange(0, len(data))
                n = rng.choice([1, 4096, 65536 + 7, MiB + 3])
                got = os.pread(fd, n, off)
                if got != data[off:off + n]:
                    bad.append((k, off, n, len(got)))
            for off in range(k * 4 * MiB, (k + 1) * 4 * MiB, 131072):  # sequential streams
                if os.pread(fd, 131072, off) != data[off:off + 131072]:
                    bad.append((k, off, 131072, "seq"))

        try:
            ts = [threading.Thread(target=reader, args=(k,)) for k in range(4)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
        finally:
            os.close(fd)
        self.assertEqual(bad, [], "wrong data (thread, offset, length, got length)")


class MultiUserTest(mh.MountedTestCase):
    """allow_other + default_permissions, as a shared mount is run: files another user creates
    belong to that user (in BACKING_DIR too) and permissions are enforced."""
    MOUNT_OPTIONS = ("allow_other", "default_permissions")
    NEED_ROOT = True
    UID = 65534

    USER_CHILD = r"""
import os, sys
os.setgroups([]); os.setgid(%(uid)d); os.setuid(%(uid)d)
d = sys.argv[1]
with open(os.path.join(d, "shared", "mine"), "wb") as f:
    f.write(b"by nobody" * 100000)
st = os.stat(os.path.join(d, "shared", "mine"))
print("uid", st.st_uid, st.st_gid)
try:
    open(os.path.join(d, "rootfile"), "r+b")
    print("opened-root-file")
except PermissionError:
    print("EACCES")
"""

    def test_other_user_creates_own_files_and_is_denied_root_files(self):
        os.chmod(self.scratch.path, 0o755)  # mkdtemp made it 0700: let the other user through
        d = os.path.dirname(self.scratch.path)
        while True:
            if not os.stat(d).st_mode & 0o001:
                self.skipTest("%s is not searchable by other users" % d)
            if d == "/":
                break
            d = os.path.dirname(d)
        os.mkdir(self.m("shared"))
        os.chmod(self.m("shared"), 0o777)
        with open(self.m("rootfile"), "wb") as f:
            f.write(b"root")
        os.chmod(self.m("rootfile"), 0o644)
        rc, out, err = child(self.USER_CHILD % {"uid": self.UID}, self.mnt)
        self.assertEqual(rc, 0, "child as uid %d failed: %s" % (self.UID, err))
        lines = out.split("\n")
        self.assertEqual(lines[0], "uid %d %d" % (self.UID, self.UID), out)
        self.assertEqual(lines[1], "EACCES", "uid %d could open a root-owned 0644 file for "
                         "writing" % self.UID)
        st = os.stat(self.b("shared", "mine"))
        self.assertEqual((st.st_uid, st.st_gid), (self.UID, self.UID),
                         "file created by uid %d is owned by %d:%d in BACKING_DIR" %
                         (self.UID, st.st_uid, st.st_gid))
        self.assertEqual(self.read(self.b("shared", "mine")), b"by nobody" * 100000)

    # A write by a user without CAP_FSETID clears set-user-ID; the kernel learns of it from us
    # (for a direct_io or O_DIRECT write it changes no cached mode of its own). statx asking for
    # the mode alone is answered from the kernel's cache while that is valid, so it shows whether
    # the cache was dropped; a plain stat would refetch anyway (the write made mtime stale).
    WRITER_CHILD = r"""
import os, sys
os.setgroups([]); os.setgid(%(uid)d); os.setuid(%(uid)d)
fd = os.open(sys.argv[1], os.O_WRONLY)
os.write(fd, b"x")
os.close(fd)
"""

    def test_cached_mode_follows_a_cleared_set_user_id(self):
        os.chmod(self.scratch.path, 0o755)
        path = self.m("suid")
        with open(path, "wb") as f:
            f.write(b"#!/bin/sh\n")
        os.chmod(path, 0o4777)
        self.assertEqual(statx_mode(path) & 0o7777, 0o4777, "the mode is cached")
        rc, _, err = child(self.WRITER_CHILD % {"uid": self.UID}, path)
        self.assertEqual(rc, 0, "writer as uid %d failed: %s" % (self.UID, err))
        self.assertEqual(os.stat(self.b("suid")).st_mode & 0o7777, 0o777, "BACKING_DIR")
        self.assertEqual(statx_mode(path) & 0o7777, 0o777,
                         "the kernel still reports set-user-ID from its cache")


class ParallelWritersTest(mh.MountedTestCase):
    """More writers than write-behind buffers (small window): no deadlock, no lost data."""
    MOUNT_OPTIONS = ("write_behind=2M", "write_chunk=512K")

    def test_eight_writers_share_a_small_window(self):
        n, size = 8, 12 * MiB
        errors = []

        def work(i):
            try:
                data = pattern(size, 60 + i)
                fd = os.open(self.m("pw%d" % i), os.O_CREAT | os.O_WRONLY, 0o644)
                try:
                    step = 300_007 + i
                    for o in range(0, size, step):
                        os.pwrite(fd, data[o:o + step], o)
                    if i % 2:
                        os.fsync(fd)
                finally:
                    os.close(fd)
            except Exception as exc:  # reported below
                errors.append((i, exc))

        run_threads(n, work)
        self.assertEqual(errors, [])
        for i in range(n):
            self.assertBytesEqual(self.read(self.b("pw%d" % i)), pattern(size, 60 + i),
                                  "backing pw%d" % i)


class DirectIoWritesTest(unittest.TestCase):
    """-o direct_io (fs/options.h): which opens hand the daemon the writer's own pages. Told
    apart by the request sizes the kernel sends for one 1 MiB write(2) at file offset 0 from a
    buffer 16 bytes into a page: through the page cache that is 256 whole pages, one 1 MiB
    request; from the writer's pages it is 257 pages, which the kernel sends whole only where
    fs.fuse.max_pages_limit lets the mount's spare page through (fs/transport/protocol_ext.h),
    and otherwise as 1 MiB - 16 bytes plus 16 (both written from the request buffer all the same:
    datapath/write_behind.h). Every case mounts anew with the limit set for it
    (and put back), then checks the bytes in BACKING_DIR."""
    LIMIT = "/proc/sys/fs/fuse/max_pages_limit"

    @classmethod
    def setUpClass(cls):
        reason = mh.skip_reason(need_root=True)
        if reason:
            raise unittest.SkipTest(reason)
        if not os.access(cls.LIMIT, os.W_OK):
            raise unittest.SkipTest("%s is not writable here: the request sizes this test "
                                    "tells the write paths apart by depend on it" % cls.LIMIT)
        with open(cls.LIMIT) as f:
            cls.saved_limit = int(f.read())

    def setUp(self):
        self.scratch = mh.Scratch(type(self).__name__)
        self.addCleanup(self.scratch.cleanup)
        self.addCleanup(self.set_limit, self.saved_limit)
        self.buf = mmap.mmap(-1, 2 * MiB)
        self.addCleanup(self.buf.close)
        self.data = os.urandom(MiB)
        self.buf[16:16 + MiB] = self.data

    def set_limit(self, pages):
        with open(self.LIMIT, "w") as f:
            f.write(str(pages))

    def write_once(self, options, limit, flags, name):
        """Mounts with `options` under max_pages_limit `limit`, writes the 1 MiB once through an
        open with `flags`, checks BACKING_DIR, returns the mount's stats."""
        self.set_limit(limit)
        with mh.Mount(self.scratch.backing, self.scratch.mnt, options=options):
            fd = os.open(os.path.join(self.scratch.mnt, name), flags | os.O_CREAT, 0o644)
            try:
                with memoryview(self.buf) as mv:
                    self.assertEqual(os.write(fd, mv[16:16 + MiB]), MiB)
                os.fsync(fd)
            finally:
                os.close(fd)
            st = mh.stats(self.scratch.mnt)
        with open(os.path.join(self.scratch.backing, name), "rb") as f:
            self.assertTrue(f.read() == self.data, "BACKING_DIR holds the write (%s)" % name)
        return st

    def test_default_sends_writers_pages_for_every_open_for_writing(self):
        st = self.write_once((), 256, os.O_WRONLY, "wronly")
        self.assertEqual(st["mount"]["direct_io"], "writable")
        self.assertFalse(st["mount"]["splice_read"], "nothing to splice for: requests are read")
        self.assertEqual(st["fuse"]["largest_write"], MiB - 16, "the writer's 257 pages, split")
        self.assertEqual(st["fuse"]["bytes_written_adopted"], MiB,
                         "the 16 bytes after the cut complete the page in the adopted buffer")
        self.assertEqual(st["fuse"]["bytes_written_sync"], 0, st["fuse"])
        st = self.write_once((), 256, os.O_RDWR, "rdwr")
        if not st["kernel"]["direct_io_allow_mmap"]["on"]:
            self.assertEqual(st["fuse"]["largest_write"], MiB, "no mmap of direct_io opens "
                             "in this kernel: O_RDWR goes through the page cache")
            self.skipTest("the kernel does not offer FUSE_DIRECT_IO_ALLOW_MMAP (before 6.6)")
        self.assertEqual(st["fuse"]["largest_write"], MiB - 16, "O_RDWR: the writer's pages")

    def test_spare_page_lets_an_unaligned_buffer_through_whole(self):
        st = self.write_once((), 257, os.O_WRONLY, "whole")  # direct_io under every kernel
        self.assertEqual(st["kernel"]["max_pages_asked"], 257)
        self.assertEqual(st["fuse"]["largest_write"], MiB)
        self.assertEqual(st["fuse"]["write_ops"], 1, st["fuse"])
        self.assertEqual(st["fuse"]["bytes_written_adopted"], MiB,
                         "received page-aligned in whole pages: written from the request buffer")
        # READs keep to max_request (the max_read mount option) although max_pages has the
        # spare page: an O_RDWR open (direct_io where the kernel allows it) reading 4 MiB into a
        # buffer 16 bytes into a page.
        self.set_limit(257)
        data = os.urandom(4 * MiB)
        with open(os.path.join(self.scratch.backing, "big"), "wb") as f:
            f.write(data)
        with mh.Mount(self.scratch.backing, self.scratch.mnt, options=("passthrough=off",)):
            big = mmap.mmap(-1, 5 * MiB)
            try:
                fd = os.open(os.path.join(self.scratch.mnt, "big"), os.O_RDWR)
                try:
                    with memoryview(big) as mv:
                        self.assertEqual(os.readv(fd, [mv[16:16 + 4 * MiB]]), 4 * MiB)
                finally:
                    os.close(fd)
                self.assertTrue(big[16:16 + 4 * MiB] == data, "read back through the mount")
            finally:
                big.close()
            st = mh.stats(self.scratch.mnt)
        self.assertGreater(st["fuse"]["read_ops"], 0)
        self.assertLessEqual(st["fuse"]["largest_read"], MiB, st["fuse"])

    def test_off_and_wronly_keep_the_page_cache(self):
        st = self.write_once(("direct_io=off",), 256, os.O_WRONLY, "off")
        self.assertEqual(st["mount"]["direct_io"], "off")
        self.assertEqual(st["fuse"]["largest_write"], MiB, "page cache: 256 whole pages")
        st = self.write_once(("direct_io=wronly",), 256, os.O_RDWR, "wronly-rdwr")
        self.assertEqual(st["fuse"]["largest_write"], MiB, "O_RDWR under wronly: page cache")
        st = self.write_once(("direct_io=wronly",), 256, os.O_WRONLY, "wronly-wronly")
        self.assertEqual(st["fuse"]["largest_write"], MiB - 16, "O_WRONLY: the writer's pages")


class ReadOnlyMountTest(mh.MountedTestCase):
    MOUNT_OPTIONS = ("ro",)

    def test_ro_refuses_writes_serves_reads(self):
        # Files put straight into BACKING_DIR are served read-only.
        with open(self.b("pre"), "wb") as f:
            f.write(b"preexisting")
        self.assertEqual(self.read(self.m("pre")), b"preexisting")
        for fn in (lambda: open(self.m("pre"), "r+b"), lambda: open(self.m("new"), "wb"),
                   lambda: os.mkdir(self.m("dd"))):
            with self.assertRaises(OSError) as cm:
                fn()
            self.assertEqual(cm.exception.errno, errno.EROFS)


if __name__ == "__main__":
    unittest.main(verbosity=2)
