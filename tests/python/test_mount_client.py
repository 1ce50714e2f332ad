"""deepnvme.Mount against a real dnvmefs mount: config and stats, shared-memory tensors and arrays
moved by the daemon (sync and async), memory found through /proc/self/maps, daemon errors as
OSError, and torch.save / deepnvme.load through the mount. The mount is always unmounted (the
harness stops the daemon even when a test fails); without FUSE every test skips with the reason.

Then Mount against a stand-in daemon (tests/python/ctl_standin.py), on any machine: the requests
on the wire are written by the native client (dnvme::CtlClient, include/dnvme/client.h), which
waits with the GIL released, and its answers come back as the same Python values and errors."""

import errno
import json
import os

import pytest

from tests.fs import mount_harness as mh
from tests.python import ctl_standin


@pytest.fixture(scope="module")
def mounted():
    reason = mh.skip_reason()
    if reason:
        pytest.skip(reason)
    with mh.Scratch("py-mount") as s:
        with mh.Mount(s.backing, s.mnt) as m:
            yield s
            # Every error the tests provoked left the daemon serving.
            assert m.alive() and m.is_mounted(), m.log_tail()


@pytest.fixture
def ctl(deepnvme, mounted):
    with deepnvme.Mount(mounted.mnt) as m:
        yield m


def test_hello_config_and_stats(ctl, mounted):
    assert ctl.hello["protocol"] == 1
    assert ctl.hello["mountpoint"] == mounted.mnt
    cfg = ctl.config()
    assert set(["block_size", "queue_depth", "intra_op_parallelism"]) <= set(cfg)
    old = cfg["queue_depth"]
    try:
        assert ctl.set_config(queue_depth=17)["queue_depth"] == 17
        assert ctl.config()["queue_depth"] == 17
        with open(os.path.join(mounted.mnt, ".dnvme", "config")) as f:
            assert '"queue_depth": 17' in f.read().replace('":17', '": 17')
    finally:
        ctl.set_config({"queue_depth": old})
    stats = ctl.stats()
    for key in ("mount", "config", "fuse", "engine", "ctl"):
        assert key in stats
    with pytest.raises(OSError) as e:
        ctl.set_config(queue_depth=0)  # refused by the daemon, which carries on
    assert e.value.errno == errno.EINVAL
    assert ctl.config()["queue_depth"] == old


def test_shared_tensor_round_trip(ctl, torch, mounted):
    n = (8 << 20) + 3  # unaligned length
    t = ctl.shared_tensor(n, torch.float32)
    g = torch.Generator().manual_seed(4)
    t.copy_(torch.randn(n, generator=g))
    before = ctl.stats()["ctl"]["bytes_written"]
    os.makedirs(os.path.join(mounted.mnt, "ckpt"), exist_ok=True)
    assert ctl.pwrite(t, "ckpt/t.bin") == n * 4
    backing = os.path.join(mounted.backing, "ckpt", "t.bin")
    with open(backing, "rb") as f:
        assert f.read() == t.numpy().tobytes()
    assert ctl.stats()["ctl"]["bytes_written"] - before >= n * 4
    r = ctl.shared_tensor(n, torch.float32)
    assert ctl.pread(r, "ckpt/t.bin") == n * 4
    assert torch.equal(r, t)
    # The same file through the mount's POSIX path.
    with open(os.path.join(mounted.mnt, "ckpt", "t.bin"), "rb") as f:
        assert f.read(4096) == t.numpy().tobytes()[:4096]


def test_numpy_async_and_offsets(ctl, np, mounted):
    a = ctl.shared_array((1000, 257), np.int16)
    a[:] = np.arange(a.size, dtype=np.int16).reshape(a.shape)
    half = a.nbytes // 2
    os.makedirs(os.path.join(mounted.mnt, "arr"), exist_ok=True)
    ops = [ctl.pwrite(a[500:], "arr/a.bin", file_offset=half, async_op=True),
           ctl.pwrite(a[:500], "arr/a.bin", file_offset=0, async_op=True)]
    done = ctl.wait()
    assert [d["op_id"] for d in done] == ops and all(d["ok"] for d in done)
    with open(os.path.join(mounted.backing, "arr", "a.bin"), "rb") as f:
        assert f.read() == a.tobytes()
    b = ctl.shared_array((1000, 257), np.int16)
    assert ctl.pread(b, "arr/a.bin") == a.nbytes
    assert (a == b).all()


