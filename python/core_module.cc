// deepnvme._C: the native half of the Python package `deepnvme` (python/deepnvme/).
//
// It knows nothing of torch or numpy: the Python half turns a tensor, an ndarray or any buffer
// into (address, byte count), checks device, contiguity and writability, and keeps the object
// alive while an asynchronous operation uses it. This half runs the engine with the GIL released
// (so other Python threads, a training loop, run during I/O) and turns every failure into OSError
// (errno, message, path) with an `offset` attribute: never an abort.
//
//   AioHandle   dnvme::AioHandle with DeepSpeed's construction arguments; pread/pwrite on
//               addresses, wait, fsync, stats.
//   GdsHandle   dnvme::GdsHandle (include/dnvme/gds_handle.h): the same calls for device or host
//               addresses, plus the data path (mode), pin/unpin of device ranges and pinned
//               device buffers.
//   DeviceBuffer  device memory from GdsHandle.new_pinned_device_buffer, exported through
//               __cuda_array_interface__ so torch.as_tensor(buf, device="cuda") / cupy view it.
//   HostBuffer  page-aligned host memory, page-locked (pinned) or not, exported through the
//               buffer protocol so torch.frombuffer / numpy.frombuffer view it without a copy.
//   FastWriter  dnvme::FastWriter (include/dnvme/fast_writer.h) as a write-only binary stream.
//   CtlClient   dnvme::CtlClient (include/dnvme/client.h), the session under deepnvme.Mount
//               (ctl_client.cc).
//
// CUDA is touched only by the GPU calls (GdsHandle, export_cuda_ipc, cuda_unavailable_reason):
// importing the module or moving host memory never initialises it, so a process that only uses
// host memory may still fork.
//
// Thread safety: an AioHandle, a GdsHandle (and a FastWriter) is used by one Python thread at a
// time, as DeepSpeed's handles are; concurrent use from several threads is the caller's bug (the
// engine does not synchronise submission against wait). HostBuffer is immutable after creation;
// a DeviceBuffer changes only when freed.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "dnvme/config.h"
#include "dnvme/crc32.h"
#include "dnvme/fast_writer.h"
#include "dnvme/gds_handle.h"
#include "dnvme/gpu.h"
#include "dnvme/handle.h"
#include "dnvme/pinned.h"
#include "dnvme/status.h"
#include "python/module.h"

namespace py = pybind11;

