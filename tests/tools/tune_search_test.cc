// The tuner's search (tools/dnvme/tune_search.h) against synthetic measurements, where the best
// point is known, and its sweep-config parser.
#include "tools/dnvme/tune_search.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <set>
#include <string>

namespace dnvme::tune {
namespace {

// A made-up disk: every parameter helps or hurts independently, with the best at
// bs=8M qd=32 overlap=1 single=0 par=4.
Measurement Separable(const TunePoint& p) {
  double w = 1.0;
  w *= p.block_size == (8 << 20) ? 1.3 : 1.0;
  w *= p.queue_depth == 32 ? 1.2 : 1.0;
  w *= p.overlap_events ? 1.1 : 1.0;
  w *= p.single_submit ? 0.8 : 1.0;
  w *= std::map<int, double>{{1, 1.0}, {2, 1.4}, {4, 1.6}, {8, 1.5}}.at(p.intra_op_parallelism);
  return Measurement{w, w * 0.7};
}

TEST(SweepSpace, DefaultIsAtLeastDsNvmeTunesSpace) {
  const SweepSpace s = SweepSpace::Default();
  EXPECT_EQ(s.GridSize(), 64u);
  EXPECT_EQ(s.block_size, (std::vector<int64_t>{1 << 20, 8 << 20}));
  EXPECT_EQ(s.queue_depth, (std::vector<int>{32, 128}));
  EXPECT_EQ(s.intra_op_parallelism, (std::vector<int>{1, 2, 4, 8}));
  EXPECT_EQ(s.overlap_events.size(), 2u);
  EXPECT_EQ(s.single_submit.size(), 2u);
  std::set<std::string> labels;
  for (const TunePoint& p : s.Grid()) labels.insert(p.Label());
  EXPECT_EQ(labels.size(), 64u) << "grid points are distinct";
  EXPECT_EQ(s.StartPoint(), TunePoint{}) << "descent starts at DeepNVMe's defaults";
}

TEST(Search, GridMeasuresEveryPointOnceAndFindsTheBest) {
  std::map<std::string, int> calls;
  auto measure = [&](const TunePoint& p, int) -> Result<Measurement> {
    ++calls[p.Label()];
    return Separable(p);
  };
  SearchOptions o;
  o.strategy = SearchStrategy::kGrid;
  auto r = RunSearch(SweepSpace::Default(), o, measure);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->measured.size(), 64u);
  EXPECT_EQ(calls.size(), 64u);
  for (const auto& [label, n] : calls) EXPECT_EQ(n, 1) << label;
  EXPECT_EQ(r->measured[r->best].point, (TunePoint{8 << 20, 32, true, false, 4}));
  EXPECT_EQ(r->best_write, r->best);
  EXPECT_EQ(r->best_read, r->best);
}

TEST(Search, DescentFindsTheSameBestWithFarFewerPoints) {
  std::map<std::string, int> calls;
  size_t last_bound = 0;
  auto measure = [&](const TunePoint& p, int) -> Result<Measurement> {
    ++calls[p.Label()];
    return Separable(p);
  };
  auto progress = [&](const SearchResult& r, size_t bound) {
    EXPECT_LE(r.measured.size(), bound);
    last_bound = bound;
  };
  auto r = RunSearch(SweepSpace::Default(), SearchOptions{}, measure, progress);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->measured[r->best].point, (TunePoint{8 << 20, 32, true, false, 4}));
  EXPECT_LT(r->measured.size(), 24u) << "descent should need well under the 64-point grid";
  EXPECT_EQ(calls.size(), r->measured.size());
  for (const auto& [label, n] : calls) EXPECT_EQ(n, 1) << label << " measured twice";
  EXPECT_EQ(last_bound, SearchUpperBound(SweepSpace::Default(), SearchOptions{}));
  EXPECT_EQ(r->measured.front().point, TunePoint{}) << "starts at the defaults";
}

TEST(Search, DescentIgnoresGainsBelowMinGain) {
  // Everything within 1% of the start: noise, so the search stops after one pass.
  auto measure = [](const TunePoint& p, int) -> Result<Measurement> {
    const double w = 1.0 + (p == TunePoint{} ? 0.0 : 0.01);
    return Measurement{w, 0};
  };
  SearchOptions o;
  o.min_gain = 0.03;
  auto r = RunSearch(SweepSpace::Default(), o, measure);
  ASSERT_TRUE(r.ok());
  for (const MeasuredPoint& m : r->measured) EXPECT_EQ(m.pass, 1) << m.point.Label();
  // Best measured is still reported honestly (it is 1% better), but no move was made.
  EXPECT_NE(r->measured[r->best].point, TunePoint{});
}

