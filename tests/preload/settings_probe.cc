// Prints what PreloadSettings() (preload/settings.h) made of this process's environment, one
// key=value a line, for tests/preload/settings_test.cc: the settings are read once per process,
// so each case runs this program with the environment it tests. With the argument "threads", the
// first call comes from eight threads at once.
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "dnvme/log.h"
#include "preload/internal.h"
#include "preload/settings.h"

int main(int argc, char** argv) {
  using dnvme::preload::PreloadSettings;
  const bool threads = argc > 1 && std::string(argv[1]) == "threads";
  bool same = true;
  if (threads) {
    std::vector<const dnvme::preload::Settings*> seen(8);
    std::vector<std::thread> ts;
    for (size_t i = 0; i < seen.size(); ++i) {
      ts.emplace_back([&seen, i] { seen[i] = &PreloadSettings(); });
    }
    for (auto& t : ts) t.join();
    for (const auto* s : seen) same = same && s == seen[0];
  }
  const dnvme::preload::Settings& s = PreloadSettings();
  std::string mounts;
  for (const auto& m : s.mounts) mounts += (mounts.empty() ? "" : "|") + m;
  const auto level = spdlog::level::to_string_view(dnvme::Logger().level());
  std::printf("enabled=%d\n", s.enabled ? 1 : 0);
  std::printf("min_bytes=%lld\n", static_cast<long long>(s.min_bytes));
  std::printf("mounts=%s\n", mounts.c_str());
  std::printf("mount_count=%zu\n", s.mounts.size());
  std::printf("stats_file=%s\n", s.stats_file.c_str());
  std::printf("config_file=%s\n", s.config_file.c_str());
  std::printf("readahead=%lld\n", static_cast<long long>(s.readahead));
  std::printf("map_fill=%lld\n", static_cast<long long>(s.map_fill));
  std::printf("cpus=%d\n", s.cpus);
  std::printf("log=%.*s\n", static_cast<int>(level.size()), level.data());
  const auto min = static_cast<size_t>(s.min_bytes);
  std::printf("large_at_min=%d\n", dnvme::preload::IsLarge(min) ? 1 : 0);
  std::printf("large_below_min=%d\n", dnvme::preload::IsLarge(min - 1) ? 1 : 0);
  std::printf("same=%d\n", same ? 1 : 0);
  return 0;
}
