#!/usr/bin/env bash
# Builds and runs every test: the release build (build/, with the CUDA toolkit when it is installed,
# as on the CI machines: /usr/local/cuda), the ASan+UBSan build (build-asan/, built without CUDA, so
# both configurations of the GPU path are built and tested), the ThreadSanitizer run
# (scripts/tsan.sh: the data path's, engine's and mount's unit tests and the model check through a
# TSan daemon), the Debian 13 lane
# (scripts/torch2-lane.sh: every target built with GCC 14 and libfuse 3.17, then the unit, Python
# and `dnvme run` tests on torch 2.6), the control-file parser's libFuzzer target for 60 s
# (build-fuzz/), then the clang-format check. Runs all of them and exits non-zero if any failed.
#
# The suites' tests run one suite at a time, as before; each next build runs beside them, at the
# lowest CPU and I/O priority (nice 19, ionice idle): a suite's tests are mostly mounts that wait,
# and leave about half of the two cores idle (docs/performance-journal.md, "CI time"). A build's
# output goes to its log (BUILD_DIR.log), shown when it fails.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 1

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

# The release suite runs with spliced requests where the machine allows 2 MiB pipes (tests that
# need them skip, saying why, where it does not); the ASan suite runs at the machine's own
# setting. Both run the read(2) mode too (ModelReadReceiveTest).
# shellcheck source=scripts/pipe-max.sh
source "$ROOT/scripts/pipe-max.sh"
# A run that ends early (a signal) ends the builds it started beside the tests.
stop_background() {
  local pids
  mapfile -t pids < <(jobs -p)
  [[ ${#pids[@]} -eq 0 ]] || kill "${pids[@]}" 2>/dev/null
}
trap 'pipe_max_restore; stop_background' EXIT
pipe_max_raise
# Both suites keep line tables only (-g1 for RelWithDebInfo's -g): a crash or a sanitizer report
# still names every frame's function, file and line, inlined frames too, and the builds take a
# quarter less time (CI's budget: the Debian 13 lane builds every test too). The sanitized build
# is -O1, as the sanitizers' authors advise: UBSan's checks make GCC's -O2 take twice as long for
# the same reports. Its model check runs 12 s per transport (the release suite's runs the full
# budget; the TSan run has its own).
RELEASE_ARGS=(-DDNVME_BUILD_TESTS=ON "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG")
ASAN_ARGS=(-DDNVME_BUILD_TESTS=ON -DDNVME_SANITIZE=ON -DDNVME_WITH_CUDA=OFF
  "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG")

LOW=(nice -n 19)
command -v ionice >/dev/null && LOW+=(ionice -c 3)
declare -A BG_PID BG_LOG BG_START
background() {  # name log command...: starts the command beside what runs in front, at low priority
  local name=$1 log=$2
  shift 2
  echo "=== $name: started beside the tests (log: $log) ==="
  BG_LOG[$name]=$log
  BG_START[$name]=$SECONDS
  "${LOW[@]}" "$@" >"$log" 2>&1 &
  BG_PID[$name]=$!
}
collect() {  # name: waits for a background job; its status; its log's tail when it failed
  local name=$1 waited=$SECONDS rc
  wait "${BG_PID[$name]}"
  rc=$?
  timings+=("$name $((SECONDS - BG_START[$name])) s (waited $((SECONDS - waited)) s)")
  if [[ $rc -ne 0 ]]; then
    echo "=== $name: FAILED (status $rc), the end of ${BG_LOG[$name]}: ==="
    tail -60 "${BG_LOG[$name]}"
  fi
  return $rc
}
ctest_suite() {  # name build_dir: the suite's tests, in front
  local name=$1 dir=$2
  echo "=== $name: ctest ==="
  # -j: the unit tests (mostly waiting) two at a time on two cores; every mount test is
  # RUN_SERIAL, so it still runs alone.
  if ! (cd "$dir" && ctest --output-on-failure -j "$(nproc)"); then
    failed+=("$name tests")
  fi
}

# Debian 13's tree (network-bound) is made while the release build runs.
background lane-tree "$ROOT/build-torch2-tree.log" scripts/torch2-lane.sh --prepare

echo "=== release: build (build/) ==="
release_built=1
timed release-build scripts/build.sh "$ROOT/build" "${RELEASE_ARGS[@]}" ||
  { failed+=("release build"); release_built=0; }
background asan-build "$ROOT/build-asan.log" scripts/build.sh "$ROOT/build-asan" "${ASAN_ARGS[@]}"
[[ $release_built -eq 1 ]] && timed release-tests ctest_suite release "$ROOT/build"
pipe_max_restore

# 77 from the lane: it cannot run here (no root, no /dev/fuse), said by the script, not a failure.
lane=0
collect lane-tree || lane=$?
if collect asan-build; then
  background tsan-build "$ROOT/build-tsan.log" scripts/tsan.sh --build-only "$ROOT/build-tsan"
  [[ $lane -eq 0 ]] &&
    background lane-build "$ROOT/build-torch2.log" scripts/torch2-lane.sh --run true
  DNVME_MODEL_SECONDS=12 timed asan-tests ctest_suite asan "$ROOT/build-asan"
else
  failed+=("asan build")
  background tsan-build "$ROOT/build-tsan.log" scripts/tsan.sh --build-only "$ROOT/build-tsan"
  [[ $lane -eq 0 ]] &&
    background lane-build "$ROOT/build-torch2.log" scripts/torch2-lane.sh --run true
fi

if collect tsan-build; then
  background fuzz-build "$ROOT/build-fuzz.log" tests/fuzz/run.sh --build-only 60 "$ROOT/build-fuzz"
  echo "=== tsan (scripts/tsan.sh) ==="
  timed tsan scripts/tsan.sh --no-build "$ROOT/build-tsan" || failed+=("tsan")
else
  failed+=("tsan build")
  background fuzz-build "$ROOT/build-fuzz.log" tests/fuzz/run.sh --build-only 60 "$ROOT/build-fuzz"
fi

# Debian 13 (a tree by debootstrap: GCC 14, libfuse 3.17, torch 2.6): every target built, the unit
# tests, the Python tests and `dnvme run`'s.
echo "=== torch 2.x lane (scripts/torch2-lane.sh) ==="
if [[ $lane -eq 0 ]]; then
  collect lane-build || lane=$?
fi
if [[ $lane -eq 0 ]]; then
  timed lane-tests scripts/torch2-lane.sh  # the build is done: ctest only
  lane=$?
fi
if [[ $lane -eq 77 ]]; then
  echo "torch2-lane: skipped (reason above)"
elif [[ $lane -ne 0 ]]; then
  failed+=("torch2-lane")
fi

echo "=== fuzz: control-file request parser (60 s) ==="
if ! collect fuzz-build; then
  failed+=("fuzz build")
elif ! timed fuzz tests/fuzz/run.sh --no-build 60 "$ROOT/build-fuzz" >>"$ROOT/build-fuzz.log" 2>&1; then
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
