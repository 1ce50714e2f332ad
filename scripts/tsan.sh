#!/usr/bin/env bash
# Usage: scripts/tsan.sh [--build-only | --no-build] [BUILD_DIR]   (default build-tsan/ in the repo)
# The ThreadSanitizer run CI makes (issue 54; scripts/run-tests.sh runs it): a TSan build
# (-DDNVME_TSAN=ON, without CUDA, -O1) of the data path's, the engine's and the mount's unit tests
# (fs_unit_tests: the session loops, the per-uid lanes, the broker and its leases, the control
# sessions, the engine swap) and of the daemon, then
#   1. each of the three test binaries, halting at the first report;
#   2. the mount's concurrency tests (tests/fs/test_model.py: randomized concurrent clients
#      against a model of ext4, every transport) through a mount whose daemon is that TSan build,
#      DNVME_MODEL_SECONDS (default here 8) per transport; the daemon's reports go to files
#      (TSAN_OPTIONS log_path), and any file there fails the run.
# --build-only stops after the build; --no-build runs what was built before (scripts/run-tests.sh
# builds while another suite's tests run).
# Exits non-zero on a build failure, a failed test or any report.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MODE=all
case ${1:-} in
  --build-only) MODE=build; shift ;;
  --no-build) MODE=run; shift ;;
esac
DIR=${1:-$ROOT/build-tsan}
mkdir -p "$DIR"
if [[ $MODE != run ]]; then
  cmake -S "$ROOT" -B "$DIR" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDNVME_BUILD_TESTS=ON \
    -DDNVME_TSAN=ON -DDNVME_WITH_CUDA=OFF "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG" \
    >"$DIR/cmake.log" 2>&1 || { cat "$DIR/cmake.log"; exit 1; }
  cmake --build "$DIR" -j"$(nproc)" --target datapath_tests engine_tests fs_unit_tests dnvmefs ||
    exit 1
  [[ $MODE == build ]] && exit 0
fi

failed=()
REPORTS=$DIR/tsan-reports
rm -rf "$REPORTS" && mkdir -p "$REPORTS" "$DIR/test-scratch"
run() { setarch "$(uname -m)" -R "$@"; }
for t in datapath_tests engine_tests fs_unit_tests; do
  echo "=== tsan: $t ==="
  if ! DNVME_TEST_DIR=$DIR/test-scratch TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 die_after_fork=0" \
    run "$DIR/bin/$t" --gtest_brief=1; then
    failed+=("$t")
  fi
done
echo "=== tsan: the mount's concurrency tests (tests/fs/test_model.py) ==="
if ! (cd "$ROOT" && DNVMEFS_BIN=$DIR/bin/dnvmefs DNVME_TEST_DIR=$DIR/test-scratch/fs \
  DNVME_SANITIZED=1 DNVME_MODEL_SECONDS=${DNVME_MODEL_SECONDS:-8} \
  TSAN_OPTIONS="log_path=$REPORTS/daemon second_deadlock_stack=1" \
  run /usr/bin/python3 -m unittest tests.fs.test_model) >"$DIR/test_model.log" 2>&1; then
  failed+=("test_model")
fi
tail -15 "$DIR/test_model.log"
shopt -s nullglob
reports=("$REPORTS"/daemon*)
if [[ ${#reports[@]} -gt 0 ]]; then
  echo "tsan: the daemon reported ${#reports[@]} time(s):"
  head -60 "${reports[0]}"
  failed+=("daemon reports")
fi
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "tsan: FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "tsan: clean"
