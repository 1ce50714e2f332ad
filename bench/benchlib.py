"""What the Python benchmarks in bench/ share (imported, not run)."""
import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time


def size_arg(text):
    """argparse type: "512M", "2G", "4096" (powers of 1024, as fio and dnvme read them)."""
    m = re.fullmatch(r"(\d+)([KMGT]?)", text.strip().upper())
    if not m or int(m.group(1)) == 0:
        raise argparse.ArgumentTypeError("not a size: %r (use e.g. 512M or 2G)" % text)
    return int(m.group(1)) * 1024 ** " KMGT".index(m.group(2) or " ")


class ForegroundMount:
    """BINARY BACKING MNT -f [-o OPTS] as a child in its own session (a Ctrl-C meant for the
    benchmark does not reach it), its messages to `out` (a file object; default stderr). close()
    unmounts and stops it, also after a failure; False if MNT is still mounted then."""

    def __init__(self, binary, backing, mnt, opts="", out=None):
        self.mnt = mnt
        argv = [binary, backing, mnt, "-f"] + (["-o", opts] if opts else [])
        self.proc = subprocess.Popen(argv, stdout=out or sys.stderr, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.time() + 15
        while not os.path.ismount(mnt):
            if self.proc.poll() is not None or time.time() > deadline:
                self.close()
                raise RuntimeError("dnvmefs did not mount %s" % mnt)
            time.sleep(0.05)

    def close(self):
        if os.path.ismount(self.mnt):
            subprocess.run(["fusermount3", "-u", self.mnt], check=False)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # flushes and unmounts
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if os.path.ismount(self.mnt):
            subprocess.run(["umount", "-l", self.mnt], check=False)
        return not os.path.ismount(self.mnt)


def evict(path):
    """Writes back `path` and drops its pages from the page cache (posix_fadvise DONTNEED): the
    next read of it comes from the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident_bytes(path):
    """Bytes of `path` the page cache holds now (util-linux fincore, which uses mincore on a
    mapping: root, or the file's owner), or None where fincore is missing."""
    exe = shutil.which("fincore")
    if exe is None:
        return None
    out = subprocess.run([exe, "--bytes", "--noheadings", "--output", "RES", path],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


def io_read_bytes(pid="self"):
    """/proc/PID/io read_bytes: what the process made the kernel fetch from the storage layer."""
    with open("/proc/%s/io" % pid) as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/%s/io has no read_bytes" % pid)


class MemoryCgroup:
    """A memory cgroup with a limit, for a process that must see less memory than the machine
    (`preexec` moves the child into it before exec); removed on exit. cgroup v2 where the memory
    controller is enabled for the root's children, else v1's memory hierarchy. `reason` says why
    none could be made (not root, no memory controller), then `preexec` is None."""

    def __init__(self, limit, name="dnvme-test"):
        self.path, self.reason, self.preexec = None, None, None
        name = "%s-%d" % (name, os.getpid())
        v2 = "/sys/fs/cgroup"
        candidates = []
        try:
            with open(os.path.join(v2, "cgroup.subtree_control")) as f:
                if "memory" in f.read().split():
                    candidates.append((os.path.join(v2, name), "memory.max"))
        except OSError:
            pass
        candidates.append((os.path.join("/sys/fs/cgroup/memory", name), "memory.limit_in_bytes"))
        errors = []
        for path, knob in candidates:
            try:
                os.mkdir(path)
            except OSError as e:
                errors.append("%s: %s" % (path, e.strerror))
                continue
            try:
                with open(os.path.join(path, knob), "w") as f:
                    f.write(str(limit))
            except OSError as e:
                errors.append("%s/%s: %s" % (path, knob, e.strerror))
                os.rmdir(path)
                continue
            self.path = path
            procs = os.path.join(path, "cgroup.procs")

            def enter():
                with open(procs, "w") as f:
                    f.write(str(os.getpid()))
            self.preexec = enter
            return
        self.reason = "no memory cgroup could be made (%s)" % "; ".join(errors)

    def close(self):
        if self.path is None:
            return
        for _ in range(50):  # the last member may still be exiting
            try:
                os.rmdir(self.path)
                break
            except OSError:
                time.sleep(0.1)
        self.path = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