namespace {

using dnvme::python::IoFailure;
using dnvme::python::ThrowStatus;

void* ToPointer(uintptr_t address) { return reinterpret_cast<void*>(address); }

dnvme::HandleConfig MakeConfig(int64_t block_size, int queue_depth, bool single_submit,
                               bool overlap_events, int intra_op_parallelism) {
  dnvme::HandleConfig config;
  config.block_size = block_size;
  config.queue_depth = queue_depth;
  config.single_submit = single_submit;
  config.overlap_events = overlap_events;
  config.intra_op_parallelism = intra_op_parallelism;
  // A bad value is the caller's mistake: ValueError naming the key, never an abort.
  if (dnvme::Status st = config.Validate(); !st.ok()) throw py::value_error(st.message());
  return config;
}

// DeepSpeed's return values: a synchronous operation returns 1 (the operations it completed), an
// asynchronous one 0 (wait() counts it). Called with the GIL released.
// `File` is the path or the caller's open fd (DeepSpeed's async_pwrite(buffer, fd, offset)); the
// caller keeps an fd open until the operation is over (the call returned, or wait() for async).
template <class Handle, class File>
int Transfer(Handle& h, bool read, uintptr_t address, int64_t num_bytes, const File& file,
             bool validate, bool async_op, int64_t file_offset) {
  dnvme::Status st =
      read ? h.pread(ToPointer(address), num_bytes, file, validate, async_op, file_offset)
           : h.pwrite(ToPointer(address), num_bytes, file, validate, async_op, file_offset);
  if (!st.ok()) {
    if constexpr (std::is_same_v<File, int>) {
      ThrowStatus(st, "", file_offset);
    } else {
      ThrowStatus(st, file, file_offset);
    }
  }
  return async_op ? 0 : 1;
}

// Waits for every queued operation. Returns how many completed; when any failed, raises for the
// first failure (all of them have finished by then, so the handle is idle and reusable). Called
// with the GIL released.
template <class Handle>
int WaitAndRaise(Handle& h) {
  const int n = h.wait();
  int failed = 0;
  const dnvme::OpResult* first = nullptr;
  for (const dnvme::OpResult& r : h.completed()) {
    if (r.status.ok()) continue;
    ++failed;
    if (first == nullptr) first = &r;
  }
  if (first != nullptr) {
    std::string msg = first->status.message();
    if (failed > 1) {
      msg += " (" + std::to_string(failed) + " of " + std::to_string(n) +
             " operations failed; this is the first)";
    }
    throw IoFailure{first->status.ErrnoOr(), msg, first->path,
                    first->error_offset >= 0 ? first->error_offset : first->file_offset};
  }
  return n;
}

// Waits like WaitAndRaise but raises nothing: [(ok, errno, message, path, offset)] for every
// operation, in submission order. The Python half merges the lists of two engines (an aio_handle
// that moved host and CUDA buffers) in its own submission order before raising.
template <class Handle>
py::list WaitResults(Handle& h) {
  {
    py::gil_scoped_release release;
    h.wait();
  }
  py::list out;
  for (const dnvme::OpResult& r : h.completed()) {
    out.append(py::make_tuple(r.status.ok(), r.status.ErrnoOr(), r.status.message(), r.path,
                              r.error_offset >= 0 ? r.error_offset : r.file_offset));
  }
  return out;
}

// What aio_handle and gds_handle share: DeepSpeed's getters, pread/pwrite, wait, fsync and the
// stats, forwarded to the engine handle (AioHandle or GdsHandle, the same API).
template <class Handle>
class PyHandle {
 public:
  int64_t block_size() const { return handle_->get_block_size(); }
  int queue_depth() const { return handle_->get_queue_depth(); }
  bool single_submit() const { return handle_->get_single_submit(); }
  bool overlap_events() const { return handle_->get_overlap_events(); }
  int intra_op_parallelism() const { return handle_->get_intra_op_parallelism(); }

  int pread(uintptr_t address, int64_t num_bytes, const std::string& path, bool validate,
            bool async_op, int64_t file_offset) {
    return Transfer(*handle_, true, address, num_bytes, path, validate, async_op, file_offset);
  }
  int pwrite(uintptr_t address, int64_t num_bytes, const std::string& path, bool validate,
             bool async_op, int64_t file_offset) {
    return Transfer(*handle_, false, address, num_bytes, path, validate, async_op, file_offset);
  }
  int pread_fd(uintptr_t address, int64_t num_bytes, int fd, bool validate, bool async_op,
               int64_t file_offset) {
    return Transfer(*handle_, true, address, num_bytes, fd, validate, async_op, file_offset);
  }
  int pwrite_fd(uintptr_t address, int64_t num_bytes, int fd, bool validate, bool async_op,
                int64_t file_offset) {
    return Transfer(*handle_, false, address, num_bytes, fd, validate, async_op, file_offset);
  }
  int wait() { return WaitAndRaise(*handle_); }
  py::list wait_results() { return WaitResults(*handle_); }
  int pending() const { return handle_->pending(); }

  void fsync(const std::string& path) {
    dnvme::Status st = handle_->fsync(path);
    if (!st.ok()) ThrowStatus(st, path, -1);
  }

  std::string stats_json() const { return handle_->stats().ToJson(); }

 protected:
  std::unique_ptr<Handle> handle_;
};

class PyAioHandle : public PyHandle<dnvme::AioHandle> {
 public:
  PyAioHandle(int64_t block_size, int queue_depth, bool single_submit, bool overlap_events,
              int intra_op_parallelism) {
    const dnvme::HandleConfig config =
        MakeConfig(block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism);
    auto handle = dnvme::AioHandle::Create(config);
    if (!handle.ok()) ThrowStatus(handle.status(), "", -1);
    handle_ = std::move(handle).value();
  }

