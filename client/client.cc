// The control-file client (include/dnvme/client.h).
#include "dnvme/client.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <nlohmann/json.hpp>
#include <string_view>
#include <utility>
#include <vector>

namespace dnvme {
namespace {

using nlohmann::json;

// The error an answer (or one outcome of a wait) carries; DEFAULT_MESSAGE when it names none.
Status ErrorFromAnswer(const json& a, const char* default_message) {
  int err = EIO;
  std::string msg = default_message;
  if (a.contains("error") && a["error"].is_object()) {
    const json& e = a["error"];
    if (e.contains("errno") && e["errno"].is_number_integer()) err = e["errno"].get<int>();
    if (e.contains("message") && e["message"].is_string()) msg = e["message"].get<std::string>();
  }
  if (err == EINVAL) return Status::InvalidArgument(msg);
  if (err == ENOENT) return Status::NotFound(msg);
  return Status::IoError(err, msg);
}

Result<json> Parse(const std::string& text) {
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return Status::IoError(EPROTO, "the control file answered something that is not a JSON object");
  }
  return j;
}

Result<int64_t> IntField(const json& j, const char* key) {
  if (!j.contains(key) || !j[key].is_number_integer()) {
    return Status::IoError(EPROTO, std::string("the answer has no integer '") + key + "'");
  }
  return j[key].get<int64_t>();
}

// The answer to a request for OP, parsed: "ok": false becomes the daemon's error, named after the
// op so that a caller juggling several requests (or reading a log) sees which one was refused.
Result<json> Answer(const std::string& text, std::string_view op) {
  DNVME_ASSIGN_OR_RETURN(json a, Parse(text));
  if (!a.contains("ok") || !a["ok"].is_boolean()) {
    return Status::IoError(EPROTO, "the control file's answer has no 'ok'");
  }
  if (!a["ok"].get<bool>()) {
    Status st = ErrorFromAnswer(a, "control request failed");
    return op.empty() ? st : st.WithContext(op);
  }
  return a;
}

// The "op" of a raw request, for naming its error ("" when the text does not say).
std::string OpOf(const std::string& request_json) {
  json r = json::parse(request_json, nullptr, false);
  if (r.is_object() && r.contains("op") && r["op"].is_string()) return r["op"].get<std::string>();
  return "";
}

}  // namespace

// ---- SharedBuffer ----

Result<SharedBuffer> SharedBuffer::Create(size_t size, const std::string& name) {
  if (size == 0) return Status::InvalidArgument("a shared buffer needs a size above 0");
  if (name.empty() || name.find('/') != std::string::npos) {
    return Status::InvalidArgument("a shared buffer name is one file name (no '/')");
  }
  // A unique name in /dev/shm, created exclusively and readable by us alone.
  static std::atomic<uint64_t> counter{0};
  SharedBuffer b;
  std::string unique;
  for (int attempt = 0; attempt < 100 && b.fd_ < 0; ++attempt) {
    unique = name + "-" + std::to_string(getpid()) + "-" + std::to_string(counter++);
    b.fd_ = open(("/dev/shm/" + unique).c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW,
                 0600);
    if (b.fd_ < 0 && errno != EEXIST) {
      return Status::FromErrno(errno, "create /dev/shm/" + unique);
    }
  }
  if (b.fd_ < 0) return Status::IoError(EEXIST, "no free name in /dev/shm for " + name);
  b.name_ = unique;
  if (ftruncate(b.fd_, static_cast<off_t>(size)) != 0) {
    return Status::FromErrno(errno, "ftruncate of the shared buffer");
  }
  // Written now (zeroed, like a pinned buffer), so allocated on this process's memory account:
  // the daemon transfers only into pages the client has (it will not fault a hole in on its own
  // account), and a /dev/shm that is full says so here rather than with a SIGBUS later.
  {
    const std::vector<char> zeros(std::min<size_t>(size, size_t{4} << 20), 0);
    for (size_t off = 0; off < size;) {
      const ssize_t n =
          pwrite(b.fd_, zeros.data(), std::min(zeros.size(), size - off), static_cast<off_t>(off));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        return Status::FromErrno(
            n < 0 ? errno : ENOSPC,
            "allocating the shared buffer (" + std::to_string(size) + " bytes in /dev/shm)");
      }
      off += static_cast<size_t>(n);
    }
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, b.fd_, 0);
  if (p == MAP_FAILED) return Status::FromErrno(errno, "mmap of the shared buffer");
  b.data_ = static_cast<char*>(p);
  b.size_ = size;
  return b;
}

SharedBuffer& SharedBuffer::operator=(SharedBuffer&& o) noexcept {
  if (this != &o) {
    this->~SharedBuffer();
    fd_ = std::exchange(o.fd_, -1);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    name_ = std::exchange(o.name_, std::string());
  }
  return *this;
}

SharedBuffer::~SharedBuffer() {
  if (data_ != nullptr) munmap(data_, size_);  // nothing to report to: the mapping is ours
  if (fd_ >= 0) close(fd_);
  // The daemon keeps its own mapping of a registered buffer; the name is only needed to register.
  if (!name_.empty()) unlink(("/dev/shm/" + name_).c_str());
  data_ = nullptr;
  fd_ = -1;
  name_.clear();
}

