#!/usr/bin/env bash
# Usage: bench/engine_vs_fio.sh [--dir DIR] [--size 1G] [--runs 3] [--json-out FILE]
#                               [extra `dnvme io` flags...]
#
# Compares `dnvme io` with fio on the same directory in one run. Each round runs a write with each
# tool, then a read with each tool (the page cache is dropped before every read when root); the
# order of the two tools alternates from round to round so neither always gets the warmer disk.
#   fio:   ioengine=libaio direct=1 bs=1M iodepth=32 size=SIZE, rw=write then rw=read, one file
#   dnvme: build/bin/dnvme io --json --loops 1 --warmup 0 (default handle parameters unless extra
#          flags are given), --write then --read, one file
# Prints every run, the median GiB/s (GiB = 2^30 bytes) of each tool and op, and dnvme/fio.
# Removes its files at the end. DNVME=path overrides the binary.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DNVME=${DNVME:-$ROOT/build/bin/dnvme}
PY=/usr/bin/python3

DIR=$ROOT/var/offload
SIZE=1G
RUNS=3
JSON_OUT=
EXTRA=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --dir) DIR=$2; shift 2 ;;
    --size) SIZE=$2; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    --json-out) JSON_OUT=$2; shift 2 ;;
    -h | --help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
    *) EXTRA+=("$1"); shift ;;
  esac
done

BENCH_NAME=engine_vs_fio
# shellcheck source=bench/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
[[ -x $DNVME ]] || die "$DNVME is missing; build it first: scripts/build.sh"
command -v fio >/dev/null || die "fio is missing; run scripts/install-deps.sh"
[[ -x $PY ]] || die "$PY is missing (needed to parse fio's JSON)"
[[ $RUNS =~ ^[1-9][0-9]*$ ]] || die "--runs must be a positive integer, got '$RUNS'"
mkdir -p "$DIR"
[[ -w $DIR ]] || die "--dir $DIR is not writable"

BYTES=$(size_bytes "$SIZE")

FIO_FILE=$DIR/engine_vs_fio.fio.dat
DNVME_FILE=engine_vs_fio.dnvme.dat
WORK=$(mktemp -d)
cleanup() { rm -f "$FIO_FILE" "$DIR/$DNVME_FILE"; rm -rf "$WORK"; }
trap cleanup EXIT


FIO_CMD=(fio --name=engine_vs_fio --filename="$FIO_FILE" --ioengine=libaio --direct=1 --bs=1M
  --iodepth=32 --size="$BYTES" --numjobs=1 --output-format=json)
DNVME_CMD=("$DNVME" io --dir "$DIR" --file "$DNVME_FILE" --size "$BYTES" --json --loops 1
  --warmup 0 "${EXTRA[@]}")
RESULTS=$WORK/results.tsv  # run tool op gib_per_s seconds

run_fio() {  # run op
  local out=$WORK/fio.json
  "${FIO_CMD[@]}" --rw="$2" >"$out" || die "fio --rw=$2 failed (run $1)"
  $PY - "$out" "$1" "$2" >>"$RESULTS" <<'PYEOF' || die "cannot parse fio's JSON output"
import json, sys
path, run, rw = sys.argv[1:4]
text = open(path).read()
job = json.loads(text[text.index("{"):])["jobs"][0]
side = job[rw]
seconds = side["runtime"] / 1000.0
print(f"{run}\tfio\t{rw}\t{side['bw_bytes'] / 2**30:.6f}\t{seconds:.6f}")
PYEOF
}

run_dnvme() {  # run op
  local out=$WORK/dnvme.json
  "${DNVME_CMD[@]}" --"$2" >"$out" || die "dnvme io --$2 failed (run $1): ${DNVME_CMD[*]} --$2"
  $PY - "$out" "$1" >>"$RESULTS" <<'PYEOF' || die "cannot parse dnvme's JSON output"
import json, sys
path, run = sys.argv[1:3]
for line in open(path):
    r = json.loads(line)
    print(f"{run}\tdnvme\t{r['op']}\t{r['gib_per_s']:.6f}\t{r['seconds']:.6f}")
PYEOF
}

echo "engine_vs_fio: $(date -u +%Y-%m-%dT%H:%M:%SZ) dir=$DIR size=$BYTES runs=$RUNS" \
  "loadavg=$(cut -d' ' -f1-3 /proc/loadavg)"
echo "  fio:   ${FIO_CMD[*]} --rw=write|read"
echo "  dnvme: ${DNVME_CMD[*]} --write|--read"
: >"$RESULTS"
for ((run = 1; run <= RUNS; run++)); do
  if ((run % 2 == 1)); then order=(fio dnvme); else order=(dnvme fio); fi
  for op in write read; do
    for tool in "${order[@]}"; do
      [[ $op == read ]] && drop_caches
      echo "  run $run: $tool $op" >&2
      "run_$tool" "$run" "$op"
    done
  done
done

$PY - "$RESULTS" "$JSON_OUT" "$BYTES" "$RUNS" "$DIR" "${FIO_CMD[*]}" "${DNVME_CMD[*]}" <<'PYEOF'
import json, statistics, sys, time
results_path, json_out, size, runs, directory, fio_cmd, dnvme_cmd = sys.argv[1:8]
rows = []
for line in open(results_path):
    run, tool, op, gib, sec = line.split("\t")
    rows.append({"run": int(run), "tool": tool, "op": op, "gib_per_s": float(gib),
                 "seconds": float(sec)})

print()
print(f"{'run':>3}  {'tool':<5}  {'op':<5}  {'GiB/s':>7}  {'seconds':>8}")
for r in rows:
    print(f"{r['run']:>3}  {r['tool']:<5}  {r['op']:<5}  {r['gib_per_s']:>7.3f}  {r['seconds']:>8.3f}")

median = {}
for op in ("write", "read"):
    for tool in ("fio", "dnvme"):
        median[(tool, op)] = statistics.median(
            r["gib_per_s"] for r in rows if r["tool"] == tool and r["op"] == op)
print()
print(f"median of {runs} run(s), {int(size) / 2**30:.2f} GiB per run")
print(f"{'op':<5}  {'fio GiB/s':>9}  {'dnvme GiB/s':>11}  {'dnvme/fio':>9}")
summary = {}
for op in ("write", "read"):
    f, d = median[("fio", op)], median[("dnvme", op)]
    ratio = d / f if f > 0 else float("nan")
    summary[op] = {"fio_gib_per_s": f, "dnvme_gib_per_s": d, "ratio": round(ratio, 3)}
    print(f"{op:<5}  {f:>9.3f}  {d:>11.3f}  {ratio:>9.3f}")

if json_out:
    with open(json_out, "w") as out:
        json.dump({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "dir": directory,
                   "bytes": int(size), "runs": int(runs), "fio_cmd": fio_cmd,
                   "dnvme_cmd": dnvme_cmd, "results": rows, "median": summary}, out, indent=2)
        out.write("\n")
    print(f"\nwrote {json_out}")
PYEOF
