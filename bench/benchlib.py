"""What the Python benchmarks in bench/ share (imported, not run)."""
import argparse
import os
import re
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
