"""`dnvme run`: large read-only mappings of files on the mount are filled at mmap when
DNVME_PRELOAD_MAP_FILL asks for it (preload/map_fill.h; off by default), and every rule of a
mapping still holds.

Each test maps a file in a real program under `dnvme run` on a real mount, then checks three
things the program reports: how much of the mapping was resident right after mmap returned
(mincore), what the mapping holds (a SHA-256 of all of it), and the preload's counters
(map_fills, map_filled in the --stats line). Files start cold (their pages dropped with
POSIX_FADV_DONTNEED), and the same program without the preload, or with DNVME_PRELOAD_MAP_FILL=0,
finds nearly nothing resident: a fill that did not happen cannot pass.
"""

import hashlib
import json
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_preload as tp  # noqa: E402

MiB = 1024 * 1024

# argv: path size-to-map prot(r|rw) flags(private|shared) [write-first-seed]
# Prints one JSON line: resident fraction right after mmap, the mapping's SHA-256 (the part
# inside the file), and for writable shared mappings writes a pattern through the mapping.
MAPPER = r"""
import ctypes, hashlib, json, mmap, os, random, sys
libc = ctypes.CDLL(None, use_errno=True)  # mmap resolves to the preloaded library's first
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long]
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
libc.msync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
path, length, prot, flags = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
wfd = os.open(path, os.O_WRONLY) if len(sys.argv) > 5 else -1
fd = os.open(path, os.O_RDWR if prot == "rw" else os.O_RDONLY)
os.pread(fd, 4096, 0)  # the mount has served (and the kernel cached) this file's first pages
if wfd >= 0:  # then this process writes it through the engine and maps it at once
    data = random.Random(int(sys.argv[5])).randbytes(os.path.getsize(path))
    assert os.pwrite(wfd, data, 0) == len(data)
size = os.fstat(fd).st_size
addr = libc.mmap(None, length, mmap.PROT_READ | (mmap.PROT_WRITE if prot == "rw" else 0),
                 mmap.MAP_SHARED if flags == "shared" else mmap.MAP_PRIVATE, fd, 0)
assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
pages = (length + 4095) // 4096
vec = ctypes.create_string_buffer(pages)
assert libc.mincore(addr, length, vec) == 0, ctypes.get_errno()
inside = (min(length, size) + 4095) // 4096
resident = sum(b & 1 for b in vec.raw[:inside]) / inside
sha = hashlib.sha256(ctypes.string_at(addr, min(length, size))).hexdigest()
if prot == "rw" and flags == "shared":
    ctypes.memset(addr, 0x5a, 4096)
    assert libc.msync(addr, 4096, 4) == 0, ctypes.get_errno()  # MS_SYNC
print(json.dumps({"resident": resident, "sha": sha}))
"""


def kernel_skip_reason():
    release = tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2])
    if release < (5, 14):
        return "kernel %s has no MADV_POPULATE_READ (5.14): the fill is a no-op there" % (
            os.uname().release)
    return None


