#!/usr/bin/env bash
# Usage: bench/ab_binaries.sh --old DNVMEFS --new DNVMEFS [--backing DIR] [--pairs 4]
#                             [--size 1G] [--runs 2] [-o dnvmefs-options]
#
# Two dnvmefs binaries (a change and the commit before it) compared on one directory by
# alternating bench/mount_vs_fio.sh invocations: old, new, new, old, old, new, ... (ABBA, so
# neither always runs first or on a warmer machine). Every invocation measures raw fio on the
# same directory in the same run, so each one's ratios (mount / raw) are compared, not absolute
# GiB/s, which this shared VM moves by half from minute to minute. Prints each invocation's
# ratios and, per binary, the median, minimum and maximum of each ratio over its invocations.
# Run as root. Build the old binary in a worktree, e.g.
#   git worktree add /tmp/old HEAD~1 && cmake -S /tmp/old -B /tmp/old/build \
#     -DCMAKE_BUILD_TYPE=RelWithDebInfo && cmake --build /tmp/old/build --target dnvmefs
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OLD=
NEW=
BACKING=$ROOT/var/bench-backing
PAIRS=4
SIZE=1G
RUNS=2
OPTS=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --old) OLD=${2:?--old needs a dnvmefs binary}; shift 2 ;;
    --new) NEW=${2:?--new needs a dnvmefs binary}; shift 2 ;;
    --backing) BACKING=${2:?--backing needs a directory}; shift 2 ;;
    --pairs) PAIRS=${2:?--pairs needs a number}; shift 2 ;;
    --size) SIZE=${2:?--size needs a value}; shift 2 ;;
    --runs) RUNS=${2:?--runs needs a number}; shift 2 ;;
    -o) OPTS=(-o "${2:?-o needs options}"); shift 2 ;;
    -h | --help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
    *) echo "ab_binaries: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
for b in "$OLD" "$NEW"; do
  [[ -n $b && -x $b ]] || { echo "ab_binaries: --old and --new must name dnvmefs binaries" >&2; exit 2; }
done
[[ $PAIRS =~ ^[1-9][0-9]*$ ]] || { echo "ab_binaries: --pairs must be a positive number" >&2; exit 2; }

OUT=$(mktemp -d /tmp/dnvme-ab.XXXXXX)
trap 'rm -rf "$OUT"' EXIT
order=()
for ((p = 0; p < PAIRS; p++)); do
  if ((p % 2 == 0)); then order+=(old new); else order+=(new old); fi
done
i=0
for which in "${order[@]}"; do
  bin=$OLD
  [[ $which == new ]] && bin=$NEW
  echo "== invocation $((i + 1))/${#order[@]}: $which ($bin)"
  DNVMEFS=$bin "$ROOT/bench/mount_vs_fio.sh" --backing "$BACKING" --size "$SIZE" --runs "$RUNS" \
    --no-passthrough "${OPTS[@]}" --json-out "$OUT/$i-$which.json" | tail -8
  i=$((i + 1))
done

/usr/bin/python3 - "$OUT" <<'PYEOF'
import glob, json, os, statistics, sys
out = sys.argv[1]
runs = {"old": [], "new": []}
for path in sorted(glob.glob(os.path.join(out, "*.json")), key=lambda p: int(os.path.basename(p).split("-")[0])):
    which = os.path.basename(path).split("-")[1].split(".")[0]
    runs[which].append(json.load(open(path))["ratios"])
keys = [("a_write", "(a) write, buffered / raw"), ("a_read", "(a) read, buffered / raw"),
        ("b_write", "(b) write, O_DIRECT / raw"), ("b_read", "(b) read, O_DIRECT / raw"),
        ("d_buf", "(d) daemon CPU / fio's, (a)"), ("d_dir", "(d) daemon CPU / fio's, (b)")]
print()
print(f"{'ratio':<30} {'old: each invocation':<34} {'new: each invocation':<34} {'old med':>7} {'new med':>7}")
for k, label in keys:
    o = [r[k] for r in runs["old"]]
    n = [r[k] for r in runs["new"]]
    print(f"{label:<30} {' '.join(f'{x:.3f}' for x in o):<34} {' '.join(f'{x:.3f}' for x in n):<34}"
          f" {statistics.median(o):>7.3f} {statistics.median(n):>7.3f}")
PYEOF
