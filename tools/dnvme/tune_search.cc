#include "tools/dnvme/tune_search.h"

#include <spdlog/fmt/fmt.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

namespace dnvme::tune {
namespace {

std::string SizeLabel(int64_t bytes) {
  if (bytes % (int64_t{1} << 30) == 0) return fmt::format("{}G", bytes >> 30);
  if (bytes % (int64_t{1} << 20) == 0) return fmt::format("{}M", bytes >> 20);
  if (bytes % (int64_t{1} << 10) == 0) return fmt::format("{}K", bytes >> 10);
  return std::to_string(bytes);
}

Status Invalid(const std::string& key, const std::string& why) {
  return Status::InvalidArgument(fmt::format("sweep config: \"{}\": {}", key, why));
}

// Checks one value through HandleConfig::Validate, so the tuner refuses exactly what every
// consumer of its output would refuse.
Status ValidateWith(const std::string& key, const TunePoint& p) {
  Status st = p.Apply(HandleConfig{}).Validate();
  if (!st.ok()) return Invalid(key, st.message());
  return Status::Ok();
}

template <typename T>
Status CheckUnique(const std::string& key, const std::vector<T>& values) {
  std::set<T> seen(values.begin(), values.end());
  if (seen.size() != values.size()) return Invalid(key, "a value is listed twice");
  return Status::Ok();
}

Result<std::vector<int64_t>> ParseSizes(const std::string& key, const nlohmann::json& list) {
  std::vector<int64_t> out;
  for (const auto& v : list) {
    int64_t bytes = 0;
    if (v.is_number_integer()) {
      bytes = v.get<int64_t>();
    } else if (v.is_string()) {
      Result<int64_t> r = ParseSize(v.get<std::string>());
      if (!r.ok()) return Invalid(key, r.status().message());
      bytes = *r;
    } else {
      return Invalid(key, "values must be integers or size strings like \"1M\", got " + v.dump());
    }
    TunePoint p;
    p.block_size = bytes;
    DNVME_RETURN_IF_ERROR(ValidateWith(key, p));
    out.push_back(bytes);
  }
  return out;
}

Result<std::vector<int>> ParseInts(const std::string& key, const nlohmann::json& list,
                                   bool queue_depth) {
  std::vector<int> out;
  for (const auto& v : list) {
    if (!v.is_number_integer()) return Invalid(key, "values must be integers, got " + v.dump());
    const auto n = v.get<int64_t>();
    if (n < 1 || n > (int64_t{1} << 20)) return Invalid(key, fmt::format("{} is out of range", n));
    TunePoint p;
    (queue_depth ? p.queue_depth : p.intra_op_parallelism) = static_cast<int>(n);
    DNVME_RETURN_IF_ERROR(ValidateWith(key, p));
    out.push_back(static_cast<int>(n));
  }
  return out;
}

Result<std::vector<bool>> ParseBools(const std::string& key, const nlohmann::json& list,
                                     bool invert) {
  std::vector<bool> out;
  for (const auto& v : list) {
    // ds_nvme_tune's output had "true"/"false" strings that DeepSpeed's own parser then ignored;
    // we take JSON booleans only, so a setting can never be silently lost.
    if (!v.is_boolean()) {
      return Invalid(key, "values must be JSON booleans (true/false), got " + v.dump());
    }
    out.push_back(v.get<bool>() != invert);
  }
  return out;
}

template <typename T>
size_t IndexOf(const std::vector<T>& values, const T& v) {
  auto it = std::find(values.begin(), values.end(), v);
  return it == values.end() ? 0 : static_cast<size_t>(it - values.begin());
}

}  // namespace

HandleConfig TunePoint::Apply(HandleConfig base) const {
  base.block_size = block_size;
  base.queue_depth = queue_depth;
  base.overlap_events = overlap_events;
  base.single_submit = single_submit;
  base.intra_op_parallelism = intra_op_parallelism;
  return base;
}

std::string TunePoint::Label() const {
  return fmt::format("bs={} qd={} overlap={} single={} par={}", SizeLabel(block_size), queue_depth,
                     overlap_events ? 1 : 0, single_submit ? 1 : 0, intra_op_parallelism);
}

SweepSpace SweepSpace::Default() {
  SweepSpace s;
  s.block_size = {1 << 20, 8 << 20};
  s.queue_depth = {32, 128};
  s.overlap_events = {true, false};
  s.single_submit = {false, true};
  s.intra_op_parallelism = {1, 2, 4, 8};
  return s;
}

Result<SweepSpace> SweepSpace::FromJson(std::string_view json) {
  auto doc = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return Status::InvalidArgument("sweep config: not valid JSON");
  if (!doc.is_object()) return Status::InvalidArgument("sweep config: must be a JSON object");
  SweepSpace s = Default();
  std::set<std::string> given;
  for (const auto& [key, value] : doc.items()) {
    // DeepSpeed's names for the same parameters.
    std::string name = key;
    if (key == "io_parallel") name = "intra_op_parallelism";
    if (key == "sequential_requests") name = "overlap_events";
    if (!given.insert(name).second) {
      return Invalid(key, "names the same parameter as another key");
    }
    if (!value.is_array()) return Invalid(key, "must be a list of values, got " + value.dump());
    if (value.empty()) return Invalid(key, "the list is empty");
    const ConfigKey* k = FindConfigKey(name);
    if (k == nullptr || !k->deepspeed) {
      return Invalid(key, "unknown key; the keys are " + ConfigKeyNames(/*deepspeed_only=*/true) +
                              " (or DeepSpeed's io_parallel, sequential_requests)");
    }
    switch (k->id) {
      case ConfigKeyId::kBlockSize: {
        DNVME_ASSIGN_OR_RETURN(s.block_size, ParseSizes(key, value));
        DNVME_RETURN_IF_ERROR(CheckUnique(key, s.block_size));
        break;
      }
      case ConfigKeyId::kQueueDepth: {
        DNVME_ASSIGN_OR_RETURN(s.queue_depth, ParseInts(key, value, /*queue_depth=*/true));
        DNVME_RETURN_IF_ERROR(CheckUnique(key, s.queue_depth));
        break;
      }
      case ConfigKeyId::kIntraOpParallelism: {
        DNVME_ASSIGN_OR_RETURN(s.intra_op_parallelism, ParseInts(key, value, false));
        DNVME_RETURN_IF_ERROR(CheckUnique(key, s.intra_op_parallelism));
        break;
      }
      case ConfigKeyId::kOverlapEvents: {
        DNVME_ASSIGN_OR_RETURN(s.overlap_events,
                               ParseBools(key, value, /*invert=*/key == "sequential_requests"));
        DNVME_RETURN_IF_ERROR(CheckUnique(key, s.overlap_events));
        break;
      }
      case ConfigKeyId::kSingleSubmit: {
        DNVME_ASSIGN_OR_RETURN(s.single_submit, ParseBools(key, value, false));
        DNVME_RETURN_IF_ERROR(CheckUnique(key, s.single_submit));
        break;
      }
      case ConfigKeyId::kDirect:
      case ConfigKeyId::kFdatasyncOnWrite:
      case ConfigKeyId::kBounceBytesPerWorker:
        return Invalid(key, "is not one of DeepSpeed's keys, which the tuner sweeps");
    }
  }
  return s;
}

Result<SweepSpace> SweepSpace::FromJsonFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::FromErrno(errno, "sweep config " + path);
  std::stringstream text;
  text << in.rdbuf();
  if (in.bad()) return Status::FromErrno(EIO, "sweep config " + path);
  Result<SweepSpace> s = FromJson(text.str());
  if (!s.ok()) return s.status().WithContext(path);
  return s;
}