def test_memory_found_through_proc_maps(ctl, deepnvme, torch, mounted):
    # Shared memory the session did not create: registered on first use, page by page.
    buf = deepnvme.SharedBuffer(3 << 20)
    try:
        t = buf.tensor(torch.uint8)
        t.copy_(torch.arange(t.numel()) % 251)
        view = t[12345:12345 + (1 << 20)]  # an unaligned slice in the middle
        assert ctl.pwrite(view, "maps.bin") == 1 << 20
        with open(os.path.join(mounted.backing, "maps.bin"), "rb") as f:
            assert f.read() == view.numpy().tobytes()
        before = ctl.stats()["ctl"]["buffers_registered"]
        ctl.pwrite(view, "maps2.bin")  # the registration is reused
        assert ctl.stats()["ctl"]["buffers_registered"] == before
    finally:
        buf.close()


def test_errors(ctl, deepnvme, torch, mounted):
    t = ctl.shared_tensor(4096, torch.uint8)
    with pytest.raises(OSError) as e:
        ctl.pwrite(t, "../escape.bin")
    assert e.value.errno == errno.EINVAL
    with pytest.raises(FileNotFoundError):
        ctl.pread(t, "no/such/file.bin")
    with pytest.raises(OSError) as e:
        ctl.pwrite(t, ".dnvme/ctl")
    assert e.value.errno == errno.EPERM
    with pytest.raises(ValueError, match="/dev/shm"):
        ctl.pwrite(torch.zeros(10), "x.bin")  # private memory: the daemon cannot reach it
    with pytest.raises(ValueError):
        ctl.pwrite(t, "x.bin", length=5000)
    with pytest.raises(FileNotFoundError):
        deepnvme.Mount(mounted.backing)  # not a mount
    assert ctl.config()  # the session still works


def test_torch_checkpoint_through_the_mount(deepnvme, torch, mounted):
    state = {"w": torch.randn(1 << 20), "step": 9}
    path = os.path.join(mounted.mnt, "ckpt", "model.pt")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    loaded = deepnvme.load(path)
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 9
    deepnvme.save(state, os.path.join(mounted.mnt, "ckpt", "fast.pt"))
    assert torch.equal(torch.load(os.path.join(mounted.backing, "ckpt", "fast.pt"))["w"],
                       state["w"])


def test_mount_never_reads_or_writes_the_ctl_file_itself(deepnvme, mounted, monkeypatch):
    # Every byte on the session goes through the native client: no os.write/os.read from Python
    # touches the control file (mount.py used to speak the protocol with them).
    touched = []

    def spy(real):
        def call(fd, *args):
            try:
                target = os.readlink("/proc/self/fd/%d" % fd)
            except OSError:
                target = "?"
            if target.endswith("/.dnvme/ctl"):
                touched.append((real.__name__, target))
            return real(fd, *args)
        return call

    monkeypatch.setattr(os, "write", spy(os.write))
    monkeypatch.setattr(os, "read", spy(os.read))
    with deepnvme.Mount(mounted.mnt) as m:
        assert m.hello["protocol"] == 1 and m.config() and m.stats()["ctl"]
        buf = m.shared_buffer(8192)
        buf.map[:] = bytes(range(256)) * 32
        assert m.pwrite(buf.map, "native.bin") == 8192
        assert m.pwrite(buf.map, "native.bin", async_op=True) >= 0
        assert [op["ok"] for op in m.wait()] == [True]
        m.fsync("native.bin")
        assert m.pread(buf.map, "native.bin") == 8192
        with pytest.raises(FileNotFoundError):
            m.pread(buf.map, "no/such.bin")
        buf.close()
    assert touched == []


def stand_in_mount(deepnvme, answer, timeout_s=10):
    """A Mount whose session is a stand-in daemon answering with answer(request)."""
    def with_hello(request):
        if request["op"] == "hello":
            return {"protocol": 1, "version": "stand-in", "mountpoint": "/stand-in"}
        return answer(request)

    daemon = ctl_standin.StandInDaemon(with_hello, timeout_s)

    class StandIn(deepnvme.Mount):
        def __init__(self):
            self.mountpoint = "/stand-in"
            self._attach(daemon.client(deepnvme._C))

    return StandIn(), daemon


