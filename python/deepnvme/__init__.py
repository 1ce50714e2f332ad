"""deepnvme: DeepNVMe's Python API over the dnvmefs engine.

    import deepnvme
    h = deepnvme.aio_handle(block_size=1 << 20, queue_depth=128, intra_op_parallelism=4)
    t = h.new_cpu_locked_tensor(1 << 28, torch.empty(0, dtype=torch.float32))
    h.sync_pwrite(t, "/nvme/t.bin"); h.async_pread(t, "/nvme/t.bin"); h.wait()
    deepnvme.save(model.state_dict(), "/nvme/ckpt.pt")     # torch.load() reads it
    state = deepnvme.load("/nvme/ckpt.pt")
    g = deepnvme.gds_handle()                               # CUDA tensors (GPUDirect Storage)
    d = g.new_pinned_device_tensor(1 << 28, torch.empty(0, dtype=torch.float16))
    g.sync_pwrite(d, "/nvme/d.bin"); g.async_pread(d, "/nvme/d.bin"); g.wait()
    with deepnvme.Mount("/mnt/dnvme") as m: m.stats()

A drop-in for ``AsyncIOBuilder().load()``: ``deepnvme.aio_handle`` takes DeepSpeed's arguments
and has its methods. torch and numpy are used when the caller passes their objects; importing
deepnvme imports neither.
"""

from ._C import memlock_limit_bytes, pinned_bytes_in_use
from .checkpoint import FastFileWriter, buffer_pool, default_handle, load, read_file, save
from .handles import (GdsUnavailableError, aio_handle, cast_to_byte_tensor,
                      cuda_unavailable_reason, gds_handle, gds_unavailable_reason)
from .mount import Mount, SharedBuffer

__version__ = "@PROJECT_VERSION@"

__all__ = ["aio_handle", "gds_handle", "GdsUnavailableError", "gds_unavailable_reason",
           "cuda_unavailable_reason", "cast_to_byte_tensor", "FastFileWriter", "save", "load",
           "read_file", "default_handle", "buffer_pool", "Mount", "SharedBuffer",
           "pinned_bytes_in_use", "memlock_limit_bytes"]
