"""torch.save's zip format, written and read by the engine: the fast path of save() and load().

torch.save(obj, f) streams every tensor's bytes through a Python ``write`` call (a copy into a
``bytes`` object each) after its own CRC-32, and torch.load reads them back through its zip
reader (another copy, another CRC). Both leave most of a fast device idle. This module plugs into
torch's own serializer instead: ``torch.serialization._save`` and ``_load`` take a zip-file object
(``write_record`` / ``get_record``, ``get_storage_from_record``), and ours moves each storage
between the tensor's memory and the file with the engine's parallel O_DIRECT requests:

- save: each storage's record starts at the file offset that agrees with the storage's memory
  address modulo the 4 KiB page (the local header's extra field pads to it, as torch pads to 64
  bytes), so every whole page of the body goes O_DIRECT straight from the tensor's memory with
  no bounce copy, although torch's allocator aligns to 64 bytes, not 4096; the head before the
  first page boundary goes through the page cache. The CRC-32 runs on this thread while the
  engine writes the same bytes (``_C.crc32``: zlib's result at twice zlib's speed or more, by
  carry-less multiplication); a data descriptor after the record carries it, as in torch's own
  files (flag bit 3). The result is a standard zip (zip64 when large) that torch.load, Python's
  zipfile and ``unzip -t`` accept.
- load: the central directory gives every record's offset; a storage is read into fresh memory
  that starts as far into its page as the record into its file page (torch's own 64-byte
  aligned records included), so it too moves O_DIRECT with no bounce copy, and its CRC-32 is
  checked (torch's own reader does not check it; a damaged record raises OSError). Records are
  read ahead: from the first storage torch asks for, a thread of the reader's own reads the
  large records in the order torch will ask for them (the pickle's: storage keys are numbered as
  torch.save met them, and the file holds them sorted as strings, 0, 1, 10, 100, 11, ..., 2) with
  the engine's parallel requests and checks their CRCs, up to READ_AHEAD bytes not yet taken,
  while torch unpickles and builds tensors from the ones before; a record torch asks for before
  the thread reached it is read by the asking thread.

``torch.serialization._save/_load`` are private; ``supported()`` checks that their signatures are
the ones this module was written for, and save()/load() fall back to the public API otherwise.

Thread safety: one TorchZipWriter / TorchZipReader per thread.
"""

import ctypes
import errno
import inspect
import io
import os
import struct
import sys
import threading

from . import _C

ALIGN = 4096  # the page: large records agree with their memory modulo this (_page_residue)
SMALL_RECORD = 1 << 20  # below this a record is written with one pwrite (page cache)
ARCHIVE = "archive"  # torch's archive name for streams without a file name

_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_EOCD = struct.Struct("<IHHHHIIH")
_EOCD64 = struct.Struct("<IQHHIIQQQQ")
_LOCATOR64 = struct.Struct("<IIQI")
_U32 = 0xFFFFFFFF  # the "see the zip64 extra field" marker
ZIP64_LIMIT = 0xFFFFFFFF  # sizes and offsets from here on need zip64 (tests lower it)
_DOS_DATE = 0x21  # 1980-01-01, what zip tools show for "no date"
_FLAGS = 0x0808  # bit 3: CRC and sizes in a data descriptor; bit 11: UTF-8 names


# Parameters of torch.serialization._save after the first four that deepnvme knows, with the
# value torch.save passes (torch >= 2.1 writes a byteorder record unless told not to).
_KNOWN_SAVE_EXTRAS = {"_disable_byteorder_record": False}


class _Helper:
    """One helper thread running one call at a time (submit(fn, *args).result()). Not a
    concurrent.futures executor: those refuse work once the interpreter is shutting down, and
    deepnvme.save(blocking=False)'s saves still run then (the program's exit waits for them)."""

    def __init__(self, name):
        self._cv = threading.Condition()
        self._call = None  # (fn, args) waiting for the thread
        self._done = None  # (result, error) of the last call
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self):
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stop or self._call is not None)
                if self._call is None:
                    return
                fn, args = self._call
                self._call = None
            try:
                done = (fn(*args), None)
            except BaseException as e:  # handed to result()
                done = (None, e)
            with self._cv:
                self._done = done
                self._cv.notify_all()

    def submit(self, fn, *args):
        with self._cv:
            self._done = None
            self._call = (fn, args)
            self._cv.notify_all()
        return self

    def result(self):
        with self._cv:
            self._cv.wait_for(lambda: self._done is not None)
            (value, error), self._done = self._done, None
        if error is not None:
            raise error
        return value

    def shutdown(self):
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join()