def test_requests_are_encoded_by_the_native_client(deepnvme):
    handles = iter(range(3, 100))

    def answer(request):
        op = request["op"]
        if op == "config.get":
            return {"config": {"block_size": 1048576, "queue_depth": 32}}
        if op == "handle.open":
            return {"handle": next(handles), "config": {}}
        if op == "buffer.register":
            return {"buffer": 8, "size": request["size"], "writable": True, "sealed": False}
        if op == "pwrite":
            return {"bytes": request["length"], "op_id": 1}
        return {}

    m, daemon = stand_in_mount(deepnvme, answer)
    with m:
        m.config()  # HandleConfig fills in the keys the stand-in left out
        assert m.open_handle(queue_depth=8) == 3
        buf = m.shared_buffer(4096)
        assert m.pwrite(buf.map, "a.bin", file_offset=4096) == 4096
        buf.close()
    ops = [r["op"] for r in daemon.requests]
    assert ops == ["hello", "config.get", "handle.open", "buffer.register", "handle.open",
                   "pwrite"]
    assert daemon.requests[2] == {"op": "handle.open", "queue_depth": 8}
    assert daemon.requests[-1] == {"op": "pwrite", "handle": 4, "buffer": 8, "buffer_offset": 0,
                                   "length": 4096, "path": "a.bin", "file_offset": 4096,
                                   "async": False}
    # dnvme::CtlClient's encoding (nlohmann::json: compact, keys sorted, no request id), not
    # Python's json.dumps (", " and ": ", the caller's key order, and the id mount.py added).
    for raw in daemon.raw:
        assert raw == json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":")).encode()
        assert "id" not in json.loads(raw)
    daemon.close()


def test_answers_and_errors_keep_their_python_form(deepnvme):
    def answer(request):
        op = request["op"]
        if op == "stats":
            return {"stats": {"ctl": {"requests": 7}}}
        if op == "handle.close":
            return {"uncollected": 2}
        if op == "wait":
            return {"completed": 2, "failed": 1, "ops": [
                {"op_id": 1, "op": "pwrite", "path": "a.bin", "file_offset": 0, "length": 10,
                 "bytes": 10, "ok": True},
                {"op_id": 2, "op": "pread", "path": "b.bin", "file_offset": 4096, "length": 10,
                 "bytes": 3, "ok": False,
                 "error": {"code": "ENODATA", "errno": errno.ENODATA, "message": "short read"}}]}
        if op == "config.set":
            return {"ok": False, "error": {"code": "EPERM", "errno": errno.EPERM,
                                           "message": "only root or the mount's owner"}}
        return {"ok": False, "error": {"code": "EOPNOTSUPP", "errno": errno.EOPNOTSUPP,
                                       "message": "unknown op"}}

    m, daemon = stand_in_mount(deepnvme, answer)
    assert m.hello == {"ok": True, "protocol": 1, "version": "stand-in",
                       "mountpoint": "/stand-in"}
    assert m.stats() == {"ctl": {"requests": 7}}
    assert m.close_handle(5) == {"ok": True, "uncollected": 2}
    with pytest.raises(OSError) as e:
        m.wait(handle=5)  # raises for the failed outcome, naming its file
    assert (e.value.errno, e.value.strerror, e.value.filename) == \
        (errno.ENODATA, "short read", "b.bin")
    with pytest.raises(PermissionError) as e:
        m.set_config(queue_depth=3)
    assert e.value.strerror == "config.set: only root or the mount's owner"
    with pytest.raises(OSError) as e:
        m.call("no.such.op", x=1)
    assert (e.value.errno, e.value.strerror) == (errno.EOPNOTSUPP, "no.such.op: unknown op")
    assert daemon.requests[-1] == {"op": "no.such.op", "x": 1}
    m.close()
    with pytest.raises(ValueError, match="closed"):
        m.stats()
    daemon.close()


def test_wait_lists_every_outcome(deepnvme):
    def answer(request):
        return {"completed": 1, "failed": 0, "ops": [
            {"op_id": 4, "op": "pread", "path": "a.bin", "file_offset": 8, "length": 10,
             "bytes": 10, "ok": True}]}

    m, daemon = stand_in_mount(deepnvme, answer)
    assert m.wait(handle=1) == [{"op_id": 4, "op": "pread", "path": "a.bin", "file_offset": 8,
                                 "length": 10, "bytes": 10, "ok": True}]
    m.close()
    daemon.close()


def test_protocol_mismatch_is_refused(deepnvme):
    daemon = ctl_standin.StandInDaemon(lambda request: {"protocol": 2})
    client = daemon.client(deepnvme._C)

    class StandIn(deepnvme.Mount):
        def __init__(self):
            self.mountpoint = "/stand-in"
            self._attach(client)

    with pytest.raises(OSError) as e:
        StandIn()
    assert e.value.errno == errno.EPROTO and "unsupported control protocol 2" in str(e.value)
    assert client.closed  # the session is not left open
    daemon.close()


def test_ctl_calls_release_the_gil(deepnvme):
    # The stand-in answers from a Python thread, which runs only while the calling thread waits
    # without the GIL; a call holding it would starve that thread and fail with EAGAIN when the
    # client's receive timeout runs out.
    m, daemon = stand_in_mount(deepnvme, lambda request: {"stats": {"n": len(daemon.raw)}},
                               timeout_s=5)
    for _ in range(20):
        m.stats()
    assert m.stats() == {"n": 22}
    m.close()
    daemon.close()
