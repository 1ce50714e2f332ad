"""Acknowledged means landed (issue 54; docs/security.md, "The durability contract"): a full
backing file system, a user's quota, other writers taking the space meanwhile, a backing file
system that fails or goes read-only, the backing file truncated or removed underneath.

Every writer here is compared with the same writer on the backing file system itself (the
"plain" column) in the same run: the error comes at the same call (ENOSPC/EDQUOT at the write that
does not fit, not at close), and the file holds exactly the bytes the calls said were written.
On 030fd42 a 48 MiB tmpfs took ~30 MiB more than fit through the mount (the writes returned, the
bytes were gone; ENOSPC came at a later write and at close) and torch.save exited 0 with a
truncated checkpoint when its close was not checked.

Run: /usr/bin/python3 -m unittest -v tests.security.test_space   (as root)
"""

import ctypes
import errno
import os
import re
import shutil
import subprocess
import time
import unittest

from tests.security import sec_util as su
from tests.security.sec_util import MiB, NOBODY, PY


def setUpModule():
    reason = su.suite_skip_reason()
    if reason:
        raise unittest.SkipTest(reason)


# A writer of 1 MiB os.write calls until one fails: what the calls returned, where the first
# error came, and the close's error.
WRITE_LOOP = r'''
data = block_pattern(A["total"], A["seed"])
fd = os.open(A["path"], os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
acked, err, returns = 0, 0, []
while acked < A["total"]:
    if A.get("pause_at") and acked >= A["pause_at"] and not A.get("paused"):
        A["paused"] = True
        emit("paused", acked=acked)
        ask()
    try:
        n = os.write(fd, data[acked:acked + A["chunk"]])
    except OSError as e:
        err = e.errno
        break
    returns.append(n)
    acked += n
close_err = 0
try:
    os.close(fd)
except OSError as e:
    close_err = e.errno
emit("done", acked=acked, err=err, close_err=close_err, shorts=[r for r in returns if r != A["chunk"]])
'''

COPY_LOOP = r'''
# The source on the same file system (copy_file_range between file systems is EXDEV), copied
# over and over into the destination in 1 MiB pieces.
src = os.open(A["src"], os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
os.write(src, block_pattern(A["src_size"], A["seed"]))
dst = os.open(A["path"], os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
acked, err = 0, 0
while acked < A["total"]:
    at = acked % A["src_size"]
    try:
        n = os.copy_file_range(src, dst, min(1 << 20, A["src_size"] - at), at)
    except OSError as e:
        err = e.errno
        break
    if n == 0:
        break
    acked += n
close_err = 0
try:
    os.close(dst)
except OSError as e:
    close_err = e.errno
os.close(src)
os.unlink(A["src"])
emit("done", acked=acked, err=err, close_err=close_err)
'''

SAVERS = {
    "torch.save": "import torch\ntorch.save({'w': torch.ones(%d // 4)}, %r)\nprint('saved')",
    "np.save": "import numpy as np\nnp.save(%r, np.ones(%d // 8))\nprint('saved')",
}


def wait_space(path, want, timeout=20.0):
    """Waits until `path`'s file system has `want` bytes free for users again: FUSE frees a
    removed file's blocks once the kernel sends RELEASE and FORGET, after close/unlink returned."""
    deadline = time.monotonic() + timeout
    while su.avail_bytes(path) < want:
        os.sync()  # btrfs frees a removed file's extents when its transaction commits
        if time.monotonic() > deadline:
            raise AssertionError("%s: %d bytes free, want %d" % (path, su.avail_bytes(path), want))
        time.sleep(0.05)


