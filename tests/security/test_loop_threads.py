"""No user can freeze or stall the mount's loop threads, fill the daemon's descriptor table, or
write through passthrough with the daemon's credentials (issue 45, items 1, 2, 3, 6 and 9;
docs/security.md "Nobody waits for another user", "Writes on behalf of a user are that user's
writes", "Per-uid limits").

Each mount here has a short watchdog: a test whose mount hangs (the deadlocks these tests look
for) has its FUSE connection aborted, fails, and never holds CI.

Run: /usr/bin/python3 -m unittest -v tests.security.test_loop_threads   (as root)
"""

import errno
import os
import stat
import subprocess
import time
import unittest

from tests.security import sec_util as su
from tests.security.sec_util import MiB, mh

HANG_S = 5.0  # a request that must not wait for anyone: milliseconds; main's waits were 27-45 s
LEASE_WAIT_S = 2.0  # PreloadLeases::kWriteWait
WATCHDOG_S = 90.0  # aborts the FUSE connection of a hung mount (mount_harness)


timed = su.timed


def setUpModule():
    reason = su.suite_skip_reason()
    if reason:
        raise unittest.SkipTest(reason)


class Case(su.SecurityCase):
    def mount(self, **kw):
        kw.setdefault("watchdog_s", WATCHDOG_S)
        return super().mount(**kw)

    def not_waiting(self, what, fn, bound=HANG_S):
        t, r = timed(fn, bound)
        self.assertIsNotNone(t, "%s waited %.0f s or more (it must not wait for another user)" %
                             (what, bound))
        self.assertNotIsInstance(r, BaseException, "%s: %r" % (what, r))
        return r


# ---------------------------------------------------------------------------------------------
# Item 1: a file lease on a descriptor the broker hands out.

TRY_LEASES = r'''
import fcntl
F_SETLEASE = 1024
path = os.path.join(A["mnt"], "pub", "own")
with open(path, "wb") as f:
    f.write(b"o" * (1 << 20))
ino = os.stat(path).st_ino
br = Broker(A["mnt"], timeout=30)
err, _, _, _, msg, page = br.call(1)
assert err == 0 and page, (err, msg)
got = {}
for name, acc, kind in (("read", os.O_RDONLY, fcntl.F_RDLCK), ("write", os.O_RDWR, fcntl.F_WRLCK)):
    err, lease, slot, size, msg, fds = br.call(2, path=b"pub/own", flags=acc, ino=ino)
    assert err == 0, (err, msg)
    res = []
    for x in fds:
        try:
            fcntl.fcntl(x, F_SETLEASE, kind)
            res.append(0)
            fcntl.fcntl(x, F_SETLEASE, fcntl.F_UNLCK)
        except OSError as e:
            res.append(e.errno)
        os.close(x)
    got[name] = res
    br.call(5, lease=lease, length=0)   # close the lease
emit("leases", got=got)
'''

# A process that holds a kernel file lease on a backing file (as root: CAP_LEASE) until told.
HOLD_LEASE = r'''
import fcntl, signal
signal.signal(signal.SIGIO, signal.SIG_IGN)  # the lease-break signal must not kill us
fd = os.open(A["path"], os.O_RDONLY)
fcntl.fcntl(fd, 1024, fcntl.F_RDLCK)
emit("held")
ask()
fcntl.fcntl(fd, 1024, fcntl.F_UNLCK)
os.close(fd)
emit("released")
ask()
'''

# Openers for writing (uid 65534) of a file through the mount; each reports errno or 0.
OPEN_FOR_WRITE = r'''
res = []
def one():
    try:
        os.close(os.open(A["path"], os.O_WRONLY))
        res.append(0)
    except OSError as e:
        res.append(e.errno)
ths = [threading.Thread(target=one, daemon=True) for _ in range(A["n"])]
for t in ths:
    t.start()
emit("started")
for t in ths:
    t.join(A["join_s"])
emit("done", res=res, running=sum(t.is_alive() for t in ths))
ask()
'''

