"""One user stalls or starves everyone (issue 34, items 5-11; docs/security.md "Per-uid limits",
"Nobody waits for another user").

Each test has the user (uid 65534) take as much as it can of one resource, then checks that the
user was stopped at its own limit with the documented error and that root is still served.
Where a wait must not happen, the assertion is an ordering ("root's request finished while the
user's was still running") or a generous hang-detection bound, never a performance figure.

Run: /usr/bin/python3 -m unittest -v tests.security.test_limits   (as root)
"""

import json
import os
import resource
import socket
import struct
import subprocess
import time
import unittest

from tests.security import sec_util as su
from tests.security.sec_util import GiB, MiB, mh

# A request that must not wait for another user's counts as hung after this long (it takes
# milliseconds; the waits of main's daemon were 8-10 s).
HANG_S = 5.0
LEASE_WAIT_S = 2.0  # lease_wait_ms (docs/security.md)
# An open of a leased file that must not wait again: below one lease wait, so that a second
# wait shows.
NO_REPEAT_S = 1.5


timed = su.timed


def setUpModule():
    # Everything here mounts as root and acts as uid 65534: without that, skip it all (ctest
    # then shows the test as skipped).
    reason = su.suite_skip_reason()
    if reason:
        raise unittest.SkipTest(reason)


# ---------------------------------------------------------------------------------------------
# Item 5: client mappings, per uid.

FILL_MAPPINGS = r'''
name = shm(4096)
sessions = []
ok, refused, message = 0, None, ""
for s in range(A["sessions"]):
    c = Ctl(A["mnt"])
    sessions.append(c)
    first = True
    while True:
        a = c.req("buffer.register", shm=name)
        if not a.get("ok"):
            refused, message = code(a), a["error"]["message"]
            break
        ok += 1
        first = False
    if first:
        break  # a fresh session is refused at once: the uid is at its limit
emit("filled", ok=ok, refused=refused, message=message, sessions=len(sessions))
ask()
os.unlink("/dev/shm/" + name)
emit("done")
'''


