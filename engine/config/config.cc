#include "dnvme/config.h"

#include <cerrno>
#include <cstdlib>
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

namespace {

// The HandleConfig field behind a key: exactly one pointer is set, of the key's value type.
struct Slot {
  int64_t* size = nullptr;
  int* integer = nullptr;
  bool* boolean = nullptr;
  DirectPolicy* direct = nullptr;
};

Slot SlotOf(HandleConfig& c, ConfigKeyId id) {
  switch (id) {
    case ConfigKeyId::kBlockSize:
      return {.size = &c.block_size};
    case ConfigKeyId::kQueueDepth:
      return {.integer = &c.queue_depth};
    case ConfigKeyId::kSingleSubmit:
      return {.boolean = &c.single_submit};
    case ConfigKeyId::kOverlapEvents:
      return {.boolean = &c.overlap_events};
    case ConfigKeyId::kIntraOpParallelism:
      return {.integer = &c.intra_op_parallelism};
    case ConfigKeyId::kDirect:
      return {.direct = &c.direct};
    case ConfigKeyId::kFdatasyncOnWrite:
      return {.boolean = &c.fdatasync_on_write};
    case ConfigKeyId::kBounceBytesPerWorker:
      return {.size = &c.bounce_bytes_per_worker};
  }
  return {};
}

}  // namespace

// DeepSpeed's five first, in the order of DeepSpeed's "aio" config section (and of the file
// `dnvme tune` writes), then dnvme's own.
const std::vector<ConfigKey>& ConfigKeys() {
  using T = ConfigValueType;
  static const std::vector<ConfigKey> keys = {
      {ConfigKeyId::kBlockSize, "block_size", T::kSize, true,
       "bytes per libaio request (1..1G; rounded up to the file's direct-I/O alignment)"},
      {ConfigKeyId::kQueueDepth, "queue_depth", T::kInt, true,
       "requests in flight per worker (1..4096)"},
      {ConfigKeyId::kIntraOpParallelism, "intra_op_parallelism", T::kInt, true,
       "worker threads, each with its own libaio context (1..256)"},
      {ConfigKeyId::kSingleSubmit, "single_submit", T::kBool, true,
       "one io_submit per request instead of one per batch"},
      {ConfigKeyId::kOverlapEvents, "overlap_events", T::kBool, true,
       "sliding window of requests instead of lock-step batches"},
      {ConfigKeyId::kDirect, "direct", T::kDirect, false,
       "when O_DIRECT is refused: auto (fall back, counted), required (fail), never"},
      {ConfigKeyId::kFdatasyncOnWrite, "fdatasync_on_write", T::kBool, false,
       "fdatasync once at the end of every write operation"},
      {ConfigKeyId::kBounceBytesPerWorker, "bounce_bytes_per_worker", T::kSize, false,
       "cap on pinned bounce memory per worker (at least two blocks are always allowed)"},
  };
  return keys;
}

const ConfigKey* FindConfigKey(std::string_view name) {
  for (const ConfigKey& k : ConfigKeys()) {
    if (name == k.name) return &k;
  }
  return nullptr;
}

std::string ConfigKeyNames(bool deepspeed_only) {
  std::string out;
  for (const ConfigKey& k : ConfigKeys()) {
    if (deepspeed_only && !k.deepspeed) continue;
    if (!out.empty()) out += ", ";
    out += k.name;
  }
  return out;
}

Result<int64_t> ParseSizeOption(std::string_view key, const std::optional<std::string>& value) {
  if (!value || value->empty()) {
    return Status::InvalidArgument("option '" + std::string(key) + "' needs a value");
  }
  auto n = ParseSize(*value);
  if (!n.ok()) return n.status().WithContext("option '" + std::string(key) + "'");
  return n;
}

