// HandleConfig: the tunable parameters of an I/O handle, and their one JSON form.
//
// The same JSON object is read by `dnvme io --config`, the mount (`-o config=FILE`), the control
// file and the Python handle, so parsing is strict: an unknown key, a wrong type or an out-of-range
// value is an error that names the key, never a silently ignored setting.
//
// Thread safety: plain values; no shared state.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dnvme/status.h"

namespace dnvme {

// What to do when a file's filesystem refuses O_DIRECT.
enum class DirectPolicy {
  kAuto,      // fall back to buffered I/O, warn once per handle, count it in stats
  kRequired,  // fail the operation with Status::Unsupported
  kNever,     // always buffered (for comparisons; not a production setting)
};

const char* DirectPolicyName(DirectPolicy policy);
Result<DirectPolicy> ParseDirectPolicy(std::string_view name);

struct HandleConfig {
  // Defaults are DeepNVMe's aio_handle defaults.
  // Bytes per libaio request, 1..1G. A request is never smaller than the file's direct-I/O
  // alignment: block sizes below it (DeepSpeed's tests use 1K) or not a multiple of it are
  // rounded up to the next multiple, so every value DeepSpeed accepts works with the same data.
  int64_t block_size = 1 << 20;
  int queue_depth = 128;         // requests in flight per worker, 1..4096
  bool single_submit = false;    // one io_submit per request instead of one per batch
  bool overlap_events = false;   // sliding window instead of lock-step batches
  int intra_op_parallelism = 1;  // worker threads (each with its own libaio context), 1..256

  // dnvme extensions.
  DirectPolicy direct = DirectPolicy::kAuto;
  bool fdatasync_on_write = false;  // fdatasync once at the end of every write operation
  // Cap on pinned bounce memory per worker (bounce buffers are block_size each; at least two per
  // worker are always allowed so misaligned buffers still make progress).
  int64_t bounce_bytes_per_worker = 64 << 20;

  // Checks ranges; the error names the offending key.
  Status Validate() const;

  // JSON with every key above (direct as "auto" | "required" | "never").
  std::string ToJson() const;

  // Starts from `base` (the defaults unless given) and applies every key present in `json` (one
  // JSON object), so a partial object changes only what it names. Sizes may be integers or
  // strings with K/M/G/T suffixes (powers of 1024). Booleans must be JSON booleans.
  static Result<HandleConfig> FromJson(std::string_view json, const HandleConfig& base);
  static Result<HandleConfig> FromJson(std::string_view json);
  static Result<HandleConfig> FromJsonFile(const std::string& path);

  bool operator==(const HandleConfig&) const = default;
};

// Parses "4096", "1M", "1MiB", "64k", "2G" (binary multiples). Rejects negatives, junk and
// overflow.
Result<int64_t> ParseSize(std::string_view text);

// The text forms of a `-o key[=value]` option (`value` absent: the bare option), shared by the
// engine's keys and the mount's own. Errors name the key. A size or an integer needs a value; a
// boolean is 1/true/yes or 0/false/no, and the bare option means true.
Result<int64_t> ParseSizeOption(std::string_view key, const std::optional<std::string>& value);
Result<int> ParseIntOption(std::string_view key, const std::optional<std::string>& value);
Result<bool> ParseBoolOption(std::string_view key, const std::optional<std::string>& value);

// ---- The keys of HandleConfig, declared once ----
//
// Every place that names an engine option reads this table: the JSON form above (config files,
// the control file's config.get/config.set and handle.open), the mount's `-o` options, the
// ctl request checker and the tuner's sweep config. A key added here is accepted everywhere.

enum class ConfigKeyId {
  kBlockSize,
  kQueueDepth,
  kSingleSubmit,
  kOverlapEvents,
  kIntraOpParallelism,
  kDirect,
  kFdatasyncOnWrite,
  kBounceBytesPerWorker,
};

enum class ConfigValueType {
  kSize,    // bytes: an integer, or (in JSON and -o) a string such as "1M"
  kInt,     // an integer
  kBool,    // JSON true/false; in -o also 1/0/yes/no, or the bare key for true
  kDirect,  // "auto" | "required" | "never"
};

struct ConfigKey {
  ConfigKeyId id;
  const char* name;
  ConfigValueType type;
  // One of DeepSpeed's five aio_handle parameters: the tuner sweeps these, and `dnvme tune`
  // writes exactly these into the config file it produces (DeepSpeed reads that file).
  bool deepspeed;
  const char* help;  // one line, for usage texts and docs
};

// Every key, in the order ToJson writes them.
const std::vector<ConfigKey>& ConfigKeys();
// The key named `name`; null when there is none.
const ConfigKey* FindConfigKey(std::string_view name);
// "block_size, queue_depth, ..." (all keys, or only DeepSpeed's): for error messages.
std::string ConfigKeyNames(bool deepspeed_only = false);

// Sets key `name` of `config` from its text form, as `-o name=value` gives it (`value` absent:
// the bare option, which only a boolean accepts, as true). The error names the key. Does not
// Validate(): the caller checks the finished configuration once.
Status SetConfigKeyFromText(HandleConfig* config, std::string_view name,
                            const std::optional<std::string>& value);

}  // namespace dnvme
