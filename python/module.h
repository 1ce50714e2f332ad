// What the files of deepnvme._C share: the way a failure travels to Python, and the functions
// that bind each file's classes into the module (called from PYBIND11_MODULE in core_module.cc).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "dnvme/status.h"

namespace dnvme::python {

// An I/O failure on its way to Python: thrown with or without the GIL, turned into
// OSError(errno, message[, path]) with an `offset` attribute by the module's exception translator
// (core_module.cc) once the GIL is held again.
struct IoFailure {
  int err;
  std::string message;
  std::string path;  // "" when no file applies
  int64_t offset;    // -1 when no offset applies
};

[[noreturn]] inline void ThrowStatus(const Status& st, const std::string& path, int64_t offset) {
  throw IoFailure{st.ErrnoOr(), st.message(), path, offset};
}

// deepnvme._C.CtlClient (ctl_client.cc).
void BindCtlClient(pybind11::module_& m);

}  // namespace dnvme::python