class MappingsTest(su.SecurityCase):
    def test_05_client_mappings_are_limited_per_uid(self):
        m = self.mount()
        c = self.child(FILL_MAPPINGS, {"mnt": self.mnt, "sessions": 20})
        got = c.expect("filled", timeout=120)
        shm_path = "/dev/shm/dnvme-sec-root-%d" % os.getpid()
        fd = os.open(shm_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(fd, MiB)
        os.pwrite(fd, bytes(MiB), 0)
        os.close(fd)
        self.addCleanup(os.unlink, shm_path)
        ctl = su.Ctl(self.mnt)
        self.addCleanup(ctl.close)
        root = ctl.req("buffer.register", shm=os.path.basename(shm_path))
        c.send("end")
        c.expect("done")
        self.assertIs(root.get("ok"), True, "root's buffer.register while the user holds %d "
                      "mappings: %s" % (got["ok"], root))
        self.assertEqual(got["refused"], "EMFILE", got)
        self.assertLessEqual(got["ok"], 256, "ctl_max_buffers (256) per uid, all sessions: %s" %
                             got)
        self.alive(m)


# ---------------------------------------------------------------------------------------------
# Item 6: files the daemon holds open for a uid (uncollected async transfers).

FILL_FDS = r'''
c = Ctl(A["mnt"])
h = c.ok("handle.open")["handle"]
name = shm(1 << 20)
b = c.ok("buffer.register", shm=name)["buffer"]
n, refused, message = 0, None, ""
while n < A["max"]:
    a = c.req("pread", handle=h, buffer=b, length=4096, path="pub/src", **{"async": True})
    if not a.get("ok"):
        refused, message = code(a), a["error"]["message"]
        break
    n += 1
emit("filled", n=n, refused=refused, message=message)
ask()
os.unlink("/dev/shm/" + name)
emit("done")
'''


class FilesTest(su.SecurityCase):
    # The daemon starts with a soft RLIMIT_NOFILE of 4096 (the 20,000 scaled down, so
    # that main's daemon is filled quickly). The fixed daemon raises it to the hard limit, and
    # max_files_per_uid is then max(1024, hard/16).
    NOFILE = 4096

    def test_06_uncollected_async_transfers_are_limited_per_uid(self):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(self.NOFILE, hard), hard))
        try:
            m = self.mount()
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        limit = max(1024, (hard if hard != resource.RLIM_INFINITY else 1 << 20) // 16)
        self.public_dir()
        self.write_file(self.m("pub", "src"), b"s" * 65536)
        c = self.child(FILL_FDS, {"mnt": self.mnt, "max": max(self.NOFILE, limit) + 1000})
        got = c.expect("filled", timeout=120)
        nfd = len(os.listdir("/proc/%d/fd" % m.pid))
        err = None
        try:
            with open(self.m("new"), "w") as f:
                f.write("hi\n")
        except OSError as e:
            err = e
        ctl = su.Ctl(self.mnt)
        hello = ctl.req("hello")
        ctl.close()
        c.send("end")
        c.expect("done")
        self.assertIsNone(err, "root's `echo hi > MNT/new` with the user's %d transfers "
                          "pending (daemon fds: %d)" % (got["n"], nfd))
        self.assertIs(hello.get("ok"), True, hello)
        # ctl_max_pending (1024, EAGAIN) or max_files_per_uid (EMFILE): whichever the daemon
        # counts first.
        self.assertIn(got["refused"], ("EAGAIN", "EMFILE"), got)
        self.assertLessEqual(got["n"], limit, got)
        self.alive(m)


# ---------------------------------------------------------------------------------------------
# Item 7: pinned and registered memory a user can make the daemon hold.

PINNING = r'''
c = Ctl(A["mnt"])
res = {"hello": c.ok("hello")}
def try_open(**cfg):
    a = c.req("handle.open", **cfg)
    if a.get("ok"):
        return a, "OK", a["config"]
    return a, code(a), None
a, res["block"], cfg = try_open(block_size=1 << 30)
if cfg is not None:
    res["block_cfg"] = cfg["block_size"]
    if cfg["block_size"] <= 64 << 20:  # clamped: the transfer that pinned 2 GiB on main
        name = shm(1 << 20)
        b = c.ok("buffer.register", shm=name)["buffer"]
        emit("before_pread")
        ask()
        res["pread"] = code(c.req("pread", handle=a["handle"], buffer=b, buffer_offset=1,
                                  length=8192, file_offset=1, path="pub/src"))
        emit("after_pread")
        ask()
        c.req("buffer.unregister", buffer=b)
        os.unlink("/dev/shm/" + name)
    c.req("handle.close", handle=a["handle"])
a, res["bounce"], cfg = try_open(bounce_bytes_per_worker=4 << 30)
if cfg is not None:
    res["bounce_cfg"] = cfg["bounce_bytes_per_worker"]
    c.req("handle.close", handle=a["handle"])
a, res["estimate"], cfg = try_open(block_size=64 << 20, bounce_bytes_per_worker=1 << 30,
                                   intra_op_parallelism=8)
if cfg is not None:
    c.req("handle.close", handle=a["handle"])
name = shm(1 << 30, sparse=True)  # nothing allocated yet
r = c.req("buffer.register", shm=name)
res["sparse"] = code(r)
res["sparse_blocks"] = os.stat("/dev/shm/" + name).st_blocks * 512
os.unlink("/dev/shm/" + name)
emit("done", **res)
'''


class PinnedTest(su.SecurityCase):
    def test_07_pinned_and_registered_memory_are_bounded(self):
        m = self.mount()
        self.public_dir()
        self.write_file(self.m("pub", "src"), b"s" * (1 << 20))
        c = self.child(PINNING, {"mnt": self.mnt})
        pinned = None
        msg = c.next(120)
        if msg and msg["tag"] == "before_pread":
            before = su.pinned_bytes(m.pid)
            c.send("go")
            c.expect("after_pread", 120)
            pinned = su.pinned_bytes(m.pid) - before
            c.send("go")
            msg = c.next(120)
        if not msg or msg["tag"] != "done":
            self.fail("child: %r; stderr:\n%s" % (msg, c.stderr()))
        got = msg
        ram = su.mem_total()
        limits = got["hello"]["limits"]
        problems = []
        max_bytes = next((limits[k] for k in ("max_buffer_bytes", "ctl_max_bytes", "max_bytes")
                          if k in limits), None)
        if max_bytes is None or max_bytes > ram // 4 + MiB:
            problems.append("ctl_max_bytes is not RAM/4 by default (RAM %d): hello says %s" %
                            (ram, limits))
        if got["block"] == "OK" and got.get("block_cfg", 0) > 64 * MiB:
            problems.append("handle.open block_size=1G accepted as %s" % got["block_cfg"])
        if pinned is not None and pinned > 256 * MiB:
            problems.append("an unaligned 8 KiB pread pinned %d bytes" % pinned)
        if got["bounce"] == "OK" and got.get("bounce_cfg", 0) > GiB:
            problems.append("bounce_bytes_per_worker=4G accepted as %s" % got["bounce_cfg"])
        if got["estimate"] != "ENOMEM":
            problems.append("a handle of 8 workers x 1 GiB bounce buffers (over ctl_max_pinned, "
                            "min(RAM/16, 4 GiB)) gave %s, not ENOMEM" % got["estimate"])
        if got["sparse"] != "OK":
            problems.append("registering a sparse 1 GiB object: %s" % got["sparse"])
        if got["sparse_blocks"] >= 16 * MiB:
            problems.append("registering a sparse 1 GiB object populated %d bytes of it" %
                            got["sparse_blocks"])
        self.assertEqual(problems, [])
        self.alive(m)


# ---------------------------------------------------------------------------------------------
# Item 8: one user's long control request does not hold another's.

LONG_WAIT = r'''
c = Ctl(A["mnt"])
h = c.ok("handle.open", block_size=4096, queue_depth=1, intra_op_parallelism=1)["handle"]
size = A["size"]
name = shm(size)
b = c.ok("buffer.register", shm=name)["buffer"]
os.unlink("/dev/shm/" + name)  # mapped by the daemon; the name is not needed (nor left behind)
t0 = time.monotonic()
c.ok("pread", handle=h, buffer=b, length=A["probe"], path="pub/big")
rate = A["probe"] / max(time.monotonic() - t0, 1e-6)
n = max(1, min(A["max_ops"], int(A["seconds"] * rate / size) + 1))
for i in range(n):
    c.ok("pread", handle=h, buffer=b, length=size, path="pub/big", **{"async": True})
emit("waiting", n=n, rate=rate)
w = c.req("wait", handle=h)
emit("waited", code=code(w), completed=w.get("completed"))
'''


class CtlInodeTest(su.SecurityCase):
    SIZE = 64 * MiB
    SECONDS = 4.0  # the user's wait is sized to last about this long

    def test_08_a_users_long_wait_does_not_hold_roots_request(self):
        m = self.mount()
        self.public_dir()
        self.write_file(self.m("pub", "big"), su.nonzero_pattern(self.SIZE))
        os.sync()
        c = self.child(LONG_WAIT, {"mnt": self.mnt, "size": self.SIZE, "probe": 8 * MiB,
                                   "seconds": self.SECONDS, "max_ops": 400})
        waiting = c.expect("waiting", timeout=120)
        time.sleep(0.3)  # the user's `wait` is in the daemon (not an assertion)
        ctl = su.Ctl(self.mnt)
        self.addCleanup(ctl.close)
        t, hello = timed(lambda: ctl.req("hello"), 300)
        root_done = time.monotonic()
        waited = c.expect("waited", timeout=300)
        self.assertEqual(waited["code"], "OK", waited)
        self.assertIsInstance(hello, dict, hello)
        self.assertIs(hello.get("ok"), True, hello)
        self.assertLess(root_done, waited["t"],
                        "root's hello (%.2f s) finished only after the user's wait of %d x %d "
                        "bytes (%.2f s) ended: root waited for another user" %
                        (t, waiting["n"], self.SIZE, waited["t"] - waiting["t"]))
        self.alive(m)


# ---------------------------------------------------------------------------------------------
# Item 9: a broker open of a FIFO; SIGTERM afterwards.

FIFO_OPEN = r'''
fifo = os.path.join(A["mnt"], "pub", "fifo")
os.mkfifo(fifo, 0o666)
fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # the client's own descriptor (the kernel's)
ino = os.fstat(fd).st_ino
br = Broker(A["mnt"], timeout=A["timeout"])
br.call(1)
t0 = time.monotonic()
try:
    err, lease, slot, size, msg, fds = br.call(2, path=b"pub/fifo", flags=os.O_RDONLY, ino=ino)
    emit("reply", err=err, message=msg, nfds=len(fds), dt=time.monotonic() - t0)
except socket.timeout:
    emit("reply", err="timeout", dt=time.monotonic() - t0)
ask()
'''


class FifoTest(su.SecurityCase):
    def test_09_broker_open_of_a_fifo_neither_blocks_nor_stops_shutdown(self):
        m = self.mount()
        self.public_dir()
        c = self.child(FIFO_OPEN, {"mnt": self.mnt, "timeout": 10.0})

        def unstick():  # main's daemon hangs in open(2) of the FIFO: a writer frees it
            try:
                os.close(os.open(self.b("pub", "fifo"), os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        self.addCleanup(unstick)
        got = c.expect("reply", timeout=60)
        self.assertNotEqual(got["err"], "timeout", "no reply to a broker open of a FIFO within "
                            "10 s: a broker thread is blocked in open(2)")
        self.assertIsNotNone(got["err"], "the broker closed the connection: %s" % got)
        self.assertNotEqual(got["err"], 0, "a FIFO was handed out: %s" % got)
        self.assertEqual(got["nfds"], 0, got)
        exited, rc = m.terminate_and_wait(timeout=mh.STOP_WAIT_S)
        self.assertTrue(exited, "the daemon did not stop within %.0f s of SIGTERM; log:\n%s" %
                        (mh.STOP_WAIT_S, m.log_tail()))
        self.assertTrue(mh.wait_unmounted(self.mnt, 10.0), "still mounted after SIGTERM")


# ---------------------------------------------------------------------------------------------
# Item 10: a lease holder's writes_inflight counter delays only opens of its own file, briefly.

LEASE = r'''
path = os.path.join(A["mnt"], "pub", "ufile")
with open(path, "wb") as f:
    f.write(b"u" * (1 << 20))
fd = os.open(path, os.O_RDWR)  # the descriptor the lease is for
br = Broker(A["mnt"], timeout=30)
err, _, _, _, msg, page = br.call(1)
assert err == 0 and page, (err, msg)
err, lease, slot, size, msg, fds = br.call(2, path=b"pub/ufile", flags=os.O_RDWR,
                                           ino=os.fstat(fd).st_ino)
assert err == 0, (err, msg)
for x in fds:
    os.close(x)
mm = mmap.mmap(page[0], 8192)  # the lease page, writable by its client (it counts there)
def setw(v):
    struct.pack_into("=I", mm, slot * 16 + 8, v)  # LeaseWord.writes_inflight
setw(1)
durations = []
def opener():
    t = time.monotonic()
    try:
        os.close(os.open(path, os.O_RDONLY))
        durations.append(time.monotonic() - t)
    except OSError as e:
        durations.append(-e.errno)
ths = [threading.Thread(target=opener, daemon=True) for _ in range(A["opens"])]
for t in ths:
    t.start()
emit("armed", slot=slot)
while True:
    cmd = ask()
    if cmd in ("0", "1"):
        setw(int(cmd))
        emit("set")
    elif cmd == "opens":
        for t in ths:
            t.join(A["join_s"])
        emit("opens", durations=durations)
    else:
        break
'''


class LeaseCounterTest(su.SecurityCase):
    OPENS = 40  # more than the daemon's 32 FUSE loop threads

    def test_10_writes_inflight_delays_only_opens_of_the_own_file_once(self):
        m = self.mount()
        self.public_dir()
        for i in range(8):  # never looked up through the mount: each stat reaches the daemon
            self.write_file(self.b("other%d" % i), b"o" * 65536)
        c = self.child(LEASE, {"mnt": self.mnt, "opens": self.OPENS, "join_s": 30})
        c.expect("armed", timeout=60)
        time.sleep(0.3)  # the user's opens reach the daemon (not an assertion)
        ufile = self.m("pub", "ufile")

        def check_not_waiting(what, fn, bound=HANG_S):
            t, r = timed(fn, bound)
            self.assertIsNotNone(t, "%s waited %.1f s or more while the user's counter reads 1 "
                                 "(it must not wait at all)" % (what, bound))
            self.assertNotIsInstance(r, BaseException, "%s: %r" % (what, r))

        check_not_waiting("root's stat of another file", lambda: os.stat(self.m("other0")))
        check_not_waiting("root's cat of another file", lambda: self.read_file(self.m("other1")))
        check_not_waiting("root's stat of the leased file", lambda: os.stat(ufile))
        t, r = timed(lambda: self.read_file(ufile), LEASE_WAIT_S + 2.0)
        self.assertIsNotNone(t, "root's open of the leased file waited more than lease_wait_ms "
                             "(%.0f s) + 2 s" % LEASE_WAIT_S)
        self.assertEqual(r, b"u" * MiB)
        for rnd, name in enumerate(("other2", "other3")):
            c.send("0")
            c.expect("set")
            c.send("1")
            c.expect("set")
            check_not_waiting("round %d: root's open of the leased file (the holder already "
                              "kept one wait to the limit)" % (rnd + 2),
                              lambda: self.read_file(ufile), NO_REPEAT_S)
            check_not_waiting("round %d: root's stat of another file" % (rnd + 2),
                              lambda: os.stat(self.m(name)))
        c.send("opens")
        opens = c.expect("opens", timeout=120)["durations"]
        self.assertEqual(len(opens), self.OPENS, "the user's own opens did not all finish: %s" %
                         opens)
        self.assertTrue(all(d >= 0 for d in opens), opens)
        c.send("end")
        self.alive(m)


# ---------------------------------------------------------------------------------------------
# Item 11: broker connections and threads per uid.

CONNECT = r'''
import select
name = open(os.path.join(A["mnt"], ".dnvme", "broker")).read().split("socket @")[1].split()[0]
socks, counts, messages = {}, {"ok": 0, "error": 0, "closed": 0, "connect_failed": 0}, {}
for i in range(A["n"]):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        s.connect("\0" + name)  # blocking: waits while the daemon's backlog is full
        s.send(REQ.pack(MAGIC, 1, 0, 0, 0, 0, 0, 0, b""))
    except OSError as e:
        counts["connect_failed"] += 1
        messages[str(e)] = messages.get(str(e), 0) + 1
        s.close()
        continue
    socks[s.fileno()] = s
p = select.poll()
for fd in socks:
    p.register(fd, select.POLLIN)
pending = set(socks)
deadline = time.monotonic() + A["reply_s"]
while pending and time.monotonic() < deadline:
    for fd, ev in p.poll(200):
        if fd not in pending:
            continue
        pending.discard(fd)
        p.unregister(fd)
        try:
            msg, anc, _, _ = socks[fd].recvmsg(REP.size, socket.CMSG_SPACE(16))
        except OSError:
            msg, anc = b"", []  # reset: closed by the daemon without a reply
        for lvl, typ, data in anc:
            if typ == socket.SCM_RIGHTS:
                for x in struct.unpack("%di" % (len(data) // 4), data[:len(data) // 4 * 4]):
                    os.close(x)
        if not msg:
            counts["closed"] += 1
            continue
        err, text = REP.unpack(msg)[1], REP.unpack(msg)[6].split(b"\0")[0].decode()
        if err == 0:
            counts["ok"] += 1
        else:
            counts["error"] += 1
            messages[text] = messages.get(text, 0) + 1
counts["no_reply"] = len(pending)
emit("connected", counts=counts, messages=messages)
ask()
'''


class ConnectionsTest(su.SecurityCase):
    N = 1030

    def test_11_broker_connections_are_limited_per_uid(self):
        reason = su.preload_skip_reason()
        if reason:
            self.skipTest(reason)
        m = self.mount()
        # Warm the daemon up first (its loop threads, the broker's first connection), so that
        # only the user's connections make it grow below.
        os.listdir(self.mnt)
        mh.stats(self.mnt)
        warm = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        warm.connect("\0" + su.broker_socket(self.mnt))
        warm.send(struct.pack("=IIQQqqII4096s", 0x444e5642, 1, 0, 0, 0, 0, 0, 0, b""))
        warm.settimeout(10)
        _, anc, _, _ = warm.recvmsg(1024, socket.CMSG_SPACE(16))
        for _, _, fdata in anc:
            for fd in struct.unpack("%di" % (len(fdata) // 4), fdata[:len(fdata) // 4 * 4]):
                os.close(fd)
        warm.close()
        before = su.settled_threads(m.pid)
        c = self.child(CONNECT, {"mnt": self.mnt, "n": self.N, "reply_s": 20.0})
        got = c.expect("connected", timeout=120)
        grown = su.settled_threads(m.pid) - before
        stats = os.path.join(self.scratch.path, "preload.jsonl")
        leases0 = mh.stats(self.mnt)["broker"]["leases"]
        r = subprocess.run([su.dnvme_bin(), "run", "--stats", stats, "--min-bytes", "64K",
                            "--mount", self.mnt, "--", "dd", "if=/dev/zero",
                            "of=" + self.m("root.bin"), "bs=1M", "count=8", "status=none"],
                           capture_output=True, text=True, timeout=120)
        leases1 = mh.stats(self.mnt)["broker"]["leases"]
        c.send("end")
        counts, messages = got["counts"], got["messages"]
        self.assertEqual(r.returncode, 0, r.stderr)
        adopted = 0
        if os.path.exists(stats):
            with open(stats) as f:
                adopted = sum(json.loads(x).get("adopted", 0) for x in f if x.strip())
        self.assertGreater(leases1, leases0, "root's `dnvme run` got no lease while the user "
                           "holds %d connections (%s); preload adopted %d" %
                           (self.N, counts, adopted))
        self.assertGreaterEqual(adopted, 1, "root's `dnvme run` adopted nothing")
        self.assertLessEqual(grown, 128 + 16, "the daemon grew %d threads for one user's %d "
                             "connections (broker_max_conns_per_uid 128): %s" %
                             (grown, self.N, counts))
        self.assertLessEqual(counts["ok"], 128, counts)
        self.assertEqual(counts["error"], self.N - counts["ok"],
                         "every refused connection gets an error reply: %s" % counts)
        self.assertTrue(all("broker_max_conns_per_uid" in t for t in messages),
                        "the error names the limit: %s" % messages)
        self.alive(m)


if __name__ == "__main__":
    unittest.main()
