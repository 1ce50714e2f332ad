// deepnvme._C.CtlClient: the session under deepnvme.Mount (python/deepnvme/mount.py), a thin skin
// over dnvme::CtlClient (include/dnvme/client.h), the project's one client of the control-file
// protocol (docs/control-protocol.md).
//
// Python hands in and gets back plain objects (dicts, lists, ints, str); requests are written and
// answers judged by dnvme::CtlClient alone. The JSON documents the protocol carries as data (the
// configuration, the stats, hello, a raw call) cross as dicts through Python's json module.
//
// Every call that talks to the daemon runs with the GIL released: a transfer, a wait or a
// handle.close can take seconds, and the caller's other threads (a training loop) run meanwhile.
// Failures raise OSError(errno, "<op>: <the daemon's message>") like the rest of _C (so
// PermissionError for EACCES, ...); a session that was closed raises ValueError.
//
// Thread safety: a Mount is meant for one thread at a time (its Python half keeps unsynchronised
// bookkeeping). Since the GIL is released here, a program breaking that rule could interleave two
// requests on one session and hand each the other's answer; a mutex per client serialises them
// instead, and close() waits for a call in flight. Lock order: the GIL is released before the
// mutex is taken and taken again only after the mutex is released, so no thread holds one while
// waiting for the other.
#include <pybind11/pybind11.h>
#include <cstring>  // strerrorname_np

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dnvme/client.h"
#include "dnvme/config.h"
#include "dnvme/status.h"
#include "python/module.h"

namespace py = pybind11;

namespace dnvme::python {
namespace {

template <class T>
T ValueOrThrow(Result<T> r) {
  if (!r.ok()) ThrowStatus(r.status(), "", -1);
  return std::move(r).value();
}

void ThrowIfError(const Status& st) {
  if (!st.ok()) ThrowStatus(st, "", -1);
}

// JSON text <-> Python objects. Called with the GIL held.
py::object Loads(const std::string& text) {
  return py::module_::import("json").attr("loads")(py::bytes(text));
}
std::string Dumps(const py::handle& obj) {
  return py::module_::import("json").attr("dumps")(obj).cast<std::string>();
}

// wait's outcome as the daemon wrote it in the answer's "ops" list.
py::dict OutcomeDict(const CtlOpOutcome& o) {
  py::dict d;
  d["op_id"] = o.op_id;
  d["op"] = o.write ? "pwrite" : "pread";
  d["path"] = o.path;
  d["file_offset"] = o.file_offset;
  d["length"] = o.length;
  d["bytes"] = o.bytes;
  d["ok"] = o.status.ok();
  if (!o.status.ok()) {
    const int err = o.status.ErrnoOr();
    const char* name = strerrorname_np(err);
    py::dict e;
    e["code"] = name != nullptr ? std::string(name) : "E" + std::to_string(err);
    e["errno"] = err;
    e["message"] = o.status.message();
    d["error"] = e;
  }
  return d;
}

class PyCtlClient {
 public:
  explicit PyCtlClient(CtlClient client) : client_(std::move(client)) {}

  static std::unique_ptr<PyCtlClient> Open(const std::string& mountpoint) {
    Result<CtlClient> c = [&] {
      py::gil_scoped_release release;
      return CtlClient::Open(mountpoint);
    }();
    return std::make_unique<PyCtlClient>(ValueOrThrow(std::move(c)));
  }
  // Takes the fd (see CtlClient::Adopt); the caller gives up its own hold on it.
  static std::unique_ptr<PyCtlClient> Adopt(int fd) {
    return std::make_unique<PyCtlClient>(CtlClient::Adopt(fd));
  }

  py::object hello() {
    return Loads(ValueOrThrow(Run([](CtlClient& c) { return c.Hello(); })));
  }

  py::object call(const py::object& request) {
    const std::string text = Dumps(request);
    return Loads(ValueOrThrow(Run([&](CtlClient& c) { return c.Call(text); })));
  }

  py::object config() {
    HandleConfig cfg = ValueOrThrow(Run([](CtlClient& c) { return c.ConfigGet(); }));
    return Loads(cfg.ToJson());
  }

  py::object set_config(const py::object& config) {
    const std::string text = Dumps(config);
    HandleConfig cfg = ValueOrThrow(Run([&](CtlClient& c) { return c.ConfigSet(text); }));
    return Loads(cfg.ToJson());
  }

  py::object stats() {
    return Loads(ValueOrThrow(Run([](CtlClient& c) { return c.Stats(); })));
  }

  int64_t open_handle(const py::object& config) {
    const std::string text = Dumps(config);
    return ValueOrThrow(Run([&](CtlClient& c) { return c.OpenHandle(text); }));
  }

  int64_t close_handle(int64_t handle) {
    return ValueOrThrow(Run([&](CtlClient& c) { return c.CloseHandle(handle); }));
  }

