#!/usr/bin/env bash
# The torch 2.x and current-Debian lane (issues 37 and 46): builds every target of dnvmefs (the
# product and every test, with -Werror as everywhere) inside a Debian 13 ("trixie") tree: GCC 14,
# libfuse 3.17 (what differs from Debian 12's 3.14: fs/fuse_compat.h), Python 3.13 and Debian's
# python3-torch 2.6 with numpy 2.2. It runs there the unit tests (ctest label `unit`: every
# GoogleTest case), the Python tests (python_*) and the `dnvme run` / mount tests with torch cases
# (fs_preload), those two by label `torch`: `ctest -L '^(unit|torch)$'`.
#
# Usage (root): scripts/torch2-lane.sh [--tree DIR] [--mirror URL] [--jobs N] [--bind DIR]...
#                                      [--cmake ARG]... [--prepare | --run COMMAND | -- CTEST_ARGS...]
#
# --prepare makes the tree (when its stamp is missing or stale) and stops: scripts/run-tests.sh
# makes it while the release build runs, and builds with `--run true` while other tests run;
# --bind DIR makes DIR (a benchmark's directory, say) visible at the same path in the tree;
# --cmake ARG adds ARG to the configure step (-DCMAKE_BUILD_TYPE=Debug, say);
# --run COMMAND runs COMMAND (bash, in the repository at /src) in the tree instead of the tests,
# after the build (bench/dcp.py's numbers were taken this way); -- CTEST_ARGS replaces the default
# selection (`-- -R '^python_'`, say).
#
# The build is RelWithDebInfo without its -g: the optimization, and so the warnings -Werror turns
# into errors, of a user's default build on Debian 13, without the debug information the lane
# never reads (every target: 465 s of compile CPU on the 2-core VM, 573 s with -g). ctest runs
# -j JOBS: mount tests are RUN_SERIAL, so only the unit tests share the machine.
#
# The tree (default /var/tmp/dnvme-trixie) is made with `debootstrap --variant=minbase trixie`
# and Debian's packages (the list below) the first time, and reused while its stamp file names the
# same package list; a failed or interrupted set-up leaves no stamp, so the next run starts over.
# The repository is bind-mounted at DIR/src with /proc, /sys and /dev (for /dev/fuse), the build
# goes to build-torch2/ in the repository, and every mount is undone at exit, also on failure or
# Ctrl-C. Measured on the 2-core reference VM with Debian's mirror: the tree 23 s, its packages
# 40 s (2.1 GiB in all).
#
# Exit status: 0 when every selected test passed, 1 when one failed or the build did, 2 for a
# usage error, 77 when the lane cannot run here (not root, no /dev/fuse, no debootstrap and no
# apt-get), with the reason printed.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ARGS=("$@")

TREE=/var/tmp/dnvme-trixie
MIRROR=http://deb.debian.org/debian
JOBS=$(nproc)
CTEST_ARGS=()
CMAKE_ARGS=()
BINDS=()
RUN=
PREPARE=0
while [[ $# -gt 0 ]]; do
  case $1 in
    --bind) BINDS+=("$(realpath -e "${2:?--bind needs a directory}")") || exit 2; shift 2 ;;
    --run) RUN=${2:?--run needs a command}; shift 2 ;;
    --prepare) PREPARE=1; shift ;;
    --cmake) CMAKE_ARGS+=("${2:?--cmake needs an argument}"); shift 2 ;;
    --tree) TREE=${2:?--tree needs a directory}; shift 2 ;;
    --mirror) MIRROR=${2:?--mirror needs a URL}; shift 2 ;;
    --jobs) JOBS=${2:?--jobs needs a number}; shift 2 ;;
    --) shift; CTEST_ARGS=("$@"); break ;;
    -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
    *) echo "torch2-lane: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

cannot() { echo "torch2-lane: SKIPPED, cannot run here: $*" >&2; exit 77; }
[[ $(id -u) -eq 0 ]] || cannot "needs root (debootstrap, chroot, bind mounts)"
[[ -c /dev/fuse ]] || cannot "no /dev/fuse (the mount tests need FUSE)"
if ! command -v debootstrap >/dev/null; then
  command -v apt-get >/dev/null || cannot "no debootstrap and no apt-get to install it"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null ||
    { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null; } ||
    cannot "debootstrap could not be installed"
fi

# One run at a time on a tree: a second run's bind mounts, and their undoing at its exit, would
# pull /src from under the first. The script runs again under flock(1), which holds the lock and
# keeps it from the lane's own processes (a test's daemon that outlives the run holds nothing).
if [[ ${DNVME_LANE_LOCKED:-} != "$TREE" ]]; then
  flock -n "$TREE.lock" true || echo "torch2-lane: waiting for the other run on $TREE to end" >&2
  DNVME_LANE_LOCKED=$TREE exec flock -o "$TREE.lock" "${BASH_SOURCE[0]}" "${ARGS[@]}"