class MapFillTest(tp.PreloadBase):
    SIZE = 24 * MiB  # DNVME_PRELOAD_MAP_FILL=8 MiB for these (off by default)

    @classmethod
    def setUpClass(cls):
        reason = kernel_skip_reason()
        if reason:
            raise unittest.SkipTest(reason)
        super().setUpClass()

    def cold_file(self, name, seed, size=None):
        """A file of `size` random bytes written in BACKING_DIR, its pages dropped; returns its
        bytes."""
        data = tp.pattern(seed, size or self.SIZE)
        self.write(self.b(name), data)
        for path in (self.b(name), self.m(name)):
            tp.mh.evict(path)
        return data

    def map_in(self, name, length, prot="r", flags="private", write_seed=None, preload=True,
               fill="8388608"):
        argv = [tp.PY, "-c", MAPPER, self.m(name), str(length), prot, flags]
        if write_seed is not None:
            argv.append(str(write_seed))
        env = dict(os.environ, DNVME_PRELOAD_MAP_FILL=fill or "")
        if fill is None:
            del env["DNVME_PRELOAD_MAP_FILL"]
        if preload:
            p = self.run_cmd(argv, env=env)
        else:
            p = tp.subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
            self.assertEqual(p.returncode, 0, p.stderr)
        return json.loads(p.stdout.strip().splitlines()[-1])

    def test_a_read_only_private_mapping_is_filled_at_mmap_and_holds_the_file(self):
        data = self.cold_file("priv", 1)
        plain = self.map_in("priv", self.SIZE, preload=False)
        self.assertLess(plain["resident"], 0.5, "without dnvme run the file starts cold")
        self.cold_file("priv", 1)
        got = self.map_in("priv", self.SIZE)
        self.assertEqual(got["resident"], 1.0, "every page in before mmap returned")
        self.assertEqual(got["sha"], hashlib.sha256(data).hexdigest())
        total = self.total()
        self.assertEqual(total.get("map_fills"), 1)
        self.assertEqual(total.get("map_filled"), self.SIZE)

    def test_fill_off_leaves_the_mapping_to_the_kernel(self):
        data = self.cold_file("off", 2)
        got = self.map_in("off", self.SIZE, fill="0")
        self.assertLess(got["resident"], 0.5)
        self.assertEqual(got["sha"], hashlib.sha256(data).hexdigest())
        self.assertEqual(self.total().get("map_fills"), 0)

    def test_off_by_default(self):
        self.cold_file("default", 10)
        got = self.map_in("default", self.SIZE, fill=None)
        self.assertLess(got["resident"], 0.5)
        self.assertEqual(self.total().get("map_fills"), 0)

    def test_a_mapping_smaller_than_the_threshold_is_left_alone(self):
        self.cold_file("small", 3)
        got = self.map_in("small", self.SIZE, fill=str(self.SIZE + 4096))
        self.assertLess(got["resident"], 0.5)
        self.assertEqual(self.total().get("map_fills"), 0)

    def test_the_mapping_holds_this_process_s_own_earlier_writes(self):
        # The program writes the whole file through the engine (write-behind: the write returns
        # once submitted), then maps it at once: the mapping must hold the new bytes.
        self.cold_file("own", 4)
        got = self.map_in("own", self.SIZE, write_seed=5)
        self.assertEqual(got["sha"], hashlib.sha256(tp.pattern(5, self.SIZE)).hexdigest())
        total = self.total()
        self.assertGreater(total.get("bytes_written", 0), 0, "the write went through the engine")
        self.assertEqual(total.get("map_fills"), 1)

    def test_a_read_only_shared_mapping_is_filled_and_stays_shared(self):
        data = self.cold_file("shared", 6)
        got = self.map_in("shared", self.SIZE, flags="shared")
        self.assertEqual(got["resident"], 1.0)
        self.assertEqual(got["sha"], hashlib.sha256(data).hexdigest())
        self.assertEqual(self.total().get("map_fills"), 1)

    def test_writable_mappings_stay_the_kernel_s(self):
        data = self.cold_file("rw", 7)
        got = self.map_in("rw", self.SIZE, prot="rw", flags="shared")
        self.assertLess(got["resident"], 0.5, "a writable mapping is not filled")
        self.assertEqual(got["sha"], hashlib.sha256(data).hexdigest())
        # Its stores reach the file, as without dnvme run.
        self.assertBytesEqual(self.read(self.m("rw"))[:4096], b"\x5a" * 4096)
        self.assertBytesEqual(self.read(self.b("rw"))[:4096], b"\x5a" * 4096)
        self.cold_file("rwp", 8)
        got = self.map_in("rwp", self.SIZE, prot="rw", flags="private")
        self.assertLess(got["resident"], 0.5)
        self.assertEqual(self.total().get("map_fills"), 0)

    def test_a_mapping_past_the_end_fills_only_the_file(self):
        size = self.SIZE - 5000  # not a whole page either
        data = self.cold_file("short", 9, size)
        got = self.map_in("short", self.SIZE + 8 * MiB)
        self.assertEqual(got["resident"], 1.0)
        self.assertEqual(got["sha"], hashlib.sha256(data).hexdigest())
        total = self.total()
        self.assertEqual(total.get("map_fills"), 1)
        self.assertEqual(total.get("map_filled"), (size + 4095) // 4096 * 4096)


class MapFillNoPassthroughTest(MapFillTest):
    """The same rules where a mapping's pages are the mount's own (FUSE reads to the daemon, no
    passthrough): the fill then goes through the daemon's read path, and this process's writes
    around the mount must be announced for the mapping to see them."""
    MOUNT_OPTIONS = ("passthrough=off",)


if __name__ == "__main__":
    unittest.main()
