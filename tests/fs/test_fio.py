"""fio clients through a dnvmefs mount: libaio + O_DIRECT sequential write, then a separate
verifying read (crc32c), a random-write verify job, and buffered psync writers. fio's exit code
is the verdict (a verify mismatch makes fio exit non-zero); sizes are checked against BACKING_DIR.

Run: /usr/bin/python3 -m unittest -v tests.fs.test_fio   (skips with a reason when fio is missing)
"""

import mmap
import os
import shutil
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mount_harness as mh  # noqa: E402

MiB = 1 << 20


class FioTest(mh.MountedTestCase):

    @classmethod
    def setUpClass(cls):
        cls.fio = shutil.which("fio")
        if cls.fio is None:
            raise unittest.SkipTest("fio is not installed")
        super().setUpClass()

    def run_fio(self, *args, timeout=240):
        cmd = [self.fio, "--output-format=terse", "--terse-version=3"] + list(args)
        # cwd: fio drops *-verify.state files into its working directory.
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           cwd=self.scratch.path)
        if r.returncode != 0:
            self.fail("fio failed (exit %d): %s\nstdout: %s\nstderr: %s\ndaemon log:\n%s" %
                      (r.returncode, " ".join(cmd), r.stdout[-2000:], r.stderr[-3000:],
                       self.mount.log_tail()))
        return r

    def test_libaio_direct_write_then_verified_read(self):
        common = ["--name=seq", "--filename=" + self.m("fio_seq"), "--ioengine=libaio",
                  "--direct=1", "--iodepth=32", "--bs=1M", "--size=256M", "--verify=crc32c",
                  "--randrepeat=1"]
        # Write with verify headers but no read-back in this run...
        self.run_fio(*common, "--rw=write", "--do_verify=0")
        self.assertEqual(os.stat(self.b("fio_seq")).st_size, 256 * MiB)
        # ...then a separate read job checks every block (page cache dropped in between).
        mh.drop_caches()
        self.run_fio(*common, "--rw=read", "--verify_only=1")

    def test_verify_job_detects_corruption(self):
        # Guards the test above against a verify that checks nothing: the same read job must
        # fail on a file whose bytes were changed behind fio's back (in BACKING_DIR, before the
        # mount ever read the file).
        common = ["--name=bad", "--filename=" + self.m("fio_bad"), "--ioengine=libaio",
                  "--direct=1", "--iodepth=8", "--bs=1M", "--size=8M", "--verify=crc32c",
                  "--randrepeat=1"]
        self.run_fio(*common, "--rw=write", "--do_verify=0")
        with open(self.b("fio_bad"), "r+b") as f:
            f.seek(5 * MiB + 1234)
            f.write(b"\xff\x00corrupt\x00")
            os.fsync(f.fileno())
        mh.drop_caches()
        cmd = [self.fio, "--output-format=terse"] + common + ["--rw=read", "--verify_only=1"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                           cwd=self.scratch.path)
        self.assertNotEqual(r.returncode, 0, "fio's verify passed on corrupted data: the read "
                            "verify job checks nothing (or the mount served stale data)")

    def test_libaio_direct_randwrite_verify(self):
        self.run_fio("--name=rand", "--filename=" + self.m("fio_rand"), "--ioengine=libaio",
                     "--direct=1", "--iodepth=32", "--bs=4k", "--size=32M", "--rw=randwrite",
                     "--verify=crc32c", "--verify_fatal=1", "--randrepeat=1")
        self.assertEqual(os.stat(self.b("fio_rand")).st_size, 32 * MiB)

    def test_buffered_psync_two_jobs_verify(self):
        self.run_fio("--name=buf", "--directory=" + self.mnt, "--ioengine=psync", "--direct=0",
                     "--bs=64k", "--size=48M", "--rw=write", "--numjobs=2", "--verify=crc32c",
                     "--verify_fatal=1", "--end_fsync=1")
        names = sorted(n for n in os.listdir(self.backing) if n.startswith("buf."))
        self.assertEqual(len(names), 2, names)
        for n in names:
            self.assertEqual(os.stat(self.b(n)).st_size, 48 * MiB, n)



class FioAsyncReplyTest(FioTest):
    """The same fio jobs with O_DIRECT reads answered from the engine's completion callback
    (-o async_reply=1, off by default), so that path is checked too."""
    MOUNT_OPTIONS = ("async_reply=1",)



class FioSplicedReplyTest(FioTest):
    """The same fio jobs with READ replies sent by vmsplice + splice from a pipe (-o
    splice_reply=1, off by default; fs/transport/request_pipe.h, SpliceMessage), passthrough off so that
    O_DIRECT reads are answered by the daemon too."""
    MOUNT_OPTIONS = ("splice_reply=1", "passthrough=off")

    def test_replies_spliced_carry_the_right_bytes(self):
        if mh.stats(self.mnt)["mount"]["reply_pipes"] == 0:
            self.skipTest("no reply pipes: the daemon could not size 2 MiB pipes (no "
                          "CAP_SYS_RESOURCE and fs.pipe-max-size < 2 MiB; scripts/pipe-max.sh)")
        data = os.urandom(8 * MiB + 12345)  # an unaligned tail: a short last reply
        with open(self.m("spliced"), "wb") as f:
            f.write(data)
            os.fsync(f.fileno())
        before = mh.stats(self.mnt)["fuse"]
        mh.drop_caches()
        with open(self.m("spliced"), "rb") as f:  # buffered: the kernel's read-ahead READs
            self.assertTrue(f.read() == data, "buffered read back through spliced replies")
        fd = os.open(self.m("spliced"), os.O_RDONLY | os.O_DIRECT)
        try:  # O_DIRECT: one READ per call, at an offset that is not a multiple of the reply
            buf = mmap.mmap(-1, 2 * MiB)
            n = os.preadv(fd, [buf], 3 * MiB + 4096)
            self.assertEqual(n, 2 * MiB)
            self.assertTrue(buf[:n] == data[3 * MiB + 4096:5 * MiB + 4096], "O_DIRECT read")
        finally:
            os.close(fd)
        after = mh.stats(self.mnt)
        self.assertEqual(after["mount"]["reply_pipes"], 8, after["mount"])
        spliced = after["fuse"]["bytes_replied_spliced"] - before["bytes_replied_spliced"]
        # Every reply of 64 KiB or more was spliced (one reader: no pipe was ever busy); the
        # 12345-byte tail was written.
        self.assertGreaterEqual(spliced, 8 * MiB + 2 * MiB, after["fuse"])
        self.assertLess(spliced, len(data) + 2 * MiB + 4096, after["fuse"])

    def test_a_reader_killed_mid_reply_leaves_the_mount_serving(self):
        # Interrupted READs: the kernel may refuse a reply whose request is gone (ENOENT from
        # splice); the daemon must neither die nor leave a stale page in a reply pipe.
        data = os.urandom(32 * MiB)
        with open(self.m("killed"), "wb") as f:
            f.write(data)
        for _ in range(3):
            mh.drop_caches()
            p = subprocess.Popen(["dd", "if=" + self.m("killed"), "of=/dev/null", "bs=4M",
                                  "iflag=direct"], stderr=subprocess.DEVNULL)
            time.sleep(0.02)
            p.kill()
            p.wait()
        mh.drop_caches()
        with open(self.m("killed"), "rb") as f:
            self.assertTrue(f.read() == data, "read back after the killed readers")


if __name__ == "__main__":
    unittest.main(verbosity=2)
