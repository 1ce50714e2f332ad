"""Stand-in for DeepSpeed 0.19.6's decoupled checkpoint engine (see ../../../README.md).

DecoupledCheckpointEngine starts a process with the "spawn" method whose target is this module's
init_decoupled_checkpoint, looked up when the engine is made; save() queues (state_dict, path),
commit() waits until the process has written everything queued. The process writes with the
async_io op it loads itself (DeepSpeed's FastCheckpointEngine: deepspeed.io writers over
AsyncIOBuilder().load().aio_handle()); here each save is the state's tensors' bytes, one after
the other, written with sync_pwrite from a locked buffer, and PATH.op names the op's module."""

import torch
import torch.multiprocessing as mp

SAVE, COMMIT, EXIT = 1, 2, 3


def init_decoupled_checkpoint(config_params, dp_writer_config, save_event, save_queue,
                              optimize_dp_state):
    from deepspeed.ops.op_builder import AsyncIOBuilder
    aio = AsyncIOBuilder().load()  # DeepSpeed's own build fails here (no compiler for the op)
    handle = aio.aio_handle(1 << 20, 8, False, False, 1)
    while True:
        info, event = save_queue.get()
        if event == SAVE:
            state_dict, path = info
            data = torch.cat([t.reshape(-1).view(torch.uint8) for t in state_dict.values()])
            locked = handle.new_cpu_locked_tensor(data.numel(), data)
            locked.copy_(data)
            handle.sync_pwrite(locked, path)
            handle.free_cpu_locked_tensor(locked)
            with open(path + ".op", "w") as f:
                f.write(aio.__name__)
        elif event == COMMIT:
            save_event.set()
        elif event == EXIT:
            return


class DecoupledCheckpointEngine:

    def __init__(self, config_params=None, dp_writer_config=None, optimize_dp_state=False):
        ctx = mp.get_context("spawn")
        self.save_event = ctx.Event()
        self.save_queue = ctx.SimpleQueue()
        self.process = ctx.Process(target=init_decoupled_checkpoint,
                                   args=(config_params, dp_writer_config, self.save_event,
                                         self.save_queue, optimize_dp_state))
        self.process.start()

    def save(self, state_dict, path):
        self.save_queue.put(((state_dict, path), SAVE))

    def commit(self, timeout=120):
        self.save_queue.put((None, COMMIT))
        for _ in range(timeout):  # as DeepSpeed's: waits in steps, checking the process lives
            if self.save_event.wait(1):
                self.save_event.clear()
                return True
            if not self.process.is_alive():
                raise RuntimeError("decoupled checkpoint process died (exit code %s)" %
                                   self.process.exitcode)
        raise RuntimeError("decoupled checkpoint process: no commit in %d s" % timeout)

    def cleanup(self):
        self.save_queue.put((None, EXIT))
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
