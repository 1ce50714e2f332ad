// The library's settings (preload/settings.h): what each DNVME_PRELOAD_* variable sets, what a
// value it cannot use leaves (the default), the CPUs of the affinity mask, the log level. The
// settings are read once per process, so each case runs tests/preload/settings_probe.cc with
// exactly the environment it tests and reads what it printed.
#include <fcntl.h>
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

extern char** environ;

namespace dnvme::preload {
namespace {

using Env = std::vector<std::pair<std::string, std::string>>;
using Printed = std::map<std::string, std::string>;

struct ProbeRun {
  Env env;
  const cpu_set_t* cpus = nullptr;  // the probe's affinity mask; null: the test's own
  bool threads = false;             // the first call from eight threads at once
};

// The probe's key=value lines, run with `run.env` only (and the sanitizers' options).
Printed ProbeWith(const ProbeRun& run) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string v = *e;
    for (const char* keep : {"ASAN_", "UBSAN_", "LSAN_", "TSAN_", "LD_LIBRARY_PATH="}) {
      if (v.rfind(keep, 0) == 0) env.push_back(v);
    }
  }
  for (const auto& [k, v] : run.env) env.push_back(k + "=" + v);
  std::vector<char*> envp;
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::string arg0 = DNVME_SETTINGS_PROBE;
  std::string arg1 = "threads";
  std::vector<char*> argv = {arg0.data(), run.threads ? arg1.data() : nullptr, nullptr};

  int out[2];
  if (pipe2(out, O_CLOEXEC) != 0) {
    ADD_FAILURE() << "pipe: " << strerror(errno);
    return {};
  }
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(out[1], STDOUT_FILENO);
    if (run.cpus != nullptr && sched_setaffinity(0, sizeof(cpu_set_t), run.cpus) != 0) _exit(126);
    execve(argv[0], argv.data(), envp.data());
    _exit(127);
  }
  close(out[1]);
  std::string text;
  char buf[4096];
  ssize_t n;
  while ((n = read(out[0], buf, sizeof(buf))) > 0 || (n < 0 && errno == EINTR)) {
    if (n > 0) text.append(buf, static_cast<size_t>(n));
  }
  close(out[0]);
  int status = 0;
  EXPECT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << DNVME_SETTINGS_PROBE << " ended with status " << status;
  Printed printed;
  size_t at = 0;
  while (at < text.size()) {
    size_t nl = text.find('\n', at);
    if (nl == std::string::npos) nl = text.size();
    const std::string line = text.substr(at, nl - at);
    const size_t eq = line.find('=');
    if (eq != std::string::npos) printed[line.substr(0, eq)] = line.substr(eq + 1);
    at = nl + 1;
  }
  return printed;
}

Printed Probe(Env env) { return ProbeWith(ProbeRun{std::move(env)}); }

TEST(PreloadSettings, DefaultsWithoutTheEnvironment) {
  Printed p = Probe(Env{});
  EXPECT_EQ(p["enabled"], "1");
  EXPECT_EQ(p["min_bytes"], std::to_string(128 << 10));
  EXPECT_EQ(p["mount_count"], "0");  // every mount
  EXPECT_EQ(p["stats_file"], "");
  EXPECT_EQ(p["config_file"], "");
  EXPECT_EQ(p["readahead"], std::to_string(32 << 20));
  EXPECT_EQ(p["map_fill"], "0");  // off
  EXPECT_GE(std::stoi(p["cpus"]), 1);
  EXPECT_EQ(p["log"], "warning");
  EXPECT_EQ(p["large_at_min"], "1");
  EXPECT_EQ(p["large_below_min"], "0");
}

TEST(PreloadSettings, DisableTakesAnyValueButZero) {
  for (const char* v : {"1", "yes", "true"}) {
    EXPECT_EQ(Probe({{"DNVME_PRELOAD_DISABLE", v}})["enabled"], "0") << v;
  }
  for (const char* v : {"0", ""}) {
    EXPECT_EQ(Probe({{"DNVME_PRELOAD_DISABLE", v}})["enabled"], "1") << "'" << v << "'";
  }
}

