#!/usr/bin/env bash
# Builds and runs every test: the release build (build/, with the CUDA toolkit when it is installed,
# as on the CI machines: /usr/local/cuda), the ASan+UBSan build (build-asan/, built without CUDA, so
# both configurations of the GPU path are built and tested), the ThreadSanitizer run
# (scripts/tsan.sh: the data path's, engine's and mount's unit tests and the model check through a
# TSan daemon), the Debian 13 lane
# (scripts/torch2-lane.sh: every target built with GCC 14 and libfuse 3.17, then the unit, Python
# and `dnvme run` tests on torch 2.6), the control-file parser's libFuzzer target for 60 s
# (build-fuzz/), then the clang-format check. Runs all of them and exits non-zero if any failed.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

export ASAN_OPTIONS=detect_leaks=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1

failed=()
timings=()  # "part: N s", printed at the end (the README quotes them)
timed() {  # name command...: runs the command, records how long it took
  local name=$1 start=$SECONDS
  shift
  "$@"
  local rc=$?
  timings+=("$name $((SECONDS - start)) s")
  return $rc
}

run_suite() {  # name build_dir cmake args...
  local name=$1 dir=$2
  shift 2
  echo "=== $name: build ($dir) ==="
  if ! scripts/build.sh "$dir" "$@"; then
    failed+=("$name build")
    return
  fi
  echo "=== $name: ctest ==="
  # -j: the unit tests (mostly waiting) two at a time on two cores; every mount test is
  # RUN_SERIAL, so it still runs alone.
  if ! (cd "$dir" && ctest --output-on-failure -j "$(nproc)"); then
    failed+=("$name tests")
  fi
}

# The release suite runs with spliced requests where the machine allows 2 MiB pipes (tests that
# need them skip, saying why, where it does not); the ASan suite runs at the machine's own
# setting. Both run the read(2) mode too (ModelReadReceiveTest).
# shellcheck source=scripts/pipe-max.sh
source "$ROOT/scripts/pipe-max.sh"
trap pipe_max_restore EXIT
pipe_max_raise
# Both suites keep line tables only (-g1 for RelWithDebInfo's -g): a crash or a sanitizer report
# still names every frame's function, file and line, inlined frames too, and the builds take a
# quarter less time (CI's budget: the Debian 13 lane builds every test too). The sanitized build
# is -O1, as the sanitizers' authors advise: UBSan's checks make GCC's -O2 take twice as long for
# the same reports. Its model check runs 12 s per transport (the release suite's runs the full
# budget; the TSan run has its own).
timed release run_suite release "$ROOT/build" -DDNVME_BUILD_TESTS=ON \
  "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG"
pipe_max_restore
DNVME_MODEL_SECONDS=12 timed asan run_suite asan "$ROOT/build-asan" -DDNVME_BUILD_TESTS=ON \
  -DDNVME_SANITIZE=ON -DDNVME_WITH_CUDA=OFF "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG"

echo "=== tsan (scripts/tsan.sh) ==="
timed tsan scripts/tsan.sh "$ROOT/build-tsan" || failed+=("tsan")

# Debian 13 (a tree by debootstrap: GCC 14, libfuse 3.17, torch 2.6): every target built, the unit
# tests, the Python tests and `dnvme run`'s; 77: cannot run here (no root, no /dev/fuse), said by
# the script, not a failure.
echo "=== torch 2.x lane (scripts/torch2-lane.sh) ==="
timed torch2-lane scripts/torch2-lane.sh
lane=$?
if [[ $lane -eq 77 ]]; then
  echo "torch2-lane: skipped (reason above)"
elif [[ $lane -ne 0 ]]; then
  failed+=("torch2-lane")
fi

echo "=== fuzz: control-file request parser (60 s) ==="
if ! timed fuzz tests/fuzz/run.sh 60 "$ROOT/build-fuzz" >"$ROOT/build-fuzz.log" 2>&1; then
  tail -40 "$ROOT/build-fuzz.log"
  failed+=("fuzz")
else
  grep -E "^(Done|stat::number_of_executed_units)" "$ROOT/build-fuzz.log" || true
fi

echo "=== clang-format check ==="
mapfile -t sources < <(find include engine datapath fs client tools tests python preload -type f \( -name '*.cc' -o -name '*.h' \) | sort)
if [[ ${#sources[@]} -gt 0 ]] && ! clang-format --dry-run -Werror "${sources[@]}"; then
  failed+=("clang-format")
else
  echo "clang-format: ${#sources[@]} files clean"
fi

echo "run-tests: times (build and tests): ${timings[*]/%/,} total $SECONDS s"
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "run-tests: FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "run-tests: all passed"
