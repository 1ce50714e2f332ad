#include "dnvme/config.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

namespace dnvme {
namespace {

using nlohmann::json;

constexpr int kMaxQueueDepth = 4096;
constexpr int kMaxParallelism = 256;
constexpr int64_t kMaxBlockSize = int64_t{1} << 30;

Result<int64_t> SizeValue(const json& v, const char* key) {
  if (v.is_number_integer() || v.is_number_unsigned()) {
    if (v.is_number_unsigned() &&
        v.get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max())) {
      return Status::InvalidArgument(std::string("config key '") + key + "': value too large");
    }
    int64_t n = v.get<int64_t>();
    if (n < 0) return Status::InvalidArgument(std::string("config key '") + key + "' is negative");
    return n;
  }
  if (v.is_string()) {
    auto parsed = ParseSize(v.get<std::string>());
    if (!parsed.ok()) return parsed.status().WithContext(std::string("config key '") + key + "'");
    return parsed;
  }
  return Status::InvalidArgument(std::string("config key '") + key +
                                 "' must be an integer or a size string like \"1M\", got " +
                                 v.type_name());
}

Result<int> IntValue(const json& v, const char* key) {
  if (!v.is_number_integer() && !v.is_number_unsigned()) {
    return Status::InvalidArgument(std::string("config key '") + key +
                                   "' must be an integer, got " + v.type_name());
  }
  if (v.is_number_unsigned() ? v.get<uint64_t>() > uint64_t(std::numeric_limits<int>::max())
                             : (v.get<int64_t>() > std::numeric_limits<int>::max() ||
                                v.get<int64_t>() < std::numeric_limits<int>::min())) {
    return Status::InvalidArgument(std::string("config key '") + key + "' is out of range");
  }
  return static_cast<int>(v.get<int64_t>());
}

Result<bool> BoolValue(const json& v, const char* key) {
  // Strict on purpose: ds_nvme_tune once emitted "true" as a string and DeepSpeed read it as false.
  if (!v.is_boolean()) {
    return Status::InvalidArgument(std::string("config key '") + key +
                                   "' must be a JSON boolean (true/false), got " + v.type_name());
  }
  return v.get<bool>();
}

}  // namespace

const char* DirectPolicyName(DirectPolicy policy) {
  switch (policy) {
    case DirectPolicy::kAuto:
      return "auto";
    case DirectPolicy::kRequired:
      return "required";
    case DirectPolicy::kNever:
      return "never";
  }
  return "auto";
}

Result<DirectPolicy> ParseDirectPolicy(std::string_view name) {
  if (name == "auto") return DirectPolicy::kAuto;
  if (name == "required") return DirectPolicy::kRequired;
  if (name == "never") return DirectPolicy::kNever;
  return Status::InvalidArgument("direct must be one of auto, required, never; got '" +
                                 std::string(name) + "'");
}

Result<int64_t> ParseSize(std::string_view text) {
  std::string_view s = text;
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  auto bad = [&](const char* why) {
    return Status::InvalidArgument("invalid size '" + std::string(text) + "': " + why +
                                   " (expected e.g. 4096, 64K, 1M, 2G)");
  };
  if (s.empty()) return bad("empty");
  size_t i = 0;
  uint64_t value = 0;
  while (i < s.size() && s[i] >= '0' && s[i] <= '9') {
    uint64_t digit = static_cast<uint64_t>(s[i] - '0');
    if (value > (std::numeric_limits<uint64_t>::max() - digit) / 10) return bad("too large");
    value = value * 10 + digit;
    ++i;
  }
  if (i == 0) return bad(s[0] == '-' ? "negative" : "not a number");
  std::string suffix(s.substr(i));
  for (auto& c : suffix) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  int shift = 0;
  if (suffix.empty() || suffix == "B") {
    shift = 0;
  } else {
    static const char* kUnits = "KMGTP";
    const char* p = std::strchr(kUnits, suffix[0]);
    if (p == nullptr || suffix[0] == '\0') return bad("unknown unit");
    std::string rest = suffix.substr(1);
    if (!(rest.empty() || rest == "B" || rest == "IB")) return bad("unknown unit");
    shift = 10 * static_cast<int>(p - kUnits + 1);
  }
  if (shift > 0 && value > (uint64_t(std::numeric_limits<int64_t>::max()) >> shift)) {
    return bad("too large");
  }
  value <<= shift;
  if (value > uint64_t(std::numeric_limits<int64_t>::max())) return bad("too large");
  return static_cast<int64_t>(value);
}

