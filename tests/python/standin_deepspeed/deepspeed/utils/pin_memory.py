"""Stand-in for DeepSpeed 0.19.6's deepspeed.utils.pin_memory (see ../../README.md).

DS_PIN_MEMORY_BACKEND=native makes the accelerator pin host memory through the op DeepSpeed
builds for it: PinMemoryBuilder().load().pin_handle() (DeepSpeed's current master) with
new_cpu_locked_tensor(numel, example), freed by address (free_cpu_locked_tensor_by_ptr) at
unpin() or when the allocation's last view is collected; or, as in the first 0.19.6 version
(OP="async_io"), AsyncIOBuilder().load().aio_handle(...), freed only by unpin()
(free_cpu_locked_tensor). One manager per process."""

import os
import weakref

OP = "pin_memory"


class NativePinnedMemory:

    def __init__(self, op=None):
        op = op or OP
        try:
            if op == "pin_memory":
                from deepspeed.ops.op_builder import PinMemoryBuilder
                self._handle = PinMemoryBuilder().load().pin_handle()
            else:
                from deepspeed.ops.op_builder import AsyncIOBuilder
                self._handle = AsyncIOBuilder().load().aio_handle(128 * 1024, 8, False, False, 1)
        except Exception as e:
            raise RuntimeError("DS_PIN_MEMORY_BACKEND=native: the %s op did not load" % op) from e
        self._op = op
        self._ends = {}  # allocation address -> end address
        self._collect = {}  # allocation address -> weakref.finalize on the allocation

    def _new(self, example, shape):
        count = 1
        for d in shape:
            count *= int(d)
        root = self._handle.new_cpu_locked_tensor(count, example)
        address = root.data_ptr()
        out = root[:count].view(tuple(shape))
        self._ends[address] = address + count * example.element_size()
        out.ds_pinned = True
        out.ds_pin_base = address
        if self._op == "pin_memory":
            self._collect[address] = weakref.finalize(root, self._free, self._handle, address,
                                                      self._ends, self._collect)
        return out

    def pin(self, tensor, make_copy=True, match_shape=True):
        shape = tensor.shape if match_shape else (tensor.numel(),)
        out = self._new(tensor, shape)
        if make_copy:
            out.copy_(tensor.reshape(shape))
        return out

    def pin_empty(self, example, shape):
        return self._new(example, shape)

    def is_pinned(self, tensor):
        if getattr(tensor, "ds_pinned", False):
            return True
        if tensor.device.type == "meta":
            return False
        p = tensor.data_ptr()
        return any(a <= p < e for a, e in self._ends.items())

    def unpin(self, tensor):
        address = getattr(tensor, "ds_pin_base", None)
        if address is None:
            address = tensor.data_ptr()
        collect = self._collect.pop(address, None)
        if collect is not None:
            collect.detach()
        self._ends.pop(address, None)
        tensor.ds_pinned = False
        if self._op != "pin_memory":
            return self._handle.free_cpu_locked_tensor(tensor)
        return self._handle.free_cpu_locked_tensor_by_ptr(address)

    @staticmethod
    def _free(handle, address, ends, collect):
        ends.pop(address, None)
        collect.pop(address, None)
        try:
            handle.free_cpu_locked_tensor_by_ptr(address)
        except Exception:
            pass


_manager = None


def get_native_pinned_memory():
    global _manager
    if _manager is None:
        _manager = NativePinnedMemory()
    return _manager


def get_active_native_pinned_memory():
    if os.environ.get("DS_PIN_MEMORY_BACKEND", "torch").strip().lower() != "native":
        return None
    return get_native_pinned_memory()