class SpaceCase(su.SecurityCase):
    def small_tmpfs(self, name, size_mib):
        where = os.path.join(self.scratch.path, name)
        os.makedirs(where)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=%dm,mode=0755" % size_mib,
                            "dnvme-space", where], capture_output=True, text=True)
        if r.returncode != 0:
            self.skipTest("cannot mount a tmpfs: %s" % r.stderr.strip())
        self.addCleanup(lambda: subprocess.run(["umount", "-l", where], capture_output=True))
        return where

    def loop_fs(self, name, size_mib, mkfs, mount_opts="loop"):
        """A file system made by `mkfs` (argv, the image appended) on a loop device."""
        if shutil.which(mkfs[0]) is None:
            self.skipTest("%s is missing (scripts/packages.sh installs it)" % mkfs[0])
        reason = su.ext4_skip_reason()
        if reason:
            self.skipTest(reason)
        where = os.path.join(self.scratch.path, name)
        img = where + ".img"
        with open(img, "wb") as f:
            f.truncate(size_mib * MiB)
        r = subprocess.run(mkfs + [img], capture_output=True, text=True)
        if r.returncode != 0:
            self.skipTest("%s failed: %s" % (mkfs[0], r.stderr.strip()[-300:]))
        os.makedirs(where)
        r = subprocess.run(["mount", "-o", mount_opts, img, where], capture_output=True, text=True)
        if r.returncode != 0:
            # The kernel says why in its log (a quota format it was built without, say).
            why = subprocess.run(["dmesg"], capture_output=True, text=True).stdout.splitlines()
            self.skipTest("cannot mount %s: %s (kernel: %s)" %
                          (name, r.stderr.strip().splitlines()[0], (why or ["?"])[-1]))
        self.addCleanup(su._umount, where)
        os.chmod(where, 0o755)
        return where

    def write_loop(self, path, total, uid=0, argv_prefix=(), chunk=MiB, seed=3, **extra):
        args = {"path": path, "total": total, "chunk": chunk, "seed": seed}
        args.update(extra)
        c = self.child(WRITE_LOOP, args, uid=uid, argv_prefix=argv_prefix)
        return c

    def assertHoldsWhatWasAcked(self, path, got, seed=3, what=""):
        data = self.read_file(path)
        self.assertEqual(len(data), got["acked"],
                         "%s: the file holds %d bytes, the writes returned %d" %
                         (what, len(data), got["acked"]))
        self.assertAllBytes(data, su.block_pattern(got["acked"], seed), what)

    def assertLikePlain(self, got, plain, what, want_err=errno.ENOSPC, slack=2 * MiB):
        """The writer through the mount met the error where the plain one did: at a write (not
        at close), with about as many bytes accepted."""
        self.assertEqual(got["err"], want_err,
                         "%s: the first error at a write: %s (plain: %s)" % (what, got, plain))
        self.assertEqual(got["close_err"], 0,
                         "%s: close after the refused write: %s (plain: %s)" % (what, got, plain))
        self.assertGreaterEqual(got["acked"], plain["acked"] - slack,
                                "%s: accepted far less than the plain writer: %s / %s" %
                                (what, got, plain))
        self.assertLessEqual(got["acked"], plain["acked"] + slack, "%s: %s / %s" %
                             (what, got, plain))


# ---------------------------------------------------------------------------------------------
# A full backing file system: every kind of writer, on the file system itself, through the mount
# and under `dnvme run`.