Status HandleConfig::Validate() const {
  // Any positive size, as DeepSpeed accepts (its tests use 1 KiB): the block size only says how
  // an operation is cut into requests. Each O_DIRECT request is rounded up to the file's
  // direct-I/O alignment by the worker, so the caller never has to know that alignment.
  if (block_size <= 0 || block_size > kMaxBlockSize) {
    return Status::InvalidArgument("config key 'block_size' must be in 1..1G bytes, got " +
                                   std::to_string(block_size));
  }
  if (queue_depth < 1 || queue_depth > kMaxQueueDepth) {
    return Status::InvalidArgument("config key 'queue_depth' must be in 1.." +
                                   std::to_string(kMaxQueueDepth) + ", got " +
                                   std::to_string(queue_depth));
  }
  if (intra_op_parallelism < 1 || intra_op_parallelism > kMaxParallelism) {
    return Status::InvalidArgument("config key 'intra_op_parallelism' must be in 1.." +
                                   std::to_string(kMaxParallelism) + ", got " +
                                   std::to_string(intra_op_parallelism));
  }
  if (bounce_bytes_per_worker < 0) {
    return Status::InvalidArgument("config key 'bounce_bytes_per_worker' must not be negative");
  }
  return Status::Ok();
}

std::string HandleConfig::ToJson() const {
  json j = {
      {"block_size", block_size},
      {"queue_depth", queue_depth},
      {"single_submit", single_submit},
      {"overlap_events", overlap_events},
      {"intra_op_parallelism", intra_op_parallelism},
      {"direct", DirectPolicyName(direct)},
      {"fdatasync_on_write", fdatasync_on_write},
      {"bounce_bytes_per_worker", bounce_bytes_per_worker},
  };
  return j.dump();
}

Result<HandleConfig> HandleConfig::FromJson(std::string_view text, const HandleConfig& base) {
  json j;
  try {
    j = json::parse(text.begin(), text.end());
  } catch (const json::parse_error& e) {
    return Status::InvalidArgument(std::string("config is not valid JSON: ") + e.what());
  }
  if (!j.is_object()) {
    return Status::InvalidArgument(std::string("config must be a JSON object, got ") +
                                   j.type_name());
  }
  HandleConfig c = base;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& key = it.key();
    const json& v = it.value();
    if (key == "block_size") {
      DNVME_ASSIGN_OR_RETURN(c.block_size, SizeValue(v, "block_size"));
    } else if (key == "queue_depth") {
      DNVME_ASSIGN_OR_RETURN(c.queue_depth, IntValue(v, "queue_depth"));
    } else if (key == "single_submit") {
      DNVME_ASSIGN_OR_RETURN(c.single_submit, BoolValue(v, "single_submit"));
    } else if (key == "overlap_events") {
      DNVME_ASSIGN_OR_RETURN(c.overlap_events, BoolValue(v, "overlap_events"));
    } else if (key == "intra_op_parallelism") {
      DNVME_ASSIGN_OR_RETURN(c.intra_op_parallelism, IntValue(v, "intra_op_parallelism"));
    } else if (key == "direct") {
      if (!v.is_string()) {
        return Status::InvalidArgument(
            "config key 'direct' must be a string (auto, required, never)");
      }
      DNVME_ASSIGN_OR_RETURN(c.direct, ParseDirectPolicy(v.get<std::string>()));
    } else if (key == "fdatasync_on_write") {
      DNVME_ASSIGN_OR_RETURN(c.fdatasync_on_write, BoolValue(v, "fdatasync_on_write"));
    } else if (key == "bounce_bytes_per_worker") {
      DNVME_ASSIGN_OR_RETURN(c.bounce_bytes_per_worker, SizeValue(v, "bounce_bytes_per_worker"));
    } else {
      return Status::InvalidArgument(
          "unknown config key '" + key +
          "' (known: block_size, queue_depth, single_submit, overlap_events, "
          "intra_op_parallelism, direct, fdatasync_on_write, bounce_bytes_per_worker)");
    }
  }
  DNVME_RETURN_IF_ERROR(c.Validate());
  return c;
}

Result<HandleConfig> HandleConfig::FromJson(std::string_view text) {
  return FromJson(text, HandleConfig{});
}

Result<HandleConfig> HandleConfig::FromJsonFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::FromErrno(errno, "cannot open config file '" + path + "'");
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return Status::FromErrno(errno, "cannot read config file '" + path + "'");
  auto c = FromJson(ss.str());
  if (!c.ok()) return c.status().WithContext("config file '" + path + "'");
  return c;
}

}  // namespace dnvme
