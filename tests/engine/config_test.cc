// HandleConfig: DeepNVMe defaults, the strict JSON form, sizes with suffixes, and Validate().
#include "dnvme/config.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>

#include "tests/engine/test_util.h"

namespace dnvme {
namespace {

using Code = Status::Code;
using test::kKiB;
using test::kMiB;

// Expects `json` to be rejected as an invalid argument whose message names `key`.
void ExpectRejectedNaming(const std::string& json, const std::string& key) {
  SCOPED_TRACE(json);
  const Result<HandleConfig> r = HandleConfig::FromJson(json);
  ASSERT_FALSE(r.ok()) << "accepted: " << json;
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << r.status().ToString();
  EXPECT_NE(r.status().message().find(key), std::string::npos)
      << "error does not name the key '" << key << "': " << r.status().message();
}

TEST(ConfigTest, DefaultsAreDeepNvmes) {
  const HandleConfig c;
  EXPECT_EQ(c.block_size, 1 * kMiB);
  EXPECT_EQ(c.queue_depth, 128);
  EXPECT_FALSE(c.single_submit);
  EXPECT_FALSE(c.overlap_events);
  EXPECT_EQ(c.intra_op_parallelism, 1);
  EXPECT_EQ(c.direct, DirectPolicy::kAuto);
  EXPECT_FALSE(c.fdatasync_on_write);
  EXPECT_EQ(c.bounce_bytes_per_worker, 64 * kMiB);
  DNVME_EXPECT_OK(c.Validate());
}

TEST(ConfigTest, EmptyObjectGivesDefaults) {
  const Result<HandleConfig> r = HandleConfig::FromJson("{}");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r.value(), HandleConfig{});
}

TEST(ConfigTest, PartialObjectChangesOnlyItsKeysOfTheBase) {
  HandleConfig base;
  base.queue_depth = 32;
  base.intra_op_parallelism = 4;
  const Result<HandleConfig> r = HandleConfig::FromJson(R"({"block_size": "256K"})", base);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->block_size, 256 * kKiB);
  EXPECT_EQ(r->queue_depth, 32);
  EXPECT_EQ(r->intra_op_parallelism, 4);
  // A bad key still fails and names the key, base or not.
  const Result<HandleConfig> bad = HandleConfig::FromJson(R"({"queue_depth": 0})", base);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("queue_depth"), std::string::npos)
      << bad.status().ToString();
}

TEST(ConfigTest, DefaultJsonRoundTrips) {
  const HandleConfig c;
  const Result<HandleConfig> r = HandleConfig::FromJson(c.ToJson());
  ASSERT_TRUE(r.ok()) << r.status().ToString() << "\njson: " << c.ToJson();
  EXPECT_EQ(r.value(), c);
}

TEST(ConfigTest, NonDefaultJsonRoundTrips) {
  HandleConfig c;
  c.block_size = 256 * kKiB;
  c.queue_depth = 32;
  c.single_submit = true;
  c.overlap_events = true;
  c.intra_op_parallelism = 8;
  c.direct = DirectPolicy::kRequired;
  c.fdatasync_on_write = true;
  c.bounce_bytes_per_worker = 8 * kMiB;
  DNVME_ASSERT_OK(c.Validate());
  const std::string json = c.ToJson();
  const Result<HandleConfig> r = HandleConfig::FromJson(json);
  ASSERT_TRUE(r.ok()) << r.status().ToString() << "\njson: " << json;
  EXPECT_EQ(r.value(), c) << "json: " << json;
}

TEST(ConfigTest, ToJsonHasEveryKey) {
  HandleConfig c;
  c.direct = DirectPolicy::kNever;
  const std::string json = c.ToJson();
  for (const char* key :
       {"block_size", "queue_depth", "single_submit", "overlap_events", "intra_op_parallelism",
        "direct", "fdatasync_on_write", "bounce_bytes_per_worker"}) {
    EXPECT_NE(json.find(std::string("\"") + key + "\""), std::string::npos)
        << key << " missing from " << json;
  }
  EXPECT_NE(json.find("\"never\""), std::string::npos) << json;
}

