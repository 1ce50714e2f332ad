"""`dnvme tune` and `dnvme report`, run for real on this machine's disk.

tune: a small sweep completes, writes its CSV, PNG and config, and the config is taken verbatim
by every consumer: `dnvme io --config`, `dnvmefs -o config=FILE` (a real mount), the control
file's config.set (raw request and `dnvme ctl config set`), and the Python handle
`deepnvme.aio_handle(**cfg)`. Bad arguments exit 2 with a message.
report: the JSON has every field, and the values the test can find out by itself match.
GPU: report's gpu and cufile checks against what this machine has; `tune --gpu` refuses with CUDA's
reason where there is no device and sweeps device buffers where there is one (never both skipped:
DNVME_TEST_EXPECT_GPU=1 or /dev/nvidia0 makes a missing device a failure).

Run: DNVME_BIN=build/bin/dnvme DNVMEFS_BIN=build/bin/dnvmefs \
     /usr/bin/python3 -m unittest -v tests.tools.test_tune_report
"""

import csv
import ctypes
import ctypes.util
import gzip
import json
import mmap
import os
import re
import resource
import shutil
import stat
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "tests", "fs"))
import mount_harness as mh  # noqa: E402

DNVME = os.path.abspath(os.environ.get("DNVME_BIN") or os.path.join(REPO, "build", "bin", "dnvme"))
DEEPSPEED_KEYS = ["block_size", "queue_depth", "intra_op_parallelism", "single_submit",
                  "overlap_events"]
# A 4-point space keeps the test short; the default space is exercised by the descent unit tests
# and by docs/tuning.md's run.
SMALL_SWEEP = {"block_size": ["256K", "1M"], "queue_depth": [8, 32],
               "overlap_events": [False], "single_submit": [False], "intra_op_parallelism": [2]}


def run(args, **kw):
    return subprocess.run([DNVME] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, timeout=kw.pop("timeout", 300), **kw)


def scratch_root():
    root = os.path.join(mh.test_root(), "..", "tools")
    os.makedirs(root, exist_ok=True)
    return os.path.realpath(root)


def kernel_config():
    """The running kernel's config text, or None when neither place has it."""
    try:
        with open("/boot/config-" + os.uname().release) as f:
            return f.read()
    except OSError:
        pass
    try:
        with gzip.open("/proc/config.gz", "rt") as f:
            return f.read()
    except OSError:
        return None


def built_with_cuda():
    """What the build found (CMakeCache.txt beside bin/), or None when there is no cache."""
    cache = os.path.join(os.path.dirname(os.path.dirname(DNVME)), "CMakeCache.txt")
    if not os.path.exists(cache):
        return None
    with open(cache) as f:
        lines = f.read().splitlines()
    return ("DNVME_WITH_CUDA:BOOL=ON" in lines and
            any(l.startswith("CUDA_cudart_static_LIBRARY:FILEPATH=") and
                l.endswith("libcudart_static.a") for l in lines))


def expect_gpu():
    """Whether this machine must have a usable GPU (so a missing one is a failure, not a skip)."""
    return os.environ.get("DNVME_TEST_EXPECT_GPU") == "1" or os.path.exists("/dev/nvidia0")


def gpu_report(directory):
    """dnvme report's gpu and cufile checks."""
    p = run(["report", "--dir", directory, "--json"])
    assert p.returncode == 0, p.stderr
    checks = json.loads(p.stdout)["checks"]
    return checks["gpu"], checks["cufile"]


