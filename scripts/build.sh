#!/usr/bin/env bash
# Usage: scripts/build.sh [--demo] [BUILD_DIR] [extra cmake args...]
# Configures and builds dnvmefs (RelWithDebInfo unless a CMAKE_BUILD_TYPE is passed). The CLI
# lands in BUILD_DIR/bin/dnvme. BUILD_DIR defaults to build/ in the repository root.
# --demo builds only what bench/demo.sh runs (dnvme, dnvmefs, libdnvme_preload.so), not the test
# suites or the Python module: the README's first command.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
targets=()
if [[ ${1:-} == --demo ]]; then
  targets=(--target dnvme dnvmefs dnvme_preload)
  shift
fi
BUILD_DIR=${1:-$ROOT/build}
[[ $# -gt 0 ]] && shift

has_type=0
for arg in "$@"; do [[ $arg == -DCMAKE_BUILD_TYPE=* ]] && has_type=1; done
type_arg=()
[[ $has_type -eq 1 ]] || type_arg=(-DCMAKE_BUILD_TYPE=RelWithDebInfo)

cmake -S "$ROOT" -B "$BUILD_DIR" "${type_arg[@]}" "$@"
cmake --build "$BUILD_DIR" -j"$(nproc)" "${targets[@]}"
