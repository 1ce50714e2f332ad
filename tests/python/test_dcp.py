"""deepnvme.dcp: torch.distributed.checkpoint's FileSystemWriter / FileSystemReader on the
engine, with two gloo ranks (tests/python/dcp_worker.py): files each side's reader accepts,
resharding, dcp.async_save, a damaged record refused, a bad path reported on every rank."""

import os
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ranks  # noqa: E402  (tests/python/ranks.py)


@pytest.fixture(scope="module")
def dcp_results(torch):
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.tensor import DTensor  # noqa: F401
    except ImportError as e:
        pytest.skip("torch %s has no torch.distributed.checkpoint with DTensor (torch >= 2.4): "
                    "%s" % (torch.__version__, e))
    if not hasattr(dcp, "async_save"):
        pytest.skip("torch %s has no dcp.async_save" % torch.__version__)
    from conftest import scratch_root
    os.makedirs(scratch_root(), exist_ok=True)
    top = tempfile.mkdtemp(prefix="dcp-", dir=scratch_root())  # O_DIRECT capable
    try:
        yield top, ranks.run_ranks(top, "dcp_worker.py", [top], "dcp")
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_deepnvme_writer_files_are_dcps(dcp_results):
    top, results = dcp_results
    for r in results:
        assert r["save_ours"] == "ok", r
        assert r["ours_to_dcp"] == "equal", r  # DCP's own reader
        assert r["ours_to_ours"] == "equal", r
    # DCP's layout: the metadata and one file per rank.
    names = sorted(os.listdir(os.path.join(top, "ours")))
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp"], names


def test_tensor_bytes_go_through_the_engine_and_files_are_synced(dcp_results):
    top, results = dcp_results
    # Tensors of 1 MiB or more: the embedding (8 MiB), "big" (12 MiB) and the shards (4 MiB
    # each), each written once (DCP gives each replicated tensor to one rank), by the engine.
    large = (4096 * 512 + (3 << 20) + (2 << 20)) * 4
    written = sum(r["bytes_written"] for r in results)
    assert large <= written <= sum(os.path.getsize(os.path.join(top, "ours", n))
                                   for n in ("__0_0.distcp", "__1_0.distcp")), written
    # Every rank reads every replicated tensor, and its own shard.
    for r in results:
        assert r["bytes_read"] >= (4096 * 512 + (3 << 20) + (1 << 20)) * 4, r
    # sync_files (the default): each rank fsyncs its file; the coordinator also the metadata.
    assert results[0]["fsyncs"] == [".metadata.tmp", "__0_0.distcp"], results[0]
    assert results[1]["fsyncs"] == ["__1_0.distcp"], results[1]


def test_reshard_and_dcps_own_files(dcp_results):
    _, results = dcp_results
    for r in results:
        assert r["reshard"] == "equal", r
        assert r["dcp_to_ours"] == "equal", r
        assert r["variants"] == "equal", r


def test_large_records_are_read_into_the_tensors_being_loaded(dcp_results):
    # Each rank loads the embedding (8 MiB), the Linear's weight (1 MiB: its archive is larger),
    # "big" (12 MiB) and its own shard (4 MiB) that way; the LayerNorm's and the biases are small.
    _, results = dcp_results
    for r in results:
        assert r["into_target"] == 4, r


def test_async_save_snapshots_the_state(dcp_results):
    _, results = dcp_results
    for r in results:
        assert r["async"] == "equal", r


def said(r, name):
    """What rank r's attempt `name` raised and what deepnvme.dcp logged: torch 2.6 on Python 3.13
    cannot gather the ranks' exceptions (their tracebacks do not pickle), so the raised error
    may be that TypeError; the rank's own reason is in its log."""
    return r[name] + " | " + " | ".join(r["log"])


def test_damaged_record_fails_the_load(dcp_results):
    _, results = dcp_results
    for case in ("damaged", "damaged_small"):
        for r in results:
            assert r[case] != "equal", (case, r)
        # The rank that read the record says why (a shard is read by its own rank only).
        assert any("CRC-32" in said(r, case) for r in results), (case, results)


def test_bad_thread_count(torch):
    try:
        import deepnvme.dcp
    except ImportError as e:
        pytest.skip(str(e))
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(ValueError, match="thread_count"):
            deepnvme.dcp.FileSystemWriter("/nonexistent/ckpt", thread_count=bad)


def test_bad_path_fails_on_every_rank(dcp_results):
    _, results = dcp_results
    for r in results:
        assert r["bad_path"] != "saved", r
    assert any("a-file" in said(r, "bad_path") for r in results), results
