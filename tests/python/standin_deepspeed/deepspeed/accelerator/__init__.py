"""Stand-in for deepspeed.accelerator (see ../../README.md): the CPU accelerator's host-memory
calls of DeepSpeed 0.19.6 (pin_memory, pin_empty, is_pinned, unpin_memory), which go to the
native manager when DS_PIN_MEMORY_BACKEND=native and to torch otherwise."""


class _CpuAccelerator:

    def device_name(self, device_index=None):
        return "cpu"

    def pin_memory(self, tensor, make_copy=True, match_shape=True, alloc_shape=None):
        from deepspeed.utils.pin_memory import get_active_native_pinned_memory
        pins = get_active_native_pinned_memory()
        if pins is not None:
            if alloc_shape is not None:
                return pins.pin_empty(tensor, tuple(alloc_shape))
            return pins.pin(tensor, make_copy=make_copy, match_shape=match_shape)
        return tensor  # the CPU accelerator's torch path: nothing to pin without a device

    def pin_empty(self, *size, dtype=None):
        import torch
        shape = tuple(size[0]) if len(size) == 1 and not isinstance(size[0], int) else size
        return self.pin_memory(torch.empty(0, dtype=dtype), make_copy=False, alloc_shape=shape)

    def is_pinned(self, tensor):
        from deepspeed.utils.pin_memory import get_active_native_pinned_memory
        pins = get_active_native_pinned_memory()
        return bool(pins is not None and pins.is_pinned(tensor))

    def unpin_memory(self, tensor):
        from deepspeed.utils.pin_memory import get_active_native_pinned_memory
        pins = get_active_native_pinned_memory()
        return pins.unpin(tensor) if pins is not None else None


_accelerator = _CpuAccelerator()


def get_accelerator():
    return _accelerator
