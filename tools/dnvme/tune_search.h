// The tuner's search space and search strategies (`dnvme tune`), kept free of I/O so that tests
// can drive them with a synthetic measurement.
//
// A point is one setting of the five DeepNVMe handle parameters. The tuner measures a point by
// writing and/or reading a file with a handle configured that way; the search decides which
// points to measure:
//   - kGrid measures every point of the space (ds_nvme_tune's way);
//   - kDescent is coordinate descent: starting from DeepNVMe's defaults, it varies one parameter
//     at a time over all of its values with the others fixed, moves to the best value when that
//     beats the current point by more than `min_gain`, and repeats the passes until one makes no
//     move. Every point is measured at most once. On the default space (64 points) it measures
//     about 10 to 20 (docs/tuning.md has the comparison with the grid on the reference machine).
//
// Thread safety: plain values and free functions; the measure callback is called from the
// calling thread only, one point at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "dnvme/config.h"
#include "dnvme/status.h"

namespace dnvme::tune {

struct TunePoint {
  int64_t block_size = 1 << 20;
  int queue_depth = 128;
  bool overlap_events = false;
  bool single_submit = false;
  int intra_op_parallelism = 1;

  // `base` with the five parameters replaced.
  HandleConfig Apply(HandleConfig base) const;
  // "bs=1M qd=128 overlap=0 single=0 par=1": stable, used as the cache key and in the CSV.
  std::string Label() const;
  bool operator==(const TunePoint&) const = default;
};

// The values explored for each parameter. Each list is non-empty and without duplicates.
struct SweepSpace {
  std::vector<int64_t> block_size;
  std::vector<int> queue_depth;
  std::vector<bool> overlap_events;
  std::vector<bool> single_submit;
  std::vector<int> intra_op_parallelism;

  // At least as wide as ds_nvme_tune's: {1M, 8M} x {32, 128} x {true, false} x {false, true}
  // x {1, 2, 4, 8} = 64 points.
  static SweepSpace Default();
  // A JSON object mapping parameter names to lists of values. Keys it does not name keep the
  // default lists. Also takes DeepSpeed's sweep-file names: "io_parallel" for
  // intra_op_parallelism and "sequential_requests" (= not overlap_events). Strict: an unknown
  // key, a non-list, an empty list, a duplicate, a wrong type or a value HandleConfig refuses is
  // an error naming the key.
  static Result<SweepSpace> FromJson(std::string_view json);
  static Result<SweepSpace> FromJsonFile(const std::string& path);

  size_t GridSize() const;
  // Every point, in the order block_size, queue_depth, overlap_events, single_submit,
  // intra_op_parallelism (the last varies fastest).
  std::vector<TunePoint> Grid() const;
  // The DeepNVMe default where the space has it, else each list's first value.
  TunePoint StartPoint() const;
};

// One measured point. A rate of 0 means that direction was not measured (--no-read/--no-write).
struct Measurement {
  double write_gib_per_s = 0;
  double read_gib_per_s = 0;
  // What the search maximises: the geometric mean of the measured rates, so a point must be
  // good at both to win (a 2x better write does not hide a 2x worse read).
  double Score() const;
};

struct MeasuredPoint {
  TunePoint point;
  Measurement m;
  int pass = 0;  // descent pass that measured it (1-based); 0 for the grid
};

enum class SearchStrategy { kDescent, kGrid };
Result<SearchStrategy> ParseSearchStrategy(std::string_view name);
const char* SearchStrategyName(SearchStrategy s);

struct SearchOptions {
  SearchStrategy strategy = SearchStrategy::kDescent;
  double min_gain = 0.03;  // relative; smaller differences are taken as noise
  int max_passes = 4;
};

struct SearchResult {
  std::vector<MeasuredPoint> measured;  // in measurement order
  size_t best = 0;                      // index of the best score
  size_t best_write = 0;                // index of the best write rate
  size_t best_read = 0;                 // index of the best read rate
};

// Called with each point to measure; an error stops the search and is returned.
using MeasureFn = std::function<Result<Measurement>(const TunePoint&, int pass)>;
// Called after each measurement with everything measured so far and an upper bound on how many
// points the search will measure in all.
using ProgressFn = std::function<void(const SearchResult& so_far, size_t upper_bound)>;

Result<SearchResult> RunSearch(const SweepSpace& space, const SearchOptions& options,
                               const MeasureFn& measure, const ProgressFn& progress = {});

// The most points a search with these options can measure on this space.
size_t SearchUpperBound(const SweepSpace& space, const SearchOptions& options);

}  // namespace dnvme::tune