  int64_t register_shm(const std::string& name, int64_t offset, int64_t size) {
    return ValueOrThrow(Run([&](CtlClient& c) { return c.RegisterShm(name, offset, size); }));
  }

  py::tuple register_cuda_ipc(const std::string& handle_hex, int device, int64_t offset,
                              int64_t size) {
    CtlBuffer b = ValueOrThrow(
        Run([&](CtlClient& c) { return c.RegisterCudaIpc(handle_hex, device, offset, size); }));
    return py::make_tuple(b.buffer, b.writable);
  }

  void unregister(int64_t buffer) {
    ThrowIfError(Run([&](CtlClient& c) { return c.Unregister(buffer); }));
  }

  int64_t pread(int64_t handle, int64_t buffer, int64_t buffer_offset, int64_t length,
                const std::string& path, int64_t file_offset, bool async) {
    return ValueOrThrow(Run([&](CtlClient& c) {
      return c.Pread(handle, buffer, buffer_offset, length, path, file_offset, async);
    }));
  }

  int64_t pwrite(int64_t handle, int64_t buffer, int64_t buffer_offset, int64_t length,
                 const std::string& path, int64_t file_offset, bool async) {
    return ValueOrThrow(Run([&](CtlClient& c) {
      return c.Pwrite(handle, buffer, buffer_offset, length, path, file_offset, async);
    }));
  }

  // Every outcome since the last wait; when any failed, raises for the first one after
  // collecting all (the handle is idle and reusable by then), naming its file.
  py::list wait(int64_t handle) {
    std::vector<CtlOpOutcome> ops = ValueOrThrow(Run([&](CtlClient& c) { return c.Wait(handle); }));
    for (const CtlOpOutcome& o : ops) {
      if (!o.status.ok()) ThrowStatus(o.status, o.path, -1);
    }
    py::list out;
    for (const CtlOpOutcome& o : ops) out.append(OutcomeDict(o));
    return out;
  }

  void fsync(const std::string& path) {
    ThrowIfError(Run([&](CtlClient& c) { return c.Fsync(path); }));
  }

  // Ends the session: the daemon waits for its transfers in flight, then releases its handles
  // and buffers, so this too runs without the GIL. Closing twice is allowed.
  void close() {
    py::gil_scoped_release release;
    std::lock_guard lock(mu_);
    client_.reset();
  }

  bool closed() {
    py::gil_scoped_release release;
    std::lock_guard lock(mu_);
    return !client_.has_value();
  }

 private:
  // F(client) with the GIL released and the session locked; ValueError once it is closed.
  template <class F>
  auto Run(F&& f) -> decltype(f(std::declval<CtlClient&>())) {
    std::optional<decltype(f(std::declval<CtlClient&>()))> r;
    {
      py::gil_scoped_release release;
      std::lock_guard lock(mu_);
      if (client_.has_value()) r.emplace(f(*client_));
    }
    if (!r.has_value()) throw py::value_error("Mount session is closed");
    return std::move(*r);
  }

  std::mutex mu_;
  std::optional<CtlClient> client_;  // guarded by mu_; empty once closed
};

}  // namespace

void BindCtlClient(py::module_& m) {
  py::class_<PyCtlClient>(m, "CtlClient")
      .def(py::init(&PyCtlClient::Open), py::arg("mountpoint"))
      .def_static("adopt", &PyCtlClient::Adopt, py::arg("fd"))
      .def("hello", &PyCtlClient::hello)
      .def("call", &PyCtlClient::call, py::arg("request"))
      .def("config", &PyCtlClient::config)
      .def("set_config", &PyCtlClient::set_config, py::arg("config"))
      .def("stats", &PyCtlClient::stats)
      .def("open_handle", &PyCtlClient::open_handle, py::arg("config"))
      .def("close_handle", &PyCtlClient::close_handle, py::arg("handle"))
      .def("register_shm", &PyCtlClient::register_shm, py::arg("name"), py::arg("offset"),
           py::arg("size"))
      .def("register_cuda_ipc", &PyCtlClient::register_cuda_ipc, py::arg("handle"),
           py::arg("device"), py::arg("offset"), py::arg("size"))
      .def("unregister", &PyCtlClient::unregister, py::arg("buffer"))
      .def("pread", &PyCtlClient::pread, py::arg("handle"), py::arg("buffer"),
           py::arg("buffer_offset"), py::arg("length"), py::arg("path"), py::arg("file_offset"),
           py::arg("async_op"))
      .def("pwrite", &PyCtlClient::pwrite, py::arg("handle"), py::arg("buffer"),
           py::arg("buffer_offset"), py::arg("length"), py::arg("path"), py::arg("file_offset"),
           py::arg("async_op"))
      .def("wait", &PyCtlClient::wait, py::arg("handle"))
      .def("fsync", &PyCtlClient::fsync, py::arg("path"))
      .def("close", &PyCtlClient::close)
      .def_property_readonly("closed", &PyCtlClient::closed);
}

}  // namespace dnvme::python
