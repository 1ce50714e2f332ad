"""Access beyond the caller (issue 34, items 1-4 and 15; docs/security.md "Names are never
followed as root", "Writes on behalf of a user are that user's writes", "Capabilities stay
dormant", "Set-up").

Run: /usr/bin/python3 -m unittest -v tests.security.test_access   (as root)
"""

import errno
import os
import re
import socket
import stat
import struct
import time
import unittest

from tests.security import sec_util as su
from tests.security.sec_util import KiB, MiB, mh


def setUpModule():
    # Everything here mounts as root and acts as uid 65534: without that, skip it all (ctest
    # then shows the test as skipped).
    reason = su.suite_skip_reason()
    if reason:
        raise unittest.SkipTest(reason)


# ---------------------------------------------------------------------------------------------
# Item 1: CREATE that meets an existing name must not follow a symlink as root.

RACE = r'''
mnt, secret, target = A["mnt"], A["secret"], A["target"]
path = os.path.join(mnt, "pub", "d", "x")
os.mkdir(os.path.join(mnt, "pub", "d"), 0o755)       # the user's own directory, made through
try:                                                  # the mount: writable by the user in
    os.open(secret, os.O_RDONLY)                      # BACKING_DIR as well
    emit("setup", error="the user can open the secret without dnvmefs")
    sys.exit(1)
except PermissionError:
    pass
st0 = os.stat(secret)
deadline = time.monotonic() + A["seconds"]
swapper = os.fork()
if swapper == 0:
    # Swap the name between a symlink to the root-only file and nothing, as fast as we can.
    n = 0
    while n & 1023 or time.monotonic() < deadline:
        try:
            os.symlink(secret, target)
        except FileExistsError:
            pass
        try:
            os.unlink(target)
        except FileNotFoundError:
            pass
        n += 1
    os._exit(0)
prefix = A["prefix"].encode()
tries = opened = leaked = 0
errs = {}
while tries < A["tries"] and time.monotonic() < deadline:
    flags = os.O_CREAT | os.O_RDWR | (os.O_TRUNC if tries & 1 else 0)
    tries += 1
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as e:
        errs[e.errno] = errs.get(e.errno, 0) + 1
        fd = -1
    # Drop the kernel's dentry (a cached symlink or file would spare the next open its LOOKUP
    # and CREATE, and with them the race).
    try:
        os.unlink(path)
    except OSError:
        pass
    if fd < 0:
        continue
    opened += 1
    try:
        if os.pread(fd, len(prefix), 0) == prefix:
            leaked += 1
        os.pwrite(fd, b"PWNED", 0)
    except OSError as e:
        errs[e.errno] = errs.get(e.errno, 0) + 1
    os.close(fd)
    if leaked or (tries & 63) == 0:
        st = os.stat(secret)                          # size and mtime: visible to anyone
        if leaked or (st.st_size, st.st_mtime_ns) != (st0.st_size, st0.st_mtime_ns):
            break
os.kill(swapper, 9)
os.waitpid(swapper, 0)
emit("done", tries=tries, opened=opened, leaked=leaked, errs=errs)
'''


class CreateRaceTest(su.SecurityCase):
    # The race is bounded: at most this many opens, at most this many seconds (each ends early
    # once the secret was read or changed).
    SECONDS = 10.0
    TRIES = 400000

    def test_01_create_never_follows_a_symlink_swapped_in_as_root(self):
        m = self.mount()
        self.public_dir()
        # Defence in depth: the user can reach BACKING_DIR here on purpose (0755 all the way), as
        # on a machine set up carelessly; the mount must still not follow a name as root.
        secret = os.path.join(self.scratch.path, "secret")
        data = b"ROOT-ONLY-SECRET" + su.nonzero_pattern(64 * KiB - 16)
        self.write_file(secret, data, 0o600)
        st0 = os.stat(secret)
        c = self.child(RACE, {"mnt": self.mnt, "secret": secret, "prefix": "ROOT-ONLY-SECRET",
                              "target": self.b("pub", "d", "x"), "seconds": self.SECONDS,
                              "tries": self.TRIES})
        done = c.expect("done", timeout=self.SECONDS + 60)
        self.assertEqual(c.wait(30), 0, c.stderr())
        m.stop()  # whatever a handle wrote is landed now
        st1 = os.stat(secret)
        got = self.read_file(secret)
        self.assertEqual(done["leaked"], 0, "the user read the root-only file through the mount "
                         "(%s)" % done)
        self.assertAllBytes(got, data, "the root-only file outside the mount after %d racing "
                            "opens (%s)" % (done["tries"], done))
        self.assertEqual((st1.st_uid, st1.st_mode, st1.st_mtime_ns),
                         (st0.st_uid, st0.st_mode, st0.st_mtime_ns), "secret's inode changed")
        self.assertGreater(done["tries"], 500, "the race ran too few times to mean anything")