def _check_signatures(torch):
    """(reason, save_kwargs): reason is None when _save/_load have the shapes deepnvme knows."""
    ser = getattr(torch, "serialization", None)
    save, load = getattr(ser, "_save", None), getattr(ser, "_load", None)
    if save is None or load is None:
        return "torch %s has no torch.serialization._save/_load" % torch.__version__, None
    try:
        save_params = list(inspect.signature(save).parameters.values())
        load_params = list(inspect.signature(load).parameters.values())
    except (TypeError, ValueError) as e:
        return "cannot inspect torch.serialization._save/_load: %s" % e, None
    differ = ("torch %s's torch.serialization._save/_load differ from what deepnvme knows" %
              torch.__version__)
    if [p.name for p in save_params[:4]] != ["obj", "zip_file", "pickle_module",
                                              "pickle_protocol"] or \
            [p.name for p in load_params[:3]] != ["zip_file", "map_location", "pickle_module"]:
        return differ, None
    save_kwargs = {}
    for p in save_params[4:]:
        if p.name in _KNOWN_SAVE_EXTRAS:
            save_kwargs[p.name] = _KNOWN_SAVE_EXTRAS[p.name]
        elif p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL,
                                                                      p.VAR_KEYWORD):
            return "%s (required parameter %r of _save)" % (differ, p.name), None
    for p in load_params[3:]:
        if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL,
                                                                    p.VAR_KEYWORD):
            return "%s (required parameter %r of _load)" % (differ, p.name), None
    # Every method of torch's own zip writer that _save names must be ours too (torch 2.5 added
    # write_record_metadata): a later torch that calls one more falls back to torch.save instead
    # of failing half-way through a checkpoint.
    torch_writer = getattr(getattr(torch, "_C", None), "PyTorchFileWriter", None)
    code = getattr(save, "__code__", None)
    if torch_writer is not None and code is not None:
        missing = sorted(n for n in set(code.co_names)
                         if hasattr(torch_writer, n) and not (hasattr(TorchZipWriter, n) and
                                                              hasattr(SnapshotZipWriter, n)))
        if missing:
            return "%s (its _save calls %s on the zip writer)" % (differ, ", ".join(missing)), None
    return None, save_kwargs


def supported():
    """Why the fast path cannot be used with this torch (a sentence), or None when it can."""
    return save_arguments()[0]


def save_arguments():
    """(reason, save_kwargs) for this torch (see _check_signatures): for a caller that saves
    many objects (deepnvme.dcp: one archive per tensor) and checks once."""
    torch = sys.modules.get("torch")
    if torch is None:
        return "torch is not imported", None
    return _check_signatures(torch)


def save(obj, zip_file, pickle_module, pickle_protocol, save_kwargs=None):
    """torch.serialization._save with the extra arguments this torch's version takes
    (save_kwargs: save_arguments()'s, when the caller has checked already)."""
    torch = sys.modules["torch"]
    if save_kwargs is None:
        reason, save_kwargs = _check_signatures(torch)
        if reason is not None:
            raise RuntimeError(reason)
    torch.serialization._save(obj, zip_file, pickle_module, pickle_protocol, **save_kwargs)


# os.pwrite / os.preadv retry EINTR themselves (PEP 475); a short transfer is continued here.
def _pwrite_all(fd, data, offset, path):
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n == 0:
            raise OSError(errno.EIO, "pwrite wrote nothing at offset %d" % (offset + done), path)
        done += n


