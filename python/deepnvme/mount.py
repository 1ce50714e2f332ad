"""Client of a dnvmefs mount's control file ``<mount>/.dnvme/ctl`` (docs/control-protocol.md).

    m = deepnvme.Mount("/mnt/dnvme")
    m.config()                              # the live engine configuration
    m.set_config(queue_depth=64)            # applied live (root or the mount's owner)
    t = m.shared_tensor(1 << 28, torch.float32)   # CPU tensor in /dev/shm, registered
    m.pwrite(t, "ckpt/w.bin")               # daemon: shared memory -> O_DIRECT -> file
    m.pread(t, "ckpt/w.bin")
    m.stats()["ctl"]["bytes_written"]

Transfers go through the daemon's engine straight from the client's shared memory: no FUSE data
copy. Memory the daemon can use is shared memory: tensors and arrays from shared_tensor /
shared_array / SharedBuffer, or any tensor or array whose memory lies in a mapping of a live
``/dev/shm`` object (found through /proc/self/maps and registered on first use), and GPU memory
lent through CUDA IPC:

    t = torch.empty(1 << 28, dtype=torch.float16, device="cuda")
    m.register_cuda(t)                      # buffer.register with the allocation's IPC handle
    m.pread(t, "ckpt/w.bin")                # the daemon reads the file into this tensor

The protocol itself is spoken by the native client deepnvme._C.CtlClient, which is
dnvme::CtlClient (include/dnvme/client.h), the same code as `dnvme ctl`; it waits for the daemon
with the GIL released. This module adds what only Python knows: which tensor or array lies in which
registered memory.

Failures the daemon reports raise OSError with its errno and message (PermissionError for
EACCES, ...); the session stays usable. Thread safety: a Mount is one ctl session and is used by
one thread at a time (its memory bookkeeping is not locked; the native client serialises calls
only so that a misuse cannot swap answers); open one Mount per thread.
"""

import collections
import errno
import itertools
import mmap
import os
import threading
import weakref

from . import _C
from .handles import _buffer, _path

# Memory this session registered: [address, address + nbytes) is buffer `buffer_id` from its
# start; `keepalive` is held while registered (None: the caller keeps it); `writable` is False
# for memory registered read-only (a pwrite source only).
_Region = collections.namedtuple("_Region", "address nbytes buffer_id keepalive writable")

PAGE = mmap.PAGESIZE
_names = itertools.count()
_names_lock = threading.Lock()


class SharedBuffer:
    """A new /dev/shm object (mode 0600, unique name), mapped here; removed by close() or GC.

    The mapping stays valid while tensors or arrays made from it are alive."""

    def __init__(self, nbytes):
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError("SharedBuffer size must be a positive int, not %r" % (nbytes,))
        with _names_lock:
            self.name = "deepnvme-%d-%d" % (os.getpid(), next(_names))
        self.path = "/dev/shm/" + self.name
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            # Written now, so allocated on this process's memory account: the daemon transfers
            # only into pages the client has (it will not fault a hole in on its own account),
            # and a full /dev/shm says so here rather than with a SIGBUS later.
            zeros, off = bytes(min(nbytes, 4 << 20)), 0
            while off < nbytes:
                off += os.pwrite(fd, memoryview(zeros)[:nbytes - off], off)
            self.map = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)  # the mapping keeps the object; the name is removed by close()
        self.nbytes = nbytes
        self._finalizer = weakref.finalize(self, _unlink_quietly, self.path)

    def close(self):
        """Removes the name (the memory lives on while mapped, also in the daemon)."""
        self._finalizer()

    def tensor(self, dtype, count=-1, offset=0):
        import torch
        return torch.frombuffer(self.map, dtype=dtype, count=count, offset=offset)

    def array(self, dtype, shape=None, offset=0):
        import numpy as np
        dtype = np.dtype(dtype)
        count = -1 if shape is None else int(np.prod(shape))
        a = np.frombuffer(self.map, dtype=dtype, count=count, offset=offset)
        return a if shape is None else a.reshape(shape)