TEST(ConfigTest, AppliesEveryKey) {
  const Result<HandleConfig> r = HandleConfig::FromJson(R"({
      "block_size": 524288, "queue_depth": 64, "single_submit": true, "overlap_events": true,
      "intra_op_parallelism": 4, "direct": "never", "fdatasync_on_write": true,
      "bounce_bytes_per_worker": 2097152 })");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const HandleConfig& c = r.value();
  EXPECT_EQ(c.block_size, 512 * kKiB);
  EXPECT_EQ(c.queue_depth, 64);
  EXPECT_TRUE(c.single_submit);
  EXPECT_TRUE(c.overlap_events);
  EXPECT_EQ(c.intra_op_parallelism, 4);
  EXPECT_EQ(c.direct, DirectPolicy::kNever);
  EXPECT_TRUE(c.fdatasync_on_write);
  EXPECT_EQ(c.bounce_bytes_per_worker, 2 * kMiB);
}

// The key table (ConfigKeys) is what every consumer reads: each key must change exactly its
// own field through the text form (-o) and survive the JSON round trip, and the table must name
// exactly the keys ToJson writes.
TEST(ConfigKeysTest, TableMatchesJsonAndEveryKeyChangesItsField) {
  const nlohmann::json all = nlohmann::json::parse(HandleConfig{}.ToJson());
  ASSERT_EQ(all.size(), ConfigKeys().size());
  std::set<std::string> names;
  for (const ConfigKey& k : ConfigKeys()) {
    SCOPED_TRACE(k.name);
    EXPECT_TRUE(names.insert(k.name).second) << "declared twice";
    EXPECT_TRUE(all.contains(k.name));
    EXPECT_EQ(FindConfigKey(k.name), &k);
    EXPECT_GT(std::strlen(k.help), 10u);
    // A value different from the default, in the text form.
    std::optional<std::string> text;
    switch (k.type) {
      case ConfigValueType::kSize:
        text = "2M";
        break;
      case ConfigValueType::kInt:
        text = "3";
        break;
      case ConfigValueType::kBool:
        text = std::nullopt;  // the bare option: true (every boolean defaults to false)
        break;
      case ConfigValueType::kDirect:
        text = "required";
        break;
    }
    HandleConfig c;
    ASSERT_TRUE(SetConfigKeyFromText(&c, k.name, text).ok());
    ASSERT_TRUE(c.Validate().ok());
    const nlohmann::json changed = nlohmann::json::parse(c.ToJson());
    for (const auto& [name, value] : all.items()) {
      if (name == k.name) {
        EXPECT_NE(changed[name], value) << "did not change";
      } else {
        EXPECT_EQ(changed[name], value) << "changed " << name << " too";
      }
    }
    auto back = HandleConfig::FromJson(c.ToJson());
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(back.value(), c);
  }
  EXPECT_EQ(FindConfigKey("blocksize"), nullptr);
  EXPECT_EQ(ConfigKeyNames(true),
            "block_size, queue_depth, intra_op_parallelism, single_submit, overlap_events");
}

TEST(ConfigKeysTest, TextFormErrorsNameTheKey) {
  HandleConfig c;
  auto expect_error = [&](const char* key, std::optional<std::string> v, const char* what) {
    Status st = SetConfigKeyFromText(&c, key, v);
    EXPECT_FALSE(st.ok()) << key;
    EXPECT_NE(st.message().find(key), std::string::npos) << st.ToString();
    EXPECT_NE(st.message().find(what), std::string::npos) << st.ToString();
  };
  expect_error("queue_depth", std::string("many"), "not an integer");
  expect_error("queue_depth", std::string("99999999999"), "not an integer");
  expect_error("queue_depth", std::nullopt, "needs a value");
  expect_error("block_size", std::string("1X"), "invalid size");
  expect_error("single_submit", std::string("maybe"), "not a boolean");
  expect_error("direct", std::string("sometimes"), "auto, required, never");
  expect_error("blocksize", std::string("1M"), "unknown engine option");
  EXPECT_EQ(c, HandleConfig{}) << "a refused value changes nothing";
  ASSERT_TRUE(SetConfigKeyFromText(&c, "overlap_events", std::string("yes")).ok());
  EXPECT_TRUE(c.overlap_events);
  ASSERT_TRUE(SetConfigKeyFromText(&c, "overlap_events", std::string("0")).ok());
  EXPECT_FALSE(c.overlap_events);
}

