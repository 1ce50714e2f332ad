#include "fs/setid.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <string>

namespace dnvme::fs {

Result<bool> DropSetIdForWriter(int fd, gid_t gid, std::span<const gid_t> groups) {
  struct stat st {};
  if (fstatat(fd, "", &st, AT_EMPTY_PATH) != 0) return Status::FromErrno(errno, "fstat");
  if ((st.st_mode & (S_ISUID | S_ISGID)) == 0) return false;
  mode_t kill = st.st_mode & S_ISUID;
  const bool in_group =
      gid == st.st_gid || std::find(groups.begin(), groups.end(), st.st_gid) != groups.end();
  if ((st.st_mode & S_ISGID) && ((st.st_mode & S_IXGRP) || !in_group)) kill |= S_ISGID;
  if (kill == 0) return false;
  // Through /proc/self/fd: fchmod refuses an O_PATH descriptor, the inode's own fd at the edge.
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  if (chmod(path.c_str(), st.st_mode & 07777 & ~kill) != 0) {
    return Status::FromErrno(errno, "clearing set-user-ID/set-group-ID");
  }
  return true;
}

}  // namespace dnvme::fs
