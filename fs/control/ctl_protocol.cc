#include "fs/control/ctl_protocol.h"

#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <vector>

namespace dnvme::fs {
namespace {

using nlohmann::json;

Status Err(int err, std::string msg) { return CtlError(err, std::move(msg)); }

// Deepest nesting of arrays/objects in `text`, outside strings; stops counting past `limit`.
int NestingDepth(std::string_view text, int limit) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      deepest = std::max(deepest, ++depth);
      if (deepest > limit) return deepest;
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return deepest;
}

struct OpSpec {
  const char* name;
  CtlOp op;
  std::set<std::string> required;
  std::set<std::string> optional;
};

// handle.open takes any engine key (include/dnvme/config.h's table).
std::set<std::string> EngineKeys() {
  std::set<std::string> keys;
  for (const ConfigKey& k : ConfigKeys()) keys.insert(k.name);
  return keys;
}

const std::vector<OpSpec>& Specs() {
  static const std::vector<OpSpec> specs = {
      {"hello", CtlOp::kHello, {}, {}},
      {"config.get", CtlOp::kConfigGet, {}, {}},
      {"config.set", CtlOp::kConfigSet, {"config"}, {}},
      {"stats", CtlOp::kStats, {}, {}},
      {"handle.open", CtlOp::kHandleOpen, {}, EngineKeys()},
      {"handle.close", CtlOp::kHandleClose, {"handle"}, {}},
      {"buffer.register",
       CtlOp::kBufferRegister,
       {},
       {"shm", "source", "cuda_ipc", "device", "offset", "size"}},
      {"buffer.unregister", CtlOp::kBufferUnregister, {"buffer"}, {}},
      {"pread",
       CtlOp::kPread,
       {"handle", "buffer", "length", "path"},
       {"buffer_offset", "file_offset", "async"}},
      {"pwrite",
       CtlOp::kPwrite,
       {"handle", "buffer", "length", "path"},
       {"buffer_offset", "file_offset", "async"}},
      {"wait", CtlOp::kWait, {"handle"}, {}},
      {"fsync", CtlOp::kFsync, {"path"}, {}},
  };
  return specs;
}

// A non-negative JSON integer no larger than `max`.
Result<int64_t> GetCount(const json& j, const char* key, int64_t max) {
  const json& v = j.at(key);
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(max)) {
      return Err(EINVAL, std::string("'") + key + "' is " + std::to_string(u) +
                             ", more than the limit " + std::to_string(max));
    }
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) {  // signed, so negative here (non-negative ones are unsigned)
    return Err(EINVAL, std::string("'") + key + "' must not be negative (got " +
                           std::to_string(v.get<int64_t>()) + ")");
  }
  return Err(EINVAL,
             std::string("'") + key + "' must be a non-negative integer, not " + v.type_name());
}

Result<std::string> GetString(const json& j, const char* key, size_t max_len) {
  const json& v = j.at(key);
  if (!v.is_string()) {
    return Err(EINVAL, std::string("'") + key + "' must be a string, not " + v.type_name());
  }
  std::string s = v.get<std::string>();
  if (s.size() > max_len) {
    return Err(EINVAL,
               std::string("'") + key + "' is longer than " + std::to_string(max_len) + " bytes");
  }
  if (s.find('\0') != std::string::npos) {
    return Err(EINVAL, std::string("'") + key + "' contains a NUL byte");
  }
  return s;
}

Result<bool> GetBool(const json& j, const char* key) {
  const json& v = j.at(key);
  if (!v.is_boolean()) {
    return Err(EINVAL, std::string("'") + key + "' must be true or false, not " + v.type_name());
  }
  return v.get<bool>();
}

// Ids, offsets and lengths: below 2^62 so sums of two never overflow int64.
constexpr int64_t kMaxNumber = int64_t{1} << 62;

}  // namespace

Status CtlError(int err, std::string msg) {
  if (err == EINVAL) return Status::InvalidArgument(std::move(msg));
  return Status::IoError(err, std::move(msg));
}

std::string ErrnoName(int err) {
  const char* name = strerrorname_np(err);
  return name != nullptr ? name : "E" + std::to_string(err);
}

