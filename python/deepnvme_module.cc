// The Python module `deepnvme`: DeepSpeed's aio_handle over dnvme::AioHandle.
//
// This first part carries the handle's construction from DeepSpeed's keyword arguments, with
// DeepSpeed's defaults and names, and its getters, so that a configuration written by
// `dnvme tune` is accepted as `aio_handle(**cfg)`. The I/O methods, tensors and the checkpoint
// writer come with the Python package issue.
//
// Thread safety: an aio_handle is used by one Python thread at a time (as DeepSpeed's is).
#include <pybind11/pybind11.h>

#include <memory>
#include <stdexcept>
#include <string>

#include "dnvme/config.h"
#include "dnvme/handle.h"

namespace py = pybind11;

namespace {

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
    if (!handle.ok()) {
      const dnvme::Status& st = handle.status();
      PyErr_SetObject(PyExc_OSError, py::make_tuple(st.error_number(), st.ToString()).ptr());
      throw py::error_already_set();
    }
    handle_ = std::move(handle).value();
  }

  int64_t block_size() const { return handle_->get_block_size(); }
  int queue_depth() const { return handle_->get_queue_depth(); }
  bool single_submit() const { return handle_->get_single_submit(); }
  bool overlap_events() const { return handle_->get_overlap_events(); }
  int intra_op_parallelism() const { return handle_->get_intra_op_parallelism(); }

 private:
  std::unique_ptr<dnvme::AioHandle> handle_;
};

}  // namespace

PYBIND11_MODULE(deepnvme, m) {
  m.doc() = "DeepNVMe-compatible NVMe I/O handles (dnvmefs engine)";
  py::class_<PyAioHandle>(m, "aio_handle")
      .def(py::init<int64_t, int, bool, bool, int>(), py::arg("block_size") = 1048576,
           py::arg("queue_depth") = 128, py::arg("single_submit") = false,
           py::arg("overlap_events") = false, py::arg("intra_op_parallelism") = 1)
      .def("get_block_size", &PyAioHandle::block_size)
      .def("get_queue_depth", &PyAioHandle::queue_depth)
      .def("get_single_submit", &PyAioHandle::single_submit)
      .def("get_overlap_events", &PyAioHandle::overlap_events)
      .def("get_intra_op_parallelism", &PyAioHandle::intra_op_parallelism);
}
