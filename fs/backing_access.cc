#include "fs/backing_access.h"

#include <sys/stat.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <memory>

namespace dnvme::fs {
namespace {

std::string Real(const std::string& p) {
  std::unique_ptr<char, decltype(&std::free)> r(realpath(p.c_str(), nullptr), &std::free);
  return r ? std::string(r.get()) : std::string();
}

std::string Octal(mode_t m) {
  char buf[8];
  std::snprintf(buf, sizeof(buf), "%04o", static_cast<unsigned>(m & 07777));
  return buf;
}

}  // namespace

std::vector<std::string> BackingExposure(const std::string& backing, const std::string& mountpoint,
                                         uid_t self) {
  std::vector<std::string> why;
  const std::string dir = Real(backing);
  if (dir.empty()) {
    why.push_back("BACKING_DIR '" + backing + "' cannot be resolved: " + std::strerror(errno));
    return why;
  }
  struct stat st {};
  if (stat(dir.c_str(), &st) != 0) {
    why.push_back("stat '" + dir + "': " + std::strerror(errno));
    return why;
  }
  if (st.st_uid != 0 && st.st_uid != self) {
    why.push_back("BACKING_DIR " + dir + " belongs to uid " + std::to_string(st.st_uid));
  } else if (st.st_mode & S_IWOTH) {
    why.push_back("BACKING_DIR " + dir + " is writable by every user (mode " + Octal(st.st_mode) +
                  ")");
  }
  if (Real(mountpoint) == dir) return why;  // mounted over itself: reached only through us
  // Searchable by others all the way down: any user reaches it (and writes in every directory
  // of it that it owns, such as those it made through the mount).
  for (std::string p = dir;;) {
    struct stat d {};
    if (stat(p.c_str(), &d) != 0 || !(d.st_mode & S_IXOTH)) return why;
    if (p == "/") break;
    const size_t slash = p.rfind('/');
    p = slash == 0 ? "/" : p.substr(0, slash);
  }
  why.push_back("BACKING_DIR " + dir +
                " can be reached by every user (each directory above it is searchable by "
                "others): a user can change names in its own directories behind the mount's back; "
                "mount over BACKING_DIR itself or make a directory above it mode 0700 "
                "(docs/security.md, \"Set-up\")");
  return why;
}

}  // namespace dnvme::fs
