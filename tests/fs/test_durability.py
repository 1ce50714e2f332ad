"""Durability and lifecycle of a dnvmefs mount: kill -9 mid-stream (every fsync-acknowledged byte
must be in BACKING_DIR), ENOSPC on a small tmpfs, lazy unmount with open files, bad invocations
(exit code 2, one-line message, nothing mounted), SIGTERM/SIGINT with unflushed write-behind data.

Run: /usr/bin/python3 -m unittest -v tests.fs.test_durability   (root for the tmpfs cases)
"""

import errno
import json
import mmap
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mount_harness as mh  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20


def stream(seed, n):
    """The deterministic byte stream of one writer."""
    return random.Random(seed).randbytes(n)


def read(path):
    with open(path, "rb") as f:
        return f.read()


def first_diff(a, b):
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class Base(unittest.TestCase):
    NEED_ROOT = False
    # Options that pick the transport (fs/transport/transport.h): the subclasses at the end run the
    # crash and disk-sync tests over each form. Empty: the default (splice when it can).
    TRANSPORT = ()

    def setUp(self):
        reason = mh.skip_reason(need_root=self.NEED_ROOT)
        if reason:
            self.skipTest(reason)
        self.scratch = mh.Scratch(type(self).__name__)
        self.addCleanup(self.scratch.cleanup)
        self.backing, self.mnt = self.scratch.backing, self.scratch.mnt
        self.setUpTransport()

    def setUpTransport(self):
        if "io_uring=1" in self.TRANSPORT:
            prev = mh.set_kernel_uring(True)
            self.addCleanup(mh.restore_kernel_uring, prev)

    def mount(self, options=(), **kw):
        m = mh.Mount(self.backing, self.mnt, options=tuple(self.TRANSPORT) + tuple(options), **kw)
        self.addCleanup(m.stop)  # runs before scratch cleanup (LIFO)
        return m.start()