class FullBackingTest(SpaceCase):
    SIZE_MIB = 48

    def setUp(self):
        super().setUp()
        self.fs = self.small_tmpfs("tmpfs", self.SIZE_MIB)
        self.back = os.path.join(self.fs, "backing")
        os.mkdir(self.back)
        os.chmod(self.back, 0o755)
        self.m_ = self.mount(backing=self.back)
        self.empty = su.avail_bytes(self.fs)
        self.total = 2 * self.SIZE_MIB * MiB
        self.columns = [("plain", self.back, ())]
        self.columns.append(("mount", self.mnt, ()))
        if su.preload_skip_reason() is None:
            self.columns.append(("dnvme run", self.mnt,
                                 (su.dnvme_bin(), "run", "--mount", self.mnt, "--")))
        else:
            print("\n[space] dnvme run column skipped: %s" % su.preload_skip_reason())

    def each_column(self, run):
        """run(name, dir, argv_prefix) for each column, the file removed and the space back
        between them; returns {name: result}."""
        out = {}
        for name, where, prefix in self.columns:
            out[name] = run(name, where, prefix)
            for f in os.listdir(self.back):
                os.unlink(os.path.join(self.back if where == self.back else self.mnt, f))
            wait_space(self.fs, self.empty - 64 * 1024)
        return out

    def test_write_loop_gets_enospc_at_the_write_and_keeps_every_acked_byte(self):
        def run(name, where, prefix):
            c = self.write_loop(os.path.join(where, "loop.bin"), self.total, argv_prefix=prefix)
            got = c.expect("done", timeout=120)
            self.assertHoldsWhatWasAcked(os.path.join(where, "loop.bin"), got, what=name)
            return got
        res = self.each_column(run)
        print("\n[space] 1 MiB writes into a %d MiB tmpfs: %s" % (self.SIZE_MIB, res))
        self.assertEqual(res["plain"]["err"], errno.ENOSPC, res)
        for name in res:
            if name != "plain":
                self.assertLikePlain(res[name], res["plain"], name)
        self.alive(self.m_)

    def test_unaligned_write_loop_too(self):
        # 100,003-byte writes: every one starts inside a page.
        def run(name, where, prefix):
            c = self.write_loop(os.path.join(where, "odd.bin"), self.total, argv_prefix=prefix,
                                chunk=100_003)
            got = c.expect("done", timeout=120)
            self.assertHoldsWhatWasAcked(os.path.join(where, "odd.bin"), got, what=name)
            return got
        res = self.each_column(run)
        print("\n[space] 100,003-byte writes: %s" % res)
        for name in res:
            if name != "plain":
                self.assertLikePlain(res[name], res["plain"], name)

    def test_dd_fails_at_the_write_and_its_copied_bytes_are_there(self):
        src = os.path.join(self.scratch.path, "dd-in.bin")
        with open(src, "wb") as f:
            f.write(su.block_pattern(self.total, 5))

        def run(name, where, prefix):
            out = os.path.join(where, "dd.bin")
            r = subprocess.run(list(prefix) + ["dd", "if=" + src, "of=" + out, "bs=1M"],
                               capture_output=True, text=True, timeout=120)
            self.assertNotEqual(r.returncode, 0, "%s: dd of %d bytes into %d MiB succeeded" %
                                (name, self.total, self.SIZE_MIB))
            self.assertIn("error writing", r.stderr, name)
            self.assertIn("No space left on device", r.stderr, name)
            copied = int(re.search(r"^(\d+) bytes", r.stderr, re.M).group(1))
            data = self.read_file(out)
            self.assertEqual(len(data), copied, "%s: dd said %d bytes were copied" % (name, copied))
            self.assertAllBytes(data, su.block_pattern(copied, 5), name)
            return copied
        res = self.each_column(run)
        print("\n[space] dd: bytes copied %s" % res)
        for name in res:
            self.assertGreaterEqual(res[name], res["plain"] - 2 * MiB, res)

    def test_savers_fail_loudly(self):
        # torch.save and np.save of more than fits: neither may finish as if it had worked.
        for saver, code in SAVERS.items():
            def run(name, where, prefix):
                path = os.path.join(where, "save.bin")
                text = code % ((self.total, path) if saver == "torch.save" else (path, self.total))
                r = subprocess.run(list(prefix) + [PY, "-c", text], capture_output=True,
                                   text=True, timeout=180)
                return r.returncode, "saved" in r.stdout, r.stderr.strip().splitlines()[-1:]
            res = self.each_column(run)
            print("\n[space] %s: %s" % (saver, res))
            for name, (rc, saved, tail) in res.items():
                self.assertFalse(saved or rc == 0, "%s %s of %d bytes into %d MiB 'worked': %s" %
                                 (name, saver, self.total, self.SIZE_MIB, tail))

    def test_copy_file_range_gets_enospc_and_keeps_what_it_copied(self):
        # FUSE has no copy_file_range of ours: the kernel copies through WRITEs, which must meet
        # the error as any other write does.
        src_size = 8 * MiB

        def run(name, where, prefix):
            path = os.path.join(where, "cfr.bin")
            c = self.child(COPY_LOOP, {"src": os.path.join(where, "cfr-src.bin"), "path": path,
                                       "total": self.total, "src_size": src_size, "seed": 3},
                           uid=0, argv_prefix=prefix)
            got = c.expect("done", timeout=120)
            data = self.read_file(path)
            self.assertEqual(len(data), got["acked"], "%s: %s" % (name, got))
            one = su.block_pattern(src_size, 3)
            want = (one * (got["acked"] // src_size + 1))[:got["acked"]]
            self.assertAllBytes(data, want, name)
            return got
        res = self.each_column(run)
        print("\n[space] copy_file_range: %s" % res)
        self.assertEqual(res["plain"]["err"], errno.ENOSPC, res)
        for name in res:
            if name != "plain":
                self.assertLikePlain(res[name], res["plain"], name)

    def test_fallocate_past_the_free_space_is_refused_and_changes_nothing(self):
        for name, where, _ in self.columns[:2]:
            path = os.path.join(where, "falloc.bin")
            with open(path, "wb") as f:
                f.write(b"f" * 4096)
                err = su.fallocate(f.fileno(), 0, 0, self.total)
            self.assertEqual(err, errno.ENOSPC, name)
            self.assertEqual(os.path.getsize(path), 4096, name)
            os.unlink(path)
            wait_space(self.fs, self.empty - 64 * 1024)


# ---------------------------------------------------------------------------------------------
# The file systems a backing directory lives on: each preallocates differently (ext4 without
# extents and ramfs not at all), so each gets the same writer, through the mount and plain.

class FileSystemsTest(SpaceCase):
    def fill(self, fs, what, want_through=False):
        back = os.path.join(fs, "backing")
        os.mkdir(back)
        os.chmod(back, 0o755)
        free = su.avail_bytes(fs)
        c = self.write_loop(os.path.join(back, "plain.bin"), 2 * free + 64 * MiB)
        plain = c.expect("done", timeout=300)
        self.assertHoldsWhatWasAcked(os.path.join(back, "plain.bin"), plain, what=what + " plain")
        os.unlink(os.path.join(back, "plain.bin"))
        wait_space(fs, free - MiB)
        m = self.mount(backing=back)
        c = self.write_loop(self.m("mount.bin"), 2 * free + 64 * MiB)
        got = c.expect("done", timeout=300)
        self.assertHoldsWhatWasAcked(self.m("mount.bin"), got, what=what + " mount")
        stats = su.mh.stats(self.mnt)["fuse"]
        print("\n[space] %s (%d MiB free): plain %s, mount %s; write-through %d, short %d" %
              (what, free // MiB, plain, got, stats["space_write_through"],
               stats["space_short_writes"]))
        self.assertLikePlain(got, plain, what, slack=4 * MiB)
        if want_through:
            self.assertGreater(stats["space_write_through"], 0,
                               "without fallocate the budget wrote the last writes through")
        self.alive(m)

    def test_ext4(self):
        self.fill(su.mount_ext4(self, os.path.join(self.scratch.path, "ext4"), 64), "ext4")

    def test_ext4_without_extents(self):
        # No fallocate (EOPNOTSUPP): the statvfs budget writes through near the end.
        fs = self.loop_fs("ext2ish", 64, ["mkfs.ext4", "-q", "-F", "-b", "4096", "-m", "0", "-O",
                                          "^extent,^64bit,^flex_bg,^has_journal"])
        self.fill(fs, "ext4 without extents", want_through=True)

    def test_xfs(self):
        self.fill(self.loop_fs("xfs", 320, ["mkfs.xfs", "-q", "-f"]), "xfs")

    def test_btrfs(self):
        self.fill(self.loop_fs("btrfs", 256, ["mkfs.btrfs", "-q", "-f"]), "btrfs")

    def test_tmpfs(self):
        self.fill(self.small_tmpfs("tmpfs", 64), "tmpfs")

    def test_overlayfs(self):
        lower = os.path.join(self.scratch.path, "lower")
        os.mkdir(lower)
        up = self.small_tmpfs("upper", 64)
        os.mkdir(os.path.join(up, "u"))
        os.mkdir(os.path.join(up, "w"))
        where = os.path.join(self.scratch.path, "ovl")
        os.mkdir(where)
        r = subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                            "lowerdir=%s,upperdir=%s/u,workdir=%s/w" % (lower, up, up), where],
                           capture_output=True, text=True)
        if r.returncode != 0:
            self.skipTest("cannot mount an overlayfs: %s" % r.stderr.strip())
        self.addCleanup(lambda: subprocess.run(["umount", "-l", where], capture_output=True))
        self.fill(where, "overlayfs")