# Faults pages of a MAP_SHARED mapping of a file through the mount, in a loop, until told.
FAULTER = r'''
import mmap
fd = os.open(A["path"], os.O_RDONLY)
mm = mmap.mmap(fd, A["size"], mmap.MAP_SHARED, mmap.PROT_READ)
stop = []
count = [0]
def run():
    while not stop:
        for off in range(0, A["size"], 4096):
            mm[off]
        count[0] += 1
        time.sleep(0.001)
t = threading.Thread(target=run, daemon=True)
t.start()
emit("faulting")
ask()
stop.append(1)
t.join(30)
emit("done", rounds=count[0], running=t.is_alive())
'''


class LeaseTest(Case):
    def test_16_no_file_lease_on_a_broker_descriptor(self):
        """Failed on main: F_SETLEASE on the descriptors the broker hands out succeeded."""
        reason = su.preload_skip_reason()
        if reason:
            self.skipTest(reason)
        m = self.mount()
        self.public_dir()
        c = self.child(TRY_LEASES, {"mnt": self.mnt})
        got = c.expect("leases", timeout=60)["got"]
        for name, res in got.items():
            self.assertTrue(res, got)
            for e in res:
                self.assertEqual(e, errno.EAGAIN, "a %s lease was granted on a broker descriptor "
                                 "(0) or refused for another reason: %s" % (name, got))
        self.alive(m)

    def test_17_a_lease_on_the_backing_file_blocks_no_loop_thread(self):
        """Failed on main: 40 opens for writing of a leased file slept in __break_lease on every
        loop thread; root's stat of an unrelated name waited for the lease-break time (42 s);
        and with a MAP_SHARED mapping faulting meanwhile the mount froze for good (the
        invalidations on the loop threads waited for a READ no thread was left to serve)."""
        m = self.mount()
        self.public_dir()
        for i in range(4):  # never looked up through the mount: each stat reaches the daemon
            self.write_file(self.b("other%d" % i), b"o" * 65536)
        self.write_file(self.m("pub", "victim"), b"v" * MiB, mode=0o666)
        os.chown(self.b("pub", "victim"), su.NOBODY, su.NOBODY)
        fault = self.child(FAULTER, {"path": self.m("pub", "victim"), "size": MiB})
        fault.expect("faulting")
        holder = self.child(HOLD_LEASE, {"path": self.b("pub", "victim")}, uid=0)
        holder.expect("held")
        openers = self.child(OPEN_FOR_WRITE, {"path": self.m("pub", "victim"), "n": 40,
                                              "join_s": 30})
        openers.expect("started")
        time.sleep(0.5)  # the opens reach the daemon (not an assertion)
        self.not_waiting("root's stat of another file while a lease is held",
                         lambda: os.stat(self.m("other0")))
        self.not_waiting("root's read of another file while a lease is held",
                         lambda: self.read_file(self.m("other1")))
        done = openers.expect("done", timeout=60)
        self.assertEqual(done["running"], 0, done)
        # The opens conflicting with the lease are answered at once (EWOULDBLOCK), as an
        # O_NONBLOCK open on ext4 is; none may have slept for the lease.
        self.assertTrue(all(e in (0, errno.EAGAIN) for e in done["res"]), done)
        holder.send("release")
        holder.expect("released")
        self.not_waiting("root's stat of another file after the lease went",
                         lambda: os.stat(self.m("other2")))
        self.not_waiting("an open for writing after the lease went",
                         lambda: os.close(os.open(self.m("pub", "victim"), os.O_WRONLY)))
        fault.send("stop")
        got = fault.expect("done", timeout=60)
        self.assertFalse(got["running"], "the MAP_SHARED reader is stuck: %s" % got)
        self.alive(m)
        self.assertFalse(m.watchdog_fired, "the mount hung and was aborted")


# ---------------------------------------------------------------------------------------------
# Items 2 and 3: opens of leased files wait only for their own holder, never on a loop thread,
# and never behind other waits.

