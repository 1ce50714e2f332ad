"""Security, round 2 (issue 45): client memory the daemon cannot make safe, registered holes
populated in the daemon, and forged log lines (docs/security.md).

Run: /usr/bin/python3 -m unittest -v tests.security.test_round2   (as root)
"""

import unittest

from tests.security import sec_util as su
from tests.security.sec_util import MiB

FORGED = "[2099-01-01 00:00:00.000] [critical] FORGED"


def setUpModule():
    reason = su.suite_skip_reason()
    if reason:
        raise unittest.SkipTest(reason)


# ---------------------------------------------------------------------------------------------
# Item A: a hugetlb memfd registered, shrunk and read by a bounced pwrite killed the daemon.

NR_HUGEPAGES = "/proc/sys/vm/nr_hugepages"

HUGE = r'''
c = Ctl(A["mnt"])
h = c.ok("handle.open")["handle"]
size = 2 * A["huge"]
fd = os.memfd_create("dnvme-sec-huge", os.MFD_CLOEXEC | os.MFD_HUGETLB)
os.ftruncate(fd, size)
m = mmap.mmap(fd, size)  # hugetlbfs has no write(2): the pages are filled through a mapping
m[:] = b"h" * size
m.close()
r = c.req("buffer.register", source="/proc/%d/fd/%d" % (os.getpid(), fd))
res = {"register": code(r), "message": r.get("error", {}).get("message", "")}
if r.get("ok"):
    # Today's daemon took it: shrink it under the daemon and ask for a bounced copy of it from
    # 4 KiB into it (misaligned: copied by the daemon), so the daemon's first fault is inside a
    # huge page, where no 4 KiB page can be mapped.
    os.ftruncate(fd, 0)
    a = c.req("pwrite", handle=h, buffer=r["buffer"], buffer_offset=4097, length=A["huge"],
              path="pub/huge-dst")
    res["pwrite"] = code(a)
emit("done", **res)
'''

SHRINK = r'''
c = Ctl(A["mnt"])
h = c.ok("handle.open")["handle"]
size = A["size"]
fd = os.memfd_create("dnvme-sec-shrink")  # no MFD_ALLOW_SEALING: cannot be sealed
os.ftruncate(fd, size)
os.pwrite(fd, b"s" * size, 0)
r = c.ok("buffer.register", source="/proc/%d/fd/%d" % (os.getpid(), fd))
res = {"sealed": r["sealed"]}
# Shrunk while a bounced (misaligned) pwrite copies out of it, then shrunk before one.
a = c.req("pwrite", handle=h, buffer=r["buffer"], buffer_offset=1, length=size - 4096,
          path="pub/shrink-dst", **{"async": True})
os.ftruncate(fd, 4096)
res["async"] = code(a)
res["wait"] = code(c.req("wait", handle=h))
res["after"] = code(c.req("pwrite", handle=h, buffer=r["buffer"], buffer_offset=1,
                          length=2 * 4096, path="pub/shrink-dst2"))
res["hello"] = code(c.req("hello"))
emit("done", **res)
'''


def _read_int(path):
    with open(path) as f:
        return int(f.read().split()[0])


