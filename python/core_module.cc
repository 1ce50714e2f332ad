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
//   HostBuffer  page-aligned host memory, page-locked (pinned) or not, exported through the
//               buffer protocol so torch.frombuffer / numpy.frombuffer view it without a copy.
//   FastWriter  dnvme::FastWriter (include/dnvme/fast_writer.h) as a write-only binary stream.
//
// Thread safety: an AioHandle (and a FastWriter) is used by one Python thread at a time, as
// DeepSpeed's aio_handle is; concurrent use from several threads is the caller's bug (the engine
// does not synchronise submission against wait). HostBuffer is immutable after creation.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "dnvme/config.h"
#include "dnvme/fast_writer.h"
#include "dnvme/handle.h"
#include "dnvme/pinned.h"
#include "dnvme/status.h"

namespace py = pybind11;

namespace {

// An I/O failure on its way to Python (thrown with the GIL released, translated with it held).
struct IoFailure {
  int err;
  std::string message;
  std::string path;
  int64_t offset;
};

[[noreturn]] void ThrowStatus(const dnvme::Status& st, const std::string& path, int64_t offset) {
  throw IoFailure{st.error_number(), st.message(), path, offset};
}

void* ToPointer(uintptr_t address) { return reinterpret_cast<void*>(address); }

class PyAioHandle {
 public:
  PyAioHandle(int64_t block_size, int queue_depth, bool single_submit, bool overlap_events,
              int intra_op_parallelism) {
    dnvme::HandleConfig config;
    config.block_size = block_size;
    config.queue_depth = queue_depth;
    config.single_submit = single_submit;
    config.overlap_events = overlap_events;
    config.intra_op_parallelism = intra_op_parallelism;
    // A bad value is the caller's mistake: ValueError naming the key, never an abort.
    if (dnvme::Status st = config.Validate(); !st.ok()) throw py::value_error(st.message());
    auto handle = dnvme::AioHandle::Create(config);
    if (!handle.ok()) ThrowStatus(handle.status(), "", -1);
    handle_ = std::move(handle).value();
  }

  dnvme::AioHandle* get() { return handle_.get(); }
  int64_t block_size() const { return handle_->get_block_size(); }
  int queue_depth() const { return handle_->get_queue_depth(); }
  bool single_submit() const { return handle_->get_single_submit(); }
  bool overlap_events() const { return handle_->get_overlap_events(); }
  int intra_op_parallelism() const { return handle_->get_intra_op_parallelism(); }

  // DeepSpeed's return values: a synchronous operation returns 1 (the operations it completed),
  // an asynchronous one 0 (wait() counts it).
  int pread(uintptr_t address, int64_t num_bytes, const std::string& path, bool validate,
            bool async_op, int64_t file_offset) {
    dnvme::Status st =
        handle_->pread(ToPointer(address), num_bytes, path, validate, async_op, file_offset);
    if (!st.ok()) ThrowStatus(st, path, file_offset);
    return async_op ? 0 : 1;
  }
  int pwrite(uintptr_t address, int64_t num_bytes, const std::string& path, bool validate,
             bool async_op, int64_t file_offset) {
    dnvme::Status st =
        handle_->pwrite(ToPointer(address), num_bytes, path, validate, async_op, file_offset);
    if (!st.ok()) ThrowStatus(st, path, file_offset);
    return async_op ? 0 : 1;
  }

  // Waits for every queued operation. Returns how many completed; when any failed, raises for the
  // first failure (all of them have finished by then, so the handle is idle and reusable).
  int wait() {
    const int n = handle_->wait();
    int failed = 0;
    const dnvme::OpResult* first = nullptr;
    for (const dnvme::OpResult& r : handle_->completed()) {
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
      throw IoFailure{first->status.error_number(), msg, first->path,
                      first->error_offset >= 0 ? first->error_offset : first->file_offset};
    }
    return n;
  }
  int pending() const { return handle_->pending(); }

  void fsync(const std::string& path) {
    dnvme::Status st = handle_->fsync(path);
    if (!st.ok()) ThrowStatus(st, path, -1);
  }

  std::string stats_json() const { return handle_->stats().ToJson(); }

 private:
  std::unique_ptr<dnvme::AioHandle> handle_;
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
  PyFastWriter(PyAioHandle& handle, const std::string& path, size_t buffer_bytes, int num_buffers,
               bool truncate, bool fsync_on_close, int64_t stripe_bytes, int stripe_count,
               int stripe_index, BufferPool* pool)
      : path_(path) {
    dnvme::FastWriterOptions o;
    o.pool = pool != nullptr ? pool->get() : nullptr;
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

  py::class_<PyAioHandle>(m, "AioHandle")
      .def(py::init<int64_t, int, bool, bool, int>(), py::arg("block_size"), py::arg("queue_depth"),
           py::arg("single_submit"), py::arg("overlap_events"), py::arg("intra_op_parallelism"))
      .def("get_block_size", &PyAioHandle::block_size)
      .def("get_queue_depth", &PyAioHandle::queue_depth)
      .def("get_single_submit", &PyAioHandle::single_submit)
      .def("get_overlap_events", &PyAioHandle::overlap_events)
      .def("get_intra_op_parallelism", &PyAioHandle::intra_op_parallelism)
      .def("pread", &PyAioHandle::pread, py::call_guard<py::gil_scoped_release>())
      .def("pwrite", &PyAioHandle::pwrite, py::call_guard<py::gil_scoped_release>())
      .def("wait", &PyAioHandle::wait, py::call_guard<py::gil_scoped_release>())
      .def("pending", &PyAioHandle::pending)
      .def("fsync", &PyAioHandle::fsync, py::call_guard<py::gil_scoped_release>())
      .def("stats_json", &PyAioHandle::stats_json);

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
                    BufferPool*>(),
           py::arg("handle"), py::arg("path"), py::arg("buffer_bytes"), py::arg("num_buffers"),
           py::arg("truncate"), py::arg("fsync_on_close"), py::arg("stripe_bytes"),
           py::arg("stripe_count"), py::arg("stripe_index"), py::arg("pool").none(true),
           py::keep_alive<1, 2>(), py::keep_alive<1, 11>())
      .def("write", &PyFastWriter::write)
      .def("close", &PyFastWriter::close)
      .def("abort", &PyFastWriter::abort)
      .def("tell", &PyFastWriter::position)
      .def_property_readonly("bytes_stored", &PyFastWriter::bytes_stored)
      .def_property_readonly("closed", &PyFastWriter::closed);

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
  m.def("memlock_limit_bytes", &dnvme::MemlockLimitBytes);
}
