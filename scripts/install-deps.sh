#!/usr/bin/env bash
# Installs the Debian packages dnvmefs needs to build, test and benchmark. Idempotent: runs
# apt-get only when a package is missing, and `apt-get update` only when the package lists are
# empty or more than a day old.
set -euo pipefail

PACKAGES=(cmake g++ make libaio-dev libspdlog-dev libcli11-dev nlohmann-json3-dev libgtest-dev fio
  # dnvme tune draws its sweep (pngcairo); systemd-analyze checks the unit template.
  gnuplot-nox systemd
  # The Python module deepnvme (python/), built for Debian's /usr/bin/python3.
  python3-dev pybind11-dev
  # Its tests and benchmarks: Debian's torch, numpy and pytest (there is no PyPI here).
  python3-torch python3-numpy python3-pytest
  clang-format
  # The FUSE filesystem (fs/, mount-scripts/, bench/mount_vs_fio.sh): libfuse3 headers and its
  # passthrough_ll example, fusermount3 and mount.fuse3, libcap for the capability drop, and
  # pkg-config to find both.
  libfuse3-dev fuse3 libcap-dev pkg-config
  # FUSE over io_uring (fs/transport/uring_loop.h).
  liburing-dev
  # The libFuzzer target of the control-file parser (tests/fuzz/run.sh): clang and its runtime.
  clang libclang-rt-14-dev)

SUDO=()
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null || { echo "install-deps: not root and sudo is missing" >&2; exit 1; }
  SUDO=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive

missing=()
for pkg in "${PACKAGES[@]}"; do
  status=$(dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null || true)
  [[ $status == installed ]] || missing+=("$pkg")
done
if [[ ${#missing[@]} -eq 0 ]]; then
  echo "install-deps: all ${#PACKAGES[@]} packages already installed"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
lists=(/var/lib/apt/lists/*_Packages)
if [[ ! -e ${lists[0]} ]] || [[ -n $(find /var/lib/apt/lists -maxdepth 1 -name '*_Packages' -mmin +1440 -print -quit) ]]; then
  "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update
fi
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