  dnvme::AioHandle* get() { return handle_.get(); }
};

// A caller's open fd adopted by an AioHandle (dnvme::FileRef): synchronous transfers that, unlike
// the handle's own calls, may run from several threads at once (the checkpoint writer moves one
// record from a helper thread while its own thread computes the CRC; save/load share one default
// handle across the program's threads). The caller keeps its fd open while this object is used.
class PyFile {
 public:
  PyFile(PyAioHandle& handle, int fd, bool writable) : handle_(handle.get()) {
    auto file =
        handle_->adopt_fd(fd, writable ? dnvme::FileAccess::kWrite : dnvme::FileAccess::kRead);
    if (!file.ok()) ThrowStatus(file.status(), "", -1);
    file_ = std::move(file).value();
  }
  void pread(uintptr_t address, int64_t num_bytes, int64_t offset) {
    dnvme::Status st = handle_->sync_pread(ToPointer(address), num_bytes, file_, offset);
    if (!st.ok()) ThrowStatus(st, file_.label(), offset);
  }
  void pwrite(uintptr_t address, int64_t num_bytes, int64_t offset) {
    dnvme::Status st = handle_->sync_pwrite(ToPointer(address), num_bytes, file_, offset);
    if (!st.ok()) ThrowStatus(st, file_.label(), offset);
  }

 private:
  dnvme::AioHandle* handle_;
  dnvme::FileRef file_;
};

// Device memory from GdsHandle::new_pinned_device_buffer. Freed (and unpinned) when this object
// goes, or earlier by GdsHandle.free_pinned_device_buffer, after which it is empty.
class PyDeviceBuffer {
 public:
  explicit PyDeviceBuffer(dnvme::gpu::DeviceBuffer b) : buffer_(std::move(b)) {}

  uintptr_t address() const { return reinterpret_cast<uintptr_t>(buffer_.data()); }
  size_t nbytes() const { return buffer_.size(); }
  int device() const { return buffer_.device(); }
  bool freed() const { return buffer_.empty(); }
  dnvme::gpu::DeviceBuffer take() { return std::move(buffer_); }

  // Version 3 of the CUDA Array Interface: a 1-D uint8 array over the whole buffer. "stream" is
  // None: the buffer is ready for any stream (see new_pinned_device_buffer).
  py::dict cuda_array_interface() const {
    if (buffer_.empty()) throw py::value_error("this DeviceBuffer was freed");
    py::dict d;
    d["shape"] = py::make_tuple(static_cast<py::ssize_t>(buffer_.size()));
    d["typestr"] = "|u1";
    d["data"] = py::make_tuple(address(), false);
    d["strides"] = py::none();
    d["version"] = 3;
    d["stream"] = py::none();
    return d;
  }

 private:
  dnvme::gpu::DeviceBuffer buffer_;
};

class PyGdsHandle : public PyHandle<dnvme::GdsHandle> {
 public:
  PyGdsHandle(int64_t block_size, int queue_depth, bool single_submit, bool overlap_events,
              int intra_op_parallelism, const std::string& cufile, int device, bool cufile_compat) {
    const dnvme::HandleConfig config =
        MakeConfig(block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism);
    auto policy = dnvme::ParseCuFilePolicy(cufile);
    if (!policy.ok()) throw py::value_error(policy.status().message());
    if (device < 0) throw py::value_error("device must be >= 0, not " + std::to_string(device));
    dnvme::GdsOptions options;
    options.cufile = policy.value();
    options.cufile_compat = cufile_compat;
    options.device = device;
    // CUDA initialisation and cuFile's driver open take a while: let other threads run.
    auto handle = [&] {
      py::gil_scoped_release release;
      return dnvme::GdsHandle::Create(config, std::move(options));
    }();
    if (!handle.ok()) ThrowStatus(handle.status(), "", -1);
    handle_ = std::move(handle).value();
  }

  std::string mode() const { return dnvme::GdsModeName(handle_->mode()); }
  std::string mode_reason() const { return handle_->mode_reason(); }

  // pin/unpin refuse a range that is not device memory, pinned twice or not pinned with
  // ValueError (the caller's mistake); cuFile failures are OSError.
  void pin(uintptr_t address, int64_t num_bytes) {
    dnvme::Status st;
    {
      py::gil_scoped_release release;
      st = handle_->pin_device_buffer(ToPointer(address), num_bytes);
    }
    Raise(st);
  }
  void unpin(uintptr_t address) {
    dnvme::Status st;
    {
      py::gil_scoped_release release;
      st = handle_->unpin_device_buffer(ToPointer(address));
    }
    Raise(st);
  }