def _unlink_quietly(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _shm_mapping(address, nbytes):
    """(name, object offset of `address`) if [address, address+nbytes) lies in one mapping of a
    live /dev/shm object, else None."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(None, 5)
            if len(parts) < 6:
                continue
            start, end = (int(x, 16) for x in parts[0].split("-"))
            if not start <= address < end:
                continue
            path = parts[5].strip()
            if address + nbytes > end or not path.startswith("/dev/shm/") or \
                    path.endswith(" (deleted)"):
                return None
            name = path[len("/dev/shm/"):]
            if "/" in name:
                return None
            return name, int(parts[2], 16) + (address - start)
    return None


class Mount:
    """One session on ``<mountpoint>/.dnvme/ctl``; close() (or the with-block) ends it, and the
    daemon then releases the session's handles and buffers."""

    def __init__(self, mountpoint):
        self.mountpoint = os.path.abspath(_path(mountpoint))
        self._attach(_C.CtlClient(self.mountpoint))

    def _attach(self, client):
        """Makes `client` (a _C.CtlClient) this Mount's session and says hello; the client is
        closed when hello fails (not a dnvmefs mount, another protocol)."""
        self._client = client
        self._handle = None
        self._regions = []  # _Region: registered by this session
        self._shm_regs = {}  # (name, offset, size) -> buffer id
        try:
            self.hello = client.hello()
        except BaseException:
            client.close()
            raise

    # --- the session ------------------------------------------------------------------------
    def call(self, op, **fields):
        """One request; returns the answer (a dict) or raises OSError for "ok": false."""
        return self._client.call(dict(fields, op=op))

    def close(self):
        client = getattr(self, "_client", None)  # None: __init__ failed before the session
        if client is not None and not client.closed:
            client.close()
            self._regions.clear()
            self._shm_regs.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # --- configuration and statistics ---------------------------------------------------------
    def config(self):
        return self._client.config()

    def set_config(self, config=None, **keys):
        """Applies HandleConfig keys (a dict and/or keywords) to the live mount; returns the
        resulting configuration."""
        return self._client.set_config(dict(config or {}, **keys))

    def stats(self):
        return self._client.stats()

    # --- handles ------------------------------------------------------------------------------
    def open_handle(self, **config):
        """A daemon-side engine handle (unspecified keys from the live configuration)."""
        return self._client.open_handle(config)

    def close_handle(self, handle):
        """Closes a handle (after its transfers); returns the answer: "uncollected" counts the
        async outcomes no wait() collected."""
        if handle == self._handle:
            self._handle = None
        return {"ok": True, "uncollected": self._client.close_handle(handle)}

    def _default_handle(self):
        if self._handle is None:
            self._handle = self.open_handle()
        return self._handle

    # --- shared memory ------------------------------------------------------------------------
    def shared_buffer(self, nbytes):
        """A SharedBuffer registered with the daemon (whole object)."""
        buf = SharedBuffer(nbytes)
        self.register_shm(buf.name, keepalive=buf, address=_buffer(buf.map, True).address,
                          nbytes=nbytes)
        return buf

    def shared_tensor(self, num_elem, dtype):
        """A 1-D CPU tensor of `num_elem` elements in registered shared memory."""
        import torch
        itemsize = torch.empty(0, dtype=dtype).element_size()
        return self.shared_buffer(max(1, num_elem * itemsize)).tensor(dtype, count=num_elem)

    def shared_array(self, shape, dtype):
        """A numpy array in registered shared memory."""
        import numpy as np
        count = int(np.prod(shape))
        nbytes = max(1, count * np.dtype(dtype).itemsize)
        return self.shared_buffer(nbytes).array(dtype, shape)

    def register_shm(self, name, offset=0, size=0, keepalive=None, address=None, nbytes=None):
        """buffer.register of /dev/shm/NAME (a page-aligned part, or all of it); returns its id."""
        buffer_id = self._client.register_shm(name, offset, size)
        if address is not None:
            # The daemon answers EACCES for a pread into a read-only object itself.
            self._regions.append(_Region(address, nbytes, buffer_id, keepalive, True))
        return buffer_id

    def register(self, buffer):
        """(buffer id, buffer offset) of a tensor/array/buffer in shared memory, registering the
        /dev/shm pages it lies in on first use; for CUDA memory, of the registration
        register_cuda made."""
        return self._locate(_buffer(buffer, writable=False))

    def register_cuda(self, buffer, writable=True):
        """Lends CUDA memory (a CUDA tensor or a __cuda_array_interface__ object, contiguous) to
        the daemon through CUDA IPC; returns (buffer id, 0) like register.

        Sends buffer.register with the IPC handle of the cudaMalloc allocation holding the
        buffer, the buffer's offset in it and its size; the daemon maps it on the same device.
        After this pread/pwrite/wait take the buffer (or any part of it) like shared memory. The
        buffer is kept alive until unregister() or the end of the session. writable=False refuses
        pread into it here (and reads an interface marked read-only)."""
        mem = _buffer(buffer, writable=bool(writable))
        if not mem.is_cuda:
            raise ValueError("register_cuda needs CUDA memory (a CUDA tensor or an object with "
                             "__cuda_array_interface__); host memory goes through shared_tensor "
                             "/ register")
        if mem.nbytes == 0:
            raise ValueError("register_cuda: the buffer is empty")
        reason = _C.cuda_unavailable_reason()
        if reason:
            raise OSError(errno.ENODEV, "register_cuda: no usable CUDA device: %s" % reason)
        ipc = _C.export_cuda_ipc(mem.address)
        buffer_id, daemon_writable = self._client.register_cuda_ipc(
            ipc["handle"], ipc["device"], ipc["offset"], mem.nbytes)
        self._regions.append(_Region(mem.address, mem.nbytes, buffer_id, buffer,
                                     bool(writable) and daemon_writable))
        return buffer_id, 0

    def unregister(self, buffer):
        """buffer.unregister of a registration (its id, or the (id, offset) pair register and
        register_cuda return); drops this session's hold on the memory."""
        buffer_id = buffer[0] if isinstance(buffer, tuple) else buffer
        self._client.unregister(buffer_id)
        self._regions = [r for r in self._regions if r.buffer_id != buffer_id]
        self._shm_regs = {k: v for k, v in self._shm_regs.items() if v != buffer_id}

    def _locate(self, mem, writable=False):
        address, nbytes = mem.address, mem.nbytes
        for r in self._regions:
            if r.address <= address and address + nbytes <= r.address + r.nbytes:
                if writable and not r.writable:
                    raise ValueError("this memory is registered read-only (buffer %d) and cannot "
                                     "be read into" % r.buffer_id)
                return r.buffer_id, address - r.address
        if mem.is_cuda:
            raise ValueError("this CUDA memory is not registered with the daemon; lend it first "
                             "with Mount.register_cuda(buffer)")
        found = _shm_mapping(address, max(nbytes, 1))
        if found is None:
            raise ValueError("this memory is not in a /dev/shm mapping, so the daemon cannot "
                             "reach it; allocate it with Mount.shared_tensor / shared_array")
        name, object_offset = found
        reg_offset = object_offset - object_offset % PAGE
        reg_end = -(-(object_offset + nbytes) // PAGE) * PAGE
        key = (name, reg_offset, reg_end - reg_offset)
        buffer_id = self._shm_regs.get(key)
        if buffer_id is None:
            buffer_id = self._client.register_shm(name, reg_offset, reg_end - reg_offset)
            self._shm_regs[key] = buffer_id
        return buffer_id, object_offset - reg_offset

    # --- transfers ----------------------------------------------------------------------------
    def _transfer(self, read, buffer, path, file_offset, async_op, handle, length):
        mem = _buffer(buffer, writable=read)
        nbytes = mem.nbytes
        buffer_id, buffer_offset = self._locate(mem, writable=read)
        if mem.sync is not None:
            mem.sync()  # the daemon's copies do not follow this process's CUDA streams
        if length is None:
            length = nbytes
        if not 0 <= length <= nbytes:
            raise ValueError("length %d is outside the buffer's %d bytes" % (length, nbytes))
        transfer = self._client.pread if read else self._client.pwrite
        return transfer(self._default_handle() if handle is None else handle, buffer_id,
                        buffer_offset, length, _path(path), file_offset, bool(async_op))

    def pread(self, buffer, path, file_offset=0, async_op=False, handle=None, length=None):
        """Daemon reads the file (path relative to the mount) into `buffer`; returns bytes read
        (or the op id when async_op; collect with wait)."""
        return self._transfer(True, buffer, path, file_offset, async_op, handle, length)

    def pwrite(self, buffer, path, file_offset=0, async_op=False, handle=None, length=None):
        """Daemon writes `buffer` to the file (created if missing, never truncated)."""
        return self._transfer(False, buffer, path, file_offset, async_op, handle, length)

    def wait(self, handle=None):
        """Outcomes of the handle's async transfers since the last wait (a list of dicts); raises
        OSError for the first failure after collecting all."""
        return self._client.wait(self._default_handle() if handle is None else handle)

    def fsync(self, path):
        self._client.fsync(_path(path))


__all__ = ["Mount", "SharedBuffer"]