# ---------------------------------------------------------------------------------------------
# A user's quota: EDQUOT at the write, as the user (the daemon reserves as the writer).

class _DqBlk(ctypes.Structure):
    _fields_ = [("bhardlimit", ctypes.c_uint64), ("bsoftlimit", ctypes.c_uint64),
                ("curspace", ctypes.c_uint64), ("ihardlimit", ctypes.c_uint64),
                ("isoftlimit", ctypes.c_uint64), ("curinodes", ctypes.c_uint64),
                ("btime", ctypes.c_uint64), ("itime", ctypes.c_uint64),
                ("valid", ctypes.c_uint32)]


def set_block_quota(device, uid, limit_bytes):
    """quotactl(Q_SETQUOTA, USRQUOTA): a hard block limit for `uid`; 0 or the errno."""
    q_setquota, usrquota, qif_blimits = 0x800008, 0, 1
    libc = ctypes.CDLL(None, use_errno=True)
    d = _DqBlk(bhardlimit=limit_bytes // 1024, bsoftlimit=limit_bytes // 1024, valid=qif_blimits)
    cmd = (q_setquota << 8) | usrquota
    if libc.quotactl(cmd, device.encode(), uid, ctypes.byref(d)) != 0:
        return ctypes.get_errno()
    return 0


class QuotaTest(SpaceCase):
    LIMIT = 8 * MiB

    def test_edquot_at_the_write_of_the_user_over_its_quota(self):
        fs = self.loop_fs("quota", 96, ["mkfs.ext4", "-q", "-F", "-b", "4096", "-m", "0", "-O",
                                        "quota,^has_journal"], mount_opts="loop,usrquota")
        dev = subprocess.run(["findmnt", "-n", "-o", "SOURCE", fs], capture_output=True,
                             text=True).stdout.strip()
        err = set_block_quota(dev, NOBODY, self.LIMIT)
        if err:
            self.skipTest("quotactl(Q_SETQUOTA) on %s: %s" % (dev, os.strerror(err)))
        back = os.path.join(fs, "backing")
        os.mkdir(back)
        os.chmod(back, 0o755)
        for d in ("plain", "viamount"):
            os.mkdir(os.path.join(back, d))
            os.chown(os.path.join(back, d), NOBODY, NOBODY)
        c = self.write_loop(os.path.join(back, "plain", "f"), 4 * self.LIMIT, uid=NOBODY)
        plain = c.expect("done", timeout=120)
        os.unlink(os.path.join(back, "plain", "f"))
        wait_space(fs, su.avail_bytes(fs))
        m = self.mount(backing=back)
        c = self.write_loop(self.m("viamount", "f"), 4 * self.LIMIT, uid=NOBODY)
        got = c.expect("done", timeout=120)
        print("\n[space] uid %d over an %d MiB quota: plain %s, mount %s" %
              (NOBODY, self.LIMIT // MiB, plain, got))
        self.assertEqual(plain["err"], errno.EDQUOT, plain)
        self.assertLikePlain(got, plain, "quota", want_err=errno.EDQUOT, slack=MiB)
        self.assertHoldsWhatWasAcked(self.m("viamount", "f"), got, what="quota")
        self.alive(m)


# ---------------------------------------------------------------------------------------------
# The other ways acknowledged bytes could be lost (issue 54, item 2).

class OtherWaysTest(SpaceCase):
    def test_another_writer_fills_the_file_system_meanwhile(self):
        """A writer through the mount pauses after 8 MiB; another process fills the tmpfs
        directly; the writer goes on. Its writes must be refused at the write (its reservation
        runs out), never accepted and lost."""
        fs = self.small_tmpfs("tmpfs", 64)
        back = os.path.join(fs, "backing")
        os.mkdir(back)
        m = self.mount(backing=back)
        c = self.write_loop(self.m("w.bin"), 128 * MiB, pause_at=8 * MiB)
        c.expect("paused", timeout=60)
        with open(os.path.join(fs, "filler"), "wb") as f:
            try:
                while True:
                    f.write(b"F" * MiB)
                    f.flush()
            except OSError as e:
                self.assertEqual(e.errno, errno.ENOSPC)
        c.send("go")
        got = c.expect("done", timeout=60)
        print("\n[space] another writer filled the tmpfs: %s" % got)
        self.assertEqual(got["err"], errno.ENOSPC, got)
        self.assertEqual(got["close_err"], 0, got)
        self.assertHoldsWhatWasAcked(self.m("w.bin"), got, what="with another writer")
        self.alive(m)

    def test_a_backing_file_system_that_fails_is_reported_to_the_writer(self):
        """The backing ext4 shuts down (EXT4_IOC_SHUTDOWN, as after a device failure) while
        write-behind holds acknowledged bytes: they cannot land, and the writer must hear so at
        its fsync (as on ext4 itself, whose page cache is lost the same way); the daemon lives."""
        ext = su.mount_ext4(self, os.path.join(self.scratch.path, "ext4"), 64)
        back = os.path.join(ext, "backing")
        os.mkdir(back)
        m = self.mount(backing=back, options=su.OPTIONS + ("write_behind=64M",))
        fd = os.open(self.m("dying.bin"), os.O_CREAT | os.O_WRONLY, 0o644)
        errs = []
        try:
            os.write(fd, su.block_pattern(8 * MiB))
            ext4_ioc_shutdown, nologflush = 0x8004587D, 2
            dfd = os.open(ext, os.O_RDONLY)
            try:
                import fcntl
                import struct
                fcntl.ioctl(dfd, ext4_ioc_shutdown, struct.pack("I", nologflush))
            finally:
                os.close(dfd)
            try:
                os.write(fd, su.block_pattern(MiB))
            except OSError as e:
                errs.append(("write", e.errno))
            try:
                os.fsync(fd)
            except OSError as e:
                errs.append(("fsync", e.errno))
        finally:
            try:
                os.close(fd)
            except OSError as e:
                errs.append(("close", e.errno))
        print("\n[space] backing ext4 shut down under write-behind: %s" % errs)
        self.assertTrue(any(call == "fsync" and e == errno.EIO for call, e in errs) or
                        any(call == "write" and e == errno.EIO for call, e in errs), errs)
        self.alive(m)

    def test_a_read_only_remount_waits_for_the_writers(self):
        """remount,ro is refused (EBUSY) while the daemon holds a file open for writing, so it
        cannot strand write-behind bytes; once the writer closed it succeeds, every byte the
        writer was told about is there, and a new writer is refused at its open (EROFS)."""
        ext = su.mount_ext4(self, os.path.join(self.scratch.path, "ext4"), 64)
        back = os.path.join(ext, "backing")
        os.mkdir(back)
        self.mount(backing=back)
        data = su.block_pattern(6 * MiB)
        fd = os.open(self.m("ro.bin"), os.O_CREAT | os.O_WRONLY, 0o644)
        os.write(fd, data)
        r = subprocess.run(["mount", "-o", "remount,ro", ext], capture_output=True, text=True)
        self.assertNotEqual(r.returncode, 0, "remounted read-only under a writer")
        os.close(fd)
        deadline = time.monotonic() + 20
        while subprocess.run(["mount", "-o", "remount,ro", ext],
                             capture_output=True).returncode != 0:
            self.assertLess(time.monotonic(), deadline, "never remounted read-only after close")
            time.sleep(0.1)
        self.addCleanup(subprocess.run, ["mount", "-o", "remount,rw", ext], capture_output=True)
        self.assertAllBytes(self.read_file(os.path.join(back, "ro.bin")), data, "after remount")
        with self.assertRaises(OSError) as cm:
            os.open(self.m("new.bin"), os.O_CREAT | os.O_WRONLY, 0o644)
        self.assertEqual(cm.exception.errno, errno.EROFS)

    def test_backing_file_truncated_or_removed_underneath(self):
        """BACKING_DIR changed behind the mount (docs/security.md: unsupported, but no byte a
        write returned after the change may go missing, and nothing fails or crashes): a
        truncate to 0 between two halves, then an unlink of another file mid-stream."""
        m = self.mount()
        half = su.block_pattern(4 * MiB, 9)
        fd = os.open(self.m("t.bin"), os.O_CREAT | os.O_WRONLY, 0o644)
        os.write(fd, half)
        os.truncate(self.b("t.bin"), 0)
        os.pwrite(fd, half, 4 * MiB)
        os.close(fd)
        got = self.read_file(self.m("t.bin"))
        self.assertEqual(len(got), 8 * MiB)
        self.assertAllBytes(got[4 * MiB:], half, "the half written after the truncate")
        fd = os.open(self.m("u.bin"), os.O_CREAT | os.O_WRONLY, 0o644)
        os.write(fd, half)
        os.unlink(self.b("u.bin"))
        os.write(fd, half)
        os.fsync(fd)
        os.close(fd)
        self.assertFalse(os.path.exists(self.b("u.bin")))
        self.alive(m)


if __name__ == "__main__":
    unittest.main()