def pread_into(fd, view, offset, path):
    """Fills `view` (a writable byte memoryview) from `offset`; OSError(ENODATA) at end of
    file."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise OSError(errno.ENODATA, "'%s' ends at %d, before the %d bytes asked for at %d" %
                          (path, offset + done, len(view), offset), path)
        done += n


def _pread_all(fd, nbytes, offset, path):
    out = bytearray(nbytes)
    pread_into(fd, memoryview(out), offset, path)
    return bytes(out)


def _padding_extra(header_end, align, residue=0):
    """An extra field ('FB', zeros, as torch's writer uses) that moves header_end to a file
    offset equal to `residue` modulo align."""
    pad = (residue - header_end) % align
    if pad < 4:
        pad += align
    return struct.pack("<HH", 0x4246, pad - 4) + bytes(pad - 4)


def _page_residue(address):
    """Where a record of memory at `address` starts within its file page, so that file offset
    and memory address agree modulo the page: every whole page of the record then goes O_DIRECT
    straight from (or into) that memory, with no bounce copy, whatever torch's allocator gave
    (64-byte alignment, not 4096). The head before the first page boundary (under 4 KiB) goes
    through the page cache. Memory off a 64-byte boundary (numpy or frombuffer storages) gets a
    page-aligned record instead (written through the engine's bounce buffers), so that readers
    that map records (torch.load(mmap=True)) still find them 64-byte aligned."""
    return address % ALIGN if address % 64 == 0 else 0


class TorchZipWriter:
    """The zip_file object torch.serialization._save writes into (write_record), producing
    `path` through `handle` (a deepnvme.aio_handle; the file is adopted as an engine FileRef,
    whose transfers may run beside other threads' use of the same handle). close() adds the
    version record and the central directory, fsyncs (unless fsync=False) and closes; abort()
    stops without them."""

    def __init__(self, path, handle, fsync=True):
        self._start(path, fsync)
        try:
            self._file = _C.File(handle._h, self._fd, True)
        except BaseException:
            os.close(self._fd)
            raise

    def _start(self, path, fsync):
        """The archive's state, and `path` created or emptied."""
        self._init_state(path, fsync, os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666))

    def _init_state(self, path, fsync, fd, file=None, base=0, owns_fd=True):
        self.path = path
        self._fsync = fsync
        self._entries = []  # (name bytes, offset, size, crc)
        self._base = base  # where the archive starts in the file (EmbeddedZipWriter)
        self._pos = 0  # the archive's end, from its start
        self._writer = None  # one helper thread: writes a record while this one computes its CRC
        self._file = file
        self._fd = fd
        self._owns_fd = owns_fd  # closed by _release (else the caller's)

    def _memory(self, data, nbytes):
        """A buffer over `nbytes` of what torch's _save passes: bytes (the pickle), a str (torch
        2's byteorder), an address (torch 1.x storages) or a storage object (torch 2)."""
        if isinstance(data, str):
            data = data.encode()
        if isinstance(data, (bytes, bytearray, memoryview)):
            view = memoryview(data).cast("B")
            if len(view) != nbytes:
                raise ValueError("write_record: %d bytes given, %d announced" % (len(view), nbytes))
            return view
        address = data if isinstance(data, int) else data.data_ptr()
        if nbytes == 0:
            return memoryview(b"")
        return (ctypes.c_char * nbytes).from_address(address)

    def _header(self, name, nbytes, address):
        """Writes record `name`'s local header at the end of the archive, padded so that its
        bytes start at the file offset that agrees with `address` (their memory; 0: none) modulo
        the page when large, modulo 64 when small. Returns (name bytes, header offset, data
        offset)."""
        name_bytes = ("%s/%s" % (ARCHIVE, name)).encode()
        zip64 = nbytes >= ZIP64_LIMIT
        extra = struct.pack("<HHQQ", 1, 16, 0, 0) if zip64 else b""
        header_end = self._pos + _LOCAL.size + len(name_bytes) + len(extra)
        if nbytes >= SMALL_RECORD:  # the file offset, where O_DIRECT's alignment is decided
            extra += _padding_extra(self._base + header_end, ALIGN, _page_residue(address))
        else:  # 64 bytes into the archive, as torch's writer
            extra += _padding_extra(header_end, 64)
        header = _LOCAL.pack(0x04034B50, 45 if zip64 else 20, _FLAGS, 0, 0, _DOS_DATE, 0,
                             _U32 if zip64 else 0, _U32 if zip64 else 0, len(name_bytes),
                             len(extra)) + name_bytes + extra
        offset = self._pos
        self._write_small(header, offset)
        return name_bytes, offset, offset + len(header)

    def _end_record(self, name_bytes, offset, data_at, nbytes, crc):
        """The data descriptor after the record's bytes, and its central directory entry."""
        if nbytes >= ZIP64_LIMIT:
            descriptor = struct.pack("<IIQQ", 0x08074B50, crc, nbytes, nbytes)
        else:
            descriptor = struct.pack("<IIII", 0x08074B50, crc, nbytes, nbytes)
        self._write_small(descriptor, data_at + nbytes)
        self._pos = data_at + nbytes + len(descriptor)
        self._entries.append((name_bytes, offset, nbytes, crc))

    def write_record_metadata(self, name, nbytes):
        """What torch >= 2.5's _save calls for each storage inside
        torch.serialization.skip_data(): the record's header, size and place, without its bytes
        (the file has a hole there, which reads as zeros, for the caller to fill in later at the
        record's offset) and CRC 0, as torch's own writer leaves them (readers, ours included,
        do not check a CRC of 0)."""
        name_bytes, offset, data_at = self._header(name, nbytes, 0)
        self._end_record(name_bytes, offset, data_at, nbytes, 0)

    def write_record(self, name, data, nbytes):
        buf = self._memory(data, nbytes)
        large = nbytes >= SMALL_RECORD
        address = _C.buffer_address(buf, False)[0] if large else 0
        name_bytes, offset, data_at = self._header(name, nbytes, address)
        if large:
            # The write runs on the helper thread (GIL released) while this one computes the
            # CRC of the same bytes (_C.crc32 releases the GIL too).
            if self._writer is None:
                try:
                    self._writer = _Helper("deepnvme-zip")
                except RuntimeError:  # Python >= 3.12 starts no thread while it exits
                    self._writer = False
            if self._writer:
                written = self._writer.submit(self._write_large, buf, address, nbytes, data_at)
                try:
                    crc = _C.crc32(buf)
                finally:
                    written.result()  # raises the write's OSError; buf stays alive until here
            else:  # one after the other (a save run at exit)
                self._write_large(buf, address, nbytes, data_at)
                crc = _C.crc32(buf)
        else:
            crc = _C.crc32(buf)
            if nbytes:
                self._write_small(buf, data_at)
        self._end_record(name_bytes, offset, data_at, nbytes, crc)

    # The writes, in file order. Headers, descriptors, small records and the tail go here:
    def _write_small(self, data, offset):
        _pwrite_all(self._fd, data, self._base + offset, self.path)

    # A large record's bytes (on the helper thread): straight from the tensor's memory by the
    # engine's O_DIRECT requests.
    def _write_large(self, buf, address, nbytes, offset):
        self._file.pwrite(address, nbytes, self._base + offset)

    def _write_held(self):
        """Writes whatever _write_small held back (nothing here)."""

    def _central_directory(self):
        out = bytearray()
        for name, offset, size, crc in self._entries:
            # An entry past the limit carries its sizes in the zip64 field too, even when they
            # fit: miniz (torch's reader) checks a small entry's 32-bit header offset against
            # the archive size, which the offset marker fails.
            big = size >= ZIP64_LIMIT or offset >= ZIP64_LIMIT
            fields = [size, size] if big else []
            if offset >= ZIP64_LIMIT:
                fields.append(offset)
            extra = struct.pack("<HH%dQ" % len(fields), 1, 8 * len(fields), *fields) \
                if fields else b""
            out += _CENTRAL.pack(0x02014B50, 45, 45 if fields else 20, _FLAGS, 0, 0, _DOS_DATE,
                                 crc, _U32 if big else size, _U32 if big else size, len(name),
                                 len(extra), 0, 0, 0, 0,
                                 _U32 if offset >= ZIP64_LIMIT else offset)
            out += name + extra
        start, count = self._pos, len(self._entries)
        if count >= 0xFFFF or start >= ZIP64_LIMIT or len(out) >= ZIP64_LIMIT:
            eocd64_at = start + len(out)
            out += _EOCD64.pack(0x06064B50, 44, 45, 45, 0, 0, count, count, len(out), start)
            out += _LOCATOR64.pack(0x07064B50, 0, eocd64_at, 1)
            out += _EOCD.pack(0x06054B50, 0, 0, 0xFFFF, 0xFFFF, _U32, _U32, 0)
        else:
            out += _EOCD.pack(0x06054B50, 0, 0, count, count, len(out), start, 0)
        return bytes(out)

    def close(self):
        """Version record, central directory, fsync, close. Returns the file size."""
        if self._fd < 0:
            return self._pos
        try:
            self._write_tail()
            self._write_held()
            if self._fsync:
                os.fsync(self._fd)
        except BaseException:
            self.abort()
            raise
        self._release()
        return self._pos

    def _write_tail(self):
        """The version record and the central directory: the archive is complete."""
        self.write_record("version", b"3\n", 2)
        tail = self._central_directory()
        self._write_small(tail, self._pos)
        self._pos += len(tail)

    def _release(self):
        if self._writer:
            self._writer.shutdown()
            self._writer = None
        self._file = None
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            if self._owns_fd:
                os.close(fd)  # may raise: under `dnvme run` a write-behind error arrives here

    def abort(self):
        """Closes without finishing the archive (a failed save: the caller removes the file)."""
        self._release()


class EmbeddedZipWriter(TorchZipWriter):
    """A TorchZipWriter whose archive is one item inside a larger file: bytes [base, base +
    length) of the caller's open file `fd` (adopted by the caller as the engine File `file`),
    whose offsets inside are counted from `base`, as in torch.save to a stream positioned there.
    torch.distributed.checkpoint keeps one such archive per tensor in its files (deepnvme.dcp).
    Large records still agree with their memory modulo the page at their file offset.
    finish() adds the version record and the directory and returns the archive's length; the
    file stays open and unsynced (the caller's)."""

    def __init__(self, fd, file, path, base):
        self._init_state(path, False, fd, file, base, owns_fd=False)

    def finish(self):
        try:
            self._write_tail()
        finally:
            self.abort()
        return self._pos

    def close(self):
        raise TypeError("EmbeddedZipWriter: finish(), the file is the caller's")


class MountZipWriter(TorchZipWriter):
    """A TorchZipWriter that writes `path` with plain os.pwritev calls: what `torch.save` to a
    file on a dnvmefs mount becomes in a program under `dnvme run` (deepnvme/_run_hook.py).
    libdnvme_preload.so takes each large call to its engine (write-behind from pinned buffers,
    parallel O_DIRECT on the backing file) and keeps the mount coherent; this class only has to
    make the calls large. The archive is written front to back, so the small pieces (headers,
    data descriptors, small records) are held and go out in front of the next large record in
    one pwritev: a small write through the mount between two direct ones would make the library
    land and announce the first before it (docs/preload.md). Each record's CRC-32 is computed
    while the library copies it (the write runs on the helper thread).

    Not durable when it returns (as torch.save): fsync=True adds an os.fsync."""

    HOLD_LIMIT = 8 << 20  # held small pieces beyond this go out on their own (one large write)

    def __init__(self, path, fsync=False):
        self._held = bytearray()
        self._held_at = 0
        self._start(path, fsync)

    def _write_small(self, data, offset):
        if self._held and offset > self._held_at + len(self._held):
            self._write_held()  # a skipped record (write_record_metadata) leaves a hole
        if not self._held:
            self._held_at = offset
        elif offset != self._held_at + len(self._held):
            raise AssertionError("MountZipWriter: write at %d, %d expected" %
                                 (offset, self._held_at + len(self._held)))
        self._held += data
        if len(self._held) >= self.HOLD_LIMIT:
            self._write_held()

    def _write_large(self, buf, address, nbytes, offset):
        parts = [memoryview(buf)]
        at = offset
        if self._held:
            parts.insert(0, memoryview(self._held))
            at = self._held_at
        _pwritev_all(self._fd, parts, at, self.path)
        self._held = bytearray()

    def _write_held(self):
        if self._held:
            _pwrite_all(self._fd, self._held, self._held_at, self.path)
            self._held = bytearray()


class _FileView(io.RawIOBase):
    """Bytes [base, base + length) of an open file, as a seekable read-only file (what zipfile
    parses an embedded archive's directory from); reads with pread, the fd is the caller's."""

    def __init__(self, fd, path, base, length):
        super().__init__()
        self._fd, self.name, self._base, self._length, self._pos = fd, path, base, length, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, offset, whence=os.SEEK_SET):
        start = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._length}[whence]
        if start + offset < 0:
            raise OSError(errno.EINVAL, "seek before the start of the archive", self.name)
        self._pos = start + offset
        return self._pos

    def tell(self):
        return self._pos

    def readinto(self, b):
        n = max(0, min(len(b), self._length - self._pos))
        if n == 0:
            return 0
        view = memoryview(b).cast("B")[:n]
        pread_into(self._fd, view, self._base + self._pos, self.name)
        self._pos += n
        return n


