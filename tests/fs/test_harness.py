"""Self-tests of mount_harness: the guarantees the other suites rely on (skip reasons, cleanup of
a hung daemon, the watchdog turning a hung syscall into a failure).

Run: /usr/bin/python3 -m unittest -v tests.fs.test_harness
"""

import errno
import os
import signal
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mount_harness as mh  # noqa: E402


class SkipReasonTest(unittest.TestCase):

    def test_missing_binary_is_a_reason(self):
        old = os.environ.get("DNVMEFS_BIN")
        os.environ["DNVMEFS_BIN"] = "/nonexistent/dnvmefs"
        try:
            r = mh.skip_reason()
        finally:
            if old is None:
                del os.environ["DNVMEFS_BIN"]
            else:
                os.environ["DNVMEFS_BIN"] = old
        self.assertIsNotNone(r)
        self.assertIn("/nonexistent/dnvmefs", r)

    def test_mountinfo_unescapes(self):
        self.assertEqual(mh._unescape(r"/a\040b\011c\134d"), "/a b\tc\\d")


class HungDaemonTest(unittest.TestCase):

    def setUp(self):
        reason = mh.skip_reason()
        if reason:
            self.skipTest(reason)
        self.scratch = mh.Scratch("harness")
        self.addCleanup(self.scratch.cleanup)

    def test_stop_cleans_up_a_stopped_daemon(self):
        m = mh.Mount(self.scratch.backing, self.scratch.mnt, watchdog_s=0).start()
        m.stop_wait_s = 2
        pid = m.pid
        os.kill(pid, signal.SIGSTOP)  # a daemon that answers nothing, not even SIGTERM
        try:
            m.stop()
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.assertFalse(mh.mounts_at(self.scratch.mnt), "mount left behind")
        self.assertFalse(mh.pid_alive(pid), "daemon left behind")

    def test_watchdog_turns_a_hang_into_an_error(self):
        if not mh.ensure_fusectl():
            self.skipTest("fusectl is not mounted at %s: the watchdog cannot abort" % mh.FUSECTL)
        m = mh.Mount(self.scratch.backing, self.scratch.mnt, watchdog_s=2).start()
        self.addCleanup(m.stop)
        os.kill(m.pid, signal.SIGSTOP)
        self.addCleanup(lambda: mh.pid_alive(m.pid) and os.kill(m.pid, signal.SIGCONT))
        t0 = time.monotonic()
        with self.assertRaises(OSError) as cm:
            os.stat(os.path.join(self.scratch.mnt, "anything"))  # hangs until the abort
        # ECONNABORTED when the stat's request was already queued at the abort, ENOTCONN when it
        # reached the dead connection after it (both seen here): either way the hang became an
        # error.
        self.assertIn(cm.exception.errno, (errno.ENOTCONN, errno.ECONNABORTED),
                      mh.errno_name(cm.exception.errno))
        self.assertTrue(m.watchdog_fired)
        self.assertLess(time.monotonic() - t0, 60)  # bounded, not a timing claim about dnvmefs


if __name__ == "__main__":
    unittest.main(verbosity=2)
