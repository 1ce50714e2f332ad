"""deepnvme.Mount against a real dnvmefs mount: config and stats, shared-memory tensors and arrays
moved by the daemon (sync and async), memory found through /proc/self/maps, daemon errors as
OSError, and torch.save / deepnvme.load through the mount. The mount is always unmounted (the
harness stops the daemon even when a test fails); without FUSE every test skips with the reason."""

import errno
import os

import pytest

from tests.fs import mount_harness as mh


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
