// Space for writes acknowledged before they land (space.h).
#include "datapath/space.h"

#include <fcntl.h>
#include <linux/fiemap.h>
#include <linux/fs.h>
#include <linux/magic.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#include "dnvme/identity.h"

namespace dnvme::datapath {
namespace {

constexpr int64_t kPage = 4096;
// How far past a write inside the file the first look for its blocks goes: a writer that goes on
// through an existing file is covered by one look per this much (FIEMAP answers 32 extents a
// call; ext4's are up to 128 MiB).
constexpr int64_t kLookAhead = int64_t{1} << 30;
// A step ahead takes at most this share of the space users have free (StepAhead).
constexpr int64_t kFreeShare = 16;

bool OutOfSpace(int err) { return err == ENOSPC || err == EDQUOT; }
bool Unsupported(int err) { return err == EOPNOTSUPP || err == ENOSYS || err == ENOTTY; }

// fallocate(2), or the tests' stand-in (SpaceOptions::fallocate): 0 or the errno.
int Fallocate(const SpaceOptions& opts, int fd, int mode, int64_t off, int64_t len) {
  int (*const call)(int, int, off_t, off_t) =
      opts.fallocate != nullptr ? opts.fallocate : ::fallocate;
  int rc;
  do {
    rc = call(fd, mode, off, len);
  } while (rc != 0 && errno == EINTR);
  return rc == 0 ? 0 : errno;
}

int Ftruncate(int fd, int64_t size) {
  int rc;
  do {
    rc = ::ftruncate(fd, size);
  } while (rc != 0 && errno == EINTR);
  return rc == 0 ? 0 : errno;
}

// The end of the run of blocks the file holds from `off` (written, unwritten or delayed
// allocation), looking no further than `to`; `off` itself when it starts in a hole. `*shared`:
// the run ends at an extent shared with another file (overwriting it needs new blocks).
// FIEMAP, else SEEK_HOLE (tmpfs has no FIEMAP; SEEK_HOLE may call an unwritten extent a hole,
// which only costs a fallocate that finds the blocks there).
Result<int64_t> BackedUntil(int fd, int64_t off, int64_t to, bool* shared) {
  constexpr unsigned kExtents = 32;
  alignas(struct fiemap) char buf[sizeof(struct fiemap) + kExtents * sizeof(struct fiemap_extent)];
  auto* fm = reinterpret_cast<struct fiemap*>(buf);
  const struct fiemap_extent* ext = fm->fm_extents;
  int64_t pos = off;
  while (pos < to) {
    std::memset(buf, 0, sizeof(buf));
    fm->fm_start = static_cast<uint64_t>(pos);
    fm->fm_length = static_cast<uint64_t>(to - pos);
    fm->fm_extent_count = kExtents;
    if (ioctl(fd, FS_IOC_FIEMAP, fm) != 0) {
      if (pos != off || !Unsupported(errno)) {
        if (pos != off) return pos;
        return Status::FromErrno(errno, "FIEMAP of the backing file");
      }
      const off_t hole = lseek(fd, off, SEEK_HOLE);
      if (hole < 0) {
        if (errno == ENXIO) return off;  // at or past the end
        return Status::FromErrno(errno, "SEEK_HOLE of the backing file");
      }
      return std::min<int64_t>(hole, to);
    }
    if (fm->fm_mapped_extents == 0) return pos;
    for (unsigned i = 0; i < fm->fm_mapped_extents; ++i) {
      const fiemap_extent& e = ext[i];
      const auto start = static_cast<int64_t>(e.fe_logical);
      if (start > pos) return pos;  // a hole first
      if ((e.fe_flags & FIEMAP_EXTENT_SHARED) != 0) {
        *shared = true;
        return pos;
      }
      pos = std::max(pos, start + static_cast<int64_t>(e.fe_length));
      if ((e.fe_flags & FIEMAP_EXTENT_LAST) != 0) return std::min(pos, to);
    }
    if (fm->fm_mapped_extents < kExtents) return std::min(pos, to);
  }
  return to;
}

// The longest prefix of [from, to) that fallocate(KEEP_SIZE) can back, in pieces halved down to
// a page at each refusal for space: its end, `from` when none fits. `*err`: the refusal's errno
// (0 when all of it fit, for space: ENOSPC/EDQUOT; another errno stops the search).
int64_t FitPrefix(const SpaceOptions& opts, int fd, int64_t from, int64_t to, int* err) {
  int64_t at = from;
  int64_t piece = to - from;
  *err = 0;
  while (at < to) {
    const int64_t n = std::min(piece, to - at);
    const int e = Fallocate(opts, fd, FALLOC_FL_KEEP_SIZE, at, n);
    if (e == 0) {
      at += n;
      continue;
    }
    *err = e;
    if (!OutOfSpace(e) || piece <= kPage) break;
    piece = std::max(kPage, piece / 2 / kPage * kPage);
  }
  return at;
}

// How far past the end a lone writer's reservation reaches: as much again as the file holds
// (step_min..step_max), so a growing file takes a few steps (each empties the write-behind's
// pipeline: space.h), but never more than a sixteenth of what the file system has free for
// users, so other writers of a nearly full one still find the space a write of theirs needs
// until this writer's release gives back what it did not use.
int64_t StepAhead(const SpaceOptions& opts, int fd, int64_t size) {
  int64_t step = std::clamp(size, opts.step_min, opts.step_max);
  struct statvfs sv {};
  if (fstatvfs(fd, &sv) == 0) {
    step = std::min(
        step, static_cast<int64_t>(sv.f_bavail) * static_cast<int64_t>(sv.f_frsize) / kFreeShare);
  }
  return std::max<int64_t>(0, step / kPage * kPage);
}

}  // namespace

bool SpaceBudget::Allows(int fd, dev_t dev, int64_t len, int64_t unlanded) {
  const auto now = std::chrono::steady_clock::now();
  std::lock_guard lock(mu_);
  auto it =
      std::find_if(looks_.begin(), looks_.end(), [dev](const Look& l) { return l.dev == dev; });
  auto fits = [&](const Look& l) { return l.avail - l.allowed - len >= 2 * unlanded + kMargin; };
  if (it == looks_.end() || now - it->at > kFresh || !fits(*it)) {
    struct statvfs sv {};
    int rc;
    do {
      rc = fstatvfs(fd, &sv);
    } while (rc != 0 && errno == EINTR);
    if (rc != 0) return false;
    if (it == looks_.end()) {
      if (looks_.size() >= kLooks) {
        looks_.erase(std::min_element(looks_.begin(), looks_.end(),
                                      [](const Look& a, const Look& b) { return a.at < b.at; }));
      }
      looks_.push_back(Look{});
      it = looks_.end() - 1;
    }
    it->dev = dev;
    it->at = now;
    it->avail = static_cast<int64_t>(sv.f_bavail) * static_cast<int64_t>(sv.f_frsize);
    it->allowed = 0;
  }
  if (!fits(*it)) return false;
  it->allowed += len;
  return true;
}

void SpaceReservation::CoverLocked(int64_t a, int64_t b) {
  if (a >= b) return;
  if (hi_ > lo_ && b >= lo_ && a <= hi_) {
    lo_ = std::min(lo_, a);
    hi_ = std::max(hi_, b);
  } else {
    lo_ = a;
    hi_ = b;
  }
}

Status SpaceReservation::ExtendLocked(int fd, int64_t size, int64_t end) {
  if (end <= size) return Status::Ok();
  if (const int e = Ftruncate(fd, end); e != 0) {
    return Status::FromErrno(e, "extending the backing file");
  }
  size_seen_ = end;
  return Status::Ok();
}

void SpaceReservation::ForgetLocked() {
  lo_ = hi_ = 0;
  size_seen_ = -1;
  epoch_.fetch_add(1, std::memory_order_acq_rel);
}

void SpaceReservation::Forget() {
  std::lock_guard lock(mu_);
  ForgetLocked();
}

bool SpaceReservation::holds_past_eof() {
  std::lock_guard lock(mu_);
  return past_eof_;
}

Result<SpaceReservation::Grant> SpaceReservation::BudgetLocked(const SpaceOptions& opts,
                                                               SpaceBudget* budget,
                                                               const FileRef& file, int64_t off,
                                                               int64_t len, int64_t size,
                                                               dev_t dev) {
  const uint64_t epoch = epoch_.load(std::memory_order_relaxed);
  if (budget == nullptr || !budget->Allows(file.buffered_fd(), dev, len, opts.unlanded_max)) {
    return Grant{len, /*through=*/true, epoch};
  }
  const int64_t end = off + len;
  if (opts.extend) DNVME_RETURN_IF_ERROR(ExtendLocked(file.buffered_fd(), size, end));
  return Grant{len, false, epoch};
}

Result<SpaceReservation::Grant> SpaceReservation::Reserve(const SpaceOptions& opts,
                                                          SpaceBudget* budget, const FileRef& file,
                                                          int64_t off, int64_t len, bool alone) {
  std::lock_guard lock(mu_);
  const uint64_t epoch = epoch_.load(std::memory_order_relaxed);
  if (!opts.reserve || len <= 0) return Grant{std::max<int64_t>(len, 0), false, epoch};
  const int64_t end = off + len;
  // The common case, a writer going on within what is known backed: no system call (the mount),
  // or one fstat, which tells whether the size must move and whether someone shrank the file.
  const bool covered = !no_fallocate_ && copies_on_write_ >= 0 && lo_ <= off && end <= hi_;
  if (covered && !opts.extend) return Grant{len, false, epoch};
  const int fd = file.buffered_fd();
  struct stat sb {};
  if (fstat(fd, &sb) != 0) return Status::FromErrno(errno, "fstat of the backing file");
  const int64_t size = sb.st_size;
  if (size < size_seen_) {  // shrunk behind our back: the blocks past the new end went with it
    lo_ = hi_ = 0;
  } else if (covered) {
    size_seen_ = size;
    DNVME_RETURN_IF_ERROR(ExtendLocked(fd, size, end));
    return Grant{len, false, epoch};
  }
  size_seen_ = size;
  if (copies_on_write_ < 0) {
    struct statfs fs {};
    copies_on_write_ = fstatfs(fd, &fs) == 0 && fs.f_type == BTRFS_SUPER_MAGIC ? 1 : 0;
  }
  if (no_fallocate_) return BudgetLocked(opts, budget, file, off, len, size, sb.st_dev);

  // As the writer: its quota and its share of the file system (dnvme/identity.h).
  DNVME_ASSIGN_OR_RETURN(ScopedFsIdentity as, ScopedFsIdentity::EnterIf(file.write_identity()));
  (void)as;
  int64_t granted = end;  // the grant ends here
  int refused = 0;        // fallocate's errno when it refused part of the write
  // Inside the file: the blocks it holds already, holes filled exactly.
  const int64_t inside_end = std::min(end, size);
  if (off < inside_end && !(lo_ <= off && inside_end <= hi_)) {
    bool shared = false;
    DNVME_ASSIGN_OR_RETURN(
        int64_t backed,
        BackedUntil(fd, off, std::min(size, std::max(end, off + kLookAhead)), &shared));
    if (copies_on_write_ == 1 || shared) {
      // The blocks are there, but an overwrite takes new ones: only the budget can tell, for
      // every such write (the range is not marked backed). The part past the end, if any, is
      // reserved below as well.
      Result<Grant> g = BudgetLocked(opts, budget, file, off, len, size, sb.st_dev);
      if (!g.ok() || g->through) return g;
    } else if (backed < inside_end) {
      const int64_t fit = FitPrefix(opts, fd, backed, inside_end, &refused);
      if (Unsupported(refused)) {
        no_fallocate_ = true;
        return BudgetLocked(opts, budget, file, off, len, size, sb.st_dev);
      }
      if (refused != 0 && !OutOfSpace(refused)) {
        return Status::FromErrno(refused, "fallocate of the backing file");
      }
      if (fit < inside_end) granted = fit;
      CoverLocked(off, fit);
    } else {
      CoverLocked(off, backed);
    }
  }
  // Past the end: reserved, ahead of a writer alone on the file.
  if (granted == end && end > size) {
    const int64_t from = std::max(off, size);
    if (!(lo_ <= from && end <= hi_)) {
      int64_t hi = end;
      if (alone) hi = std::max(end, from + StepAhead(opts, fd, size));
      int e = Fallocate(opts, fd, FALLOC_FL_KEEP_SIZE, from, hi - from);
      if (e != 0) past_eof_ = true;  // it may have allocated part of the range before it failed
      if (e != 0 && hi > end && !Unsupported(e)) {
        hi = end;  // not that much: this write's range
        e = Fallocate(opts, fd, FALLOC_FL_KEEP_SIZE, from, end - from);
      }
      if (Unsupported(e)) {
        no_fallocate_ = true;
        return BudgetLocked(opts, budget, file, off, len, size, sb.st_dev);
      }
      if (e == 0) {
        past_eof_ = true;
        CoverLocked(from, hi);
      } else if (!OutOfSpace(e)) {
        return Status::FromErrno(e, "fallocate of the backing file");
      } else {
        granted = FitPrefix(opts, fd, from, end, &refused);
        if (refused == 0) refused = e;
        if (granted > from) CoverLocked(from, granted);
      }
    }
  }
  if (granted <= off) {
    return Status::FromErrno(refused != 0 ? refused : ENOSPC,
                             "no space for a write of " + std::to_string(len) +
                                 " bytes at offset " + std::to_string(off));
  }
  if (opts.extend) DNVME_RETURN_IF_ERROR(ExtendLocked(fd, size, granted));
  return Grant{granted - off, false, epoch};
}

Status SpaceReservation::Trim(int fd) {
  std::lock_guard lock(mu_);
  if (!past_eof_) return Status::Ok();
  struct stat sb {};
  if (fstat(fd, &sb) != 0) return Status::FromErrno(errno, "fstat before freeing the reservation");
  // A truncate to the file's own size frees what lies past it; it also stamps mtime and ctime,
  // and the modification time is the last write's, so it is put back (ctime moves, as after any
  // change of the inode).
  if (const int e = Ftruncate(fd, sb.st_size); e != 0) {
    return Status::FromErrno(e, "freeing the space reserved past the end");
  }
  const struct timespec times[2] = {{0, UTIME_OMIT}, sb.st_mtim};
  if (futimens(fd, times) != 0) {
    return Status::FromErrno(errno, "keeping the modification time after freeing the reservation");
  }
  past_eof_ = false;
  hi_ = std::min(hi_, static_cast<int64_t>(sb.st_size));
  if (hi_ <= lo_) lo_ = hi_ = 0;
  epoch_.fetch_add(1, std::memory_order_acq_rel);
  return Status::Ok();
}

}  // namespace dnvme::datapath