TEST(ConfigTest, PartialObjectKeepsOtherDefaults) {
  const Result<HandleConfig> r = HandleConfig::FromJson(R"({"queue_depth": 8})");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  HandleConfig want;
  want.queue_depth = 8;
  EXPECT_EQ(r.value(), want);
}

TEST(ConfigTest, SizesAsStrings) {
  {
    const Result<HandleConfig> r = HandleConfig::FromJson(R"({"block_size": "8M"})");
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->block_size, 8 * kMiB);
  }
  {
    const Result<HandleConfig> r = HandleConfig::FromJson(R"({"block_size": "64k"})");
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->block_size, 64 * kKiB);
  }
  {
    const Result<HandleConfig> r = HandleConfig::FromJson(R"({"bounce_bytes_per_worker": "1G"})");
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->bounce_bytes_per_worker, 1024 * kMiB);
  }
  {
    const Result<HandleConfig> r = HandleConfig::FromJson(R"({"block_size": "4096"})");
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->block_size, 4096);
  }
}

TEST(ConfigTest, BadSizeStringIsRejectedNamingKey) {
  ExpectRejectedNaming(R"({"block_size": "8Q"})", "block_size");
  ExpectRejectedNaming(R"({"block_size": "-1M"})", "block_size");
  ExpectRejectedNaming(R"({"bounce_bytes_per_worker": ""})", "bounce_bytes_per_worker");
}

TEST(ConfigTest, UnknownKeyIsRejected) {
  ExpectRejectedNaming(R"({"block_size": 4096, "blocksize": 4096})", "blocksize");
  ExpectRejectedNaming(R"({"queue_dpeth": 4})", "queue_dpeth");
}

TEST(ConfigTest, WrongTypesAreRejected) {
  ExpectRejectedNaming(R"({"single_submit": "true"})", "single_submit");
  ExpectRejectedNaming(R"({"overlap_events": 1})", "overlap_events");
  ExpectRejectedNaming(R"({"fdatasync_on_write": null})", "fdatasync_on_write");
  ExpectRejectedNaming(R"({"queue_depth": 1.5})", "queue_depth");
  ExpectRejectedNaming(R"({"queue_depth": "8"})", "queue_depth");
  ExpectRejectedNaming(R"({"intra_op_parallelism": 2.5})", "intra_op_parallelism");
  ExpectRejectedNaming(R"({"intra_op_parallelism": true})", "intra_op_parallelism");
  ExpectRejectedNaming(R"({"block_size": 4096.5})", "block_size");
  ExpectRejectedNaming(R"({"block_size": [4096]})", "block_size");
  ExpectRejectedNaming(R"({"direct": true})", "direct");
}

TEST(ConfigTest, OutOfRangeValuesAreRejected) {
  ExpectRejectedNaming(R"({"queue_depth": 0})", "queue_depth");
  ExpectRejectedNaming(R"({"queue_depth": -3})", "queue_depth");
  ExpectRejectedNaming(R"({"queue_depth": 4097})", "queue_depth");
  ExpectRejectedNaming(R"({"block_size": 0})", "block_size");
  ExpectRejectedNaming(R"({"block_size": -4096})", "block_size");
  ExpectRejectedNaming(R"({"block_size": "2G"})", "block_size");
  ExpectRejectedNaming(R"({"intra_op_parallelism": 0})", "intra_op_parallelism");
  ExpectRejectedNaming(R"({"intra_op_parallelism": 257})", "intra_op_parallelism");
  ExpectRejectedNaming(R"({"queue_depth": 99999999999})", "queue_depth");  // overflows int
}