# -------------------------------------------------------------------------------------------------
class CrashTest(Base):
    """kill -9 the daemon while writers append + fsync; every acknowledged byte must survive."""

    WRITERS = 3
    FILE_CAP = 32 * MiB  # a writer moves on to a new file at this size
    DEAD_MOUNT_ERRNOS = ()  # errnos besides ENOTCONN/ECONNABORTED/EIO a transport may give
    PATTERN = stream(99, MiB + 4099)  # file content at offset o: PATTERN[(o + shift) % len]

    @classmethod
    def content(cls, shift, off, n):
        p, out = cls.PATTERN, bytearray()
        while n > 0:
            i = (off + shift) % len(p)
            piece = p[i:i + n]
            out += piece
            off += len(piece)
            n -= len(piece)
        return bytes(out)

    def _writer(self, idx, st, stop):
        direct = idx == 0  # one O_DIRECT writer (aligned), the others buffered and unaligned
        rng = random.Random(idx)
        buf = mmap.mmap(-1, 2 * MiB)
        fd = None
        try:
            while not stop.is_set():
                name = "crash%d_%d" % (idx, len(st["files"]))
                shift = idx * 7919 + len(st["files"]) * 104729
                fd = os.open(os.path.join(self.mnt, name), os.O_CREAT | os.O_WRONLY |
                             (os.O_DIRECT if direct else 0), 0o644)
                rec = {"name": name, "shift": shift, "acked": 0, "written": 0}
                st["files"].append(rec)
                off = 0
                while not stop.is_set() and off < self.FILE_CAP:
                    if direct:
                        n = rng.randint(1, 512) * 4096
                        buf[:n] = self.content(shift, off, n)
                        off += os.pwritev(fd, [memoryview(buf)[:n]], off)
                    else:
                        n = rng.choice([rng.randint(1, 4096), rng.randint(4096, MiB + 5)])
                        off += os.pwrite(fd, self.content(shift, off, n), off)
                    rec["written"] = off
                    if rng.random() < 0.5:
                        os.fsync(fd)
                        rec["acked"] = off  # fsync returned: [0, off) must be durable
                        st["fsyncs"] += 1
                os.close(fd)
                fd = None
        except OSError as exc:
            st["stopped_by"] = mh.errno_name(exc.errno)
        finally:
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
            buf.close()

    def test_kill9_keeps_fsynced_data(self):
        m = self.mount()
        states = [{"files": [], "fsyncs": 0, "stopped_by": None} for _ in range(self.WRITERS)]
        stop = threading.Event()
        ts = [threading.Thread(target=self._writer, args=(i, states[i], stop), daemon=True)
              for i in range(self.WRITERS)]
        for t in ts:
            t.start()
        # Run until every writer has had a few fsyncs acknowledged (bounded), then kill.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and \
                not all(s["fsyncs"] >= 8 or s["stopped_by"] for s in states):
            time.sleep(0.05)
        running = [t.is_alive() for t in ts]
        m.kill9()
        self.assertFalse(m.alive(), "daemon survived SIGKILL?")
        for t in ts:
            t.join(30)
        stop.set()
        for t in ts:
            t.join(5)
        self.assertFalse(any(t.is_alive() for t in ts),
                         "a writer is still blocked on the dead mount")
        self.assertEqual(running, [True] * self.WRITERS,
                         "writers had stopped before the kill: %s" %
                         [s["stopped_by"] for s in states])
        for i, s in enumerate(states):
            self.assertGreater(s["fsyncs"], 0, "writer %d never got an fsync through (%s)" %
                               (i, s["stopped_by"]))
            self.assertIn(s["stopped_by"], ("ENOTCONN", "ECONNABORTED", "EIO") +
                          self.DEAD_MOUNT_ERRNOS,
                          "writer %d should have been stopped by the dead mount" % i)
        sys.stderr.write("\n[crash] per writer (file, acked, written): %s\n" %
                         [[(f["name"], f["acked"], f["written"]) for f in s["files"]]
                          for s in states])
        # Clean the dead mount (fusermount3 -u, then lazy).
        m.stop()
        self.assertFalse(mh.mounts_at(self.mnt), "dead mount could not be cleaned")

        for s in states:
            for f in s["files"]:
                got = read(os.path.join(self.backing, f["name"]))
                self.assertGreaterEqual(
                    len(got), f["acked"], "%s: BACKING_DIR has %d bytes, %d were fsync-"
                    "acknowledged" % (f["name"], len(got), f["acked"]))
                want = self.content(f["shift"], 0, f["acked"])
                d = first_diff(got[:f["acked"]], want)
                self.assertEqual(d, f["acked"], "%s: acknowledged byte %d differs in BACKING_DIR"
                                 % (f["name"], d))

        # Remount and read back through the mount: same bytes as the backing files.
        m2 = mh.Mount(self.backing, self.mnt, options=self.TRANSPORT)
        self.addCleanup(m2.stop)
        m2.start()
        for s in states:
            for f in s["files"]:
                via = read(os.path.join(self.mnt, f["name"]))
                self.assertEqual(via, read(os.path.join(self.backing, f["name"])),
                                 "%s: remounted read differs from BACKING_DIR" % f["name"])
        m2.stop()
        self.assertEqual(m2.returncode, 0, "daemon exit after fusermount3 -u:\n" + m2.log_tail())


