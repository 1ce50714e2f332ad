# shellcheck shell=bash disable=SC2034  # (the arrays are for the scripts that source this)
# The Debian packages dnvmefs needs, in one place: sourced by install-deps.sh (this machine) and
# torch2-lane.sh (its Debian 13 tree), so a new dependency is added once.

# Build and test: the machine and the torch 2.x lane's tree both get these.
DNVME_PACKAGES=(cmake g++ make libaio-dev libspdlog-dev libcli11-dev nlohmann-json3-dev libgtest-dev fio
  # The Python module deepnvme (python/), built for Debian's /usr/bin/python3.
  python3-dev pybind11-dev
  # Its tests and benchmarks: Debian's torch, numpy and pytest (there is no PyPI here).
  python3-torch python3-numpy python3-pytest
  # fincore: the page cache as the tests and bench/readers.py see it (resident_bytes).
  util-linux-extra
  # The FUSE filesystem (fs/, mount-scripts/, bench/mount_vs_fio.sh): libfuse3 headers and its
  # passthrough_ll example, fusermount3 and mount.fuse3, libcap for the capability drop, and
  # pkg-config to find both.
  libfuse3-dev fuse3 libcap-dev pkg-config
  # FUSE over io_uring (fs/transport/uring_loop.h).
  liburing-dev)
# Only in the torch 2.x lane's Debian 13 tree: the safetensors package (Debian 12 has none), for
# the real loaders' tests and bench/readers.py's st-load/st-open clients.
DNVME_LANE_PACKAGES=(python3-safetensors)

# Only on the machine itself (run-tests.sh's other suites and the tools).
DNVME_HOST_PACKAGES=(
  # dnvme tune draws its sweep (pngcairo); systemd-analyze checks the unit template.
  gnuplot-nox systemd
  clang-format
  # The libFuzzer target of the control-file parser (tests/fuzz/run.sh): clang and its runtime.
  clang libclang-rt-14-dev
  # Backing file systems of the space tests (tests/security/test_space.py): each preallocates
  # differently.
  xfsprogs btrfs-progs)
