"""Data lost or misreported (issue 34, items 12-14; issue 45; docs/security.md "Acknowledged means
durable (as on ext4)").

Run: /usr/bin/python3 -m unittest -v tests.security.test_data   (as root)
"""

import errno
import os
import signal
import unittest

from tests.security import sec_util as su
from tests.security.sec_util import MiB, NOBODY


def setUpModule():
    # Everything here mounts as root and acts as uid 65534: without that, skip it all (ctest
    # then shows the test as skipped).
    reason = su.suite_skip_reason()
    if reason:
        raise unittest.SkipTest(reason)


# ---------------------------------------------------------------------------------------------
# Item 12: under `dnvme run`, a write() that returned survives _exit and kill -9.

WRITE_THEN_DIE = r'''
import struct
data = block_pattern(A["n"], A["seed"])
fd = os.open(A["path"], os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
n = os.write(fd, data)
if A["how"] == "exit":
    os._exit(0 if n == len(data) else 5)
emit("written", n=n)  # the test kills us with SIGKILL on this line
time.sleep(120)
'''


class AcknowledgedWriteTest(su.SecurityCase):
    SIZE = 48 * MiB
    ROUNDS = 3  # main's daemon lost bytes in 3 of 4 rounds

    def test_12_returned_write_survives_exit_and_kill9_under_dnvme_run(self):
        reason = su.preload_skip_reason()
        if reason:
            self.skipTest(reason)
        m = self.mount()
        stats = os.path.join(self.scratch.path, "preload.jsonl")
        run = [su.dnvme_bin(), "run", "--stats", stats, "--mount", self.mnt, "--"]
        lost = []
        for rnd in range(self.ROUNDS):
            for how in ("exit", "kill9"):
                seed = rnd * 2 + (how == "kill9")
                path = self.m("ack-%s-%d.bin" % (how, rnd))
                c = self.child(WRITE_THEN_DIE, {"path": path, "n": self.SIZE, "seed": seed,
                                                "how": how}, uid=0, argv_prefix=run)
                if how == "kill9":
                    got = c.expect("written", timeout=120)
                    os.kill(c.p.pid, signal.SIGKILL)  # `dnvme run` execs: this is python
                    c.wait(60)
                    self.assertEqual(got["n"], self.SIZE, got)
                else:
                    self.assertEqual(c.wait(120), 0, "write or _exit failed: %s" % c.stderr())
                want = su.block_pattern(self.SIZE, seed)
                got = self.read_file(path)
                bad = su.first_difference(got, want)
                if bad is not None:
                    zeros = sum(1 for i in range(0, len(got), 4096)
                                if got[i:i + 4096] == b"\0" * 4096)
                    lost.append("%s round %d: size %d, first wrong byte at %d, %d KiB of "
                                "zeros" % (how, rnd, len(got), bad, zeros * 4))
        self.assertEqual(lost, [], "a write() of %d MiB returned, then the writer died; read "
                         "back:" % (self.SIZE // MiB))
        self.alive(m)


# ---------------------------------------------------------------------------------------------
# Item 13: a write-behind ENOSPC is the writer's, never a reader's close.

OPEN_CLOSE = r'''
errs = []
try:
    fd = os.open(A["path"], os.O_RDONLY)
except OSError as e:
    errs.append(["open", e.errno])
else:
    try:
        os.close(fd)
    except OSError as e:
        errs.append(["close", e.errno])
emit("done", errs=errs)
'''


class ErrorOwnerTest(su.SecurityCase):
    def test_13_write_behind_enospc_reaches_the_writer_not_a_readers_close(self):
        ext = su.mount_ext4(self, os.path.join(self.scratch.path, "ext4"), 5, inodes=64)
        avail = su.avail_bytes(ext)
        size = (avail // MiB + 2) * MiB  # 6 MiB into about 5
        if size > 7 * MiB:
            self.skipTest("the 5 MiB ext4 has %d bytes free (want < 6 MiB)" % avail)
        m = self.mount(backing=ext)
        path = self.m("f.bin")
        data = su.nonzero_pattern(size)
        root_errs = []
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        try:
            try:
                for off in range(0, size, MiB):
                    os.write(fd, data[off:off + MiB])
            except OSError as e:
                root_errs.append(("write", e.errno))
            user = su.run_child(OPEN_CLOSE, {"path": path})["done"]["errs"]
            try:
                os.fsync(fd)
            except OSError as e:
                root_errs.append(("fsync", e.errno))
        finally:
            try:
                os.close(fd)
            except OSError as e:
                root_errs.append(("close", e.errno))
        self.assertEqual(user, [], "uid %d's O_RDONLY open and close of a file it may read" %
                         NOBODY)
        self.assertIn(errno.ENOSPC, [e for _, e in root_errs],
                      "root wrote %d bytes into %d free: its write/fsync/close got %s (the "
                      "reader's open/close got %s)" % (size, avail, root_errs, user))
        self.alive(m)


# ---------------------------------------------------------------------------------------------
# Item 14: ENOSPC under `dnvme run` leaves no zero-filled tail.

FILL = r'''
def nonzero_pattern(n, seed=1):
    one = bytes(((i * 7 + seed) % 255) + 1 for i in range(4093))
    return (one * (n // len(one) + 1))[:n]
data = nonzero_pattern(A["n"])
fd = os.open(A["path"], os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
errs, acked = [], 0
try:
    while acked < len(data):
        acked += os.write(fd, data[acked:acked + A["chunk"]])
except OSError as e:
    errs.append(["write", e.errno])
try:
    os.fsync(fd)
except OSError as e:
    errs.append(["fsync", e.errno])
try:
    os.close(fd)
except OSError as e:
    errs.append(["close", e.errno])
emit("done", acked=acked, errs=errs)
'''


class NoZeroTailTest(su.SecurityCase):
    def test_14_enospc_under_dnvme_run_leaves_no_zero_tail(self):
        reason = su.preload_skip_reason()
        if reason:
            self.skipTest(reason)
        for chunk in (24 * MiB, MiB):  # one write of it all, and 1 MiB writes
            with self.subTest(write_size=chunk):
                ext = su.mount_ext4(self, os.path.join(self.scratch.path, "ext4-%d" % chunk), 17,
                                    inodes=64)
                mnt = self.scratch.sub("mnt-%d" % chunk)
                m = self.mount(backing=ext, mnt=mnt)
                path = os.path.join(mnt, "fill.bin")
                avail = su.avail_bytes(ext)
                want = avail + 8 * MiB  # 24 MiB into about 16
                stats = os.path.join(self.scratch.path, "preload.jsonl")
                c = self.child(FILL, {"path": path, "n": want, "chunk": chunk}, uid=0,
                               argv_prefix=[su.dnvme_bin(), "run", "--stats", stats, "--mount",
                                            mnt, "--"])
                got = c.expect("done", timeout=120)
                self.assertEqual(c.wait(60), 0, c.stderr())
                self.assertIn(errno.ENOSPC, [e for _, e in got["errs"]],
                              "%d bytes into %d free: %s" % (want, avail, got))
                st = os.stat(path)
                data = self.read_file(path)
                self.assertEqual(len(data), st.st_size)
                self.assertAllBytes(data, su.nonzero_pattern(st.st_size),
                                    "the file after ENOSPC (%d free, %d bytes acknowledged, "
                                    "size %d, allocated %d)" % (avail, got["acked"], st.st_size,
                                                                st.st_blocks * 512))
                self.alive(m)
                m.stop()


# ---------------------------------------------------------------------------------------------
# Issue 45 (a), issue 54: out of space, the file keeps the part that fit and the writer hears
# ENOSPC at the write that did not fit, as on ext4 -- not later, and nobody else hears it (a
# write refused for space is no writeback error).

READER = r'''
fd = os.open(A["path"], os.O_RDONLY)
emit("opened")
got = []
while True:
    cmd = ask()
    try:
        if cmd == "fsync":
            os.fsync(fd)
        else:
            os.close(fd)
        got.append([cmd, 0])
    except OSError as e:
        got.append([cmd, e.errno])
    if cmd == "close":
        break
emit("done", got=got)
'''


class NoSpaceWriteBehindTest(su.SecurityCase):
    LEFT = 680 * 1024  # free space left on the ext4: less than one engine request (1 MiB)

    def test_15_enospc_at_the_write_that_does_not_fit_keeps_what_fit(self):
        """Through the mount, root writes 3 MiB in 1 MiB writes into a small ext4 with about
        680 KiB free, while uid 65534 holds the file open read-only from before the first write.
        As on ext4 (whose buffered write returns the part that fits and the next one ENOSPC):
        the first write is short, the second fails with ENOSPC, fsync and close succeed, the
        file holds every byte a write returned, and the reader's fsync and close hear nothing.
        Issue 45's main kept nothing (one O_DIRECT request of 1 MiB failed whole); 030fd42 kept
        what fit but acknowledged every write and told the writer only at fsync (and every
        reader at its fsync), issue 54."""
        ext = su.mount_ext4(self, os.path.join(self.scratch.path, "ext4"), 5, inodes=64)
        with open(os.path.join(ext, "filler"), "wb") as f:
            f.write(b"x" * ((su.avail_bytes(ext) - self.LEFT) // 4096 * 4096))
            os.fsync(f.fileno())
        avail = su.avail_bytes(ext)
        if not 256 * 1024 <= avail < MiB:
            self.skipTest("the filled ext4 has %d bytes free (want 256 KiB to 1 MiB)" % avail)
        m = self.mount(backing=ext)
        path = self.m("f.bin")
        size = 3 * MiB
        data = su.nonzero_pattern(size)
        errs, returned = [], []
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        reader = self.child(READER, {"path": path})
        try:
            reader.expect("opened")
            try:
                done = 0
                while done < size:
                    n = os.write(fd, data[done:done + MiB])
                    returned.append(n)
                    done += n
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
        for cmd in ("fsync", "fsync", "close"):
            reader.send(cmd)
        heard = reader.expect("done")["got"]
        self.assertEqual(reader.wait(60), 0, reader.stderr())
        self.assertEqual(errs, [("write", errno.ENOSPC)],
                         "root wrote %d bytes into %d free (writes returned %s): its "
                         "write/fsync/close errors" % (size, avail, returned))
        self.assertEqual(heard, [["fsync", 0], ["fsync", 0], ["close", 0]],
                         "uid %d's read-only descriptor, opened before the writes: its fsync, "
                         "fsync and close" % NOBODY)
        got = self.read_file(path)
        st = os.stat(os.path.join(ext, "f.bin"))
        self.assertEqual(len(got), st.st_size, "the mount and BACKING_DIR disagree on the size")
        self.assertEqual(len(got), sum(returned), "the file against what the writes returned")
        self.assertAllBytes(got, data[:len(got)], "the file after ENOSPC")
        # ext4 may take a block or two of what was free for the file's own extent tree.
        self.assertGreaterEqual(len(got), avail - 64 * 1024,
                                "%d bytes free, %d written: the file kept %d (writer heard %s)" %
                                (avail, size, len(got), errs))
        self.alive(m)


# ---------------------------------------------------------------------------------------------
# Issue 45 (b): under `dnvme run`, the write after the daemon died fails (ENOTCONN), as through
# the dead mount; what earlier writes returned is in BACKING_DIR.

WRITE_KILL_WRITE = r'''
def nonzero_pattern(n, seed=1):
    one = bytes(((i * 7 + seed) % 255) + 1 for i in range(4093))
    return (one * (n // len(one) + 1))[:n]
data = nonzero_pattern(A["n"] * 2)
fd = os.open(A["path"], os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
acked = 0
while acked < A["n"]:
    acked += os.write(fd, data[acked:acked + (1 << 20)])
emit("written", acked=acked)
ask()  # the test kills the daemon, then says go
got = []
for call in ("write", "write", "fsync", "close"):
    try:
        if call == "write":
            got.append([call, os.write(fd, data[acked:acked + (1 << 20)])])
        elif call == "fsync":
            os.fsync(fd)
            got.append([call, 0])
        else:
            os.close(fd)
            got.append([call, 0])
    except OSError as e:
        got.append([call, -e.errno])
emit("done", got=got)
'''


class DeadDaemonTest(su.SecurityCase):
    SIZE = 4 * MiB

    def test_16_write_after_the_daemon_died_fails_under_dnvme_run(self):
        """Under `dnvme run`, a program writes 4 MiB in 1 MiB writes (direct, to the backing
        file), the daemon is killed (-9), and the program writes again: that write fails with
        ENOTCONN, as through the dead mount, and so do the next write, the fsync and the close;
        the 4 MiB that returned are in BACKING_DIR. Main's writes kept succeeding around the dead
        mount and ENOTCONN came only at fsync or close (issue 45)."""
        reason = su.preload_skip_reason()
        if reason:
            self.skipTest(reason)
        m = self.mount()
        stats = os.path.join(self.scratch.path, "preload.jsonl")
        c = self.child(WRITE_KILL_WRITE, {"path": self.m("d.bin"), "n": self.SIZE}, uid=0,
                       argv_prefix=[su.dnvme_bin(), "run", "--stats", stats, "--mount",
                                    self.mnt, "--"])
        self.assertEqual(c.expect("written", timeout=120)["acked"], self.SIZE)
        m.kill9()
        c.send("go")
        got = c.expect("done", timeout=120)["got"]
        c.wait(60)
        dead = (-errno.ENOTCONN, -errno.ECONNABORTED)
        self.assertEqual([call for call, _ in got], ["write", "write", "fsync", "close"], got)
        for call, res in got:
            self.assertIn(res, dead, "after the daemon died, the program's %s returned %s "
                          "(all: %s)" % (call, res, got))
        with open(self.b("d.bin"), "rb") as f:
            data = f.read()
        self.assertAllBytes(data, su.nonzero_pattern(self.SIZE), "BACKING_DIR's file")


if __name__ == "__main__":
    unittest.main()