Result<int> ParseIntOption(std::string_view key, const std::optional<std::string>& value) {
  if (!value || value->empty()) {
    return Status::InvalidArgument("option '" + std::string(key) + "' needs a value");
  }
  errno = 0;
  char* end = nullptr;
  const long v = std::strtol(value->c_str(), &end, 10);
  if (*end != '\0' || errno == ERANGE || v < std::numeric_limits<int>::min() ||
      v > std::numeric_limits<int>::max()) {
    return Status::InvalidArgument("option '" + std::string(key) + "': '" + *value +
                                   "' is not an integer");
  }
  return static_cast<int>(v);
}

Result<bool> ParseBoolOption(std::string_view key, const std::optional<std::string>& value) {
  if (!value || *value == "1" || *value == "true" || *value == "yes") return true;
  if (*value == "0" || *value == "false" || *value == "no") return false;
  return Status::InvalidArgument("option '" + std::string(key) + "': '" + *value +
                                 "' is not a boolean (true/false, 1/0, yes/no)");
}

Status SetConfigKeyFromText(HandleConfig* config, std::string_view name,
                            const std::optional<std::string>& value) {
  const ConfigKey* key = FindConfigKey(name);
  if (key == nullptr) {
    return Status::InvalidArgument("unknown engine option '" + std::string(name) +
                                   "' (known: " + ConfigKeyNames() + ")");
  }
  Slot slot = SlotOf(*config, key->id);
  switch (key->type) {
    case ConfigValueType::kSize: {
      DNVME_ASSIGN_OR_RETURN(*slot.size, ParseSizeOption(key->name, value));
      return Status::Ok();
    }
    case ConfigValueType::kInt: {
      DNVME_ASSIGN_OR_RETURN(*slot.integer, ParseIntOption(key->name, value));
      return Status::Ok();
    }
    case ConfigValueType::kBool: {
      DNVME_ASSIGN_OR_RETURN(*slot.boolean, ParseBoolOption(key->name, value));
      return Status::Ok();
    }
    case ConfigValueType::kDirect: {
      auto d = ParseDirectPolicy(value.value_or(""));
      if (!d.ok()) return d.status().WithContext(std::string("option '") + key->name + "'");
      *slot.direct = *d;
      return Status::Ok();
    }
  }
  return Status::Internal("engine option '" + std::string(name) + "' has no parser");
}

std::string HandleConfig::ToJson() const {
  HandleConfig copy = *this;
  json j = json::object();
  for (const ConfigKey& k : ConfigKeys()) {
    Slot slot = SlotOf(copy, k.id);
    if (slot.size) j[k.name] = *slot.size;
    if (slot.integer) j[k.name] = *slot.integer;
    if (slot.boolean) j[k.name] = *slot.boolean;
    if (slot.direct) j[k.name] = DirectPolicyName(*slot.direct);
  }
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
    const ConfigKey* key = FindConfigKey(it.key());
    if (key == nullptr) {
      return Status::InvalidArgument("unknown config key '" + it.key() +
                                     "' (known: " + ConfigKeyNames() + ")");
    }
    const json& v = it.value();
    Slot slot = SlotOf(c, key->id);
    switch (key->type) {
      case ConfigValueType::kSize: {
        DNVME_ASSIGN_OR_RETURN(*slot.size, SizeValue(v, key->name));
        break;
      }
      case ConfigValueType::kInt: {
        DNVME_ASSIGN_OR_RETURN(*slot.integer, IntValue(v, key->name));
        break;
      }
      case ConfigValueType::kBool: {
        DNVME_ASSIGN_OR_RETURN(*slot.boolean, BoolValue(v, key->name));
        break;
      }
      case ConfigValueType::kDirect: {
        if (!v.is_string()) {
          return Status::InvalidArgument(std::string("config key '") + key->name +
                                         "' must be a string (auto, required, never)");
        }
        DNVME_ASSIGN_OR_RETURN(*slot.direct, ParseDirectPolicy(v.get<std::string>()));
        break;
      }
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