TEST(PreloadSettings, MinBytesTakesAPositiveNumberAndNothingElse) {
  Printed p = Probe({{"DNVME_PRELOAD_MIN_BYTES", "4096"}});
  EXPECT_EQ(p["min_bytes"], "4096");
  EXPECT_EQ(p["large_at_min"], "1");  // IsLarge: this many bytes and more
  EXPECT_EQ(p["large_below_min"], "0");
  for (const char* v : {"0", "-4096", "4k", "4096 ", "x", ""}) {
    EXPECT_EQ(Probe({{"DNVME_PRELOAD_MIN_BYTES", v}})["min_bytes"], std::to_string(128 << 10))
        << "'" << v << "' keeps the default";
  }
}

TEST(PreloadSettings, MountsAreColonSeparatedWithoutTrailingSlashes) {
  Printed p = Probe({{"DNVME_PRELOAD_MOUNTS", "/mnt/a:/mnt/b/::/mnt/c//:/"}});
  EXPECT_EQ(p["mounts"], "/mnt/a|/mnt/b|/mnt/c|/");
  EXPECT_EQ(p["mount_count"], "4");  // the empty entry is no mount
  EXPECT_EQ(Probe({{"DNVME_PRELOAD_MOUNTS", "///"}})["mounts"], "/");
  EXPECT_EQ(Probe({{"DNVME_PRELOAD_MOUNTS", ":"}})["mount_count"], "0");
}

TEST(PreloadSettings, ReadaheadAndMapFillTakeZeroAndKeepTheirDefaultOnJunk) {
  Printed p = Probe({{"DNVME_PRELOAD_READAHEAD", "0"}, {"DNVME_PRELOAD_MAP_FILL", "1048576"}});
  EXPECT_EQ(p["readahead"], "0");  // off
  EXPECT_EQ(p["map_fill"], "1048576");
  p = Probe({{"DNVME_PRELOAD_READAHEAD", "-1"}, {"DNVME_PRELOAD_MAP_FILL", "1M"}});
  EXPECT_EQ(p["readahead"], std::to_string(32 << 20));
  EXPECT_EQ(p["map_fill"], "0");
  EXPECT_EQ(Probe({{"DNVME_PRELOAD_READAHEAD", "8388608"}})["readahead"], "8388608");
}

TEST(PreloadSettings, StatsAndConfigFilesAreTakenAsGiven) {
  Printed p = Probe({{"DNVME_PRELOAD_STATS", "/var/tmp/stats file.jsonl"},
                     {"DNVME_PRELOAD_CONFIG", "relative/engine.json"}});
  EXPECT_EQ(p["stats_file"], "/var/tmp/stats file.jsonl");
  EXPECT_EQ(p["config_file"], "relative/engine.json");
}

TEST(PreloadSettings, TheLogLevelIsSetAndABadOneKeepsTheDefault) {
  EXPECT_EQ(Probe({{"DNVME_PRELOAD_LOG", "debug"}})["log"], "debug");
  EXPECT_EQ(Probe({{"DNVME_PRELOAD_LOG", "error"}})["log"], "error");
  EXPECT_EQ(Probe({{"DNVME_PRELOAD_LOG", "loud"}})["log"], "warning");
}

TEST(PreloadSettings, CpusAreThoseOfTheAffinityMask) {
  cpu_set_t mine;
  CPU_ZERO(&mine);
  ASSERT_EQ(sched_getaffinity(0, sizeof(mine), &mine), 0);
  ProbeRun all;
  all.cpus = &mine;
  EXPECT_EQ(ProbeWith(all)["cpus"], std::to_string(CPU_COUNT(&mine)));
  cpu_set_t one;
  CPU_ZERO(&one);
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &mine)) {
      CPU_SET(c, &one);
      break;
    }
  }
  ProbeRun pinned;
  pinned.cpus = &one;  // taskset -c N
  EXPECT_EQ(ProbeWith(pinned)["cpus"], "1");
}

TEST(PreloadSettings, FirstCallsFromManyThreadsShareOneReading) {
  ProbeRun run;
  run.env = {{"DNVME_PRELOAD_MIN_BYTES", "65536"}};
  run.threads = true;
  Printed p = ProbeWith(run);
  EXPECT_EQ(p["same"], "1");
  EXPECT_EQ(p["min_bytes"], "65536");
}

}  // namespace
}  // namespace dnvme::preload