# ---------------------------------------------------------------------------------------------
# Item 2: buffer.register of the daemon's own /proc/PID/fd/N (and of its threads).

REGISTER_PROC = r'''
c = Ctl(A["mnt"])
mine = os.memfd_create("mine", os.MFD_ALLOW_SEALING)
os.ftruncate(mine, 1 << 20)
own = c.req("buffer.register", source="/proc/%d/fd/%d" % (os.getpid(), mine))
out = {}
for src in A["sources"]:
    a = c.req("buffer.register", source=src)
    out[src] = [code(a), a.get("writable")]
emit("done", own=code(own), out=out)
'''


class ProcFdTest(su.SecurityCase):
    def test_02_buffer_register_refuses_the_daemons_own_proc_fds(self):
        m = self.mount()
        pid = m.pid
        name = su.broker_socket(self.mnt)
        if name is not None:  # the attacker learns the pid from here
            self.assertIn(".%d." % pid, "." + name + ".", "broker name %r" % name)
        # Another client's lease page lives in the daemon as a memfd: make one.
        lease = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.addCleanup(lease.close)
        lease.connect("\0" + name)
        lease.send(struct.pack("=IIQQqqII4096s", 0x444e5642, 1, 0, 0, 0, 0, 0, 0, b""))
        lease.settimeout(10)
        _, anc, _, _ = lease.recvmsg(1024, socket.CMSG_SPACE(16))
        for _, _, fdata in anc:
            for fd in struct.unpack("%di" % (len(fdata) // 4), fdata[:len(fdata) // 4 * 4]):
                os.close(fd)
        fds = sorted(int(n) for n in os.listdir("/proc/%d/fd" % pid))
        kinds = {}
        for n in fds:
            try:
                kinds[n] = os.readlink("/proc/%d/fd/%d" % (pid, n))
            except OSError:
                pass
        tids = [t for t in su.threads(pid) if t != pid]
        self.assertTrue(tids, "the daemon has threads")
        tid = tids[len(tids) // 2]
        sources = []
        for n in fds:
            sources += ["/proc/%d/fd/%d" % (pid, n), "/proc/%d/fd/%d" % (tid, n),
                        "/proc/%d/task/%d/fd/%d" % (pid, tid, n), "/proc/self/fd/%d" % n,
                        "/proc/thread-self/fd/%d" % n]
        got = su.run_child(REGISTER_PROC, {"mnt": self.mnt, "sources": sources})["done"]
        self.assertEqual(got["own"], "OK", "the user's own memfd through /proc stays allowed")
        taken = {s: r for s, r in got["out"].items() if r[0] == "OK"}
        memfds = [n for n, k in kinds.items() if k.startswith("/memfd:")]
        self.assertEqual(taken, {}, "the user mapped descriptors of the daemon (memfds there: %s; "
                         "what they are: %s)" % (memfds, {s: kinds.get(int(s.rsplit("/", 1)[1]))
                                                          for s in taken}))
        self.alive(m)


# ---------------------------------------------------------------------------------------------
# Item 2 (set-up): the daemon warns when another user can reach BACKING_DIR.

WARN = re.compile(r"\[(warn|warning|error|critical)\]", re.I)


def backing_warnings(m, backing):
    out = []
    for line in m.log_text().splitlines():
        low = line.lower()
        if WARN.search(line) and (backing in line or "backing_dir" in low or
                                  "backing dir" in low or "backing directory" in low):
            out.append(line)
    return out


class BackingReachTest(su.SecurityCase):
    def test_02b_daemon_warns_when_other_users_can_reach_backing(self):
        with self.subTest("reachable BACKING_DIR: warned"):
            m = self.mount()
            time.sleep(0.3)  # start-up logging is done before the mount appears; be lenient
            m.stop()
            self.assertTrue(backing_warnings(m, self.backing),
                            "no warning about %s (0755, every directory above searchable); "
                            "log:\n%s" % (self.backing, m.log_tail(1500)))
        with self.subTest("BACKING_DIR in a 0700 directory: not warned"):
            hidden = self.scratch.sub("hidden")
            os.chmod(hidden, 0o700)
            b = os.path.join(hidden, "backing")
            os.mkdir(b, 0o755)
            m = self.mount(backing=b, mnt=self.scratch.sub("mnt2"))
            time.sleep(0.3)
            m.stop()
            self.assertEqual(backing_warnings(m, b), [], "warned for a BACKING_DIR nobody else "
                             "can reach")
        with self.subTest("mounted over BACKING_DIR itself: not warned"):
            b = self.scratch.sub("self")
            os.chmod(b, 0o755)
            with open(os.path.join(b, "f"), "wb") as f:
                f.write(b"under the mount")
            m = self.mount(backing=b, mnt=b)
            self.assertEqual(self.read_file(os.path.join(b, "f")), b"under the mount")
            time.sleep(0.3)
            m.stop()
            self.assertEqual(backing_warnings(m, b), [], "warned for a BACKING_DIR hidden by "
                             "the mount")


# ---------------------------------------------------------------------------------------------
# Item 3: a control-file pwrite by another user clears set-user-ID / set-group-ID.

SUID_WRITE = r'''
c = Ctl(A["mnt"])
h = c.ok("handle.open")["handle"]
name = shm(1 << 20)
b = c.ok("buffer.register", shm=name)["buffer"]
r = c.req("pwrite", handle=h, buffer=b, length=4096, path="pub/suid_ctl")
os.unlink("/dev/shm/" + name)
fd = os.open(os.path.join(A["mnt"], "pub", "suid_plain"), os.O_WRONLY)
os.pwrite(fd, b"u" * 4096, 0)
os.close(fd)
emit("done", ctl=code(r), answer=r)
'''


class SetuidTest(su.SecurityCase):
    def test_03_ctl_pwrite_by_another_user_clears_setuid_and_setgid(self):
        m = self.mount()
        self.public_dir()
        for name in ("suid_ctl", "suid_plain"):
            self.write_file(self.m("pub", name), b"r" * 8192, 0o6777)
            self.assertEqual(stat.S_IMODE(os.stat(self.b("pub", name)).st_mode), 0o6777)
        got = su.run_child(SUID_WRITE, {"mnt": self.mnt})["done"]
        self.assertEqual(got["ctl"], "OK", got)
        self.assertEqual(self.read_file(self.m("pub", "suid_ctl"))[:4096], b"\0" * 4096,
                         "the ctl write landed")
        plain = stat.S_IMODE(os.stat(self.b("pub", "suid_plain")).st_mode)
        ctl = stat.S_IMODE(os.stat(self.b("pub", "suid_ctl")).st_mode)
        # The reference: a plain write(2) through the mount by the same user.
        self.assertEqual(plain & (stat.S_ISUID | stat.S_ISGID), 0,
                         "plain write kept the bits: mode %o" % plain)
        self.assertEqual(ctl & stat.S_ISUID, 0, "ctl pwrite kept set-user-ID: mode %o" % ctl)
        # 06777 with group-exec, a writer outside group 0: ext4 clears set-group-ID too.
        self.assertEqual(ctl & stat.S_ISGID, 0, "ctl pwrite kept set-group-ID: mode %o" % ctl)
        self.alive(m)


# ---------------------------------------------------------------------------------------------
# Item 4: a non-root writer stops at the space available to users (ext4's reserve is root's).

FILL = r'''
mnt, target = A["mnt"], A["target"]
path = os.path.join(mnt, "pub", "fill")
errors = []
done = 0
fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o644)
chunk = b"\xa5" * (1 << 20)
try:
    while done < target:
        done += os.write(fd, chunk)
except OSError as e:
    errors.append(["write", e.errno])
try:
    os.fsync(fd)
except OSError as e:
    errors.append(["fsync", e.errno])
try:
    os.close(fd)
except OSError as e:
    errors.append(["close", e.errno])
emit("mount", acked=done, errors=errors)
ask()  # the test measured the file
os.truncate(path, 0)  # frees the blocks now (an unlinked inode the daemon still knows keeps them)
os.unlink(path)
emit("freed")
target = int(ask())
c = Ctl(mnt)
h = c.ok("handle.open")["handle"]
name = shm(target)
b = c.ok("buffer.register", shm=name)["buffer"]
r = c.req("pwrite", handle=h, buffer=b, length=target, path="pub/ctlfill")
os.unlink("/dev/shm/" + name)
emit("ctl", code=code(r), answer=r)
'''


class ReservedBlocksTest(su.SecurityCase):
    SLACK = 1 * MiB  # an extent block or two, rounding to the block

    def test_04_non_root_writes_stop_at_the_user_available_space(self):
        ext = su.mount_ext4(self, os.path.join(self.scratch.path, "ext4"), 64, reserved_pct=50)
        m = self.mount(backing=ext)
        self.public_dir()
        avail0, free0 = su.avail_bytes(ext), su.free_bytes(ext)
        self.assertGreater(free0 - avail0, 16 * MiB, "the reserve (-m 50) is there")
        c = self.child(FILL, {"mnt": self.mnt, "target": avail0 + 16 * MiB})
        got = c.expect("mount", timeout=120)
        used = free0 - su.free_bytes(ext)
        blocks = os.stat(os.path.join(ext, "pub", "fill")).st_blocks * 512
        c.send("measured")
        c.expect("freed", timeout=60)
        os.sync()
        avail1, free1 = su.avail_bytes(ext), su.free_bytes(ext)
        c.send(str(avail1 + 16 * MiB))
        ctl = c.expect("ctl", timeout=120)
        self.assertEqual(c.wait(30), 0, c.stderr())
        ctl_used = free1 - su.free_bytes(ext)
        ctl_blocks = os.stat(os.path.join(ext, "pub", "ctlfill")).st_blocks * 512
        self.assertIn(errno.ENOSPC, [e[1] for e in got["errors"]],
                      "the user wrote past the %d bytes available to users without ENOSPC: %s" %
                      (avail0, got))
        self.assertLessEqual(max(used, blocks), avail0 + self.SLACK,
                             "a user's writes through the mount took %d bytes of ext4's root "
                             "reserve (available to users: %d, used: %d)" %
                             (max(used, blocks) - avail0, avail0, used))
        self.assertEqual(ctl["code"], "ENOSPC", ctl)
        self.assertLessEqual(max(ctl_used, ctl_blocks), avail1 + self.SLACK,
                             "a user's ctl pwrite took %d bytes of ext4's root reserve" %
                             (max(ctl_used, ctl_blocks) - avail1))
        self.alive(m)


# ---------------------------------------------------------------------------------------------
# Item 15: CAP_MKNOD (and CAP_SYS_ADMIN) dormant; fallocate's COLLAPSE/INSERT_RANGE.

USER_REQUESTS = r'''
c = Ctl(A["mnt"])
h = c.ok("handle.open")["handle"]
name = shm(1 << 20)
b = c.ok("buffer.register", shm=name)["buffer"]
for i in range(8):
    c.ok("pwrite", handle=h, buffer=b, length=65536, path="pub/u%d" % i)
    c.ok("pread", handle=h, buffer=b, length=65536, path="pub/u%d" % i)
os.unlink("/dev/shm/" + name)
for i in range(8):
    with open(os.path.join(A["mnt"], "pub", "m%d" % i), "wb") as f:
        f.write(b"m" * 4096)
    os.mkdir(os.path.join(A["mnt"], "pub", "d%d" % i))
emit("done")
'''

FALLOC = r'''
fd = os.open(A["path"], os.O_RDWR)
assert len(os.pread(fd, 1 << 20, 0)) == 1 << 20   # a large read: the file is adopted
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
res = []
for mode, off, n in ((0x08, 1 << 20, 1 << 20), (0x20, 0, 1 << 20)):
    rc = libc.fallocate(fd, mode, off, n)
    res.append(0 if rc == 0 else ctypes.get_errno())
os.close(fd)
emit("done", res=res)
'''


class CapabilityTest(su.SecurityCase):
    def test_15a_cap_mknod_is_not_left_effective_on_any_thread(self):
        m = self.mount()
        self.public_dir()
        os.mknod(self.m("null"), 0o600 | stat.S_IFCHR, os.makedev(1, 3))
        self.assertTrue(stat.S_ISCHR(os.stat(self.b("null")).st_mode))
        with open(self.m("root.bin"), "wb") as f:
            f.write(b"r" * 65536)
        su.run_child(USER_REQUESTS, {"mnt": self.mnt})
        os.mknod(self.m("null2"), 0o600 | stat.S_IFCHR, os.makedev(1, 3))
        su.run_child(USER_REQUESTS.replace('"pub/u%d"', '"pub/v%d"').replace('"m%d"', '"n%d"')
                     .replace('"d%d"', '"e%d"'), {"mnt": self.mnt})
        bad = {}
        for tid in su.threads(m.pid):
            eff = su.cap_eff(m.pid, tid)
            if eff is None:
                continue
            names = [n for bit, n in ((su.CAP_MKNOD, "CAP_MKNOD"),
                                      (su.CAP_SYS_ADMIN, "CAP_SYS_ADMIN")) if eff >> bit & 1]
            if names:
                bad[tid] = "%s (CapEff %016x)" % ("+".join(names), eff)
        self.assertEqual(bad, {}, "threads of the daemon with a dormant capability effective "
                         "(of %d threads)" % len(su.threads(m.pid)))
        self.alive(m)

    def test_15b_collapse_and_insert_range(self):
        reason = su.preload_skip_reason()
        if reason:
            self.skipTest(reason)
        m = self.mount()
        data = su.block_pattern(8 * MiB, 15)
        self.write_file(self.m("f.bin"), data)
        fd = os.open(self.m("f.bin"), os.O_RDWR)
        try:
            plain = [su.fallocate(fd, su.FALLOC_FL_COLLAPSE_RANGE, MiB, MiB),
                     su.fallocate(fd, su.FALLOC_FL_INSERT_RANGE, 0, MiB)]
        finally:
            os.close(fd)
        # The FUSE kernel refuses these modes before the daemon sees them.
        self.assertEqual(plain, [errno.EOPNOTSUPP] * 2, "through the plain mount")
        probe = os.path.join(self.scratch.path, "probe.bin")
        with open(probe, "wb") as f:
            f.write(data)
        fd = os.open(probe, os.O_RDWR)
        try:
            if su.fallocate(fd, su.FALLOC_FL_COLLAPSE_RANGE, MiB, MiB):
                self.skipTest("the file system under BACKING_DIR has no COLLAPSE_RANGE")
        finally:
            os.close(fd)
        stats = os.path.join(self.scratch.path, "preload.jsonl")
        c = self.child(FALLOC, {"path": self.m("f.bin")}, uid=0,
                       argv_prefix=[su.dnvme_bin(), "run", "--stats", stats, "--min-bytes",
                                    "64K", "--mount", self.mnt, "--"])
        got = c.expect("done", timeout=60)
        self.assertEqual(c.wait(30), 0, c.stderr())
        self.assertEqual(got["res"], [0, 0], "COLLAPSE_RANGE, INSERT_RANGE under dnvme run "
                         "(errnos)")
        want = b"\0" * MiB + data[:MiB] + data[2 * MiB:]
        self.assertAllBytes(self.read_file(self.m("f.bin")), want, "after collapse + insert")
        self.alive(m)


if __name__ == "__main__":
    unittest.main()