fi

# What the lane builds and tests with: the build and test packages install-deps.sh installs
# here too, without the machine's own tools (fuzzing, formatting, gnuplot).
# shellcheck source=scripts/packages.sh
source "$ROOT/scripts/packages.sh"
PACKAGES=("${DNVME_PACKAGES[@]}" "${DNVME_LANE_PACKAGES[@]}")
STAMP="$TREE/.dnvme-torch2-lane"
WANT="trixie ${PACKAGES[*]}"

MOUNTED=()
cleanup() {
  local i
  for ((i = ${#MOUNTED[@]} - 1; i >= 0; i--)); do
    umount "${MOUNTED[i]}" 2>/dev/null || umount -l "${MOUNTED[i]}" 2>/dev/null ||
      echo "torch2-lane: could not unmount ${MOUNTED[i]}" >&2
  done
  MOUNTED=()
}
trap cleanup EXIT
trap 'exit 130' INT TERM

bind() {  # source target [options]
  mkdir -p "$2" || return 1
  mount --bind "$1" "$2" || return 1
  MOUNTED+=("$2")
}

if [[ ! -f $STAMP || $(cat "$STAMP") != "$WANT" ]]; then
  echo "=== torch2-lane: making the Debian 13 tree at $TREE ==="
  rm -rf "$TREE"
  start=$SECONDS
  if ! debootstrap --variant=minbase trixie "$TREE" "$MIRROR" >"$TREE.debootstrap.log" 2>&1; then
    tail -20 "$TREE.debootstrap.log" >&2
    echo "torch2-lane: FAILED: debootstrap (log: $TREE.debootstrap.log)" >&2
    exit 1
  fi
  bind /proc "$TREE/proc" || exit 1
  if ! chroot "$TREE" bash -c "apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends ${PACKAGES[*]}" \
      >"$TREE.apt.log" 2>&1; then
    tail -20 "$TREE.apt.log" >&2
    echo "torch2-lane: FAILED: installing the packages (log: $TREE.apt.log)" >&2
    exit 1
  fi
  cleanup
  echo "$WANT" >"$STAMP"
  echo "torch2-lane: tree made in $((SECONDS - start)) s"
fi
if [[ $PREPARE -eq 1 ]]; then
  echo "torch2-lane: the tree at $TREE is ready"
  exit 0
fi

# /dev is bound without its submounts: /dev/shm (POSIX shared memory, the tests' tmpfs) on its own.
if ! { bind /proc "$TREE/proc" && bind /sys "$TREE/sys" && bind /dev "$TREE/dev" &&
  bind /dev/shm "$TREE/dev/shm" && bind "$ROOT" "$TREE/src"; }; then
  echo "torch2-lane: FAILED: bind mounts" >&2
  exit 1
fi
for dir in "${BINDS[@]}"; do
  bind "$dir" "$TREE$dir" || { echo "torch2-lane: FAILED: binding $dir" >&2; exit 1; }
done

TORCH=$(chroot "$TREE" python3 -c "import torch; print(torch.__version__)" 2>/dev/null | tail -1)
echo "=== torch2-lane: torch $TORCH, $(chroot "$TREE" python3 --version), $(chroot "$TREE" gcc --version | head -1) ==="

# Every target: a test that no longer compiles on Debian 13 fails the lane, not a user's build.
BUILD=/src/build-torch2
CONFIGURE=(-DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -DNDEBUG"
  -DDNVME_BUILD_TESTS=ON -DDNVME_WITH_CUDA=OFF "${CMAKE_ARGS[@]}")
if ! chroot "$TREE" bash -c "cmake -S /src -B $BUILD $(printf '%q ' "${CONFIGURE[@]}") >/dev/null &&
    cmake --build $BUILD -j $JOBS"; then
  echo "torch2-lane: FAILED: build" >&2
  exit 1
fi
if [[ -n $RUN ]]; then
  chroot "$TREE" bash -c "cd /src && $RUN"
  exit $?
fi
[[ ${#CTEST_ARGS[@]} -gt 0 ]] || CTEST_ARGS=(-j "$JOBS" -L '^(unit|torch)$')
if ! chroot "$TREE" bash -c "cd $BUILD && ctest --output-on-failure $(printf '%q ' "${CTEST_ARGS[@]}")"; then
  echo "torch2-lane: FAILED: tests on torch $TORCH" >&2
  exit 1
fi
echo "torch2-lane: all passed on torch $TORCH"