Result<std::string> NormaliseCtlPath(std::string_view path, const std::string& mountpoint) {
  if (path.empty()) return Err(EINVAL, "'path' is empty");
  if (path.size() > kMaxPathBytes) {
    return Err(ENAMETOOLONG, "'path' is longer than " + std::to_string(kMaxPathBytes) + " bytes");
  }
  if (path.find('\0') != std::string_view::npos) return Err(EINVAL, "'path' contains a NUL byte");
  std::string_view rest = path;
  if (rest.front() == '/') {
    // An absolute path must name something inside this mount.
    std::string_view mnt = mountpoint;
    while (mnt.size() > 1 && mnt.back() == '/') mnt.remove_suffix(1);
    if (rest.substr(0, mnt.size()) != mnt ||
        (rest.size() > mnt.size() && rest[mnt.size()] != '/')) {
      return Err(EXDEV, "'path' " + std::string(path) + " is not inside the mount " + mountpoint);
    }
    rest.remove_prefix(mnt.size());
  }
  std::string out;
  bool first = true;
  while (!rest.empty()) {
    const size_t slash = rest.find('/');
    std::string_view part = rest.substr(0, slash);
    rest = slash == std::string_view::npos ? std::string_view() : rest.substr(slash + 1);
    if (part.empty() || part == ".") continue;
    if (part == "..") {
      return Err(EINVAL, "'path' " + std::string(path) + " has a '..' component");
    }
    if (first && part == ".dnvme") {
      return Err(EPERM, "'path' " + std::string(path) + " is inside the control directory");
    }
    if (!out.empty()) out += '/';
    out += part;
    first = false;
  }
  return out;
}

namespace {

// A request's "id" re-serialised, when it is an integer or a string of at most 128 bytes.
std::optional<std::string> IdJson(const json& id) {
  if (id.is_number_integer() ||
      (id.is_string() && id.get_ref<const std::string&>().size() <= 128)) {
    return id.dump();
  }
  return std::nullopt;
}

}  // namespace

std::string ExtractCtlId(std::string_view text) {
  if (text.size() > kMaxRequestBytes || NestingDepth(text, kMaxRequestDepth) > kMaxRequestDepth) {
    return "";
  }
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object() || !j.contains("id")) return "";
  return IdJson(j["id"]).value_or("");
}

Status CtlTooLarge(size_t bytes) {
  return Err(E2BIG, "request of " + std::to_string(bytes) + " bytes; the limit is " +
                        std::to_string(kMaxRequestBytes));
}

