// The stand-in mount the preload library's unit tests adopt files on (tests/preload): a scratch
// directory that the MountProbe seam (preload/mounts.h) calls a dnvmefs mount, served by one fake
// broker (fake_broker.h), and a directory beside it on the same device that is not the mount.
//
// The descriptor table and the broker connections are process-wide (one connection per mount
// device, kept until exit), so the mount and its broker are made once per process, at the first
// test's SetUpTestSuite, and serve every test; each test clears what the broker saw, and forgets
// and closes the descriptors it opened with OpenFile.
//
// Thread contract: the fixture is used from the test's thread; the broker is thread-safe.
#ifndef DNVME_TESTS_PRELOAD_SCRATCH_MOUNT_H_
#define DNVME_TESTS_PRELOAD_SCRATCH_MOUNT_H_

#include <sys/types.h>

#include <cstddef>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/preload/fake_broker.h"

namespace dnvme::preload::testing {

class PreloadTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite();
  void SetUp() override;
  void TearDown() override;

  // The stand-in mount (canonical path: what /proc/self/fd shows), and a directory beside it on
  // the same device that is not the mount.
  static const std::string& root();
  static const std::string& outside();
  static dev_t dev();
  static FakeBroker& broker();

  // A file of `size` patterned bytes (byte i is i * 7 + 3) at `dir`/`name`, opened with `flags`;
  // forgotten and closed at TearDown unless CloseFd closed it first.
  int OpenFile(const std::string& dir, const std::string& name, int flags, size_t size);
  // Forgets `fd` as close(2) would (the last descriptor ends the lease); returns the errno close
  // would report (ForgetBeforeClose's, 0 if none).
  int CloseFd(int fd);
  // Keeps a descriptor made otherwise (dup) for TearDown.
  void Track(int fd) { fds_.push_back(fd); }
  static ino_t InoOf(int fd);

 private:
  std::vector<int> fds_;
};

}  // namespace dnvme::preload::testing

#endif  // DNVME_TESTS_PRELOAD_SCRATCH_MOUNT_H_