MANY_LEASES = r'''
n = A["files"]
paths = [os.path.join(A["mnt"], "pub", "f%d" % i) for i in range(n)]
for p in paths:
    with open(p, "wb") as f:
        f.write(b"u" * 65536)
    os.chmod(p, 0o644)
br = Broker(A["mnt"], timeout=30)
err, _, _, _, msg, page = br.call(1)
assert err == 0 and page, (err, msg)
mm = mmap.mmap(page[0], 16 * 512)
slots = []
for i, p in enumerate(paths):
    err, lease, slot, size, msg, fds = br.call(2, path=("pub/f%d" % i).encode(), flags=os.O_RDWR,
                                               ino=os.stat(p).st_ino)
    assert err == 0, (err, msg)
    for x in fds:
        os.close(x)
    struct.pack_into("=I", mm, slot * 16 + 8, 1)  # writes_inflight, kept at 1
    slots.append(slot)
durations = []
def opener(p):
    t = time.monotonic()
    try:
        os.close(os.open(p, os.O_RDONLY))
        durations.append(time.monotonic() - t)
    except OSError as e:
        durations.append(-e.errno)
ths = [threading.Thread(target=opener, args=(p,), daemon=True) for p in paths[:-1]]
for t in ths:
    t.start()
emit("armed")
ask()
for t in ths:
    t.join(60)
emit("opens", durations=durations)
ask()
'''


class LeaseWaitTest(Case):
    FILES = 61

    def test_18_lease_waits_never_queue_behind_the_holders_own(self):
        """Failed on main: with 61 leases whose counters read 1 and 60 openers of the user's own
        files, root's cat of the 61st waited 27 s (every wait queued on the holder's lane)."""
        reason = su.preload_skip_reason()
        if reason:
            self.skipTest(reason)
        m = self.mount()
        self.public_dir()
        self.write_file(self.b("other"), b"o" * 4096)
        c = self.child(MANY_LEASES, {"mnt": self.mnt, "files": self.FILES})
        c.expect("armed", timeout=120)
        time.sleep(0.3)  # the user's opens reach the daemon (not an assertion)
        self.not_waiting("root's stat of another file", lambda: os.stat(self.m("other")))
        last = self.m("pub", "f%d" % (self.FILES - 1))
        t, r = timed(lambda: self.read_file(last), LEASE_WAIT_S + 3.0)
        self.assertIsNotNone(t, "root's cat of a leased file waited more than one lease wait "
                             "(%.0f s) + 3 s: it queued behind the holder's other waits" %
                             LEASE_WAIT_S)
        self.assertEqual(r, b"u" * 65536)
        c.send("go")
        opens = c.expect("opens", timeout=120)["durations"]
        self.assertEqual(len(opens), self.FILES - 1, opens)
        self.assertTrue(all(0 <= d < LEASE_WAIT_S + 3.0 for d in opens),
                        "each of the user's opens waits once, at most one lease wait: %s" % opens)
        self.alive(m)


# ---------------------------------------------------------------------------------------------
# Item 6: inodes the kernel holds (O_PATH pins) are charged to the uid that looked them up.

PIN = r'''
d = os.path.join(A["mnt"], "pub", A["dir"])
fds, err = [], 0
try:
    os.mkdir(d)  # its own lookup is charged too
except OSError as e:
    err = e.errno
for i in range(A["n"] if not err else 0):
    p = os.path.join(d, "l%d" % i)
    try:
        os.symlink("target", p)
        fds.append(os.open(p, os.O_PATH | os.O_NOFOLLOW))
    except OSError as e:
        err = e.errno
        break
emit("pinned", n=len(fds), err=err)
ask()
'''


