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
    p = deepnvme.pin_handle()                                # PinMemoryBuilder().load().pin_handle()
    w = deepnvme.io.FastFileWriter(path, deepnvme.io.FastFileWriterConfig(h, t))  # deepspeed.io

A drop-in for DeepSpeed 0.19's ``AsyncIOBuilder().load()``, ``GDSBuilder().load()`` and
``PinMemoryBuilder().load()`` (this module is all three: aio_handle, gds_handle, pin_handle,
aio_read, aio_write, deepspeed_memcpy) and for ``deepspeed.io`` (``deepnvme.io``);
``deepnvme.deepspeed.activate()`` makes an installed DeepSpeed load it. Differences from DeepSpeed
are listed in docs/deepspeed-compat.md. torch and numpy are used when the caller passes their objects; importing
deepnvme imports neither.
"""

from ._C import memlock_limit_bytes, pinned_bytes_in_use
from .checkpoint import (AsyncSave, FastFileWriter, buffer_pool, default_handle, load, read_file,
                         save)
from .handles import (GdsUnavailableError, aio_handle, aio_read, aio_write, cast_to_byte_tensor,
                      cuda_unavailable_reason, deepspeed_memcpy, gds_handle,
                      gds_unavailable_reason)
from .mount import Mount, SharedBuffer
from .pinned import pin_handle
from .staging import release_staging_memory
from . import io  # noqa: E402  (deepnvme.io: DeepSpeed's deepspeed.io writers)
from . import staging  # noqa: E402

__version__ = "@PROJECT_VERSION@"

__all__ = ["aio_handle", "gds_handle", "pin_handle", "aio_read", "aio_write", "deepspeed_memcpy",
           "GdsUnavailableError", "gds_unavailable_reason", "cuda_unavailable_reason",
           "cast_to_byte_tensor", "FastFileWriter", "AsyncSave", "save", "load", "read_file",
           "release_staging_memory",
           "default_handle", "buffer_pool", "io", "Mount", "SharedBuffer", "pinned_bytes_in_use",
           "memlock_limit_bytes"]