  PyDeviceBuffer new_pinned_device_buffer(int64_t num_bytes) {
    if (num_bytes <= 0) throw py::value_error("num_bytes must be positive");
    dnvme::Result<dnvme::gpu::DeviceBuffer> b = [&]() -> dnvme::Result<dnvme::gpu::DeviceBuffer> {
      py::gil_scoped_release release;
      // The engine finishes the zero fill before returning, so the interface can say
      // "stream": None.
      return handle_->new_pinned_device_buffer(num_bytes);
    }();
    if (!b.ok()) ThrowStatus(b.status(), "", -1);
    return PyDeviceBuffer(std::move(b).value());
  }
  // Frees at once: nothing may still use the memory (a tensor viewing it would dangle).
  void free_pinned_device_buffer(PyDeviceBuffer& b) {
    if (b.freed()) throw py::value_error("this DeviceBuffer was already freed");
    dnvme::gpu::DeviceBuffer owned = b.take();
    dnvme::Status st;
    {
      py::gil_scoped_release release;
      st = handle_->free_pinned_device_buffer(std::move(owned));
    }
    if (!st.ok()) ThrowStatus(st, "", -1);
  }

 private:
  static void Raise(const dnvme::Status& st) {
    if (st.ok()) return;
    if (st.code() == dnvme::Status::Code::kInvalidArgument) throw py::value_error(st.message());
    ThrowStatus(st, "", -1);
  }
};

// Page-aligned host memory. Pinned: dnvme::PinnedBuffer (mlock'ed; the refusal names
// RLIMIT_MEMLOCK). Not pinned: plain aligned memory, for O_DIRECT targets that need no locking.
class HostBuffer {
 public:
  HostBuffer(size_t num_bytes, bool pinned) : pinned_(pinned) {
    if (num_bytes == 0) throw py::value_error("HostBuffer: num_bytes must be positive");
    if (pinned) {
      auto b = dnvme::PinnedBuffer::Allocate(num_bytes);
      if (!b.ok()) ThrowStatus(b.status(), "", -1);
      pinned_buffer_ = std::move(b).value();
      data_ = pinned_buffer_.data();
    } else {
      void* p = nullptr;
      const int rc = posix_memalign(&p, 4096, num_bytes);
      if (rc != 0) {
        throw IoFailure{rc, "cannot allocate " + std::to_string(num_bytes) + " bytes", "", -1};
      }
      plain_.reset(p);
      data_ = p;
    }
    size_ = num_bytes;
  }

  void* data() const { return data_; }
  size_t size() const { return size_; }
  bool pinned() const { return pinned_; }

 private:
  struct Free {
    void operator()(void* p) const { std::free(p); }
  };
  bool pinned_;
  dnvme::PinnedBuffer pinned_buffer_;
  std::unique_ptr<void, Free> plain_;
  void* data_ = nullptr;
  size_t size_ = 0;
};

// A C-contiguous view of any buffer-protocol object (writable when asked: a read target);
// released (with the GIL) on scope exit.
class BufferView {
 public:
  explicit BufferView(py::handle obj, bool writable = false) {
    const int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj.ptr(), &view_, flags) != 0) throw py::error_already_set();
  }
  ~BufferView() { PyBuffer_Release(&view_); }
  BufferView(const BufferView&) = delete;
  BufferView& operator=(const BufferView&) = delete;
  const void* data() const { return view_.buf; }
  size_t size() const { return static_cast<size_t>(view_.len); }

 private:
  Py_buffer view_{};
};

// Pinned buffers kept for many FastWriters (pinning costs page faults, zeroing and mlock).
class BufferPool {
 public:
  BufferPool(size_t buffer_bytes, size_t count) {
    auto pool = dnvme::PinnedPool::Create(buffer_bytes, count);
    if (!pool.ok()) ThrowStatus(pool.status(), "", -1);
    pool_ = std::move(pool).value();
  }
  dnvme::PinnedPool* get() { return pool_.get(); }
  size_t buffer_bytes() const { return pool_->buffer_size(); }
  size_t count() const { return pool_->count(); }
  size_t available() const { return pool_->available(); }