TEST(Search, WriteOnlyScoresByWrite) {
  auto measure = [](const TunePoint& p, int) -> Result<Measurement> {
    return Measurement{Separable(p).write_gib_per_s, 0};
  };
  auto r = RunSearch(SweepSpace::Default(), SearchOptions{}, measure);
  ASSERT_TRUE(r.ok());
  EXPECT_DOUBLE_EQ(r->measured[r->best].m.Score(), r->measured[r->best].m.write_gib_per_s);
  EXPECT_EQ(r->best_read, 0u) << "no read measured: index stays at the first point";
}

TEST(Search, MeasurementErrorStopsTheSearchAndNamesThePoint) {
  int n = 0;
  auto measure = [&](const TunePoint&, int) -> Result<Measurement> {
    if (++n == 3) return Status::IoError(EIO, "disk on fire");
    return Measurement{1, 1};
  };
  auto r = RunSearch(SweepSpace::Default(), SearchOptions{}, measure);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("disk on fire"), std::string::npos);
  EXPECT_NE(r.status().message().find("bs="), std::string::npos) << r.status().message();
}

TEST(SweepSpace, FromJsonTakesListsAndKeepsDefaultsForTheRest) {
  auto s = SweepSpace::FromJson(
      R"({"block_size": ["256K", 2097152], "queue_depth": [8, 64], "single_submit": [false]})");
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->block_size, (std::vector<int64_t>{256 << 10, 2 << 20}));
  EXPECT_EQ(s->queue_depth, (std::vector<int>{8, 64}));
  EXPECT_EQ(s->single_submit, (std::vector<bool>{false}));
  EXPECT_EQ(s->intra_op_parallelism, SweepSpace::Default().intra_op_parallelism);
  EXPECT_EQ(s->GridSize(), 2u * 2u * 2u * 1u * 4u);
  // Start: the defaults where present (1M is not, so the first block size).
  EXPECT_EQ(s->StartPoint().block_size, 256 << 10);
  EXPECT_EQ(s->StartPoint().queue_depth, 8);
}

TEST(SweepSpace, FromJsonTakesDeepSpeedNames) {
  auto s = SweepSpace::FromJson(R"({"io_parallel": [2, 16], "sequential_requests": [true]})");
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->intra_op_parallelism, (std::vector<int>{2, 16}));
  EXPECT_EQ(s->overlap_events, (std::vector<bool>{false})) << "sequential = no overlap";
}

TEST(SweepSpace, FromJsonRefusesBrokenFilesNamingTheKey) {
  const std::map<std::string, std::string> bad = {
      {"not json", "not valid JSON"},
      {"[1, 2]", "must be a JSON object"},
      {R"({"blocksize": [1]})", "\"blocksize\": unknown key"},
      {R"({"queue_depth": 32})", "\"queue_depth\": must be a list"},
      {R"({"queue_depth": []})", "\"queue_depth\": the list is empty"},
      {R"({"queue_depth": [32, 32]})", "\"queue_depth\": a value is listed twice"},
      {R"({"queue_depth": [0]})", "\"queue_depth\""},
      {R"({"queue_depth": ["32"]})", "\"queue_depth\": values must be integers"},
      {R"({"overlap_events": ["true"]})", "\"overlap_events\": values must be JSON booleans"},
      {R"({"block_size": [0]})", "\"block_size\""},
      {R"({"block_size": ["1Q"]})", "\"block_size\""},
      {R"({"intra_op_parallelism": [1], "io_parallel": [2]})", "names the same parameter"},
  };
  for (const auto& [text, want] : bad) {
    auto s = SweepSpace::FromJson(text);
    ASSERT_FALSE(s.ok()) << text;
    EXPECT_NE(s.status().message().find(want), std::string::npos)
        << text << " -> " << s.status().message();
  }
}

TEST(SweepSpace, ApplyKeepsTheOtherKeys) {
  HandleConfig base;
  base.direct = DirectPolicy::kRequired;
  base.fdatasync_on_write = true;
  const TunePoint p{8 << 20, 32, true, true, 4};
  const HandleConfig c = p.Apply(base);
  EXPECT_EQ(c.block_size, 8 << 20);
  EXPECT_EQ(c.queue_depth, 32);
  EXPECT_TRUE(c.overlap_events);
  EXPECT_TRUE(c.single_submit);
  EXPECT_EQ(c.intra_op_parallelism, 4);
  EXPECT_EQ(c.direct, DirectPolicy::kRequired);
  EXPECT_TRUE(c.fdatasync_on_write);
  EXPECT_EQ(p.Label(), "bs=8M qd=32 overlap=1 single=1 par=4");
}

}  // namespace
}  // namespace dnvme::tune
