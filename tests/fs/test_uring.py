"""FUSE over io_uring (fs/transport/uring_loop.h) on a real mount: requests go through the ring
when the kernel has it enabled, the mount falls back to /dev/fuse (and says so) when it does not,
and the options that cannot work with it are refused. The module's enable_uring is set for each
test and put back. Skips (with the reason) where the kernel has no FUSE io_uring or we are not root.
Run: /usr/bin/python3 -m unittest -v tests.fs.test_uring
"""
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mount_harness as mh  # noqa: E402

MiB = 1 << 20


class UringTest(unittest.TestCase):
    def setUp(self):
        reason = mh.skip_reason(need_root=True)
        if reason:
            self.skipTest(reason)
        self.scratch = mh.Scratch(type(self).__name__)
        self.addCleanup(self.scratch.cleanup)

    def mount(self, kernel_on, options=("io_uring=1",)):
        prev = mh.set_kernel_uring(kernel_on)
        self.addCleanup(mh.restore_kernel_uring, prev)
        m = mh.Mount(self.scratch.backing, self.scratch.mnt, options=options)
        self.addCleanup(m.stop)
        return m.start()

    def test_requests_go_through_the_ring(self):
        m = self.mount(True)
        t0 = mh.stats(m.mnt)["transport"]
        self.assertEqual(t0["kind"], "uring")
        self.assertEqual(t0["queues"], mh_possible_cpus())
        data = os.urandom(8 * MiB + 123)
        path = os.path.join(m.mnt, "f")
        with open(path, "wb") as f:
            f.write(data)
            os.fsync(f.fileno())
        mh.drop_caches()
        with open(path, "rb") as f:
            self.assertTrue(f.read() == data, "read back through the ring")
        t1 = mh.stats(m.mnt)["transport"]
        # 8 MiB each way in 1 MiB requests, plus lookups, opens and fsync.
        self.assertGreaterEqual(t1["requests_ring"] - t0["requests_ring"], 16, t1)
        self.assertEqual(t1["ring_errors"], 0)
        self.assertEqual(mh.stats(m.mnt)["kernel"]["io_uring"]["on"], True)

    def test_falls_back_to_dev_fuse_when_the_kernel_has_it_off(self):
        m = self.mount(False)
        s = mh.stats(m.mnt)
        self.assertNotEqual(s["transport"]["kind"], "uring")
        self.assertFalse(s["kernel"]["io_uring"]["on"])
        with open(os.path.join(m.mnt, "g"), "wb") as f:
            f.write(b"x" * MiB)
        self.assertIn("enable_uring", m.log_text())

    def test_options_it_cannot_serve_are_refused(self):
        for opt, word in (("async_reply=1", "async_reply"), ("clone_fd=1", "clone_fd"),
                          ("uring_threads=0", "uring_threads")):
            r = mh.run_daemon([self.scratch.backing, self.scratch.mnt, "-o", "io_uring=1," + opt])
            self.assertEqual(r.returncode, 2, (opt, r.stderr))
            self.assertIn(word.encode(), r.stderr)
            self.assertFalse(mh.is_mounted(self.scratch.mnt))


def mh_possible_cpus():
    with open("/sys/devices/system/cpu/possible") as f:
        n = 0
        for part in f.read().strip().split(","):
            lo, _, hi = part.partition("-")
            n += int(hi or lo) - int(lo) + 1
        return n


if __name__ == "__main__":
    unittest.main(verbosity=2)
