#include "dnvme/status.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace dnvme {

Status Status::FromErrno(int err, std::string_view context) {
  Code code = Code::kIoError;
  switch (err) {
    case ENOENT:
      code = Code::kNotFound;
      break;
    case ENOSPC:
    case EDQUOT:
      code = Code::kNoSpace;
      break;
    case EINVAL:
      code = Code::kInvalidArgument;
      break;
    default:
      break;
  }
  if (err == 0) err = EIO;  // a failure must always carry an errno the FUSE edge can return
  std::string msg(context);
  msg += ": ";
  msg += std::strerror(err);
  msg += " (errno ";
  msg += std::to_string(err);
  msg += ")";
  return Status(code, err, std::move(msg));
}

const char* Status::CodeName(Code code) {
  switch (code) {
    case Code::kOk:
      return "OK";
    case Code::kInvalidArgument:
      return "InvalidArgument";
    case Code::kNotFound:
      return "NotFound";
    case Code::kIoError:
      return "IoError";
    case Code::kEndOfFile:
      return "EndOfFile";
    case Code::kNoSpace:
      return "NoSpace";
    case Code::kResourceExhausted:
      return "ResourceExhausted";
    case Code::kUnsupported:
      return "Unsupported";
    case Code::kDataMismatch:
      return "DataMismatch";
    case Code::kInternal:
      return "Internal";
  }
  return "Unknown";
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string s = CodeName(code_);
  s += ": ";
  s += message_;
  return s;
}

Status Status::WithContext(std::string_view prefix) const {
  if (ok()) return *this;
  std::string msg(prefix);
  msg += ": ";
  msg += message_;
  return Status(code_, errno_, std::move(msg));
}

void DieOnBadResultAccess(const Status& status) {
  std::fprintf(stderr, "dnvme: value() of a failed Result: %s\n", status.ToString().c_str());
  std::abort();
}

}  // namespace dnvme