class SnapshotZipWriter:
    """The zip_file object torch's _save writes into for an asynchronous save
    (deepnvme.save(blocking=False)): the pickle and small records are kept as bytes, each
    storage is copied into `staged` (a deepnvme.staging.Staged) at the same offset within its
    page as the storage, so the archive replayed later into a TorchZipWriter has the layout of a
    blocking save's. Has every method of TorchZipWriter that torch's _save calls
    (_check_signatures checks both)."""

    def __init__(self, staged):
        self._staged = staged
        self._records = []  # (name, bytes or staged address or None for metadata only, nbytes)

    def write_record(self, name, data, nbytes):
        if isinstance(data, str):
            data = data.encode()
        if isinstance(data, (bytes, bytearray, memoryview)):
            self._records.append((name, bytes(data), nbytes))
            return
        address = data if isinstance(data, int) else data.data_ptr()
        self._records.append((name, self._staged.copy_bytes(address, nbytes) if nbytes else b"",
                              nbytes))

    def write_record_metadata(self, name, nbytes):
        self._records.append((name, None, nbytes))

    def replay(self, writer):
        for name, data, nbytes in self._records:
            if data is None:
                writer.write_record_metadata(name, nbytes)
            else:
                writer.write_record(name, data, nbytes)


def _pwritev_all(fd, parts, offset, path):
    """os.pwritev of `parts` (memoryviews of 1-byte items) at `offset`, continued after a short
    write."""
    while parts:
        n = os.pwritev(fd, parts, offset)
        if n == 0:
            raise OSError(errno.EIO, "pwritev wrote nothing at offset %d" % offset, path)
        offset += n
        while parts and n >= len(parts[0]):
            n -= len(parts[0])
            parts = parts[1:]
        if parts and n:
            parts = [parts[0][n:]] + parts[1:]