 private:
  std::unique_ptr<dnvme::PinnedPool> pool_;
};

class PyFastWriter {
 public:
  // external_address: 0, or the caller's memory for the num_buffers buffers (the Python half keeps
  // the object owning it alive as long as this writer).
  PyFastWriter(PyAioHandle& handle, const std::string& path, size_t buffer_bytes, int num_buffers,
               bool truncate, bool fsync_on_close, int64_t stripe_bytes, int stripe_count,
               int stripe_index, BufferPool* pool, uintptr_t external_address)
      : path_(path) {
    dnvme::FastWriterOptions o;
    o.pool = pool != nullptr ? pool->get() : nullptr;
    o.external = static_cast<char*>(ToPointer(external_address));
    o.buffer_bytes = buffer_bytes;
    o.num_buffers = num_buffers;
    o.truncate = truncate;
    o.fsync_on_close = fsync_on_close;
    o.stripe_bytes = stripe_bytes;
    o.stripe_count = stripe_count;
    o.stripe_index = stripe_index;
    if (dnvme::Status st = o.Validate(); !st.ok()) throw py::value_error(st.message());
    dnvme::Result<std::unique_ptr<dnvme::FastWriter>> w = [&] {
      py::gil_scoped_release release;
      return dnvme::FastWriter::Open(handle.get(), path, o);
    }();
    if (!w.ok()) ThrowStatus(w.status(), path, 0);
    writer_ = std::move(w).value();
  }

  size_t write(py::handle obj) {
    if (!writer_ || writer_->closed())
      throw py::value_error("write to closed file '" + path_ + "'");
    BufferView view(obj);
    const int64_t at = writer_->position();
    dnvme::Status st;
    {
      py::gil_scoped_release release;
      st = writer_->Write(view.data(), view.size());
    }
    if (!st.ok()) ThrowStatus(st, path_, at);
    return view.size();
  }

  void close() {
    if (!writer_ || writer_->closed()) return;
    dnvme::Status st;
    {
      py::gil_scoped_release release;
      st = writer_->Close();
    }
    if (!st.ok()) ThrowStatus(st, path_, writer_->position());
  }

  // Close without raising (for __del__ / abandoned writers); the status is dropped on purpose:
  // the caller is already handling an error.
  void abort() {
    if (!writer_ || writer_->closed()) return;
    py::gil_scoped_release release;
    (void)writer_->Close();
  }

  int64_t position() const { return writer_ ? writer_->position() : 0; }
  int64_t bytes_stored() const { return writer_ ? writer_->bytes_stored() : 0; }
  bool closed() const { return !writer_ || writer_->closed(); }

 private:
  std::string path_;
  std::unique_ptr<dnvme::FastWriter> writer_;
};

}  // namespace

