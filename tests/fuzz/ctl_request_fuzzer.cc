// libFuzzer target for the control-file request parser (fs/control/ctl_protocol.h): arbitrary bytes
// must give either a checked request or an error Status, and an answer that is one JSON object;
// never a crash, a hang or a sanitizer report. Built with clang -fsanitize=fuzzer,address,undefined
// (tests/fuzz/run.sh); CI runs it for a bounded time.
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "fs/control/ctl_protocol.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto r = dnvme::fs::ParseCtlRequest(text, "/mnt/dnvme");
  std::string answer;
  if (r.ok()) {
    answer = dnvme::fs::CtlOkResponse(r->id_json, "{}");
    // Whatever was accepted is within the documented bounds.
    if (r->length < 0 || r->file_offset < 0 || r->buffer_offset < 0) __builtin_trap();
    // No accepted path has a ".." component, an empty one or a leading '/'.
    std::string_view rest = r->path;
    while (!rest.empty()) {
      const size_t slash = rest.find('/');
      const std::string_view part = rest.substr(0, slash);
      if (part == ".." || part == "." || part.empty()) __builtin_trap();
      rest = slash == std::string_view::npos ? std::string_view() : rest.substr(slash + 1);
    }
  } else {
    if (r.status().error_number() == 0) __builtin_trap();
    answer = dnvme::fs::CtlErrorResponse(dnvme::fs::ExtractCtlId(text), r.status());
  }
  auto j = nlohmann::json::parse(answer, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("ok")) __builtin_trap();
  return 0;
}
