// Helpers shared by the dnvme subcommands: size parsing and formatting, medians, the page-cache
// drop before cold reads, and the data pattern `dnvme io` writes and checks.
//
// Thread safety: pure functions, except DropPageCache (process-wide, see there).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace dnvme::cli {

inline constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// Median of the values (the mean of the middle two for an even count); 0 for none.
double Median(std::vector<double> v);

// 1610612736 -> "1.50 GiB".
std::string FormatBytes(int64_t bytes);
// 1048576 -> "1M"; sizes that are not a whole K/M/G stay in bytes.
std::string FormatSizeSuffix(int64_t bytes);

// A positive size flag ("512M"); throws UsageError naming the flag otherwise.
int64_t ParseSizeFlag(const std::string& flag, const std::string& text);

enum class DirAccess { kAny, kRead, kWrite };
// `--dir DIR` must exist, be a directory and allow `access` to the caller; throws UsageError
// naming the flag and the reason otherwise.
void CheckDirFlag(const std::string& flag, const std::string& dir, DirAccess access);

// sync(), then drops the page cache so a timed read comes from the disk. Needs root; without it
// it logs once at debug level and the read still runs. Safe to call from several threads.
void DropPageCache();

// A pattern that is a function of the byte offset only, so a later run can check a file an
// earlier one wrote. FirstPatternMismatch returns the first differing offset, or `size`.
void FillPattern(char* data, size_t size);
size_t FirstPatternMismatch(const char* data, size_t size);

}  // namespace dnvme::cli