class InodePinTest(Case):
    def test_19_o_path_pins_stop_at_the_users_share(self):
        """Failed on main: 20,500 symlinks held open with O_PATH filled the daemon's descriptor
        table, and root's `echo hi > MNT/new` failed with EMFILE (the option
        max_inodes_per_uid did not exist)."""
        m = self.mount(options=su.OPTIONS + ("max_inodes_per_uid=1000",))
        self.public_dir()
        os.mkdir(self.m("pub", "other"))
        os.chmod(self.m("pub", "other"), 0o1777)
        # The user's own share first.
        c = self.child(PIN, {"mnt": self.mnt, "n": 1500, "dir": "links"})
        got = c.expect("pinned", timeout=300)
        self.assertIn(got["err"], (errno.ENFILE, errno.EMFILE), got)
        self.assertGreaterEqual(got["n"], 900, "the user was stopped below its share: %s" % got)
        self.assertLessEqual(got["n"], 1000, "the user pinned past max_inodes_per_uid: %s" % got)
        self.assertIn("max_inodes_per_uid=1000", m.log_text())
        c.send("end")
        c.wait()
        m.stop()
        # Then all users together, on a daemon whose descriptor table (RLIMIT_NOFILE 1600, read
        # at start: fs/limits/uid_limits.h, FdShape) is far smaller than the users' shares would
        # need (as when many uids pin at once): one user fills what users may hold, another uid
        # is refused, root is served.
        m = su.mh.Mount(self.backing, self.mnt, options=su.OPTIONS + ("max_inodes_per_uid=1000",))
        argv = m.argv
        m.argv = lambda: ["prlimit", "--nofile=1600:1600", "--"] + argv()
        self.addCleanup(m.stop)
        m.start()
        c1 = self.child(PIN, {"mnt": self.mnt, "n": 1500, "dir": "links2"})
        got1 = c1.expect("pinned", timeout=300)
        self.assertEqual(got1["err"], errno.ENFILE, got1)
        c2 = self.child(PIN, {"mnt": self.mnt, "n": 200, "dir": "other/links"},
                        uid=su.NOBODY - 1)
        got2 = c2.expect("pinned", timeout=120)
        self.assertEqual(got2["err"], errno.ENFILE, got2)
        self.assertEqual(got2["n"], 0, got2)
        with open(self.m("new"), "w") as f:  # root is served
            f.write("hi\n")
        self.assertEqual(self.read_file(self.m("new")), b"hi\n")
        c1.send("end")
        c2.send("end")
        self.alive(m)


LIST_OVER_SHARE = r'''
d = os.path.join(A["mnt"], "pub", "links")
os.mkdir(d)
fds = []
for i in range(A["pins"]):
    try:
        os.symlink("target", os.path.join(d, "l%d" % i))
        fds.append(os.open(os.path.join(d, "l%d" % i), os.O_PATH | os.O_NOFOLLOW))
    except OSError:
        break
names = os.listdir(os.path.join(A["mnt"], "pub", "many"))  # READDIRPLUS: no inode left to look up
emit("listed", n=len(names), pinned=len(fds))
ask()
'''


class ListOverShareTest(Case):
    def test_19b_a_listing_past_the_users_share_names_every_entry(self):
        """A READDIRPLUS by a user at its share of inodes sends the names without lookups. Found
        by review: when such a name was the entry that did not fit the reply, the daemon
        forgot node id 0 and crashed."""
        m = self.mount(options=su.OPTIONS + ("max_inodes_per_uid=100",))
        self.public_dir()
        os.mkdir(self.b("pub", "many"))  # made behind the mount: the kernel has none of them
        for i in range(1000):
            with open(self.b("pub", "many", "file-with-a-longer-name-%04d" % i), "wb"):
                pass
        os.stat(self.m("pub", "many"))  # the directory itself known (root's lookup), its files not
        c = self.child(LIST_OVER_SHARE, {"mnt": self.mnt, "pins": 150})
        got = c.expect("listed", timeout=120)
        self.assertLessEqual(got["pinned"], 100, got)
        self.assertEqual(got["n"], 1000, got)
        c.send("end")
        self.alive(m)


# ---------------------------------------------------------------------------------------------
# Item 9: a passthrough writer writes with an unprivileged identity, never the daemon's.

