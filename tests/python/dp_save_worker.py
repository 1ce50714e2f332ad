"""One rank of the data-parallel save test (tests/python/test_checkpoint.py starts two).

    dp_save_worker.py RANK WORLD PORT RESULT_JSON PATH MODE

Initialises torch.distributed with gloo on 127.0.0.1:PORT, builds the same model state on every
rank (seeded), and calls deepnvme.save(..., data_parallel=True) with a handle of its own, so the
bytes this rank wrote can be read from the handle's counters. MODE "same" saves the replicated
state; MODE "differ" makes rank 1's state larger (the ranks must then all fail). Writes what
happened to RESULT_JSON.
"""

import faulthandler
import os
import sys

import torch
import torch.distributed as dist

import deepnvme
import ranks


def build_state(extra):
    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Embedding(3000, 256), torch.nn.LSTM(256, 256))
    return {"model": model.state_dict(), "step": 17,
            "extra": torch.arange(extra, dtype=torch.float64)}


def main():
    rank, world, port, result_path, path, mode = (int(sys.argv[1]), int(sys.argv[2]),
                                                  sys.argv[3], sys.argv[4], sys.argv[5],
                                                  sys.argv[6])
    # A rank that hangs prints every thread's stack (to the test's log) and exits, so a hang in a
    # collective shows where it is instead of only timing out.
    faulthandler.dump_traceback_later(90, exit=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    extra = 1000 + (5000 if (mode == "differ" and rank == 1) else 0)
    handle = deepnvme.aio_handle(block_size=262144, queue_depth=16)
    result = {"rank": rank}
    try:
        result["length"] = deepnvme.save(build_state(extra), path, handle, data_parallel=True,
                                         buffer_bytes=1 << 20, stripe_bytes=1 << 20)
        result["ok"] = True
    except Exception as e:  # reported to the test, which checks the message
        result["ok"] = False
        result["error"] = "%s: %s" % (type(e).__name__, e)
    result["bytes_written"] = handle.stats()["bytes_written"]
    ranks.leave(result_path, result)


if __name__ == "__main__":
    main()