size_t SweepSpace::GridSize() const {
  return block_size.size() * queue_depth.size() * overlap_events.size() * single_submit.size() *
         intra_op_parallelism.size();
}

std::vector<TunePoint> SweepSpace::Grid() const {
  std::vector<TunePoint> out;
  out.reserve(GridSize());
  for (int64_t bs : block_size) {
    for (int qd : queue_depth) {
      for (bool ov : overlap_events) {
        for (bool ss : single_submit) {
          for (int par : intra_op_parallelism) {
            out.push_back(TunePoint{bs, qd, ov, ss, par});
          }
        }
      }
    }
  }
  return out;
}

TunePoint SweepSpace::StartPoint() const {
  const TunePoint d;  // DeepNVMe's defaults
  TunePoint p;
  p.block_size = block_size[IndexOf(block_size, d.block_size)];
  p.queue_depth = queue_depth[IndexOf(queue_depth, d.queue_depth)];
  p.overlap_events = overlap_events[IndexOf(overlap_events, d.overlap_events)];
  p.single_submit = single_submit[IndexOf(single_submit, d.single_submit)];
  p.intra_op_parallelism =
      intra_op_parallelism[IndexOf(intra_op_parallelism, d.intra_op_parallelism)];
  return p;
}

double Measurement::Score() const {
  if (write_gib_per_s > 0 && read_gib_per_s > 0) {
    return std::sqrt(write_gib_per_s * read_gib_per_s);
  }
  return std::max(write_gib_per_s, read_gib_per_s);
}