# -------------------------------------------------------------------------------------------------
class DiskSyncTest(Base):
    """fsync() through the mount must reach the disk, not only BACKING_DIR's page cache: without a
    power cut the observable proof is that the daemon syncs the backing file (fsync, fdatasync,
    syncfs, sync, or O_SYNC/O_DSYNC opens), seen with strace."""

    def _traced(self, m, action):
        out = os.path.join(self.scratch.path, "strace.out")
        tr = subprocess.Popen(["strace", "-f", "-qq", "-p", str(m.pid), "-o", out, "-e",
                               "trace=fsync,fdatasync,syncfs,sync,openat,open,sync_file_range"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 10
            tids = os.listdir("/proc/%d/task" % m.pid)
            while time.monotonic() < deadline:
                traced = 0
                for tid in tids:
                    try:
                        with open("/proc/%d/task/%s/status" % (m.pid, tid)) as f:
                            traced += any(line.startswith("TracerPid:") and
                                          line.split()[1] != "0" for line in f)
                    except OSError:
                        traced += 1  # thread gone
                if traced == len(tids):
                    break
                if tr.poll() is not None:
                    self.skipTest("strace cannot attach: %s" % tr.stderr.read().decode().strip())
                time.sleep(0.05)
            else:
                self.skipTest("strace did not attach to every daemon thread within 10 s")
            action()
        finally:
            tr.send_signal(signal.SIGINT)
            try:
                tr.wait(timeout=10)
            except subprocess.TimeoutExpired:
                tr.kill()
                tr.wait()
            tr.stderr.close()
        with open(out) as f:
            return f.read()

    def _check(self, sync_call):
        if not shutil.which("strace"):
            self.skipTest("strace is not installed")
        m = self.mount()
        path = os.path.join(self.mnt, "durable")
        data = stream(8, 3 * MiB + 5)

        def action():
            fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o644)
            try:
                os.write(fd, data)
                sync_call(fd)
            finally:
                os.close(fd)

        log = self._traced(m, action)
        syncs = [ln for ln in log.splitlines()
                 if any(c + "(" in ln for c in ("fsync", "fdatasync", "syncfs", "sync"))
                 and "sync_file_range" not in ln and "= -1" not in ln]
        dsync_opens = [ln for ln in log.splitlines() if "durable" in ln and
                       ("O_SYNC" in ln or "O_DSYNC" in ln)]
        self.assertTrue(syncs or dsync_opens, "the daemon never synced the backing file for %s; "
                        "trace:\n%s" % (sync_call.__name__, log[-3000:]))
        self.assertEqual(read(os.path.join(self.backing, "durable")), data)

    def test_fsync_syncs_backing_file(self):
        self._check(os.fsync)

    def test_fdatasync_syncs_backing_file(self):
        self._check(os.fdatasync)


# -------------------------------------------------------------------------------------------------
class EnospcTest(Base):
    """BACKING_DIR on an 8 MiB tmpfs: the writer sees ENOSPC; the daemon keeps serving."""

    NEED_ROOT = True

    def setUp(self):
        super().setUp()
        small = self.scratch.sub("small")
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "dnvme-enospc", small],
                           capture_output=True, text=True)
        if r.returncode != 0:
            self.skipTest("cannot mount a tmpfs for the ENOSPC test: %s" % r.stderr.strip())
        self.addCleanup(lambda: subprocess.run(["umount", "-l", small]))
        self.backing = os.path.join(small, "backing")
        os.mkdir(self.backing)

    def _fill(self, path, chunk, do_fsync, total=32 * MiB, direct=False):
        """Writes until an error; returns (where, errno, bytes written). `direct`: O_DIRECT
        from page-aligned memory."""
        data = stream(7, chunk)
        if direct:
            aligned = mmap.mmap(-1, chunk)
            aligned[:] = data
            data = aligned
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | (os.O_DIRECT if direct else 0), 0o644)
        where, err, done, stage = None, None, 0, "write"
        try:
            for _ in range(total // chunk):
                done += os.write(fd, data)
            stage = "fsync"
            if do_fsync:
                os.fsync(fd)
        except OSError as exc:
            where, err = stage, exc.errno
        try:
            os.close(fd)
        except OSError as exc:
            if err is None:
                where, err = "close", exc.errno
        if direct:
            data.close()
        return where, err, done

    def _check_alive_and_serving(self, m):
        self.assertTrue(m.alive(), "daemon died after ENOSPC:\n" + m.log_tail())
        self.assertTrue(m.is_mounted(), "mount vanished after ENOSPC")
        self.assertEqual(read(os.path.join(self.mnt, "keep")), b"K" * 100_000,
                         "mount no longer serves reads after ENOSPC")

    def _run(self, do_fsync, chunk, total=32 * MiB, options=(), direct=False):
        m = self.mount(options=options)
        with open(os.path.join(self.mnt, "keep"), "wb") as f:
            f.write(b"K" * 100_000)
            os.fsync(f.fileno())
        where, err, done = self._fill(os.path.join(self.mnt, "big"), chunk, do_fsync, total,
                                      direct)
        sys.stderr.write("\n[enospc] error at %s: %s after %d bytes\n" %
                         (where, mh.errno_name(err) if err else None, done))
        self.assertIsNotNone(err, "%d bytes written to an 8 MiB filesystem and write/fsync/close"
                             " all succeeded: the error was lost" % total)
        self.assertEqual(err, errno.ENOSPC, "error at %s was %s, want ENOSPC" %
                         (where, mh.errno_name(err)))
        self._check_alive_and_serving(m)
        # Space comes back once the file is gone; the mount works again. FUSE frees it
        # asynchronously: the kernel sends RELEASE (of the closed writer) and FORGET (of the
        # unlinked inode) after close/unlink returned, and only then does the daemon close the
        # backing fds. So wait for the backing filesystem to have room again, within a bound.
        os.unlink(os.path.join(self.mnt, "big"))
        unlinked = time.monotonic()
        deadline = unlinked + 20
        while True:
            st = os.statvfs(self.backing)
            if st.f_bavail * st.f_frsize >= 4 * MiB:
                sys.stderr.write("[enospc] space back %.3f s after unlink\n" %
                                 (time.monotonic() - unlinked))
                break
            self.assertLess(time.monotonic(), deadline,
                            "the removed file's space never came back:\n" + m.log_tail())
            time.sleep(0.05)
        with open(os.path.join(self.mnt, "after"), "wb") as f:
            f.write(b"A" * (2 * MiB + 3))
            os.fsync(f.fileno())
        self.assertEqual(read(os.path.join(self.backing, "after")), b"A" * (2 * MiB + 3))
        self._check_alive_and_serving(m)

    def test_enospc_reaches_writer_with_fsync(self):
        self._run(do_fsync=True, chunk=MiB)

    def test_enospc_reaches_writer_by_close(self):
        # Small unaligned writes, no fsync: the error must surface at write() or close().
        self._run(do_fsync=False, chunk=100_003)

    def test_enospc_reaches_o_direct_writer(self):
        # Requests read, not spliced: the O_DIRECT payloads are flushed from the buffers they
        # were received in (fs/transport/request_buffer.h), and those flushes' errors must reach the
        # writer like a chunk's.
        self._run(do_fsync=True, chunk=MiB, options=("splice_read=0",), direct=True)
        with open(os.path.join(self.mnt, ".dnvme", "stats")) as f:
            adopted = json.load(f)["fuse"]["bytes_written_adopted"]
        self.assertGreater(adopted, 0, "the O_DIRECT writes were not written from their buffers")

    def test_enospc_small_overflow_reaches_close(self):
        # Just over the free space, all of it fitting in write-behind: no later write() can
        # carry the error, so close() must.
        self._run(do_fsync=False, chunk=MiB, total=9 * MiB, options=("write_behind=64M",))


# -------------------------------------------------------------------------------------------------
class LifecycleTest(Base):

    def test_lazy_unmount_with_open_files(self):
        m = self.mount()
        with open(os.path.join(self.mnt, "r"), "wb") as f:
            f.write(b"R" * 5000)
        data = stream(3, 3 * MiB + 5)
        wfd = os.open(os.path.join(self.mnt, "w"), os.O_CREAT | os.O_WRONLY, 0o644)
        rfd = os.open(os.path.join(self.mnt, "r"), os.O_RDONLY)
        os.write(wfd, data[:MiB])
        r = subprocess.run(["fusermount3", "-u", "-z", self.mnt], capture_output=True, text=True)
        if r.returncode != 0:
            r = subprocess.run(["umount", "-l", self.mnt], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, "lazy unmount failed: " + r.stderr)
        self.assertFalse(mh.mounts_at(self.mnt), "still in mountinfo after a lazy unmount")
        # Open files keep working after the lazy unmount.
        os.write(wfd, data[MiB:])
        self.assertEqual(os.pread(rfd, 10, 0), b"R" * 10)
        os.close(rfd)
        os.close(wfd)
        rc = m.wait_exit(15)
        self.assertFalse(m.alive(), "daemon still running 15 s after the last file of a lazily "
                         "unmounted mount was closed:\n" + m.log_tail())
        self.assertEqual(read(os.path.join(self.backing, "w")), data,
                         "data written around the lazy unmount is not all in BACKING_DIR")
        self.assertEqual(rc, 0, "daemon exit code:\n" + m.log_tail())

    def _unflushed_then_signal(self, sig):
        m = self.mount(options=("write_behind=64M",))
        data = stream(int(sig), 20 * MiB + 777)
        fd = os.open(os.path.join(self.mnt, "wb"), os.O_CREAT | os.O_WRONLY, 0o644)
        try:
            for off in range(0, len(data), 3 * MiB + 1):
                os.pwrite(fd, data[off:off + 3 * MiB + 1], off)
            exited, rc = m.terminate_and_wait(timeout=20, sig=sig)
        finally:
            try:
                os.close(fd)
            except OSError:
                pass
        self.assertTrue(exited, "daemon did not exit within 20 s of %s" % sig.name)
        got = read(os.path.join(self.backing, "wb"))
        self.assertEqual(len(got), len(data), "BACKING_DIR file size after %s" % sig.name)
        self.assertEqual(first_diff(got, data), len(data), "data differs in BACKING_DIR")
        self.assertTrue(mh.wait_unmounted(self.mnt), "still mounted 5 s after the daemon "
                        "exited; log:\n" + m.log_tail())
        self.assertEqual(rc, 0, "exit code after %s:\n%s" % (sig.name, m.log_tail()))

    def test_sigterm_flushes_write_behind(self):
        self._unflushed_then_signal(signal.SIGTERM)

    def test_sigint_flushes_write_behind(self):
        self._unflushed_then_signal(signal.SIGINT)

    def test_daemonized_mount(self):
        m = self.mount(foreground=False)
        entries = mh.mounts_at(self.mnt)
        self.assertEqual([e["fstype"] for e in entries], [mh.FSTYPE])
        self.assertIsNotNone(m.pid, "could not find the daemonized process")
        with open(os.path.join(self.mnt, "x"), "wb") as f:
            f.write(b"daemon")
        self.assertEqual(read(os.path.join(self.backing, "x")), b"daemon")
        exited, _ = m.terminate_and_wait(timeout=15)
        self.assertTrue(exited, "daemonized dnvmefs ignored SIGTERM")
        self.assertTrue(mh.wait_unmounted(self.mnt), "daemon exited on SIGTERM but left the "
                        "mount behind for 5 s (log_file shows why)")

    def test_options_accepted(self):
        cfg = os.path.join(self.scratch.path, "cfg.json")
        with open(cfg, "w") as f:
            json.dump({"block_size": "256K", "queue_depth": 16, "intra_op_parallelism": 2}, f)
        opts = ("config=" + cfg, "block_size=512K", "queue_depth=8", "intra_op_parallelism=2",
                "single_submit", "overlap_events", "direct=auto", "log_level=info",
                "log_file=" + os.path.join(self.scratch.path, "d.log"), "write_behind=16M",
                "read_ahead=1M", "fsname=dnvme-test")
        self.mount(options=opts)
        e = mh.mounts_at(self.mnt)[0]
        self.assertEqual(e["source"], "dnvme-test", "fsname= not applied")
        data = stream(5, 3 * MiB + 1)
        with open(os.path.join(self.mnt, "o"), "wb") as f:
            f.write(data)
        self.assertEqual(read(os.path.join(self.mnt, "o")), data)
        self.assertEqual(read(os.path.join(self.backing, "o")), data)

    def test_fuse_option_max_background_passes_through(self):
        # The contract lists max_background=N among the standard FUSE options that pass through.
        self.mount(options=("max_background=32", "allow_other", "default_permissions"))
        with open(os.path.join(self.mnt, "mb"), "wb") as f:
            f.write(b"mb")
        self.assertEqual(read(os.path.join(self.backing, "mb")), b"mb")

    def test_write_behind_and_read_ahead_disabled(self):
        self.mount(options=("write_behind=0", "read_ahead=0"))
        data = stream(6, 2 * MiB + 9)
        with open(os.path.join(self.mnt, "z"), "wb") as f:
            f.write(data)
        self.assertEqual(read(os.path.join(self.mnt, "z")), data)
        self.assertEqual(read(os.path.join(self.backing, "z")), data)

    def test_single_threaded_and_debug_flags(self):
        for flags in (["-s"], ["-d"], ["-d", "-s"]):
            with self.subTest(flags=flags):
                # -d implies -f: no -f is passed with it, the daemon must stay in the foreground.
                m = mh.Mount(self.backing, self.mnt, extra_args=flags,
                             foreground=("-d" not in flags))
                self.addCleanup(m.stop)
                m.start()
                data = stream(len(flags), 2 * MiB + 1)
                name = "flags%s" % "".join(flags).replace("-", "_")
                with open(os.path.join(self.mnt, name), "wb") as f:
                    f.write(data)
                self.assertEqual(read(os.path.join(self.mnt, name)), data)
                self.assertEqual(read(os.path.join(self.backing, name)), data)
                m.stop()
                self.assertEqual(m.returncode, 0, "exit code with %s:\n%s" %
                                 (flags, m.log_tail()))

    def test_nonempty_option(self):
        with open(os.path.join(self.mnt, "old"), "w") as f:
            f.write("x")
        self.mount(options=("nonempty",))
        self.assertTrue(mh.is_mounted(self.mnt))


# -------------------------------------------------------------------------------------------------
class BadInvocationTest(Base):
    """Exit code 2 and one line on stderr; nothing mounted, no daemon left behind."""

    def _expect_usage_error(self, args, what, one_line=False):
        r = mh.run_daemon(args)
        err = r.stderr.decode(errors="replace").strip()
        mounted = [e["mountpoint"] for e in mh.mountinfo() if e["fstype"] == mh.FSTYPE and
                   e["mountpoint"].startswith(self.scratch.path)]
        leftover = mh.find_daemon_pids(self.mnt)
        for pid in leftover:
            os.kill(pid, signal.SIGKILL)
        self.assertEqual(r.returncode, 2, "%s: exit code %s (want 2); stderr: %r" %
                         (what, r.returncode, err))
        self.assertTrue(err, "%s: no message on stderr" % what)
        self.assertEqual(mounted, [], "%s: something got mounted" % what)
        self.assertEqual(leftover, [], "%s: a daemon was left running" % what)
        if one_line:
            self.assertEqual(len(err.splitlines()), 1, "%s: message is not one line: %r" %
                             (what, err))

    def test_missing_backing(self):
        for fg in (["-f"], []):
            self._expect_usage_error([os.path.join(self.scratch.path, "nope"), self.mnt] + fg,
                                     "missing BACKING_DIR %s" % fg)

    def test_missing_mountpoint(self):
        for fg in (["-f"], []):
            self._expect_usage_error([self.backing, os.path.join(self.scratch.path, "nope")] + fg,
                                     "missing MOUNTPOINT %s" % fg)

    def test_not_directories(self):
        f = os.path.join(self.scratch.path, "file")
        open(f, "w").close()
        self._expect_usage_error([f, self.mnt, "-f"], "BACKING_DIR is a file")
        self._expect_usage_error([self.backing, f, "-f"], "MOUNTPOINT is a file")

    def test_nonempty_mountpoint(self):
        with open(os.path.join(self.mnt, "occupied"), "w") as f:
            f.write("x")
        for fg in (["-f"], []):
            self._expect_usage_error([self.backing, self.mnt] + fg, "non-empty MOUNTPOINT %s" % fg)

    def test_missing_arguments(self):
        self._expect_usage_error([], "no arguments")
        self._expect_usage_error([self.backing], "one argument")

    def test_bad_option_values(self):
        badcfg = os.path.join(self.scratch.path, "bad.json")
        with open(badcfg, "w") as f:
            f.write('{"block_size": "1M", "no_such_key": 1}')
        cases = ["block_size=2G", "block_size=0", "block_size=abc", "queue_depth=0",
                 "queue_depth=abc", "queue_depth=100000", "intra_op_parallelism=0",
                 "direct=sometimes", "log_level=loud", "write_behind=-1", "read_ahead=1X",
                 "config=" + os.path.join(self.scratch.path, "missing.json"), "config=" + badcfg,
                 "no_such_option", "no_such_key=3", "loop_threads=0", "loop_threads=65",
                 "loop_threads=x", "splice_read=maybe", "direct_io=sometimes", "direct_io",
                 "max_request=0", "max_request=5000", "max_request=32M",
                 "max_request=2M,clone_fd=1"]
        for opt in cases:
            for fg in (["-f"], []):
                with self.subTest(option=opt, mode=fg):
                    self._expect_usage_error([self.backing, self.mnt, "-o", opt] + fg,
                                             "-o %s %s" % (opt, fg))
        self._expect_usage_error([self.backing, self.mnt, "-f", "--no-such-flag"], "bad flag")

    def test_message_is_one_line(self):
        # The contract: exit code 2 and ONE line on stderr (not a usage dump).
        for args, what in (
                ([os.path.join(self.scratch.path, "nope"), self.mnt, "-f"], "missing BACKING_DIR"),
                ([self.backing, self.mnt, "-f", "-o", "queue_depth=0"], "queue_depth=0"),
                ([self.backing, self.mnt, "-f", "-o", "direct=sometimes"], "direct=sometimes"),
                ([self.backing, self.mnt, "-f", "-o", "no_such_option"], "unknown -o option"),
                ([self.backing, self.mnt, "-f", "--no-such-flag"], "unknown flag"),
                ([self.backing], "one argument")):
            with self.subTest(case=what):
                self._expect_usage_error(args, what, one_line=True)


# The same crash and disk-sync tests over the other transports and write paths. The default
# reads requests and takes writers' data from their own pages (-o direct_io=writable); with
# writers through the page cache (direct_io=off) requests are spliced (page references kept in
# write-behind pipes) or, with splice_read=0, read(2) into buffers write-behind adopts (READ
# replies spliced there, -o splice_reply); libfuse's own loop (clone_fd) copies the payloads.
class CrashReadTransportTest(CrashTest):
    TRANSPORT = ("direct_io=off", "splice_read=0", "splice_reply=1")


class CrashSpliceTransportTest(CrashTest):
    TRANSPORT = ("direct_io=off",)


class CrashLibfuseTransportTest(CrashTest):
    TRANSPORT = ("clone_fd=1",)


class DiskSyncReadTransportTest(DiskSyncTest):
    TRANSPORT = ("direct_io=off", "splice_read=0", "splice_reply=1")


class DiskSyncSpliceTransportTest(DiskSyncTest):
    TRANSPORT = ("direct_io=off",)


class DiskSyncLibfuseTransportTest(DiskSyncTest):
    TRANSPORT = ("clone_fd=1",)


# The passthrough policy that bypasses the daemon most (fs/fuse/passthrough.h): writes then go to
# the backing file through the kernel, fsync through the daemon's FSYNC.
class CrashPassthroughAllTest(CrashTest):
    TRANSPORT = ("passthrough=all",)


class DiskSyncPassthroughAllTest(DiskSyncTest):
    TRANSPORT = ("passthrough=all",)


# The other passthrough policies (the default, read, is the main run) and the middle direct_io
# policy, with spliced requests: O_RDWR writers through the page cache, write-only ones from their
# own pages.
class CrashPassthroughOffTest(CrashTest):
    TRANSPORT = ("passthrough=off",)


class DiskSyncPassthroughOffTest(DiskSyncTest):
    TRANSPORT = ("passthrough=off",)


class CrashPassthroughDirectTest(CrashTest):
    TRANSPORT = ("passthrough=direct",)


class DiskSyncPassthroughDirectTest(DiskSyncTest):
    TRANSPORT = ("passthrough=direct",)


class CrashWriteOnlyDirectTest(CrashTest):
    TRANSPORT = ("direct_io=wronly", "splice_read=1")


class DiskSyncWriteOnlyDirectTest(DiskSyncTest):
    TRANSPORT = ("direct_io=wronly", "splice_read=1")


# FUSE over io_uring (fs/transport/uring_loop.h), with the module's enable_uring on for the test.
class CrashUringTest(CrashTest):
    TRANSPORT = ("io_uring=1",)
    # A request the kernel had queued for a ring entry when the daemon died is cancelled with the
    # ring (fs/fuse/dev_uring.c): its caller gets ECANCELED rather than ENOTCONN.
    DEAD_MOUNT_ERRNOS = ("ECANCELED",)


class DiskSyncUringTest(DiskSyncTest):
    TRANSPORT = ("io_uring=1",)


if __name__ == "__main__":
    unittest.main(verbosity=2)