Result<CtlRequest> ParseCtlRequest(std::string_view text, const std::string& mountpoint) {
  if (text.size() > kMaxRequestBytes) return CtlTooLarge(text.size());
  if (NestingDepth(text, kMaxRequestDepth) > kMaxRequestDepth) {
    return Err(EINVAL, "request nested deeper than " + std::to_string(kMaxRequestDepth));
  }
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Err(EBADMSG, "request is not valid JSON");
  if (!j.is_object()) {
    return Err(EBADMSG, std::string("request must be one JSON object, not ") + j.type_name());
  }
  CtlRequest r;
  if (j.contains("id")) {
    std::optional<std::string> id = IdJson(j["id"]);
    if (!id) return Err(EINVAL, "'id' must be an integer or a string of at most 128 bytes");
    r.id_json = std::move(*id);
  }
  if (!j.contains("op")) return Err(EINVAL, "request has no 'op'");
  if (!j["op"].is_string()) return Err(EINVAL, "'op' must be a string");
  const std::string& name = j["op"].get_ref<const std::string&>();
  const OpSpec* spec = nullptr;
  for (const OpSpec& s : Specs()) {
    if (name == s.name) spec = &s;
  }
  if (spec == nullptr) {
    std::string shown = name.substr(0, 64);
    return Err(EOPNOTSUPP, "unknown op '" + shown + "'");
  }
  r.op = spec->op;
  for (const auto& [key, value] : j.items()) {
    (void)value;
    if (key == "op" || key == "id" || spec->required.count(key) || spec->optional.count(key)) {
      continue;
    }
    return Err(EINVAL, "unknown field '" + key.substr(0, 64) + "' for op '" + name + "'");
  }
  for (const std::string& key : spec->required) {
    if (!j.contains(key)) return Err(EINVAL, "op '" + name + "' needs '" + key + "'");
  }

  switch (r.op) {
    case CtlOp::kHello:
    case CtlOp::kConfigGet:
    case CtlOp::kStats:
      break;
    case CtlOp::kConfigSet: {
      if (!j["config"].is_object()) return Err(EINVAL, "'config' must be a JSON object");
      r.config_json = j["config"].dump();
      // Checked here against the defaults so a wrong key or type is reported before anything is
      // applied; the control plane re-applies it on top of the live configuration.
      auto cfg = HandleConfig::FromJson(r.config_json);
      if (!cfg.ok()) return Err(EINVAL, "'config': " + cfg.status().message());
      break;
    }
    case CtlOp::kHandleOpen: {
      json cfg = j;
      cfg.erase("op");
      cfg.erase("id");
      r.config_json = cfg.dump();
      auto checked = HandleConfig::FromJson(r.config_json);
      if (!checked.ok()) return Err(EINVAL, checked.status().message());
      break;
    }
    case CtlOp::kHandleClose:
    case CtlOp::kWait: {
      DNVME_ASSIGN_OR_RETURN(r.handle, GetCount(j, "handle", kMaxNumber));
      break;
    }
    case CtlOp::kBufferRegister: {
      const bool has_shm = j.contains("shm"), has_source = j.contains("source"),
                 has_cuda = j.contains("cuda_ipc");
      if (int{has_shm} + int{has_source} + int{has_cuda} != 1) {
        return Err(EINVAL,
                   "buffer.register needs exactly one of 'shm' (a /dev/shm name), 'source' "
                   "(/dev/shm/NAME or /proc/PID/fd/N) and 'cuda_ipc' (a CUDA IPC memory handle "
                   "as 128 hex digits)");
      }
      if (j.contains("device") && !has_cuda) {
        return Err(EINVAL, "'device' belongs to a 'cuda_ipc' registration");
      }
      if (has_cuda) {
        DNVME_ASSIGN_OR_RETURN(r.cuda_ipc, GetString(j, "cuda_ipc", 128));
        if (r.cuda_ipc.size() != 128 ||
            r.cuda_ipc.find_first_not_of("0123456789abcdefABCDEF") != std::string::npos) {
          return Err(EINVAL, "'cuda_ipc' must be exactly 128 hex digits (cudaIpcMemHandle_t)");
        }
        if (j.contains("device")) {
          DNVME_ASSIGN_OR_RETURN(r.cuda_device, GetCount(j, "device", 1023));
        }
      } else if (has_shm) {
        DNVME_ASSIGN_OR_RETURN(r.shm, GetString(j, "shm", 255));
        if (r.shm.empty() || r.shm == "." || r.shm == ".." ||
            r.shm.find('/') != std::string::npos) {
          return Err(EINVAL, "'shm' must be one file name in /dev/shm (no '/', not '.' or '..')");
        }
      } else {
        DNVME_ASSIGN_OR_RETURN(r.source, GetString(j, "source", 255));
      }
      if (j.contains("offset")) {
        DNVME_ASSIGN_OR_RETURN(r.region_offset, GetCount(j, "offset", kMaxNumber));
      }
      if (j.contains("size")) {
        DNVME_ASSIGN_OR_RETURN(r.region_size, GetCount(j, "size", kMaxNumber));
      }
      break;
    }
    case CtlOp::kBufferUnregister: {
      DNVME_ASSIGN_OR_RETURN(r.buffer, GetCount(j, "buffer", kMaxNumber));
      break;
    }
    case CtlOp::kPread:
    case CtlOp::kPwrite: {
      DNVME_ASSIGN_OR_RETURN(r.handle, GetCount(j, "handle", kMaxNumber));
      DNVME_ASSIGN_OR_RETURN(r.buffer, GetCount(j, "buffer", kMaxNumber));
      DNVME_ASSIGN_OR_RETURN(r.length, GetCount(j, "length", kMaxNumber));
      if (j.contains("buffer_offset")) {
        DNVME_ASSIGN_OR_RETURN(r.buffer_offset, GetCount(j, "buffer_offset", kMaxNumber));
      }
      if (j.contains("file_offset")) {
        DNVME_ASSIGN_OR_RETURN(r.file_offset, GetCount(j, "file_offset", kMaxNumber));
      }
      if (j.contains("async")) {
        DNVME_ASSIGN_OR_RETURN(r.async, GetBool(j, "async"));
      }
      std::string raw;
      DNVME_ASSIGN_OR_RETURN(raw, GetString(j, "path", kMaxPathBytes));
      DNVME_ASSIGN_OR_RETURN(r.path, NormaliseCtlPath(raw, mountpoint));
      if (r.path.empty()) return Err(EISDIR, "'path' names the mount root, not a file");
      break;
    }
    case CtlOp::kFsync: {
      std::string raw;
      DNVME_ASSIGN_OR_RETURN(raw, GetString(j, "path", kMaxPathBytes));
      DNVME_ASSIGN_OR_RETURN(r.path, NormaliseCtlPath(raw, mountpoint));
      break;
    }
  }
  return r;
}

std::string CtlOkResponse(const std::string& id_json, const std::string& body_json) {
  json out = json::parse(body_json, nullptr, false);
  if (!out.is_object()) out = json::object();
  json answer = {{"ok", true}};
  if (!id_json.empty()) answer["id"] = json::parse(id_json, nullptr, false);
  for (auto& [k, v] : out.items()) answer[k] = v;
  return answer.dump() + "\n";
}

std::string CtlErrorResponse(const std::string& id_json, const Status& error) {
  const int err = error.ErrnoOr();
  json answer = {{"ok", false},
                 {"error",
                  {{"code", ErrnoName(err)},
                   {"errno", err},
                   // Replace invalid UTF-8 (a path from the request) rather than failing the dump.
                   {"message", error.message()}}}};
  if (!id_json.empty()) answer["id"] = json::parse(id_json, nullptr, false);
  return answer.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
}

}  // namespace dnvme::fs