TEST(ConfigTest, RangeLimitsAreInclusive) {
  const Result<HandleConfig> r =
      HandleConfig::FromJson(R"({"queue_depth": 4096, "intra_op_parallelism": 256})");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->queue_depth, 4096);
  EXPECT_EQ(r->intra_op_parallelism, 256);
  const Result<HandleConfig> low = HandleConfig::FromJson(
      R"({"queue_depth": 1, "intra_op_parallelism": 1, "block_size": 4096})");
  ASSERT_TRUE(low.ok()) << low.status().ToString();
  // DeepSpeed accepts any positive block size (its tests use 1K): so does the config.
  for (const char* bs :
       {R"({"block_size": 1})", R"({"block_size": 1000})", R"({"block_size": "1K"})",
        R"({"block_size": 6144})", R"({"block_size": "1G"})"}) {
    const Result<HandleConfig> any = HandleConfig::FromJson(bs);
    EXPECT_TRUE(any.ok()) << bs << ": " << any.status().ToString();
  }
}

TEST(ConfigTest, ValidateNamesTheKey) {
  struct Case {
    const char* key;
    void (*mutate)(HandleConfig*);
  };
  const Case cases[] = {
      {"block_size", [](HandleConfig* c) { c->block_size = int64_t{2} << 30; }},
      {"block_size", [](HandleConfig* c) { c->block_size = 0; }},
      {"queue_depth", [](HandleConfig* c) { c->queue_depth = 0; }},
      {"queue_depth", [](HandleConfig* c) { c->queue_depth = 5000; }},
      {"intra_op_parallelism", [](HandleConfig* c) { c->intra_op_parallelism = 0; }},
      {"intra_op_parallelism", [](HandleConfig* c) { c->intra_op_parallelism = 300; }},
  };
  for (const Case& k : cases) {
    HandleConfig c;
    k.mutate(&c);
    const Status st = c.Validate();
    EXPECT_EQ(st.code(), Code::kInvalidArgument) << k.key << ": " << st.ToString();
    EXPECT_NE(st.message().find(k.key), std::string::npos) << st.message();
  }
}

TEST(ConfigTest, NotAnObjectOrBrokenJsonIsRejected) {
  for (const char* bad : {"", "[1, 2]", "42", "\"block_size\"", "{\"queue_depth\": 4",
                          "{queue_depth: 4}", "{\"queue_depth\": 4,}"}) {
    const Result<HandleConfig> r = HandleConfig::FromJson(bad);
    EXPECT_FALSE(r.ok()) << "accepted: '" << bad << "'";
    if (!r.ok()) {
      EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << r.status().ToString();
      EXPECT_FALSE(r.status().message().empty());
    }
  }
}

TEST(ConfigTest, DirectPolicyNames) {
  const struct {
    const char* name;
    DirectPolicy policy;
  } cases[] = {{"auto", DirectPolicy::kAuto},
               {"required", DirectPolicy::kRequired},
               {"never", DirectPolicy::kNever}};
  for (const auto& c : cases) {
    const Result<DirectPolicy> p = ParseDirectPolicy(c.name);
    ASSERT_TRUE(p.ok()) << c.name << ": " << p.status().ToString();
    EXPECT_EQ(p.value(), c.policy);
    EXPECT_STREQ(DirectPolicyName(c.policy), c.name);

    const Result<HandleConfig> r =
        HandleConfig::FromJson(std::string(R"({"direct": ")") + c.name + "\"}");
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->direct, c.policy);
  }
  for (const char* bad : {"", "Auto ", "always", "direct", "1"}) {
    const Result<DirectPolicy> p = ParseDirectPolicy(bad);
    EXPECT_FALSE(p.ok()) << "accepted '" << bad << "'";
    if (!p.ok()) {
      EXPECT_EQ(p.status().code(), Code::kInvalidArgument);
    }
  }
  ExpectRejectedNaming(R"({"direct": "sometimes"})", "direct");
}

