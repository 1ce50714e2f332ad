"""FUSE passthrough per open (fs/fuse/passthrough.h) on a real mount: which opens the kernel
serves from the backing file itself, and that readers and writers stay coherent with the
daemon's write-behind and read-ahead across the switch. Skips (with the reason) where the kernel
does not offer passthrough or the daemon may not register backing files.
Run: /usr/bin/python3 -m unittest -v tests.fs.test_passthrough
"""
import errno
import mmap
import os
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mount_harness as mh  # noqa: E402

MiB = 1 << 20
CAP_SYS_ADMIN = 21


def fuse(mnt):
    return mh.stats(mnt)["fuse"]


def cap_masks(pid):
    out = {}
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("Cap"):
                key, value = line.split(":")
                out[key] = int(value.strip(), 16)
    return out


class PassthroughCase(mh.MountedTestCase):
    def setUp(self):
        super().setUp()
        reason = mh.passthrough_skip_reason(self.mnt)
        if reason:
            self.skipTest(reason)
        self.buf = mmap.mmap(-1, 8 * MiB)  # page-aligned, for O_DIRECT
        self.addCleanup(self.buf.close)

    def direct_read(self, path, n, off=0):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            got = os.preadv(fd, [memoryview(self.buf)[:n]], off)
            return bytes(self.buf[:got])
        finally:
            os.close(fd)


class DirectPolicyTest(PassthroughCase):
    """-o passthrough=direct: read-only O_DIRECT opens."""

    MOUNT_OPTIONS = ("passthrough=direct",)

    def test_reported_in_stats(self):
        s = mh.stats(self.mnt)
        self.assertEqual(s["mount"]["passthrough"], "direct")
        self.assertTrue(s["kernel"]["kernel_protocol"].startswith("7."))
        self.assertEqual(s["kernel"]["passthrough"], {"wanted": True, "offered": True, "on": True})

    def test_direct_reader_is_served_by_the_kernel_after_write_behind_landed(self):
        data = os.urandom(4 * MiB + 4096)
        # A buffered writer: its bytes wait in write-behind until close drains them; the
        # passthrough open that follows must see every one of them.
        self.write(self.m("d1"), data)
        before = fuse(self.mnt)
        self.assertBytesEqual(self.direct_read(self.m("d1"), len(data)), data, "O_DIRECT read")
        after = fuse(self.mnt)
        self.assertEqual(after["passthrough_opens"], before["passthrough_opens"] + 1)
        self.assertEqual(after["read_ops"], before["read_ops"], "a READ reached the daemon")
        self.assertEqual(after["backing_files"], 0, "the backing id outlived its last open")

    def test_buffered_reader_and_writers_go_through_the_daemon(self):
        data = os.urandom(MiB)
        self.write(self.m("d2"), data)
        before = fuse(self.mnt)
        self.assertBytesEqual(self.read(self.m("d2")), data, "buffered read")
        after = fuse(self.mnt)
        self.assertEqual(after["passthrough_opens"], before["passthrough_opens"])
        self.assertGreater(after["read_ops"], before["read_ops"])

    def test_no_passthrough_while_another_open_may_hold_write_behind(self):
        data = os.urandom(2 * MiB)
        with open(self.m("d3"), "wb") as w:
            w.write(data)
            w.flush()  # in write-behind, the writer still open
            before = fuse(self.mnt)
            self.assertBytesEqual(self.direct_read(self.m("d3"), len(data)), data,
                                  "O_DIRECT read beside an open writer")
            self.assertEqual(fuse(self.mnt)["passthrough_opens"], before["passthrough_opens"],
                             "passthrough was chosen while a writer was open")

    def test_writer_that_joins_a_passthrough_reader_is_coherent(self):
        data = bytearray(os.urandom(2 * MiB))
        self.write(self.m("d4"), bytes(data))
        rfd = os.open(self.m("d4"), os.O_RDONLY | os.O_DIRECT)
        try:
            before = fuse(self.mnt)
            # The kernel requires every open of a passthrough inode to be passthrough.
            with open(self.m("d4"), "r+b") as w:
                w.seek(4096)
                w.write(b"x" * 8192)
                data[4096:4096 + 8192] = b"x" * 8192
                self.assertEqual(fuse(self.mnt)["passthrough_opens"],
                                 before["passthrough_opens"] + 1)
                n = os.preadv(rfd, [memoryview(self.buf)[:len(data)]], 0)
                self.assertBytesEqual(bytes(self.buf[:n]), bytes(data),
                                      "the passthrough reader sees the writer's bytes")
        finally:
            os.close(rfd)
        self.assertBytesEqual(self.read(self.b("d4")), bytes(data), "BACKING_DIR")
        mh.drop_caches()
        self.assertBytesEqual(self.read(self.m("d4")), bytes(data),
                              "a later reader through the daemon")

    def test_unaligned_direct_read_fails_as_on_the_backing_filesystem(self):
        self.write(self.m("d5"), os.urandom(64 * 1024))
        outcomes = []
        for path in (self.m("d5"), self.b("d5")):
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            try:
                os.preadv(fd, [memoryview(self.buf)[1:4097]], 0)
                outcomes.append("ok")
            except OSError as e:
                outcomes.append(mh.errno_name(e.errno))
            finally:
                os.close(fd)
        self.assertEqual(outcomes[0], outcomes[1], "mount vs BACKING_DIR")
        self.assertEqual(outcomes[0], mh.errno_name(errno.EINVAL))

    def test_daemon_keeps_cap_sys_admin_dormant(self):
        pid = mh.find_daemon_pids(self.mnt)[0]
        caps = cap_masks(pid)
        self.assertTrue(caps["CapPrm"] & (1 << CAP_SYS_ADMIN), "not permitted: %r" % caps)
        self.assertFalse(caps["CapEff"] & (1 << CAP_SYS_ADMIN), "effective: %r" % caps)


