// Status and Result<T>: how every dnvme layer reports failure.
//
// A Status is either OK or carries a code, the errno that caused it (0 when the error is not a
// syscall's), and a human-readable message that already names the path and file offset involved.
// errno is turned into a Status exactly once, at the syscall (see Status::FromErrno); above that,
// statuses are passed up unchanged or wrapped with more context. Only the FUSE edge and the
// C/Python bindings turn a Status back into an errno or an exception.
//
// Thread safety: Status and Result<T> are values; distinct objects may be used from distinct
// threads freely, and const access to one object from several threads is safe.
#pragma once

#include <cerrno>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace dnvme {

class [[nodiscard]] Status {
 public:
  enum class Code : int {
    kOk = 0,
    kInvalidArgument,    // the caller's input is wrong (size, alignment, flag, config key)
    kNotFound,           // a path or id that does not exist
    kIoError,            // a syscall or a completion failed; errno() says how
    kEndOfFile,          // a read asked for bytes past the end of the file
    kNoSpace,            // ENOSPC / EDQUOT from a write
    kResourceExhausted,  // RLIMIT_MEMLOCK, aio-max-nr, pool limits
    kUnsupported,        // e.g. O_DIRECT refused with direct=required
    kDataMismatch,       // validate=true found different bytes on disk
    kInternal,           // a broken invariant; a bug in dnvme
  };

  Status() = default;  // OK

  static Status Ok() { return Status(); }
  static Status InvalidArgument(std::string msg) {
    return Status(Code::kInvalidArgument, EINVAL, std::move(msg));
  }
  static Status NotFound(std::string msg) {
    return Status(Code::kNotFound, ENOENT, std::move(msg));
  }
  static Status IoError(int err, std::string msg) {
    return Status(Code::kIoError, err, std::move(msg));
  }
  static Status EndOfFile(std::string msg) {
    return Status(Code::kEndOfFile, ENODATA, std::move(msg));
  }
  static Status ResourceExhausted(int err, std::string msg) {
    return Status(Code::kResourceExhausted, err, std::move(msg));
  }
  static Status Unsupported(int err, std::string msg) {
    return Status(Code::kUnsupported, err, std::move(msg));
  }
  static Status DataMismatch(std::string msg) {
    return Status(Code::kDataMismatch, EIO, std::move(msg));
  }
  static Status Internal(std::string msg) {
    return Status(Code::kInternal, EFAULT, std::move(msg));
  }

  // The one place errno becomes a Status: picks the code from the errno (ENOENT -> kNotFound,
  // ENOSPC/EDQUOT -> kNoSpace, EINVAL -> kInvalidArgument, everything else -> kIoError) and formats
  // "<context>: <strerror> (errno N)".
  static Status FromErrno(int err, std::string_view context);

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  // The errno behind the failure; 0 for OK. Never 0 for an error (a non-syscall error carries the
  // closest errno, e.g. EINVAL for kInvalidArgument) so the FUSE edge can always answer with it.
  int error_number() const { return errno_; }
  // The errno to hand out where dnvme meets errno (a FUSE reply, a control-file answer, the
  // broker's wire, -errno from the C API): 0 for OK, else error_number(), or `fallback` when the
  // error carries none (a Status built by hand with errno 0). EIO by default because a failure
  // must never read as success (0) and EIO is what the kernel itself answers for an I/O it could
  // not do for a reason it cannot name; callers refusing on a permission check pass EPERM.
  int ErrnoOr(int fallback = EIO) const {
    if (ok()) return 0;
    return errno_ != 0 ? errno_ : fallback;
  }
  const std::string& message() const { return message_; }

  // "OK" or "<CodeName>: <message>".
  std::string ToString() const;
  static const char* CodeName(Code code);

  // Returns a copy whose message is "<prefix>: <message>"; OK stays OK.
  Status WithContext(std::string_view prefix) const;

 private:
  Status(Code code, int err, std::string msg)
      : code_(code), errno_(err), message_(std::move(msg)) {}

  Code code_ = Code::kOk;
  int errno_ = 0;
  std::string message_;
};

// Result<T>: a T or a non-OK Status (like absl::StatusOr). Accessing value() of an error is a bug
// and aborts (it is an invariant, never an I/O outcome).
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}         // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {  // NOLINT: implicit by design
    if (status_.ok()) status_ = Status::Internal("Result constructed from an OK status");
  }

  bool ok() const { return value_.has_value(); }
  const Status& status() const { return status_; }

  T& value() & { return CheckedValue(); }
  const T& value() const& { return const_cast<Result*>(this)->CheckedValue(); }
  T&& value() && { return std::move(CheckedValue()); }
  T* operator->() { return &CheckedValue(); }
  const T* operator->() const { return &const_cast<Result*>(this)->CheckedValue(); }
  T& operator*() & { return CheckedValue(); }

 private:
  T& CheckedValue();

  std::optional<T> value_;
  Status status_;
};

[[noreturn]] void DieOnBadResultAccess(const Status& status);

template <typename T>
T& Result<T>::CheckedValue() {
  if (!value_.has_value()) DieOnBadResultAccess(status_);
  return *value_;
}

}  // namespace dnvme

// Early-return helpers, used inside functions that return Status or Result<T>.
#define DNVME_CONCAT_INNER(a, b) a##b
#define DNVME_CONCAT(a, b) DNVME_CONCAT_INNER(a, b)

#define DNVME_RETURN_IF_ERROR(expr)        \
  do {                                     \
    ::dnvme::Status _dnvme_st = (expr);    \
    if (!_dnvme_st.ok()) return _dnvme_st; \
  } while (0)

#define DNVME_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.ok()) return tmp.status();               \
  lhs = std::move(tmp).value()

#define DNVME_ASSIGN_OR_RETURN(lhs, expr) \
  DNVME_ASSIGN_OR_RETURN_IMPL(DNVME_CONCAT(_dnvme_res_, __LINE__), lhs, expr)
