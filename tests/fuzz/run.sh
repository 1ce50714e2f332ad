#!/usr/bin/env bash
# Usage: tests/fuzz/run.sh [--build-only | --no-build] [SECONDS] [BUILD_DIR]
#
# Builds the libFuzzer target of the control-file request parser (tests/fuzz/ctl_request_fuzzer.cc
# with fs/control/ctl_protocol.cc and the engine's config/status code) with clang, libFuzzer, ASan and
# UBSan, then fuzzes it for SECONDS (default 60) from the seed corpus in tests/fuzz/corpus (new
# inputs go to a scratch copy, the repo's corpus is not modified). Exits non-zero on a crash, a
# leak, a sanitizer report or a timeout; the reproducer is left in BUILD_DIR. --build-only stops
# after the build, --no-build fuzzes the target built before (scripts/run-tests.sh builds it while
# other tests run).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
MODE=all
case ${1:-} in
  --build-only) MODE=build; shift ;;
  --no-build) MODE=run; shift ;;
esac
SECONDS_TO_RUN=${1:-60}
OUT=${2:-$ROOT/build-fuzz}
[[ $SECONDS_TO_RUN =~ ^[0-9]+$ ]] || { echo "run.sh: SECONDS must be a number" >&2; exit 2; }
CXX=${CXX_FUZZ:-clang++}
command -v "$CXX" >/dev/null || { echo "run.sh: $CXX not found (apt-get install clang)" >&2; exit 1; }
mkdir -p "$OUT/corpus"
cp -n "$ROOT"/tests/fuzz/corpus/* "$OUT/corpus/" 2>/dev/null || true
[[ $MODE == run ]] || "$CXX" -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
  -I"$ROOT/include" -I"$ROOT" \
  "$ROOT/tests/fuzz/ctl_request_fuzzer.cc" "$ROOT/fs/control/ctl_protocol.cc" \
  "$ROOT/engine/config/config.cc" "$ROOT/engine/common/status.cc" \
  -o "$OUT/ctl_request_fuzzer"
[[ $MODE != build ]] || exit 0
echo "run.sh: fuzzing the control-file parser for ${SECONDS_TO_RUN}s"
cd "$OUT"
./ctl_request_fuzzer -max_total_time="$SECONDS_TO_RUN" -max_len=70000 -timeout=10 \
  -rss_limit_mb=2048 -print_final_stats=1 corpus