// The methods AioHandle and GdsHandle share (DeepSpeed's aio_handle surface); I/O releases the
// GIL.
template <typename H>
void BindHandleMethods(py::class_<H>& c) {
  c.def("get_block_size", &H::block_size)
      .def("get_queue_depth", &H::queue_depth)
      .def("get_single_submit", &H::single_submit)
      .def("get_overlap_events", &H::overlap_events)
      .def("get_intra_op_parallelism", &H::intra_op_parallelism)
      .def("pread", &H::pread, py::call_guard<py::gil_scoped_release>())
      .def("pwrite", &H::pwrite, py::call_guard<py::gil_scoped_release>())
      .def("pread_fd", &H::pread_fd, py::call_guard<py::gil_scoped_release>())
      .def("pwrite_fd", &H::pwrite_fd, py::call_guard<py::gil_scoped_release>())
      .def("wait", &H::wait, py::call_guard<py::gil_scoped_release>())
      .def("wait_results", &H::wait_results)
      .def("pending", &H::pending)
      .def("fsync", &H::fsync, py::call_guard<py::gil_scoped_release>())
      .def("stats_json", &H::stats_json);
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "deepnvme native core (dnvmefs engine); use the deepnvme package, not this module";

  // OSError(errno, message, path), which Python maps to FileNotFoundError, PermissionError, ...;
  // plus `offset`: the file offset of the failure (-1 when none applies).
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const IoFailure& e) {
      py::object exc = e.path.empty()
                           ? py::reinterpret_steal<py::object>(PyObject_CallFunction(
                                 PyExc_OSError, "is", e.err, e.message.c_str()))
                           : py::reinterpret_steal<py::object>(PyObject_CallFunction(
                                 PyExc_OSError, "iss", e.err, e.message.c_str(), e.path.c_str()));
      if (!exc) return;  // the call itself failed and set an exception
      PyObject_SetAttrString(exc.ptr(), "offset", py::int_(e.offset).ptr());
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });

  py::class_<PyAioHandle> aio(m, "AioHandle");
  aio.def(py::init<int64_t, int, bool, bool, int>(), py::arg("block_size"), py::arg("queue_depth"),
          py::arg("single_submit"), py::arg("overlap_events"), py::arg("intra_op_parallelism"));
  BindHandleMethods(aio);
  // keep_alive: the file keeps its handle alive.
  py::class_<PyFile>(m, "File")
      .def(py::init<PyAioHandle&, int, bool>(), py::arg("handle"), py::arg("fd"),
           py::arg("writable"), py::keep_alive<1, 2>())
      .def("pread", &PyFile::pread, py::call_guard<py::gil_scoped_release>())
      .def("pwrite", &PyFile::pwrite, py::call_guard<py::gil_scoped_release>());

  py::class_<PyDeviceBuffer>(m, "DeviceBuffer")
      .def_property_readonly("address", &PyDeviceBuffer::address)
      .def_property_readonly("nbytes", &PyDeviceBuffer::nbytes)
      .def_property_readonly("device", &PyDeviceBuffer::device)
      .def_property_readonly("freed", &PyDeviceBuffer::freed)
      .def_property_readonly("__cuda_array_interface__", &PyDeviceBuffer::cuda_array_interface);

  py::class_<PyGdsHandle> gds(m, "GdsHandle");
  gds.def(py::init<int64_t, int, bool, bool, int, const std::string&, int, bool>(),
          py::arg("block_size"), py::arg("queue_depth"), py::arg("single_submit"),
          py::arg("overlap_events"), py::arg("intra_op_parallelism"), py::arg("cufile"),
          py::arg("device"), py::arg("cufile_compat"));
  BindHandleMethods(gds);
  gds.def_property_readonly("mode", &PyGdsHandle::mode)
      .def_property_readonly("mode_reason", &PyGdsHandle::mode_reason)
      .def("pin", &PyGdsHandle::pin, py::arg("address"), py::arg("num_bytes"))
      .def("unpin", &PyGdsHandle::unpin, py::arg("address"))
      .def("new_pinned_device_buffer", &PyGdsHandle::new_pinned_device_buffer, py::arg("num_bytes"))
      .def("free_pinned_device_buffer", &PyGdsHandle::free_pinned_device_buffer, py::arg("buffer"));

  py::class_<HostBuffer>(m, "HostBuffer", py::buffer_protocol())
      .def(py::init<size_t, bool>(), py::arg("num_bytes"), py::arg("pinned"))
      .def_buffer([](HostBuffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.size())}, {py::ssize_t{1}});
      })
      .def_property_readonly(
          "address", [](const HostBuffer& b) { return reinterpret_cast<uintptr_t>(b.data()); })
      .def_property_readonly("nbytes", &HostBuffer::size)
      .def_property_readonly("pinned", &HostBuffer::pinned);

  py::class_<BufferPool>(m, "BufferPool")
      .def(py::init<size_t, size_t>(), py::arg("buffer_bytes"), py::arg("count"))
      .def_property_readonly("buffer_bytes", &BufferPool::buffer_bytes)
      .def_property_readonly("count", &BufferPool::count)
      .def_property_readonly("available", &BufferPool::available);

  // keep_alive: the writer keeps its handle and its pool alive.
  py::class_<PyFastWriter>(m, "FastWriter")
      .def(py::init<PyAioHandle&, const std::string&, size_t, int, bool, bool, int64_t, int, int,
                    BufferPool*, uintptr_t>(),
           py::arg("handle"), py::arg("path"), py::arg("buffer_bytes"), py::arg("num_buffers"),
           py::arg("truncate"), py::arg("fsync_on_close"), py::arg("stripe_bytes"),
           py::arg("stripe_count"), py::arg("stripe_index"), py::arg("pool").none(true),
           py::arg("external_address") = 0, py::keep_alive<1, 2>(), py::keep_alive<1, 11>())
      .def("write", &PyFastWriter::write)
      .def("close", &PyFastWriter::close)
      .def("abort", &PyFastWriter::abort)
      .def("tell", &PyFastWriter::position)
      .def_property_readonly("bytes_stored", &PyFastWriter::bytes_stored)
      .def_property_readonly("closed", &PyFastWriter::closed);

  // ValueError naming the key when the HandleConfig values are out of range (checked before a
  // GdsHandle needs a device, so a bad argument is reported as such everywhere).
  m.def(
      "check_handle_config",
      [](int64_t block_size, int queue_depth, bool single_submit, bool overlap_events,
         int intra_op_parallelism) {
        MakeConfig(block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism);
      },
      py::arg("block_size"), py::arg("queue_depth"), py::arg("single_submit"),
      py::arg("overlap_events"), py::arg("intra_op_parallelism"));

  // (address, byte count) of any C-contiguous buffer-protocol object; `writable` asks for a
  // writable one (a read target). The caller keeps the object alive while the address is used.
  m.def(
      "buffer_address",
      [](py::handle obj, bool writable) {
        BufferView view(obj, writable);
        return py::make_tuple(reinterpret_cast<uintptr_t>(view.data()),
                              static_cast<int64_t>(view.size()));
      },
      py::arg("obj"), py::arg("writable"));
  m.def("pinned_bytes_in_use", &dnvme::PinnedBytesInUse);

  // zlib.crc32's result for any C-contiguous buffer, computed with the GIL released (a caller
  // thread checksums a record while another thread's engine call writes it).
  m.def(
      "crc32",
      [](py::handle obj, uint32_t value) {
        BufferView view(obj);
        py::gil_scoped_release release;
        return dnvme::Crc32(value, view.data(), view.size());
      },
      py::arg("data"), py::arg("value") = 0);
  m.def("crc32_implementation", &dnvme::Crc32Implementation);

  // CUDA: whether this build has it, why no device is usable ("" when one is; initialises CUDA),
  // and the IPC export of device memory for the mount's control file.
  m.def("built_with_cuda", &dnvme::gpu::BuiltWithCuda);
  // The device owning `address`; ValueError when it is not CUDA device memory (an object whose
  // __cuda_array_interface__ points at host memory), OSError when CUDA cannot answer.
  m.def(
      "cuda_pointer_device",
      [](uintptr_t address) {
        dnvme::Result<int> device = [&]() -> dnvme::Result<int> {
          py::gil_scoped_release release;
          DNVME_ASSIGN_OR_RETURN(bool is_device, dnvme::gpu::IsDevicePointer(ToPointer(address)));
          if (!is_device) {
            return dnvme::Status::InvalidArgument(
                "the address is not CUDA device memory (cudaPointerGetAttributes)");
          }
          return dnvme::gpu::DeviceOfPointer(ToPointer(address));
        }();
        if (!device.ok()) {
          if (device.status().code() == dnvme::Status::Code::kInvalidArgument) {
            throw py::value_error(device.status().message());
          }
          ThrowStatus(device.status(), "", -1);
        }
        return device.value();
      },
      py::arg("address"));
  m.def("cuda_unavailable_reason", &dnvme::gpu::UnavailableReason,
        py::call_guard<py::gil_scoped_release>());
  m.def(
      "export_cuda_ipc",
      [](uintptr_t address) {
        dnvme::Result<dnvme::gpu::IpcExport> e = [&] {
          py::gil_scoped_release release;
          return dnvme::gpu::ExportIpc(ToPointer(address));
        }();
        if (!e.ok()) {
          if (e.status().code() == dnvme::Status::Code::kInvalidArgument) {
            throw py::value_error(e.status().message());
          }
          ThrowStatus(e.status(), "", -1);
        }
        py::dict d;
        d["handle"] = e.value().handle_hex;
        d["offset"] = e.value().offset;
        d["allocation_size"] = e.value().allocation_size;
        d["device"] = e.value().device;
        return d;
      },
      py::arg("address"));
  m.def("memlock_limit_bytes", &dnvme::MemlockLimitBytes);

  dnvme::python::BindCtlClient(m);
}