// ---- ParseSize
// -------------------------------------------------------------------------------------

TEST(ParseSizeTest, Good) {
  const struct {
    const char* text;
    int64_t want;
  } cases[] = {
      {"0", 0},
      {"4096", 4096},
      {"64k", 64 * kKiB},
      {"64K", 64 * kKiB},
      {"1M", kMiB},
      {"1MiB", kMiB},
      {"8M", 8 * kMiB},
      {"2G", 2048 * kMiB},
      {"1G", 1024 * kMiB},
      {"1T", int64_t{1} << 40},
  };
  for (const auto& c : cases) {
    const Result<int64_t> r = ParseSize(c.text);
    ASSERT_TRUE(r.ok()) << "'" << c.text << "': " << r.status().ToString();
    EXPECT_EQ(r.value(), c.want) << c.text;
  }
}

TEST(ParseSizeTest, Bad) {
  for (const char* bad :
       {"", "-1", "-4096", "1X", "M", "1.5M", "abc", "12 34", "0x10", "99999999999999999999G",
        "99999999999999999999", "9999999999T", "8388608T"}) {
    const Result<int64_t> r = ParseSize(bad);
    EXPECT_FALSE(r.ok()) << "'" << bad << "' parsed as " << (r.ok() ? r.value() : 0);
    if (!r.ok()) {
      EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << r.status().ToString();
      EXPECT_FALSE(r.status().message().empty());
    }
  }
}

TEST(ParseSizeTest, LargestValues) {
  const Result<int64_t> r = ParseSize("8388607T");  // 2^63 - 2^40
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r.value(), int64_t{8388607} << 40);
  const Result<int64_t> m = ParseSize("9223372036854775807");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m.value(), INT64_MAX);
}

// ---- FromJsonFile
// ----------------------------------------------------------------------------------

class ConfigFileTest : public test::ScratchTest {
 protected:
  std::string WriteText(const std::string& name, const std::string& text) {
    const std::string path = Path(name);
    std::ofstream(path) << text;
    return path;
  }
};

TEST_F(ConfigFileTest, ReadsFile) {
  const std::string path =
      WriteText("cfg.json", R"({"block_size": "2M", "queue_depth": 16, "direct": "required"})");
  const Result<HandleConfig> r = HandleConfig::FromJsonFile(path);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->block_size, 2 * kMiB);
  EXPECT_EQ(r->queue_depth, 16);
  EXPECT_EQ(r->direct, DirectPolicy::kRequired);
}

TEST_F(ConfigFileTest, MissingFileIsNotFoundNamingPath) {
  const std::string path = Path("does-not-exist.json");
  const Result<HandleConfig> r = HandleConfig::FromJsonFile(path);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kNotFound) << r.status().ToString();
  EXPECT_NE(r.status().message().find(path), std::string::npos) << r.status().message();
}

TEST_F(ConfigFileTest, BrokenJsonNamesPath) {
  const std::string path = WriteText("broken.json", "{\"block_size\": 4096,\n  \"queue_depth\": ");
  const Result<HandleConfig> r = HandleConfig::FromJsonFile(path);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << r.status().ToString();
  EXPECT_NE(r.status().message().find(path), std::string::npos) << r.status().message();
}

TEST_F(ConfigFileTest, BadValueInFileNamesKeyAndPath) {
  const std::string path = WriteText("bad.json", R"({"queue_depth": 0})");
  const Result<HandleConfig> r = HandleConfig::FromJsonFile(path);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << r.status().ToString();
  EXPECT_NE(r.status().message().find("queue_depth"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find(path), std::string::npos) << r.status().message();
}

}  // namespace
}  // namespace dnvme
