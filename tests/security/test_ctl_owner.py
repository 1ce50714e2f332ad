"""What an open of `.dnvme/` costs and whose it is (issue 45, "Security, round 2", items A-C;
docs/security.md "Per-uid limits", docs/control-protocol.md "Security").

A: every open of a control file (a ctl session, a stats/config snapshot) is charged to the
   opener's uid (ctl_max_opens, EMFILE) until its RELEASE.
B: a control handle's engine threads and their libaio events are charged to the uid
   (ctl_max_workers, ctl_max_aio_events, EAGAIN), given back at handle.close.
C: a ctl session is its opener's: a write by another uid (root writing to a descriptor a user
   opened) is refused with EPERM, never run with the writer's rights.

Run: /usr/bin/python3 -m unittest -v tests.security.test_ctl_owner   (as root)
"""

import errno
import json
import os
import socket
import unittest

from tests.security import sec_util as su

CTL_MAX_OPENS = 1024  # the defaults (fs/options.h)
CTL_MAX_WORKERS = 64


def setUpModule():
    reason = su.suite_skip_reason()
    if reason:
        raise unittest.SkipTest(reason)


def ctl_path(mnt, name):
    return os.path.join(mnt, ".dnvme", name)


# ---------------------------------------------------------------------------------------------
# A: opens of .dnvme/ files are charged per uid.

OPEN_MANY = r'''
import resource
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # its own table must not be what stops it
fds, refused = [], None
for name in ("stats", "ctl"):
    while len(fds) < A["max"]:
        try:
            flags = os.O_RDONLY if name == "stats" else os.O_RDWR
            fds.append(os.open(os.path.join(A["mnt"], ".dnvme", name), flags))
        except OSError as e:
            refused = errno.errorcode.get(e.errno, str(e.errno))
            break
    if name == "stats":
        n_stats, stats_refused = len(fds), refused
        refused = None
ctl_refused = refused
emit("filled", n_stats=n_stats, stats_refused=stats_refused, n_total=len(fds),
     ctl_refused=ctl_refused)
ask()
for fd in fds:
    os.close(fd)
# RELEASE reaches the daemon after close(2) returned: the units come back shortly.
again, deadline = None, time.monotonic() + 10
while time.monotonic() < deadline:
    try:
        os.close(os.open(os.path.join(A["mnt"], ".dnvme", "stats"), os.O_RDONLY))
        again = "OK"
        break
    except OSError as e:
        again = errno.errorcode.get(e.errno, str(e.errno))
        time.sleep(0.1)
emit("closed", again=again)
'''


class ControlOpensTest(su.SecurityCase):
    def test_45a_control_file_opens_are_limited_per_uid(self):
        """Before: nothing counted these opens; the user held all 1,300 (and 76,000 opens grew
        the daemon by 222 MiB), so `n_stats` passed the limit and nothing was refused."""
        m = self.mount()
        c = self.child(OPEN_MANY, {"mnt": self.mnt, "max": CTL_MAX_OPENS + 300})
        got = c.expect("filled", timeout=300)
        # Root is served while the user sits at its limit.
        with open(ctl_path(self.mnt, "stats")) as f:
            root_stats = json.load(f)
        ctl = su.Ctl(self.mnt)
        hello = ctl.req("hello")
        ctl.close()
        c.send("close")
        closed = c.expect("closed", timeout=60)
        self.assertIn("ctl", root_stats)
        self.assertIs(hello.get("ok"), True, hello)
        self.assertEqual(got["stats_refused"], "EMFILE", got)
        self.assertEqual(got["n_stats"], CTL_MAX_OPENS, got)
        self.assertEqual(got["ctl_refused"], "EMFILE", "a ctl open past the limit: %s" % got)
        self.assertEqual(got["n_total"], CTL_MAX_OPENS, got)
        self.assertEqual(hello["limits"].get("max_opens"), CTL_MAX_OPENS, hello)
        self.assertEqual(closed["again"], "OK", "the units did not come back at RELEASE")
        self.assertIn("ctl_max_opens", m.log_tail(), "the refusal is logged with the option")
        self.alive(m)


# ---------------------------------------------------------------------------------------------
# B: a handle's workers and their libaio events are charged per uid.

MANY_WORKERS = r'''
c = Ctl(A["mnt"])
small = {"block_size": 4096, "bounce_bytes_per_worker": 8192}
handles, refused, message = [], None, ""
for i in range(8):  # ctl_max_handles
    a = c.req("handle.open", intra_op_parallelism=A["workers"], queue_depth=32, **small)
    if not a.get("ok"):
        refused, message = code(a), a["error"]["message"]
        break
    handles.append(a["handle"])
emit("filled", n=len(handles), refused=refused, message=message)
ask()
for h in handles:
    c.ok("handle.close", handle=h)
a = c.req("handle.open", intra_op_parallelism=8, queue_depth=4096, **small)
emit("events", code=code(a), message=a.get("error", {}).get("message", ""))
if a.get("ok"):
    c.req("handle.close", handle=a["handle"])
a = c.req("handle.open", intra_op_parallelism=A["workers"], queue_depth=32, **small)
emit("again", code=code(a))
'''