@unittest.skipUnless(os.path.exists(DNVME), "dnvme binary %s not built" % DNVME)
class TuneTest(unittest.TestCase):
    """One real sweep in setUpClass; the tests check what it produced and who accepts it."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="tune-", dir=scratch_root())
        cls.data = os.path.join(cls.tmp, "data")
        cls.logs = os.path.join(cls.tmp, "logs")
        os.mkdir(cls.data)
        cls.sweep = os.path.join(cls.tmp, "sweep.json")
        with open(cls.sweep, "w") as f:
            json.dump(SMALL_SWEEP, f)
        cls.proc = run(["tune", "--dir", cls.data, "--io-size", "8M", "--loops", "1",
                        "--sweep-config", cls.sweep, "--search", "grid", "--log-dir", cls.logs,
                        "--json"])
        sys.stderr.write(cls.proc.stderr[-2000:])
        cls.out = json.loads(cls.proc.stdout) if cls.proc.returncode == 0 else None
        cls.config_path = os.path.join(cls.logs, "dnvme_tune.json")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def setUp(self):
        self.assertEqual(self.proc.returncode, 0, self.proc.stderr)

    def config(self):
        with open(self.config_path) as f:
            return f.read()

    # --- what the sweep produced ----------------------------------------------------------------
    def test_json_summary(self):
        o = self.out
        self.assertEqual(o["points_measured"], 4)
        self.assertEqual(o["grid_points"], 4)
        self.assertEqual(o["search"], "grid")
        self.assertEqual(o["io_size"], 8 << 20)
        for key in ("best", "best_write", "best_read"):
            self.assertEqual(list(o[key]["config"]), DEEPSPEED_KEYS, key)
            self.assertGreater(o[key]["write_gib_per_s"], 0, key)
            self.assertGreater(o[key]["read_gib_per_s"], 0, key)
        self.assertEqual(o["config_file"], self.config_path)
        # The config file is the best point.
        self.assertEqual(json.loads(self.config()), o["best"]["config"])
        self.assertEqual(os.listdir(self.data), [], "the tuner removes its data files")

    def test_config_has_exactly_the_deepspeed_keys_json_typed(self):
        cfg = json.loads(self.config())
        self.assertEqual(list(cfg), DEEPSPEED_KEYS)
        self.assertIs(type(cfg["single_submit"]), bool)
        self.assertIs(type(cfg["overlap_events"]), bool)
        for k in ("block_size", "queue_depth", "intra_op_parallelism"):
            self.assertIs(type(cfg[k]), int, k)
        self.assertIn(cfg["block_size"], (256 << 10, 1 << 20))
        self.assertIn(cfg["queue_depth"], (8, 32))
        self.assertEqual(cfg["intra_op_parallelism"], 2)

    def test_csv_has_every_point(self):
        with open(os.path.join(self.logs, "sweep.csv")) as f:
            rows = list(csv.DictReader(f))
        self.assertEqual(len(rows), 4)
        seen = {(int(r["block_size"]), int(r["queue_depth"])) for r in rows}
        self.assertEqual(seen, {(256 << 10, 8), (256 << 10, 32), (1 << 20, 8), (1 << 20, 32)})
        best = max(rows, key=lambda r: float(r["score"]))
        cfg = json.loads(self.config())
        self.assertEqual((int(best["block_size"]), int(best["queue_depth"])),
                         (cfg["block_size"], cfg["queue_depth"]))
        for r in rows:
            self.assertGreater(float(r["write_gib_per_s"]), 0)
            self.assertGreater(float(r["read_gib_per_s"]), 0)

    def test_png_plot(self):
        png = self.out["plot"]
        self.assertIsNotNone(png, "gnuplot missing? install-deps installs gnuplot-nox")
        with open(png, "rb") as f:
            head = f.read(24)
        self.assertEqual(head[:8], b"\x89PNG\r\n\x1a\n")
        width = int.from_bytes(head[16:20], "big")
        self.assertGreaterEqual(width, 900)

    def test_text_mode_and_write_only(self):
        logs = os.path.join(self.tmp, "logs-text")
        p = run(["tune", "--dir", self.data, "--io-size", "4M", "--loops", "1", "--no-read",
                 "--sweep-config", self.sweep, "--log-dir", logs])
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("best write:", p.stdout)
        self.assertNotIn("best read:", p.stdout)
        # Not a terminal: plain progress lines, one per point, no carriage returns.
        self.assertIn("tune: point 1 ", p.stderr)
        self.assertNotIn("\r", p.stderr)
        with open(os.path.join(logs, "dnvme_tune.json")) as f:
            self.assertEqual(list(json.load(f)), DEEPSPEED_KEYS)

    def test_ds_nvme_tune_names(self):
        """ds_nvme_tune's command line, with its sweep-config keys, runs with the name changed:
        two directories after one --nvme_dir, --io_size, --no_read, --sweep_config with
        io_parallel and sequential_requests, --log_dir, --flush_page_cache, --verbose."""
        other = os.path.join(self.tmp, "data2")
        os.makedirs(other, exist_ok=True)
        sweep = os.path.join(self.tmp, "ds_sweep.json")
        with open(sweep, "w") as f:
            json.dump({"block_size": ["1M"], "queue_depth": [8], "io_parallel": [1],
                       "sequential_requests": [True, False], "single_submit": [False]}, f)
        logs = os.path.join(self.tmp, "logs-ds")
        p = run(["tune", "--nvme_dir", self.data, other, "--io_size", "4M", "--no_read",
                 "--sweep_config", sweep, "--log_dir", logs, "--flush_page_cache", "--verbose",
                 "--loops", "1", "--search", "grid", "--json"])
        self.assertEqual(p.returncode, 0, p.stderr)
        out = json.loads(p.stdout)
        self.assertEqual(out["points_measured"], 2)
        self.assertEqual(len(out["dirs"]), 2, out)
        with open(os.path.join(logs, "sweep.csv")) as f:
            rows = list(csv.DictReader(f))
        self.assertEqual(sorted(r["overlap_events"] for r in rows), ["0", "1"])

    # --- consumers, verbatim --------------------------------------------------------------------
    def test_dnvme_io_takes_it(self):
        io_dir = os.path.join(self.tmp, "io")
        os.makedirs(io_dir, exist_ok=True)
        p = run(["io", "--dir", io_dir, "--size", "4M", "--write", "--read", "--loops", "1",
                 "--validate", "--config", self.config_path, "--json"])
        self.assertEqual(p.returncode, 0, p.stderr)
        cfg = json.loads(self.config())
        for line in p.stdout.splitlines():
            used = json.loads(line)["config"]
            for k in DEEPSPEED_KEYS:
                self.assertEqual(used[k], cfg[k], k)

    @unittest.skipIf(mh.skip_reason(need_root=False), mh.skip_reason(need_root=False) or "")
    def test_mount_and_control_file_take_it(self):
        cfg = json.loads(self.config())
        with mh.Scratch("tune") as s, mh.Mount(s.backing, s.mnt,
                                               options=["config=" + self.config_path]) as m:
            with open(os.path.join(m.mnt, ".dnvme", "config")) as f:
                live = json.load(f)
            for k in DEEPSPEED_KEYS:
                self.assertEqual(live[k], cfg[k], "-o config=: " + k)

            # config.set with the file's text, verbatim, as the "config" value. Start from a
            # different configuration so the change is visible.
            other = run(["ctl", m.mnt, "config", "set",
                         '{"queue_depth": 3, "block_size": 65536}'])
            self.assertEqual(other.returncode, 0, other.stderr)
            fd = os.open(os.path.join(m.mnt, ".dnvme", "ctl"), os.O_RDWR)
            try:
                req = '{"op": "config.set", "config": %s}' % self.config()
                os.write(fd, req.encode())
                answer = json.loads(os.read(fd, 1 << 20))
            finally:
                os.close(fd)
            self.assertTrue(answer.get("ok"), answer)
            for k in DEEPSPEED_KEYS:
                self.assertEqual(answer["config"][k], cfg[k], "config.set: " + k)

            other = run(["ctl", m.mnt, "config", "set", '{"queue_depth": 3}'])
            self.assertEqual(other.returncode, 0, other.stderr)
            p = run(["ctl", m.mnt, "config", "set", self.config_path])
            self.assertEqual(p.returncode, 0, p.stderr)
            with open(os.path.join(m.mnt, ".dnvme", "config")) as f:
                live = json.load(f)
            for k in DEEPSPEED_KEYS:
                self.assertEqual(live[k], cfg[k], "dnvme ctl config set FILE: " + k)

    def test_python_aio_handle_takes_it(self):
        try:
            import deepnvme  # noqa: F401
        except ImportError as exc:
            self.skipTest("the Python module deepnvme is not built yet (%s); this consumer is "
                          "checked once it is" % exc)
        cfg = json.loads(self.config())
        h = deepnvme.aio_handle(**cfg)
        self.assertEqual(h.get_block_size(), cfg["block_size"])
        self.assertEqual(h.get_queue_depth(), cfg["queue_depth"])
        self.assertEqual(h.get_intra_op_parallelism(), cfg["intra_op_parallelism"])
        self.assertEqual(h.get_single_submit(), cfg["single_submit"])
        self.assertEqual(h.get_overlap_events(), cfg["overlap_events"])
        # What ds_nvme_tune used to print is refused, not silently dropped.
        with self.assertRaises(TypeError):
            deepnvme.aio_handle(num_threads=2)
        with self.assertRaisesRegex(ValueError, "block_size"):
            deepnvme.aio_handle(**dict(cfg, block_size=0))


@unittest.skipUnless(os.path.exists(DNVME), "dnvme binary %s not built" % DNVME)
class TuneUsageTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="tune-usage-", dir=scratch_root())

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def expect_usage(self, args, want):
        p = run(["tune"] + args)
        self.assertEqual(p.returncode, 2, "%s: rc %d, stderr %s" % (args, p.returncode, p.stderr))
        self.assertIn(want, p.stderr, args)
        self.assertEqual(p.stdout, "", args)

    def sweep_file(self, text):
        path = os.path.join(self.tmp, "sweep-%d.json" % len(os.listdir(self.tmp)))
        with open(path, "w") as f:
            f.write(text)
        return path

    def test_bad_arguments(self):
        d = self.tmp
        self.expect_usage(["--dir", d, "--bogus"], "--bogus")
        self.expect_usage([], "--dir")
        self.expect_usage(["--dir", os.path.join(d, "missing")], "No such file or directory")
        self.expect_usage(["--dir", d, "--io-size", "0"], "--io-size must be positive")
        self.expect_usage(["--dir", d, "--io-size", "12Q"], "--io-size")
        self.expect_usage(["--dir", d, "--no-read", "--no-write"], "nothing to tune")
        self.expect_usage(["--dir", d, "--loops", "0"], "--loops")
        self.expect_usage(["--dir", d, "--search", "random"], "--search")
        self.expect_usage(["--dir", d, "--gds"], "--gds needs --gpu")
        self.expect_usage(["--dir", d, "--gpu", "--gds-compat"], "--gds-compat needs --gds")
        self.expect_usage(["--dir", d, "--gpu-device", "0"], "--gpu-device needs --gpu")
        self.expect_usage(["--dir", d, "--sweep-config", os.path.join(d, "nope.json")],
                          "--sweep-config")
        for text, want in [("{", "not valid JSON"),
                           ('{"queue_depht": [1]}', '"queue_depht": unknown key'),
                           ('{"queue_depth": []}', '"queue_depth": the list is empty'),
                           ('{"single_submit": ["false"]}', "JSON booleans"),
                           ('{"block_size": [0]}', '"block_size"')]:
            self.expect_usage(["--dir", d, "--sweep-config", self.sweep_file(text)], want)
        self.assertFalse([n for n in os.listdir(d) if n.startswith("dnvme_tune")],
                         "a refused run leaves no files")

    @unittest.skipUnless(os.geteuid() == 0, "needs root to run a child as nobody")
    def test_non_writable_dir(self):
        ro = os.path.join(self.tmp, "ro")
        os.mkdir(ro, 0o755)
        os.chmod(self.tmp, 0o755)
        p = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", DNVME,
                            "tune", "--dir", ro, "--log-dir", os.path.join(ro, "logs")],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=60)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("not writable", p.stderr)


@unittest.skipUnless(os.path.exists(DNVME), "dnvme binary %s not built" % DNVME)
class TuneGpuTest(unittest.TestCase):
    """`tune --gpu`: a clear refusal without a device, a real sweep of device buffers with one."""

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="tune-gpu-", dir=scratch_root())
        self.data = os.path.join(self.tmp, "data")
        os.mkdir(self.data)
        self.gpu, self.cufile = gpu_report(self.tmp)

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def tune(self, *extra):
        sweep = os.path.join(self.tmp, "sweep.json")
        with open(sweep, "w") as f:
            json.dump(dict(SMALL_SWEEP, block_size=["1M"], queue_depth=[8]), f)
        return run(["tune", "--dir", self.data, "--io-size", "8M", "--loops", "1",
                    "--sweep-config", sweep, "--log-dir", os.path.join(self.tmp, "logs"),
                    "--json", "--gpu"] + list(extra))

    def test_tune_gpu(self):
        p = self.tune()
        if self.gpu["device_count"] == 0:
            self.assertFalse(expect_gpu(), "a GPU is expected here: %s" % self.gpu["reason"])
            self.assertEqual(p.returncode, 1, p.stderr)
            self.assertEqual(p.stdout, "")
            self.assertIn("--gpu: " + self.gpu["reason"], p.stderr)
            self.assertEqual(len(p.stderr.splitlines()), 1, p.stderr)
            self.assertFalse(os.path.exists(os.path.join(self.tmp, "logs")),
                             "a refused run creates no log directory")
            self.assertEqual(os.listdir(self.data), [])
            return
        self.assertEqual(p.returncode, 0, p.stderr)
        o = json.loads(p.stdout)
        self.assertEqual(o["memory"], "gpu")
        self.assertEqual(o["gpu"]["device"], 0)
        self.assertEqual(o["gpu"]["name"], self.gpu["devices"][0]["name"])
        self.assertEqual((o["gpu"]["cufile"], o["gpu"]["mode"]), ("never", "bounce"))
        self.assertEqual(o["points_measured"], 1)
        self.assertGreater(o["best"]["write_gib_per_s"], 0)
        self.assertGreater(o["best"]["read_gib_per_s"], 0)
        self.assertEqual(list(o["best"]["config"]), DEEPSPEED_KEYS)
        self.assertEqual(os.listdir(self.data), [], "the tuner removes its data files")

    def test_tune_gds(self):
        p = self.tune("--gds")
        if self.gpu["device_count"] == 0:
            self.assertEqual(p.returncode, 1, p.stderr)
            self.assertIn("--gpu: " + self.gpu["reason"], p.stderr)
        elif self.cufile["mode"] in ("gds", "p2pdma"):
            self.assertEqual(p.returncode, 0, p.stderr)
            o = json.loads(p.stdout)
            self.assertEqual((o["gpu"]["cufile"], o["gpu"]["mode"]),
                             ("require", self.cufile["mode"]))
        else:
            # Never silently the bounce path: --gds refuses with cuFile's reason.
            self.assertEqual(p.returncode, 1, p.stderr)
            self.assertIn("GPUDirect Storage required but unavailable", p.stderr)
            self.assertEqual(p.stdout, "")


@unittest.skipUnless(os.path.exists(DNVME), "dnvme binary %s not built" % DNVME)
class ReportTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="report-", dir=scratch_root())
        p = run(["report", "--dir", cls.dir, "--json"])
        assert p.returncode == 0, p.stderr
        cls.doc = json.loads(p.stdout)
        cls.checks = cls.doc["checks"]
        cls.text = run(["report", "--dir", cls.dir])

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    FIELDS = {
        "dnvmefs": ["version", "build_type", "compiler", "sanitizers", "libfuse", "spdlog",
                    "cuda_built", "gds_handle_built", "dnvmefs_binary"],
        "libaio": ["aio_max_nr", "aio_nr", "io_setup_ok", "io_setup_error",
                   "default_workers_that_fit"],
        "o_direct": ["dir", "filesystem", "dio_mem_align", "dio_offset_align", "direct_write_ok"],
        "memlock": ["soft_bytes", "hard_bytes", "cap_ipc_lock", "mount_needs_bytes",
                    "mount_peak_bytes"],
        "fuse_device": ["present", "mode", "openable", "users_can_mount"],
        "fusermount3": ["path", "setuid_root"],
        "fuse_max_pages": ["max_pages_limit", "libfuse_max_pages", "max_request_bytes",
                           "mount_max_pages", "unaligned_writes_whole"],
        "fuse_kernel": ["io_uring_offered", "io_uring_enabled", "passthrough_offered",
                        "writeback_cache_offered", "used"],
        "splice_pipes": ["pipe_max_size", "cap_sys_resource", "request_pipe_bytes",
                         "splice_possible"],
        "capabilities": ["uid", "cap_ipc_lock", "cap_sys_admin", "cap_setuid", "cap_dac_override"],
        "gpu": ["built_with_cuda", "cuda_runtime_version", "nvidia_driver", "device_count",
                "devices", "reason"],
        "cufile": ["library", "found", "loaded", "error", "version", "nvidia_fs",
                   "nvidia_fs_loaded", "nvfs_driver_version", "p2pdma", "mode", "mode_reason"],
    }

    def test_every_field(self):
        self.assertEqual(list(self.checks), list(self.FIELDS))
        for name, fields in self.FIELDS.items():
            c = self.checks[name]
            for f in ["ok", "summary", "fix"] + fields:
                self.assertIn(f, c, "%s.%s" % (name, f))
            self.assertIsInstance(c["ok"], bool, name)
            self.assertEqual(c["fix"] is None, c["ok"], "%s: a fix exactly when not ok" % name)

    def test_text_has_one_line_per_check(self):
        self.assertEqual(self.text.returncode, 0, self.text.stderr)
        lines = [l for l in self.text.stdout.splitlines() if l.startswith("[")]
        self.assertEqual(len(lines), len(self.FIELDS))
        for line, name in zip(lines, self.FIELDS):
            want = "[OKAY]" if self.checks[name]["ok"] else "[NO]"
            self.assertTrue(line.startswith(want) and name in line, line)

    def test_build(self):
        c = self.checks["dnvmefs"]
        version = run(["--version"]).stdout.split()[-1]
        self.assertEqual(c["version"], version)
        self.assertEqual(self.doc["version"], version)
        want = os.path.join(os.path.dirname(os.path.realpath(DNVME)), "dnvmefs")
        self.assertEqual(c["dnvmefs_binary"], want if os.access(want, os.X_OK) else None)

    def test_libaio(self):
        c = self.checks["libaio"]
        with open("/proc/sys/fs/aio-max-nr") as f:
            self.assertEqual(c["aio_max_nr"], int(f.read()))
        self.assertTrue(c["io_setup_ok"])  # the engine tests would fail too otherwise
        self.assertTrue(c["ok"])

    def test_o_direct(self):
        c = self.checks["o_direct"]
        self.assertEqual(c["dir"], self.dir)
        fs = subprocess.run(["stat", "-f", "-c", "%T", self.dir], stdout=subprocess.PIPE,
                            text=True).stdout.strip()
        if fs == "ext2/ext3":  # coreutils' name for the ext magic number
            fs = "ext4"
        self.assertEqual(c["filesystem"], fs)
        # Check the reported alignment for ourselves: an O_DIRECT write of one offset_align
        # block at offset offset_align from memory aligned to mem_align must work.
        self.assertTrue(c["direct_write_ok"])
        align = c["dio_offset_align"]
        self.assertGreater(align, 0)
        self.assertEqual(align & (align - 1), 0, "a power of two")
        path = os.path.join(self.dir, "dio")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
        try:
            buf = mmap.mmap(-1, 4096)  # page aligned, so aligned to any mem_align <= 4096
            self.assertLessEqual(c["dio_mem_align"], 4096)
            self.assertEqual(os.pwritev(fd, [memoryview(buf)[:align]], align), align)
        finally:
            os.close(fd)
            os.unlink(path)
        self.assertEqual([n for n in os.listdir(self.dir)], [], "report leaves no file behind")

    def test_memlock_and_capabilities(self):
        soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        c = self.checks["memlock"]
        self.assertEqual(c["soft_bytes"], -1 if soft == resource.RLIM_INFINITY else soft)
        self.assertEqual(c["hard_bytes"], -1 if hard == resource.RLIM_INFINITY else hard)
        with open("/proc/self/status") as f:
            eff = int([l for l in f if l.startswith("CapEff:")][0].split()[1], 16)
        caps = self.checks["capabilities"]
        self.assertEqual(caps["uid"], os.geteuid())
        self.assertEqual(caps["cap_ipc_lock"], bool(eff & (1 << 14)))
        self.assertEqual(caps["cap_sys_admin"], bool(eff & (1 << 21)))
        self.assertEqual(caps["cap_setuid"], bool(eff & (1 << 7)))
        self.assertEqual(c["cap_ipc_lock"], caps["cap_ipc_lock"])
        self.assertEqual(c["ok"], caps["cap_ipc_lock"] or soft == resource.RLIM_INFINITY or
                         soft >= c["mount_peak_bytes"])

    def test_fuse(self):
        c = self.checks["fuse_device"]
        self.assertEqual(c["present"], os.path.exists("/dev/fuse"))
        if c["present"]:
            mode = stat.S_IMODE(os.stat("/dev/fuse").st_mode)
            self.assertEqual(c["mode"], "%04o" % mode)
            self.assertEqual(c["users_can_mount"], mode & 0o006 == 0o006)
            self.assertEqual(c["openable"], os.access("/dev/fuse", os.R_OK | os.W_OK))
        f = self.checks["fusermount3"]
        self.assertEqual(f["path"], shutil.which("fusermount3"))
        p = "/proc/sys/fs/fuse/max_pages_limit"
        m = self.checks["fuse_max_pages"]
        if os.path.exists(p):
            with open(p) as fh:
                self.assertEqual(m["max_pages_limit"], int(fh.read()))
        self.assertEqual(m["max_request_bytes"],
                         min(m["max_pages_limit"] or 256, 256) * os.sysconf("SC_PAGE_SIZE"))
        # A mount asks for one spare page: 1 MiB from an unaligned buffer is 257 pages.
        self.assertEqual(m["mount_max_pages"], 257)
        self.assertEqual(m["unaligned_writes_whole"], (m["max_pages_limit"] or 256) >= 257)
        self.assertIn("arrive whole" if m["unaligned_writes_whole"] else "arrive split",
                      m["summary"])

    def test_fuse_kernel(self):
        # What the kernel offers, read here independently: the module parameter and the config.
        k = self.checks["fuse_kernel"]
        self.assertTrue(k["ok"], "informational, never [NO]")
        param = "/sys/module/fuse/parameters/enable_uring"
        config = kernel_config()
        if os.path.exists(param):
            with open(param) as fh:
                self.assertEqual(k["io_uring_enabled"], fh.read().strip() in ("Y", "1"))
            self.assertTrue(k["io_uring_offered"])
            self.assertIn("enable_uring" if not k["io_uring_enabled"] else "enabled",
                          k["summary"])
        else:
            self.assertFalse(k["io_uring_enabled"])
        if config is None:
            self.assertIsNone(k["passthrough_offered"])
        else:
            self.assertEqual(k["passthrough_offered"],
                             re.search(r"^CONFIG_FUSE_PASSTHROUGH=[ym]$", config, re.M) is not None)
        with open("/proc/self/status") as fh:
            prm = [int(l.split()[1], 16) for l in fh if l.startswith("CapPrm:")][0]
        self.assertEqual(k["cap_sys_admin"], bool(prm & (1 << 21)))  # CAP_SYS_ADMIN
        # A mount's default: passthrough for read-only opens where offered and allowed.
        want_pt = None if k["passthrough_offered"] is None else \
            (k["passthrough_offered"] and k["cap_sys_admin"])
        release = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", os.uname().release).groups())
        self.assertEqual(k["direct_io_allow_mmap_offered"], release >= (6, 6))
        self.assertEqual(k["used"], {"io_uring": False, "passthrough": want_pt,
                                     "writeback_cache": False,
                                     "direct_io": "writable" if release >= (6, 6) else "wronly"})
        if want_pt:
            self.assertIn("passthrough=off|direct|read|all", k["summary"])

    def test_splice_pipes(self):
        s = self.checks["splice_pipes"]
        with open("/proc/sys/fs/pipe-max-size") as fh:
            self.assertEqual(s["pipe_max_size"], int(fh.read()))
        with open("/proc/self/status") as fh:
            eff = [int(l.split()[1], 16) for l in fh if l.startswith("CapEff:")][0]
        # The report runs as a child of this process with the same capabilities.
        self.assertEqual(s["cap_sys_resource"], bool(eff & (1 << 24)))  # CAP_SYS_RESOURCE
        self.assertEqual(s["request_pipe_bytes"], 2 << 20)
        self.assertEqual(s["splice_possible"],
                         s["cap_sys_resource"] or s["pipe_max_size"] >= 2 << 20)
        self.assertTrue(s["ok"], "a default mount does not splice: informational")
        self.assertIn("direct_io=writable", s["summary"])

    def test_gpu(self):
        g = self.checks["gpu"]
        self.assertEqual(g["built_with_cuda"], self.checks["dnvmefs"]["cuda_built"])
        self.assertTrue(self.checks["dnvmefs"]["gds_handle_built"])
        self.assertEqual(g["cuda_runtime_version"] is not None, g["built_with_cuda"])
        if built_with_cuda() is not None:
            self.assertEqual(g["built_with_cuda"], built_with_cuda(), "CMakeCache.txt disagrees")
        self.assertEqual(g["nvidia_driver"] is not None,
                         os.path.exists("/proc/driver/nvidia/version"))
        self.assertEqual(g["device_count"], len(g["devices"]))
        self.assertEqual(g["ok"], g["device_count"] > 0)
        line = [l for l in self.text.stdout.splitlines() if l.split()[1:2] == ["gpu"]]
        self.assertEqual(len(line), 1, self.text.stdout)
        if g["device_count"] == 0:
            self.assertFalse(expect_gpu(), "a GPU is expected here, dnvme finds none: %s"
                             % g["reason"])
            self.assertIsInstance(g["reason"], str)
            self.assertTrue(g["reason"].strip())
            if g["built_with_cuda"]:
                self.assertIn("no device: " + g["reason"], line[0])
            else:
                self.assertIn("built without CUDA", g["reason"])
                self.assertIn("built without CUDA", line[0])
        else:
            self.assertIsNone(g["reason"])
            for i, d in enumerate(g["devices"]):
                self.assertEqual(d["index"], i)
                self.assertTrue(d["name"] and d["pci_bus_id"], d)
                self.assertGreater(d["total_memory_bytes"], 0)
                self.assertRegex(d["compute_capability"], r"^\d+\.\d+$")
                self.assertRegex(d["driver_version"], r"^\d+\.\d+$")
                self.assertIn(d["name"], line[0])
            smi = shutil.which("nvidia-smi")
            if smi:
                listed = subprocess.run([smi, "-L"], stdout=subprocess.PIPE, text=True).stdout
                self.assertEqual(g["device_count"],
                                 len([l for l in listed.splitlines() if l.startswith("GPU ")]))

    def test_cufile(self):
        c = self.checks["cufile"]
        g = self.checks["gpu"]
        self.assertEqual(c["library"], "libcufile.so.0")
        try:
            ctypes.CDLL("libcufile.so.0")
            have_cufile = True
        except OSError as exc:
            have_cufile = False
            dlopen_error = str(exc)
        self.assertEqual(c["found"], have_cufile)
        if not have_cufile:
            # dlopen's own reason, as the loader gave it to ctypes.
            self.assertFalse(c["loaded"])
            self.assertIn("libcufile.so.0", c["error"])
            self.assertIn(dlopen_error.split(":")[-1].strip(), c["error"])
            self.assertIsNone(c["version"])
            self.assertFalse(c["p2pdma"])
        self.assertEqual(c["error"] is None, c["loaded"])
        self.assertEqual(c["nvidia_fs"] is not None,
                         os.path.exists("/proc/driver/nvidia-fs/version"))
        if c["nvidia_fs"] is not None:
            self.assertTrue(c["nvidia_fs_loaded"])
        if g["device_count"] == 0:
            self.assertIsNone(c["mode"])
            self.assertEqual(c["mode_reason"], "no device: " + g["reason"])
            self.assertFalse(c["ok"])
        else:
            self.assertIn(c["mode"], ("gds", "p2pdma", "compat", "bounce"))
            self.assertTrue(c["mode_reason"])
            self.assertEqual(c["ok"], c["mode"] in ("gds", "p2pdma"))
            if not c["loaded"]:
                self.assertEqual(c["mode"], "bounce")  # cufile=auto without cuFile

    def test_bad_arguments(self):
        p = run(["report", "--dir", os.path.join(self.dir, "missing")])
        self.assertEqual(p.returncode, 2)
        self.assertIn("No such file or directory", p.stderr)
        p = run(["report", "--frobnicate"])
        self.assertEqual(p.returncode, 2)


if __name__ == "__main__":
    unittest.main()