Result<SearchStrategy> ParseSearchStrategy(std::string_view name) {
  if (name == "descent") return SearchStrategy::kDescent;
  if (name == "grid") return SearchStrategy::kGrid;
  return Status::InvalidArgument(fmt::format("unknown search '{}' (descent or grid)", name));
}

const char* SearchStrategyName(SearchStrategy s) {
  return s == SearchStrategy::kGrid ? "grid" : "descent";
}

size_t SearchUpperBound(const SweepSpace& space, const SearchOptions& options) {
  if (options.strategy == SearchStrategy::kGrid) return space.GridSize();
  // Each pass tries every other value of every parameter once.
  const size_t per_pass = (space.block_size.size() - 1) + (space.queue_depth.size() - 1) +
                          (space.overlap_events.size() - 1) + (space.single_submit.size() - 1) +
                          (space.intra_op_parallelism.size() - 1);
  return std::min(space.GridSize(), 1 + per_pass * static_cast<size_t>(options.max_passes));
}

Result<SearchResult> RunSearch(const SweepSpace& space, const SearchOptions& options,
                               const MeasureFn& measure, const ProgressFn& progress) {
  if (space.GridSize() == 0) return Status::InvalidArgument("the sweep space is empty");
  if (options.max_passes < 1) return Status::InvalidArgument("max_passes must be at least 1");
  SearchResult result;
  const size_t bound = SearchUpperBound(space, options);
  std::map<std::string, size_t> index;  // label -> position in result.measured

  auto update_best = [&result] {
    const size_t i = result.measured.size() - 1;
    const Measurement& m = result.measured[i].m;
    if (m.Score() > result.measured[result.best].m.Score()) result.best = i;
    if (m.write_gib_per_s > result.measured[result.best_write].m.write_gib_per_s) {
      result.best_write = i;
    }
    if (m.read_gib_per_s > result.measured[result.best_read].m.read_gib_per_s) {
      result.best_read = i;
    }
  };
  // Measures p once; later calls return the first measurement.
  auto eval = [&](const TunePoint& p, int pass) -> Result<size_t> {
    const std::string key = p.Label();
    if (auto it = index.find(key); it != index.end()) return it->second;
    Result<Measurement> m = measure(p, pass);
    if (!m.ok()) return m.status().WithContext(key);
    result.measured.push_back(MeasuredPoint{p, *m, pass});
    index.emplace(key, result.measured.size() - 1);
    update_best();
    if (progress) progress(result, bound);
    return result.measured.size() - 1;
  };

  if (options.strategy == SearchStrategy::kGrid) {
    for (const TunePoint& p : space.Grid()) {
      DNVME_ASSIGN_OR_RETURN(size_t unused, eval(p, 0));
      (void)unused;
    }
    return result;
  }

  // Coordinate descent. Parameters in the order of the effect they usually have on NVMe
  // throughput (parallelism and depth first), so the first pass moves furthest.
  TunePoint current = space.StartPoint();
  DNVME_ASSIGN_OR_RETURN(size_t current_index, eval(current, 1));
  for (int pass = 1; pass <= options.max_passes; ++pass) {
    bool moved = false;
    // One step: try every value of one parameter, keep the best if it is clearly better.
    auto step = [&](const auto& values, auto field) -> Status {
      size_t best_index = current_index;
      for (const auto& v : values) {
        TunePoint candidate = current;
        candidate.*field = v;
        DNVME_ASSIGN_OR_RETURN(size_t i, eval(candidate, pass));
        if (result.measured[i].m.Score() > result.measured[best_index].m.Score()) best_index = i;
      }
      const double now = result.measured[current_index].m.Score();
      if (best_index != current_index &&
          result.measured[best_index].m.Score() > now * (1.0 + options.min_gain)) {
        current = result.measured[best_index].point;
        current_index = best_index;
        moved = true;
      }
      return Status::Ok();
    };
    DNVME_RETURN_IF_ERROR(step(space.intra_op_parallelism, &TunePoint::intra_op_parallelism));
    DNVME_RETURN_IF_ERROR(step(space.queue_depth, &TunePoint::queue_depth));
    DNVME_RETURN_IF_ERROR(step(space.block_size, &TunePoint::block_size));
    DNVME_RETURN_IF_ERROR(step(space.overlap_events, &TunePoint::overlap_events));
    DNVME_RETURN_IF_ERROR(step(space.single_submit, &TunePoint::single_submit));
    if (!moved) break;
  }
  return result;
}

}  // namespace dnvme::tune