class TorchZipReader:
    """The zip_file object torch.serialization._load reads from: records by name, storages read
    into fresh memory by `handle` (through an engine FileRef, so threads may share the
    handle), CRC-32 checked unless verify=False. torch's own reader does not check CRCs; records
    whose stored CRC is 0 (torch.serialization.set_crc32_options(False)) are not checked.

    Storages of at least AHEAD_MIN bytes are read ahead by one thread of the reader's (see the
    module comment), at most READ_AHEAD bytes beyond what torch has taken; its errors reach the
    caller when torch asks for that record (a record never asked for does not fail the load).
    The reader's methods are for one thread (torch's); close() stops the read-ahead."""

    READ_AHEAD = 512 << 20
    AHEAD_MIN = 1 << 20
    IMAGE_MAX = 1 << 20  # an embedded archive below this is read whole, with one pread

    def __init__(self, path, handle, verify=True, embedded=None):
        """embedded=(fd, file, base, length): the archive is bytes [base, base + length) of the
        caller's open file (fd, and the engine File adopting it), which stays the caller's."""
        import zipfile  # parses the central directory only
        self.path = path
        self._verify = verify
        self._owns_fd = embedded is None
        self._image = None  # a small embedded archive's bytes: every read is served from them
        if embedded is None:
            self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            base, length = 0, None
        else:
            self._fd, self._file, base, length = embedded
        self._base = base
        self.targets = {}  # record name -> a tensor to read it into (get_storage_from_record)
        try:
            if embedded is None:
                self._file = _C.File(handle._h, self._fd, False)
                f = open(self._fd, "rb", closefd=False)
            elif length < self.IMAGE_MAX:
                # A small tensor's archive (DCP keeps thousands): one read, not one per header.
                self._image = _pread_all(self._fd, length, base, path)
                f = io.BytesIO(self._image)
            else:
                f = _FileView(self._fd, path, base, length)
            with f:
                infos = zipfile.ZipFile(f).infolist()
            self._records = {}
            for info in infos:
                if info.compress_type != zipfile.ZIP_STORED:
                    raise ValueError("'%s': record %s is compressed; torch's records are stored" %
                                     (path, info.filename))
                local = self._pread(_LOCAL.size, base + info.header_offset)
                sig, *_, name_len, extra_len = _LOCAL.unpack(local)
                if sig != 0x04034B50:
                    raise ValueError("'%s': no local header at %d" %
                                     (path, base + info.header_offset))
                at = base + info.header_offset + _LOCAL.size + name_len + extra_len
                if length is not None and at + info.file_size > base + length:
                    raise ValueError("'%s': record %s ends beyond its archive [%d, %d)" %
                                     (path, info.filename, base, base + length))
                key = info.filename.split("/", 1)[1] if "/" in info.filename else info.filename
                self._records[key] = (at, info.file_size, info.CRC)
        except BaseException:
            if self._owns_fd:
                os.close(self._fd)
            raise
        # Read-ahead state, guarded by _cv: name -> "claimed" (being read by whoever claimed it)
        # or ("done", memory, shift, error); _ahead_bytes: read ahead and not yet taken.
        self._cv = threading.Condition()
        self._ahead = {}
        self._ahead_bytes = 0
        self._stop = False
        self._thread = None
        self.read_ahead_records = 0  # records torch got from the read-ahead (tests, stats)

    def close(self):
        self._stop_read_ahead()
        self._file = None
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            if self._owns_fd:
                os.close(fd)  # may raise: under `dnvme run` a write-behind error arrives here

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _pread(self, nbytes, offset):
        """nbytes at file offset `offset`: from the image of a small archive, else by pread."""
        if self._image is None:
            return _pread_all(self._fd, nbytes, offset, self.path)
        start = offset - self._base
        if start < 0 or start + nbytes > len(self._image):
            raise OSError(errno.ENODATA, "'%s': %d bytes at %d lie outside the archive" %
                          (self.path, nbytes, offset), self.path)
        return self._image[start:start + nbytes]

    def _read_into(self, address, nbytes, offset):
        """A record's bytes into memory at `address`: the engine's O_DIRECT requests, or a copy
        from the image of a small archive."""
        if self._image is None:
            self._file.pread(address, nbytes, offset)
        else:
            ctypes.memmove(address, self._pread(nbytes, offset), nbytes)

    def _record(self, name):
        try:
            return self._records[name]
        except KeyError:
            raise KeyError("'%s' has no record %r" % (self.path, name)) from None

    def _check(self, name, data, crc):
        if self._verify and crc != 0 and _C.crc32(data) != crc:
            raise OSError(errno.EIO, "'%s': record %s fails its CRC-32 check (the file is "
                          "damaged)" % (self.path, name), self.path)

    def _read_storage(self, name, at, size, crc):
        """(memory, shift): the record read into fresh memory and checked. The memory starts as
        far into its page as the record into its file page, so the engine reads every whole
        page O_DIRECT into it, with no bounce copy (records of torch.save's own files are
        64-byte aligned; save() writes them that way too)."""
        shift = _page_residue(at)
        memory = _C.HostBuffer(size + shift, False)
        self._read_into(memory.address + shift, size, at)
        self._check(name, memoryview(memory)[shift:], crc)
        return memory, shift

    # --- the read-ahead thread ------------------------------------------------------------------
    @staticmethod
    def _ask_order(name, at):
        """Where torch asks for record `name`: its storage key's number (data/KEY) when it is
        one, else its place in the file."""
        key = name.rsplit("/", 1)[-1]
        return (0, int(key), at) if name.startswith("data/") and key.isdigit() else (1, 0, at)

    def _start_read_ahead(self):
        plan = sorted((self._ask_order(name, at), name, at, size, crc)
                      for name, (at, size, crc) in self._records.items()
                      if size >= self.AHEAD_MIN)
        if len(plan) < 2:
            self._thread = False  # nothing to overlap
            return
        self._thread = threading.Thread(target=self._read_ahead, args=(plan,), daemon=True,
                                        name="deepnvme-load-ahead")
        self._thread.start()

    def _read_ahead(self, plan):
        # States in self._ahead: "ahead" (this thread reads it), "here" (the asking thread
        # does), "taken", or ("done", memory, shift, error) waiting to be taken.
        for _, name, at, size, crc in plan:
            with self._cv:
                # Room in the window (always for one record, whatever its size).
                self._cv.wait_for(lambda: self._stop or self._ahead_bytes == 0 or
                                  self._ahead_bytes + size <= self.READ_AHEAD)
                if self._stop:
                    return
                if name in self._ahead:
                    continue  # torch asked for it first: the asking thread reads it
                self._ahead[name] = "ahead"
            memory = shift = error = None
            try:
                memory, shift = self._read_storage(name, at, size, crc)
            except BaseException as e:  # the asking thread reads it again, and reports that
                error = e
            with self._cv:
                self._ahead[name] = ("done", memory, shift, error)
                self._ahead_bytes += size
                self._cv.notify_all()

    def _stop_read_ahead(self):
        thread = self._thread
        if not thread:
            return
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        try:
            thread.join()
        finally:
            while thread.is_alive():  # (interrupted: the file must outlive the thread's read)
                thread.join(1.0)
            self._thread = None
            self._ahead.clear()

    def _take(self, name, at, size, crc):
        """The record's (memory, shift): from the read-ahead when it has read it (waiting while it
        is reading it), else read here."""
        if self._thread is None:
            self._start_read_ahead()
        with self._cv:
            if self._ahead.get(name) == "ahead":
                self._cv.wait_for(lambda: self._ahead[name] != "ahead")
            state = self._ahead.get(name)
            if isinstance(state, tuple):
                _, memory, shift, error = state
                self._ahead[name] = "taken"
                self._ahead_bytes -= size
                self._cv.notify_all()
                if error is None:
                    self.read_ahead_records += 1
                    return memory, shift
                # Read again here: a transient failure (memory the read-ahead itself held, say)
                # may not repeat, and a real one is reported by this read.
            else:
                self._ahead[name] = "here"  # the read-ahead thread skips it
        try:
            return self._read_storage(name, at, size, crc)
        finally:
            with self._cv:
                self._ahead[name] = "taken"

    # --- what torch.serialization._load calls ------------------------------------------------
    def has_record(self, name):
        return name in self._records

    def get_all_records(self):
        return list(self._records)

    def get_record_offset(self, name):
        return self._record(name)[0]

    def serialization_id(self):
        if ".data/serialization_id" in self._records:
            return self.get_record(".data/serialization_id").decode()
        return ""

    def get_record(self, name):
        at, size, crc = self._record(name)
        data = self._pread(size, at)
        self._check(name, data, crc)
        return data

    def get_storage_from_record(self, name, numel, storage_type):
        """A uint8 tensor of the record's bytes in fresh memory, or in the memory of
        targets[name] (a contiguous CPU tensor whose whole storage is the record's size: the
        tensor torch builds then shares it)."""
        torch = sys.modules["torch"]
        at, size, crc = self._record(name)
        if size == 0:
            return torch.empty(0, dtype=torch.uint8)
        target = self.targets.get(name)
        if target is not None and target.untyped_storage().nbytes() == size:
            storage = target.untyped_storage()
            self._read_into(storage.data_ptr(), size, at)
            whole = torch.empty(0, dtype=torch.uint8).set_(storage)
            self._check(name, memoryview(whole.numpy()), crc)
            return whole
        if size >= self.AHEAD_MIN:
            memory, shift = self._take(name, at, size, crc)
        else:
            memory, shift = self._read_storage(name, at, size, crc)
        return torch.frombuffer(memory, dtype=torch.uint8, count=size, offset=shift)


__all__ = ["TorchZipWriter", "EmbeddedZipWriter", "SnapshotZipWriter", "TorchZipReader",
           "supported"]