class HugetlbTest(su.SecurityCase):
    def huge_pages(self, want):
        """Makes sure `want` free 2 MiB huge pages exist (raising vm.nr_hugepages, restored after
        the test); skips the test with the reason when that cannot be done."""
        try:
            size = su.status_field("/proc/meminfo", "Hugepagesize")
            huge = int(size.split()[0]) * 1024 if size else 0
            before = _read_int(NR_HUGEPAGES)
        except (OSError, ValueError) as e:
            self.skipTest("no huge pages here: %s" % e)
        if huge == 0:
            self.skipTest("no huge pages here (no Hugepagesize in /proc/meminfo)")
        free = _read_int("/sys/kernel/mm/hugepages/hugepages-%dkB/free_hugepages" %
                         (huge // 1024))
        if free < want:
            try:
                with open(NR_HUGEPAGES, "w") as f:
                    f.write(str(before + want - free))
            except OSError as e:
                self.skipTest("cannot configure huge pages (%s: %s)" % (NR_HUGEPAGES, e))
            self.addCleanup(self._restore, before)
            free = _read_int("/sys/kernel/mm/hugepages/hugepages-%dkB/free_hugepages" %
                             (huge // 1024))
            if free < want:
                self.skipTest("the kernel gave %d free huge pages of %d asked for (memory too "
                              "fragmented?)" % (free, want))
        return huge

    def _restore(self, before):
        with open(NR_HUGEPAGES, "w") as f:
            f.write(str(before))

    def test_45a_hugetlb_memory_is_refused(self):
        """Before: the daemon accepted a /proc/PID/fd/N of a MFD_HUGETLB memfd; the owner shrank
        it and a bounced pwrite made the daemon fault in it: the SIGBUS handler's 4 KiB repair
        failed inside the hugetlb mapping, it fell back to SIG_DFL and the daemon died (every
        mount user with it). Now: EINVAL at buffer.register, saying why."""
        huge = self.huge_pages(4)
        m = self.mount()
        self.public_dir()
        c = self.child(HUGE, {"mnt": self.mnt, "huge": huge})
        msg = c.next(120)
        self.alive(m)
        self.assertIsNotNone(msg, "child: %s" % c.stderr())
        self.assertEqual(msg["register"], "EINVAL", msg)
        self.assertIn("hugetlbfs", msg["message"])
        self.assertIn("SIGBUS", msg["message"])

    def test_45a_shrunk_client_memory_keeps_the_daemon_alive(self):
        """A tmpfs memfd that cannot be sealed, shrunk during and before bounced pwrites: the
        transfers fail (EFAULT) and the daemon lives (the SIGBUS handler repairs the mapping)."""
        m = self.mount()
        self.public_dir()
        got = self.child(SHRINK, {"mnt": self.mnt, "size": 16 * MiB}).next(120)
        self.alive(m)
        self.assertIsNotNone(got)
        self.assertFalse(got["sealed"], got)
        self.assertIn(got["async"], ("OK", "EFAULT", "EIO"), got)
        self.assertIn(got["wait"], ("OK", "EFAULT", "EIO"), got)
        self.assertIn(got["after"], ("EFAULT", "EIO"), got)
        self.assertEqual(got["hello"], "OK", got)


# ---------------------------------------------------------------------------------------------
# Item B: registering the hole of a half-allocated /dev/shm object allocated it in the daemon.

HOLE = r'''
c = Ctl(A["mnt"])
half = A["half"]
name = shm(2 * half, sparse=True)
fd = os.open("/dev/shm/" + name, os.O_RDWR)
os.pwrite(fd, b"d" * half, half)  # the first half stays a hole
emit("made", blocks=os.fstat(fd).st_blocks * 512)
ask()
r = c.req("buffer.register", shm=name, offset=0, size=half)
emit("hole", code=code(r), blocks=os.fstat(fd).st_blocks * 512)
ask()
r = c.req("buffer.register", shm=name, offset=half, size=half)
emit("data", code=code(r), blocks=os.fstat(fd).st_blocks * 512)
ask()
os.unlink("/dev/shm/" + name)
emit("done")
'''


class HoleTest(su.SecurityCase):
    HALF = 64 * MiB

    def test_45b_a_registered_hole_is_not_populated(self):
        """Before: Map() compared the whole object's allocated size with the end of the range;
        the first half of a half-allocated object has as many bytes allocated as the range is
        long, so the hole was populated: the daemon's RssShmem grew by the whole range (and the
        object by as much). Now the range's own holes are looked up (SEEK_HOLE)."""
        m = self.mount()
        c = self.child(HOLE, {"mnt": self.mnt, "half": self.HALF})
        made = c.expect("made", 60)
        rss0 = su.vm_kib(m.pid, "RssShmem") * 1024
        c.send("go")
        hole = c.expect("hole", 60)
        rss1 = su.vm_kib(m.pid, "RssShmem") * 1024
        c.send("go")
        data = c.expect("data", 60)
        rss2 = su.vm_kib(m.pid, "RssShmem") * 1024
        c.send("go")
        c.expect("done", 60)
        self.alive(m)
        self.assertEqual((hole["code"], data["code"]), ("OK", "OK"), (hole, data))
        self.assertLess(rss1 - rss0, 4 * MiB, "registering a %d MiB hole grew the daemon's "
                        "RssShmem from %d to %d bytes" % (self.HALF // MiB, rss0, rss1))
        self.assertLess(hole["blocks"] - made["blocks"], 4 * MiB,
                        "registering the hole allocated it: %s -> %s" % (made, hole))
        # A range that is all data is still pre-faulted (nothing to allocate).
        self.assertGreater(rss2 - rss1, self.HALF // 2, "the data half was not pre-faulted")
        self.assertLess(data["blocks"] - made["blocks"], 4 * MiB, (made, data))


# ---------------------------------------------------------------------------------------------
# Item C: a newline in a ctl path forged a whole line of the daemon's log.

FORGE = r'''
c = Ctl(A["mnt"])
emit("done", code=code(c.req("fsync", path="nosuch\n" + A["forged"])))
'''


class LogInjectionTest(su.SecurityCase):
    def test_45c_a_path_cannot_forge_a_log_line(self):
        """Before: the refusal of a control request was logged with the user's path as it was,
        so a path "nosuch\\n[2099-...] [critical] FORGED" wrote a line of its own that read as
        a critical message of the daemon. Now every record is one line: the newline is shown
        as \\n."""
        m = self.mount()
        got = self.child(FORGE, {"mnt": self.mnt, "forged": FORGED}).next(60)
        self.assertIsNotNone(got)
        self.assertEqual(got["code"], "ENOENT", got)
        self.alive(m)
        text = m.log_text()
        forged = [line for line in text.splitlines() if line.startswith(FORGED)]
        self.assertEqual(forged, [], "a forged line in the daemon's log:\n%s" % text[-3000:])
        self.assertIn("nosuch\\n" + FORGED, text, "the refusal, escaped, is not in the log")


if __name__ == "__main__":
    unittest.main()