PT_WRITE = r'''
# A passthrough open first (read-only, O_DIRECT: -o passthrough=direct), then the writer's.
rd = os.open(A["path"], os.O_RDONLY | os.O_DIRECT)
wr = os.open(A["path"], os.O_WRONLY | os.O_APPEND)
chunk = b"w" * (1 << 20)
written, err = 0, 0
while written < A["target"]:
    try:
        written += os.write(wr, chunk)
    except OSError as e:
        err = e.errno
        break
os.close(wr)
os.close(rd)
emit("wrote", written=written, err=err)
'''

PT_SETGID = r'''
rd = os.open(A["path"], os.O_RDONLY | os.O_DIRECT)
wr = os.open(A["path"], os.O_WRONLY)
os.write(wr, b"x" * 4096)
os.close(wr)
os.close(rd)
emit("wrote")
'''


class PassthroughCredentialsTest(Case):
    SLACK = 4 * MiB

    def passthrough_mount(self, backing=None):
        m = self.mount(backing=backing, options=su.OPTIONS + ("passthrough=direct",))
        reason = mh.passthrough_skip_reason(self.mnt)
        if reason:
            self.skipTest(reason)
        return m

    def assertWriterWasPassthrough(self, before):
        # Both of the user's opens were passthrough (the reader's, then the writer's it forced):
        # otherwise the daemon wrote, and the test says nothing about passthrough.
        after = mh.stats(self.mnt)["fuse"]["passthrough_opens"]
        self.assertGreaterEqual(after - before, 2, "the writer was not served by passthrough")

    def test_20_passthrough_writer_stops_at_the_user_available_space(self):
        """Failed on main: a user's writes to a file with a passthrough open took 9 MiB of
        ext4's root-reserved blocks."""
        reason = su.ext4_skip_reason()
        if reason:
            self.skipTest(reason)
        ext = su.mount_ext4(self, os.path.join(self.scratch.path, "ext4"), 64, reserved_pct=50)
        m = self.passthrough_mount(ext)
        self.public_dir()
        path = self.m("pub", "pt")
        with open(path, "wb") as f:
            f.write(b"p" * 4096)
        os.chmod(path, 0o666)
        avail0, free0 = su.avail_bytes(ext), su.free_bytes(ext)
        self.assertGreater(free0 - avail0, 16 * MiB, "the reserve (-m 50) is there")
        before = mh.stats(self.mnt)["fuse"]["passthrough_opens"]
        c = self.child(PT_WRITE, {"path": path, "target": avail0 + 16 * MiB})
        got = c.expect("wrote", timeout=120)
        self.assertWriterWasPassthrough(before)
        os.sync()
        used = free0 - su.free_bytes(ext)
        self.assertEqual(got["err"], errno.ENOSPC, got)
        self.assertLessEqual(used, avail0 + self.SLACK,
                             "a user's passthrough writes took %d bytes of ext4's root reserve "
                             "(available to users: %d)" % (used - avail0, avail0))
        self.alive(m)

    def test_21_passthrough_writer_clears_set_group_id(self):
        """Failed on main: a user's write into root's mode-2666 file through a passthrough open
        kept the set-group-ID bit (written with the daemon's CAP_FSETID)."""
        m = self.passthrough_mount()
        self.public_dir()
        path = self.m("pub", "sgid")
        with open(path, "wb") as f:
            f.write(b"s" * 4096)
        os.chmod(path, 0o2666)
        self.assertTrue(os.stat(self.b("pub", "sgid")).st_mode & stat.S_ISGID)
        before = mh.stats(self.mnt)["fuse"]["passthrough_opens"]
        c = self.child(PT_SETGID, {"path": path})
        c.expect("wrote", timeout=60)
        self.assertWriterWasPassthrough(before)
        mode = os.stat(self.b("pub", "sgid")).st_mode
        self.assertFalse(mode & stat.S_ISGID, "set-group-ID kept after a user's write: %o" % mode)
        self.alive(m)


if __name__ == "__main__":
    unittest.main()