std::string SharedBuffer::source() const { return "/dev/shm/" + name_; }

// ---- CtlClient ----

Result<CtlClient> CtlClient::Open(const std::string& mountpoint) {
  const std::string path = mountpoint + "/.dnvme/ctl";
  int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    Status st = Status::FromErrno(err, "open " + path);
    return err == ENOENT ? st.WithContext("not a dnvmefs mount (no control file)") : st;
  }
  return Adopt(fd);
}

CtlClient CtlClient::Adopt(int fd) {
  CtlClient c;
  c.fd_ = fd;
  return c;
}

CtlClient& CtlClient::operator=(CtlClient&& o) noexcept {
  if (this != &o) {
    this->~CtlClient();
    fd_ = std::exchange(o.fd_, -1);
  }
  return *this;
}

CtlClient::~CtlClient() {
  if (fd_ >= 0) close(fd_);  // the daemon ends the session (waits for its transfers)
  fd_ = -1;
}

Result<std::string> CtlClient::Send(const std::string& request) {
  if (fd_ < 0) return Status::InvalidArgument("control client is not open");
  // One request is one write(): the daemon answers the write() once the request is queued, and
  // the first read() below once it has run.
  ssize_t n;
  do {
    n = write(fd_, request.data(), request.size());
  } while (n < 0 && errno == EINTR);
  if (n < 0) return Status::FromErrno(errno, "write to the control file");
  if (static_cast<size_t>(n) != request.size()) {
    return Status::IoError(EIO, "short write of a control request (" + std::to_string(n) + " of " +
                                    std::to_string(request.size()) + " bytes)");
  }
  std::string answer;
  char chunk[64 * 1024];
  while (true) {
    ssize_t r = read(fd_, chunk, sizeof(chunk));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return Status::FromErrno(errno, "read from the control file");
    if (r == 0) break;  // the whole answer has been read
    answer.append(chunk, static_cast<size_t>(r));
  }
  return answer;
}

Result<std::string> CtlClient::Call(const std::string& request_json) {
  DNVME_ASSIGN_OR_RETURN(std::string text, Send(request_json));
  DNVME_RETURN_IF_ERROR(Answer(text, OpOf(request_json)).status());
  return text;
}

Result<std::string> CtlClient::Hello() {
  DNVME_ASSIGN_OR_RETURN(std::string text, Send(R"({"op":"hello"})"));
  DNVME_ASSIGN_OR_RETURN(json a, Answer(text, "hello"));
  if (!a.contains("protocol") || a["protocol"] != kProtocol) {
    const std::string said = a.contains("protocol") ? a["protocol"].dump() : "none";
    return Status::IoError(EPROTO, "unsupported control protocol " + said +
                                       " (this client speaks " + std::to_string(kProtocol) + ")");
  }
  return text;
}

Result<HandleConfig> CtlClient::ConfigGet() {
  DNVME_ASSIGN_OR_RETURN(std::string text, Send(R"({"op":"config.get"})"));
  DNVME_ASSIGN_OR_RETURN(json a, Answer(text, "config.get"));
  return HandleConfig::FromJson(a["config"].dump());
}

Result<HandleConfig> CtlClient::ConfigSet(const std::string& config_json) {
  json cfg = json::parse(config_json, nullptr, false);
  if (cfg.is_discarded() || !cfg.is_object()) {
    return Status::InvalidArgument("the configuration must be one JSON object");
  }
  DNVME_ASSIGN_OR_RETURN(std::string text,
                         Send(json{{"op", "config.set"}, {"config", cfg}}.dump()));
  DNVME_ASSIGN_OR_RETURN(json a, Answer(text, "config.set"));
  return HandleConfig::FromJson(a["config"].dump());
}

Result<std::string> CtlClient::Stats() {
  DNVME_ASSIGN_OR_RETURN(std::string text, Send(R"({"op":"stats"})"));
  DNVME_ASSIGN_OR_RETURN(json a, Answer(text, "stats"));
  return a["stats"].dump();
}

Result<int64_t> CtlClient::OpenHandle(const HandleConfig& config) {
  return OpenHandle(config.ToJson());
}

Result<int64_t> CtlClient::OpenHandle(const std::string& config_json) {
  json req = json::parse(config_json, nullptr, false);
  if (req.is_discarded() || !req.is_object()) {
    return Status::InvalidArgument("the handle configuration must be one JSON object");
  }
  req["op"] = "handle.open";
  DNVME_ASSIGN_OR_RETURN(std::string text, Send(req.dump()));
  DNVME_ASSIGN_OR_RETURN(json a, Answer(text, "handle.open"));
  return IntField(a, "handle");
}

Result<int64_t> CtlClient::CloseHandle(int64_t handle) {
  DNVME_ASSIGN_OR_RETURN(std::string text,
                         Send(json{{"op", "handle.close"}, {"handle", handle}}.dump()));
  DNVME_ASSIGN_OR_RETURN(json a, Answer(text, "handle.close"));
  return IntField(a, "uncollected");
}