class HandleWorkersTest(su.SecurityCase):
    def test_45b_handle_workers_and_aio_events_are_limited_per_uid(self):
        """Before: only the handle count was limited; the user's 8 handles of 64 workers all
        opened (512 threads, eventfds and libaio contexts), refused only by ctl_max_handles
        (EMFILE), and a handle of 8 x 4096 libaio events (half of aio-max-nr) opened."""
        m = self.mount()
        with open(ctl_path(self.mnt, "stats")):
            pass  # the loop threads are up before the count
        before = su.settled_threads(m.pid)
        c = self.child(MANY_WORKERS, {"mnt": self.mnt, "workers": CTL_MAX_WORKERS})
        got = c.expect("filled", timeout=120)
        grown = su.settled_threads(m.pid) - before
        ctl = su.Ctl(self.mnt)
        root = ctl.req("handle.open", intra_op_parallelism=4, queue_depth=32)
        if root.get("ok"):
            ctl.req("handle.close", handle=root["handle"])
        ctl.close()
        c.send("go")
        events = c.expect("events", timeout=60)
        again = c.expect("again", timeout=60)
        self.assertIs(root.get("ok"), True, "root's handle.open while the user holds its "
                      "workers: %s" % root)
        self.assertEqual(got["n"], 1, got)
        self.assertEqual(got["refused"], "EAGAIN", got)
        self.assertIn("ctl_max_workers=%d" % CTL_MAX_WORKERS, got["message"])
        self.assertLessEqual(grown, CTL_MAX_WORKERS + 16, "the daemon grew %d threads for one "
                             "user's handles" % grown)
        self.assertEqual(events["code"], "EAGAIN", events)
        self.assertIn("ctl_max_aio_events", events["message"])
        self.assertEqual(again["code"], "OK", "the workers did not come back at handle.close")
        self.alive(m)


# ---------------------------------------------------------------------------------------------
# C: a ctl session runs as its opener; root writing to a user's ctl descriptor is refused.

HAND_OVER = r'''
name = shm(1 << 20)
os.chmod("/dev/shm/" + name, 0o600)
c = Ctl(A["mnt"])
h = c.ok("handle.open", block_size=4096, queue_depth=4, intra_op_parallelism=1)["handle"]
b = c.ok("buffer.register", shm=name)["buffer"]
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect("\0" + A["sock"])
socket.send_fds(s, [json.dumps({"handle": h, "buffer": b}).encode()], [c.fd])
emit("sent")
ask()
with open("/dev/shm/" + name, "rb") as f:
    data = f.read(A["n"])
os.unlink("/dev/shm/" + name)
emit("buffer", leaked=data == A["secret"].encode())
'''


class CtlOwnerTest(su.SecurityCase):
    SECRET = "root-only secret: 0123456789abcdef\n"

    def test_45c_a_ctl_descriptor_is_its_openers(self):
        """Before: a request ran as the writer of each write(): root writing a pread into the
        uid-65534 process's session read the root-only 0600 file into the user's buffer."""
        m = self.mount()
        self.write_file(self.m("secret"), self.SECRET.encode(), mode=0o600)
        sock_name = "dnvme-sec-45c-%d" % os.getpid()
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.addCleanup(srv.close)
        srv.bind("\0" + sock_name)
        srv.listen(1)
        srv.settimeout(60)
        c = self.child(HAND_OVER, {"mnt": self.mnt, "sock": sock_name, "secret": self.SECRET,
                                   "n": len(self.SECRET)})
        conn, _ = srv.accept()
        self.addCleanup(conn.close)
        msg, fds, _, _ = socket.recv_fds(conn, 4096, 1)
        self.assertEqual(len(fds), 1, "no descriptor came")
        fd = fds[0]
        self.addCleanup(os.close, fd)
        ids = json.loads(msg)
        c.expect("sent")
        # Root (a set-user-ID program, say) writes into the user's session.
        req = {"op": "pread", "handle": ids["handle"], "buffer": ids["buffer"],
               "path": "secret", "length": len(self.SECRET)}
        write_err, answer = None, None
        try:
            os.write(fd, json.dumps(req).encode())
            answer = os.read(fd, 1 << 20)
        except OSError as e:
            write_err = e.errno
        c.send("check")
        leaked = c.expect("buffer")["leaked"]
        self.assertFalse(leaked, "root's write into uid %d's ctl session read a 0600 root file "
                         "into the user's buffer (answer %r)" % (su.NOBODY, answer))
        self.assertEqual(write_err, errno.EPERM, "root's write into another uid's session: "
                         "errno %s, answer %r" % (write_err, answer))
        # The user's own session still works, and root's own session is root's.
        ctl = su.Ctl(self.mnt)
        self.assertIs(ctl.req("hello").get("ok"), True)
        ctl.close()
        self.alive(m)


if __name__ == "__main__":
    unittest.main()