class ReadPolicyTest(PassthroughCase):
    """The default policy, -o passthrough=read: every read-only open, mmap included."""

    def test_default_policy_in_stats(self):
        s = mh.stats(self.mnt)
        self.assertEqual(s["mount"]["passthrough"], "read")
        self.assertEqual(s["kernel"]["passthrough"], {"wanted": True, "offered": True, "on": True})

    def test_buffered_and_mmap_readers_are_served_by_the_kernel(self):
        data = os.urandom(3 * MiB + 100)
        self.write(self.m("r1"), data)
        before = fuse(self.mnt)
        self.assertBytesEqual(self.read(self.m("r1")), data, "buffered read")
        with open(self.m("r1"), "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
            self.assertBytesEqual(m[:], data, "mmap")
        after = fuse(self.mnt)
        self.assertEqual(after["passthrough_opens"], before["passthrough_opens"] + 2)
        self.assertEqual(after["read_ops"], before["read_ops"])

    def test_daemon_reads_are_not_stale_after_passthrough_writes(self):
        # Read through the daemon first so its read-ahead holds the old bytes.
        old = os.urandom(2 * MiB)
        self.write(self.m("r2"), old)
        with open(self.m("r2"), "r+b") as f:  # not read-only: through the daemon
            self.assertBytesEqual(f.read(), old, "first read")
        new = bytearray(old)
        with open(self.m("r2"), "rb") as reader:  # passthrough
            with open(self.m("r2"), "r+b") as w:  # joins it
                w.write(b"n" * MiB)
                new[:MiB] = b"n" * MiB
            self.assertBytesEqual(reader.read(), bytes(new), "passthrough reader")
        with open(self.m("r2"), "r+b") as f:  # through the daemon again
            self.assertBytesEqual(f.read(), bytes(new), "daemon read after passthrough writes")


class EngineOpenTest(PassthroughCase):
    """Read-only opens the read policy sends to the engine (datapath/read_policy.h,
    ColdReadsToEngine): served by the daemon with FOPEN_DIRECT_IO, each read(2) one READ of its
    whole size, mmap still working; smaller files stay passthrough. read_cache=off sends every
    large one."""

    MOUNT_OPTIONS = ("read_cache=off", "engine_reads_from=8M")

    def test_large_read_only_opens_are_served_by_the_engine_in_whole_requests(self):
        size = 24 * MiB
        data = os.urandom(size)
        with open(self.b("e1"), "wb") as f:
            f.write(data)
        before = fuse(self.mnt)
        buf = mmap.mmap(-1, MiB)  # page-aligned: a 1 MiB read spans exactly 256 pages
        self.addCleanup(buf.close)
        got = bytearray()
        reads = 0
        fd = os.open(self.m("e1"), os.O_RDONLY)
        try:
            while True:
                n = os.readv(fd, [buf])
                reads += 1
                if n == 0:
                    break
                got += buf[:n]
        finally:
            os.close(fd)
        self.assertBytesEqual(bytes(got), data, "read through the engine")
        after = fuse(self.mnt)
        self.assertEqual(after["engine_opens"], before["engine_opens"] + 1)
        self.assertEqual(after["passthrough_opens"], before["passthrough_opens"])
        # The request sizes the daemon receives: one READ of 1 MiB per read(2) (the end of the
        # file may cost one more, empty).
        self.assertEqual(after["largest_read"], MiB)
        self.assertGreaterEqual(after["read_ops"] - before["read_ops"], size // MiB)
        self.assertLessEqual(after["read_ops"] - before["read_ops"], reads)
        self.assertEqual(after["bytes_read_cached"], before["bytes_read_cached"])
        self.assertGreaterEqual(after["bytes_read_ahead_hit"] + after["bytes_read_engine"] -
                                before["bytes_read_ahead_hit"] - before["bytes_read_engine"], size)
        with open(self.m("e1"), "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
            self.assertBytesEqual(m[5 * MiB:6 * MiB], data[5 * MiB:6 * MiB], "mmap")
        # Under engine_reads_from: passthrough.
        small = os.urandom(MiB)
        with open(self.b("e2"), "wb") as f:
            f.write(small)
        self.assertBytesEqual(self.read(self.m("e2")), small, "small file")
        self.assertEqual(fuse(self.mnt)["passthrough_opens"], after["passthrough_opens"] + 1)


class AutoEngineOpenTest(PassthroughCase):
    """The default policy (read_cache=auto): a large cold file is passthrough for an opener whose
    memory holds it, and goes to the engine for one in a memory cgroup it does not fit."""

    def test_the_openers_memory_decides(self):
        if os.geteuid() != 0:
            self.skipTest("needs root for a memory cgroup")
        size = 160 * MiB
        with open(self.b("big"), "wb") as f:
            f.write(os.urandom(size))
        mh.evict(self.b("big"))
        want = subprocess.run(["sha256sum", self.b("big")], capture_output=True, text=True,
                              check=True).stdout.split()[0]
        mh.evict(self.b("big"))
        with mh.MemoryCgroup(128 * MiB) as cg:
            if cg.preexec is None:
                self.skipTest(cg.reason)
            before = fuse(self.mnt)
            out = subprocess.run(["sha256sum", self.m("big")], capture_output=True, text=True,
                                 check=True, preexec_fn=cg.preexec).stdout.split()[0]
        self.assertEqual(out, want)
        after = fuse(self.mnt)
        self.assertEqual(after["engine_opens"], before["engine_opens"] + 1, "in the cgroup")
        self.assertGreaterEqual(after["read_ops"] - before["read_ops"], size // MiB)
        out = subprocess.run(["sha256sum", self.m("big")], capture_output=True, text=True,
                             check=True).stdout.split()[0]
        self.assertEqual(out, want)
        last = fuse(self.mnt)
        self.assertEqual(last["passthrough_opens"], after["passthrough_opens"] + 1, "outside")
        self.assertEqual(last["engine_opens"], after["engine_opens"])


class OffPolicyTest(mh.MountedTestCase):
    MOUNT_OPTIONS = ("passthrough=off",)

    def test_never_used_and_capability_not_kept(self):
        s = mh.stats(self.mnt)
        self.assertEqual(s["kernel"]["passthrough"]["wanted"], False)
        self.assertEqual(s["kernel"]["passthrough"]["on"], False)
        self.write(self.m("o1"), os.urandom(MiB))
        buf = mmap.mmap(-1, MiB)
        fd = os.open(self.m("o1"), os.O_RDONLY | os.O_DIRECT)
        try:
            self.assertEqual(os.preadv(fd, [buf], 0), MiB)
        finally:
            os.close(fd)
            buf.close()
        self.assertEqual(fuse(self.mnt)["passthrough_opens"], 0)
        pid = mh.find_daemon_pids(self.mnt)[0]
        self.assertFalse(cap_masks(pid)["CapPrm"] & (1 << CAP_SYS_ADMIN))


class BadOptionTest(unittest.TestCase):
    def test_unknown_policy_is_a_usage_error(self):
        reason = mh.skip_reason()
        if reason:
            self.skipTest(reason)
        with mh.Scratch("ptbad") as s:
            r = mh.run_daemon([s.backing, s.mnt, "-o", "passthrough=sometimes"])
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn(b"'passthrough'", r.stderr)
            self.assertIn(b"off, direct, read, all", r.stderr)
            self.assertFalse(mh.is_mounted(s.mnt))


if __name__ == "__main__":
    unittest.main(verbosity=2)