Result<int64_t> CtlClient::RegisterShm(const std::string& shm_name, int64_t offset, int64_t size) {
  return RegisterAs("shm", shm_name, offset, size);
}

Result<int64_t> CtlClient::RegisterSource(const std::string& source, int64_t offset, int64_t size) {
  return RegisterAs("source", source, offset, size);
}

Result<int64_t> CtlClient::RegisterAs(const char* key, const std::string& name, int64_t offset,
                                      int64_t size) {
  json req = {{"op", "buffer.register"}, {key, name}, {"offset", offset}, {"size", size}};
  DNVME_ASSIGN_OR_RETURN(std::string text, Send(req.dump()));
  DNVME_ASSIGN_OR_RETURN(json a, Answer(text, "buffer.register"));
  return IntField(a, "buffer");
}

Result<CtlBuffer> CtlClient::RegisterCudaIpc(const std::string& ipc_handle_hex, int device,
                                             int64_t offset, int64_t size) {
  if (size <= 0) return Status::InvalidArgument("CUDA memory to lend needs a size above 0");
  json req = {{"op", "buffer.register"},
              {"cuda_ipc", ipc_handle_hex},
              {"device", device},
              {"offset", offset},
              {"size", size}};
  DNVME_ASSIGN_OR_RETURN(std::string text, Send(req.dump()));
  DNVME_ASSIGN_OR_RETURN(json a, Answer(text, "buffer.register"));
  CtlBuffer b;
  DNVME_ASSIGN_OR_RETURN(b.buffer, IntField(a, "buffer"));
  // The daemon may not shrink the region quietly: transfers past its end would be refused later,
  // far from the cause.
  b.size = a.contains("size") && a["size"].is_number_integer() ? a["size"].get<int64_t>() : size;
  if (b.size != size) {
    return Status::IoError(EPROTO, "buffer.register of " + std::to_string(size) +
                                       " bytes of CUDA memory answered size " +
                                       std::to_string(b.size));
  }
  b.writable = a.value("writable", true);
  return b;
}

Status CtlClient::Unregister(int64_t buffer) {
  DNVME_ASSIGN_OR_RETURN(std::string text,
                         Send(json{{"op", "buffer.unregister"}, {"buffer", buffer}}.dump()));
  return Answer(text, "buffer.unregister").status();
}

Result<int64_t> CtlClient::Transfer(const char* op, int64_t handle, int64_t buffer,
                                    int64_t buffer_offset, int64_t length, const std::string& path,
                                    int64_t file_offset, bool async) {
  json req = {{"op", op},
              {"handle", handle},
              {"buffer", buffer},
              {"buffer_offset", buffer_offset},
              {"length", length},
              {"path", path},
              {"file_offset", file_offset},
              {"async", async}};
  DNVME_ASSIGN_OR_RETURN(std::string text, Send(req.dump()));
  DNVME_ASSIGN_OR_RETURN(json a, Answer(text, op));
  return IntField(a, async ? "op_id" : "bytes");
}

Result<int64_t> CtlClient::Pread(int64_t handle, int64_t buffer, int64_t buffer_offset,
                                 int64_t length, const std::string& path, int64_t file_offset,
                                 bool async) {
  return Transfer("pread", handle, buffer, buffer_offset, length, path, file_offset, async);
}

Result<int64_t> CtlClient::Pwrite(int64_t handle, int64_t buffer, int64_t buffer_offset,
                                  int64_t length, const std::string& path, int64_t file_offset,
                                  bool async) {
  return Transfer("pwrite", handle, buffer, buffer_offset, length, path, file_offset, async);
}

Result<std::vector<CtlOpOutcome>> CtlClient::Wait(int64_t handle) {
  DNVME_ASSIGN_OR_RETURN(std::string text, Send(json{{"op", "wait"}, {"handle", handle}}.dump()));
  DNVME_ASSIGN_OR_RETURN(json a, Answer(text, "wait"));
  std::vector<CtlOpOutcome> out;
  if (!a.contains("ops") || !a["ops"].is_array()) {
    return Status::IoError(EPROTO, "the wait answer has no 'ops' list");
  }
  for (const json& o : a["ops"]) {
    CtlOpOutcome c;
    c.op_id = o.value("op_id", uint64_t{0});
    c.write = o.value("op", std::string()) == "pwrite";
    c.path = o.value("path", std::string());
    c.file_offset = o.value("file_offset", int64_t{0});
    c.length = o.value("length", int64_t{0});
    c.bytes = o.value("bytes", int64_t{0});
    if (!o.value("ok", false)) c.status = ErrorFromAnswer(o, "transfer failed");
    out.push_back(std::move(c));
  }
  return out;
}

Status CtlClient::Fsync(const std::string& path) {
  DNVME_ASSIGN_OR_RETURN(std::string text, Send(json{{"op", "fsync"}, {"path", path}}.dump()));
  return Answer(text, "fsync").status();
}

}  // namespace dnvme
