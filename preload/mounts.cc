// Mount discovery (mounts.h).
#include "preload/mounts.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/statfs.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>

#include "preload/libc.h"
#include "preload/settings.h"

namespace dnvme::preload {
namespace {

// mountinfo escapes ' ', '\t', '\n' and '\\' as octal (\040).
std::string Unescape(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 3 < s.size() && std::isdigit(static_cast<unsigned char>(s[i + 1]))) {
      out.push_back(static_cast<char>(std::strtol(s.substr(i + 1, 3).c_str(), nullptr, 8)));
      i += 3;
    } else {
      out.push_back(s[i]);
    }
  }
  return out;
}

bool OnFuse(int fd) {
  struct statfs sfs {};
  return fstatfs(fd, &sfs) == 0 && sfs.f_type == FUSE_SUPER_MAGIC;
}

// The dnvmefs mount with device `dev`, from /proc/self/mountinfo (read with libc's own calls).
bool FindMount(dev_t dev, MountInfo* out) {
  int fd = Libc().open("/proc/self/mountinfo", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  std::string text;
  char buf[16384];
  for (;;) {
    ssize_t n = Libc().read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    text.append(buf, static_cast<size_t>(n));
  }
  Libc().close(fd);
  size_t pos = 0;
  while (pos < text.size()) {
    size_t eol = text.find('\n', pos);
    if (eol == std::string::npos) eol = text.size();
    const std::string line = text.substr(pos, eol - pos);
    pos = eol + 1;
    // id parent major:minor root mountpoint options [optional...] - fstype source superopts
    unsigned maj = 0, min = 0;
    char root[4096], point[4096];
    if (std::sscanf(line.c_str(), "%*d %*d %u:%u %4095s %4095s", &maj, &min, root, point) != 4) {
      continue;
    }
    if (makedev(maj, min) != dev) continue;
    const size_t dash = line.find(" - ");
    if (dash == std::string::npos) continue;
    if (line.compare(dash + 3, 13, "fuse.dnvmefs ") != 0) return false;
    out->dev = dev;
    out->point = Unescape(point);
    return true;
  }
  return false;
}

// Written only by SetMountProbeForTesting, before any thread reads it.
MountProbe g_probe{OnFuse, FindMount};

}  // namespace

const MountProbe& Mounts() { return g_probe; }

void SetMountProbeForTesting(const MountProbe& probe) { g_probe = probe; }

bool MountAllowed(const std::string& point) {
  const Settings& s = PreloadSettings();
  if (s.mounts.empty()) return true;
  for (const auto& m : s.mounts) {
    if (m == point) return true;
  }
  return false;
}

}  // namespace dnvme::preload
