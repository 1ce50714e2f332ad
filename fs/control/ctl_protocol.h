// The request/response protocol of the control file `<mount>/.dnvme/ctl`
// (docs/control-protocol.md).
//
// A request is one JSON object written with one write(); the answer is one JSON object read back
// from the same open file. This file only parses and checks requests and formats answers: it
// touches no file, memory or engine, so the libFuzzer target (tests/fuzz/ctl_request_fuzzer.cc)
// can drive it with arbitrary bytes. Parsing is strict: an unknown op or field, a wrong type, a
// negative or out-of-range number, a path that is absolute-outside-the-mount or has a `..`
// component is an error naming the field, never a silently ignored setting.
//
// Thread safety: free functions over values; no shared state.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "dnvme/config.h"
#include "dnvme/status.h"

namespace dnvme::fs {

// Requests longer than this are refused (E2BIG) before any parsing.
inline constexpr size_t kMaxRequestBytes = 64 * 1024;
// JSON nesting deeper than this is refused (EINVAL) before parsing: no request needs more than 3.
inline constexpr int kMaxRequestDepth = 8;
// Longest path accepted in a request (PATH_MAX).
inline constexpr size_t kMaxPathBytes = 4096;

enum class CtlOp {
  kHello,
  kConfigGet,
  kConfigSet,
  kStats,
  kHandleOpen,
  kHandleClose,
  kBufferRegister,
  kBufferUnregister,
  kPread,
  kPwrite,
  kWait,
  kFsync,
};

// One checked request. Only the fields of its op are meaningful.
struct CtlRequest {
  CtlOp op = CtlOp::kHello;
  std::string
      id_json;  // the request's "id" (an integer or a short string), re-serialised; "" if absent

  // config.set: the JSON object of settings (HandleConfig keys), checked by HandleConfig.
  // handle.open: the handle's settings as a JSON object (may be "{}").
  std::string config_json;

  int64_t handle = -1;  // handle.close, pread, pwrite, wait
  int64_t buffer = -1;  // buffer.unregister, pread, pwrite

  // buffer.register: either `shm` (a name in /dev/shm) or `source` (/dev/shm/NAME or
  // /proc/PID/fd/N), with an optional offset (page multiple) and size (0: to the object's end).
  std::string shm;
  std::string source;
  int64_t region_offset = 0;
  int64_t region_size = 0;
  // ... or `cuda_ipc`: another process's GPU memory (a cudaIpcMemHandle_t as 128 hex digits) on
  // CUDA device `device` (default 0); offset (any byte) and size (0: to the allocation's end)
  // select a range inside the exported allocation.
  std::string cuda_ipc;
  int64_t cuda_device = 0;

  // pread / pwrite / fsync.
  std::string path;  // relative to the mount root, normalised: no leading '/', no '.' parts
  int64_t buffer_offset = 0;
  int64_t length = 0;
  int64_t file_offset = 0;
  bool async = false;
};

// Parses and checks one request. The error's errno is what the answer reports: E2BIG (too long),
// EBADMSG (not JSON, or not one object), EOPNOTSUPP (unknown op), EINVAL (anything else).
// `mountpoint` (absolute) lets a path be given as an absolute path inside the mount.
Result<CtlRequest> ParseCtlRequest(std::string_view text, const std::string& mountpoint);
// ParseCtlRequest's refusal of a request of `bytes` bytes, over kMaxRequestBytes (E2BIG): for a
// request refused by its size alone, whose text need not be kept.
Status CtlTooLarge(size_t bytes);

// The request's "id", re-serialised, when the text is a JSON object with a valid id ("" if not):
// so that even a refused request's answer carries its id.
std::string ExtractCtlId(std::string_view text);

// Checks a path from a request and returns it relative to the mount root ("" is the root itself).
// Accepts "a/b", "/MOUNTPOINT/a/b"; refuses "..", other absolute paths, NUL bytes, ".dnvme".
Result<std::string> NormaliseCtlPath(std::string_view path, const std::string& mountpoint);

// Answers. `id_json` is echoed when not empty; `body_json` is a JSON object whose members are
// merged into the answer (may be "{}").
std::string CtlOkResponse(const std::string& id_json, const std::string& body_json);
std::string CtlErrorResponse(const std::string& id_json, const Status& error);

// The Status an answer reports for `err` (kInvalidArgument for EINVAL, else kIoError with `err`).
Status CtlError(int err, std::string msg);

// "EINVAL" for EINVAL, "E<n>" when the errno has no name.
std::string ErrnoName(int err);

}  // namespace dnvme::fs
