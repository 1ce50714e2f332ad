#!/usr/bin/env bash
# Usage: bench/gpu_io.sh [--dir DIR] [--size 1G] [--rounds 3] [--bs 1M] [--iodepth 128]
#                        [--gpu-device N] [--json-out FILE] [extra `dnvme io` flags...]
#
# What GPU memory costs against host memory and the disk, in one run on one directory. Each round
# writes, then reads, SIZE bytes with each of:
#   host:  dnvme io                  (pinned host memory, the AioHandle)
#   gpu:   dnvme io --gpu            (device memory through the gds_handle's bounce path)
#   gds:   dnvme io --gpu --gds      (cuFile; skipped, with cuFile's reason, where it cannot run)
#   fio:   ioengine=libaio direct=1, the same bs and iodepth as dnvme (the disk's own rate)
# every dnvme run with --json --loops 1 --warmup 0 --block-size BS --queue-depth IODEPTH. The page
# cache is dropped before every read when root; the order of the tools rotates from round to
# round so none always gets the warmer disk. Prints every run, the median GiB/s (GiB = 2^30
# bytes) of each tool and op, the raw pinned host<->device copy rates for SIZE (as dnvme io
# --gpu measured them), and the ratios gpu/host, gds/host and gpu/min(disk, copy), where disk is
# fio's median and copy is device->host for writes, host->device for reads.
#
# Without a usable GPU it prints the reason (`dnvme report`'s) and SKIPPED, and exits 0, so it
# can run anywhere. Removes its files at the end. DNVME=path overrides the binary.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DNVME=${DNVME:-$ROOT/build/bin/dnvme}
PY=/usr/bin/python3

DIR=$ROOT/var/offload
SIZE=1G
ROUNDS=3
BS=1M
IODEPTH=128
DEVICE=0
JSON_OUT=
EXTRA=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --dir) DIR=$2; shift 2 ;;
    --size) SIZE=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --bs) BS=$2; shift 2 ;;
    --iodepth) IODEPTH=$2; shift 2 ;;
    --gpu-device) DEVICE=$2; shift 2 ;;
    --json-out) JSON_OUT=$2; shift 2 ;;
    -h | --help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
    *) EXTRA+=("$1"); shift ;;
  esac
done

BENCH_NAME=gpu_io
# shellcheck source=bench/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
[[ -x $DNVME ]] || die "$DNVME is missing; build it first: scripts/build.sh"
[[ -x $PY ]] || die "$PY is missing (needed to parse the JSON outputs)"
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || die "--rounds must be a positive integer, got '$ROUNDS'"
[[ $IODEPTH =~ ^[1-9][0-9]*$ ]] || die "--iodepth must be a positive integer, got '$IODEPTH'"
[[ $DEVICE =~ ^[0-9]+$ ]] || die "--gpu-device must be a device index, got '$DEVICE'"
mkdir -p "$DIR"
[[ -w $DIR ]] || die "--dir $DIR is not writable"
BYTES=$(size_bytes "$SIZE")
BS_BYTES=$(size_bytes "$BS")

WORK=$(mktemp -d)
FILES=()
cleanup() {
  for f in "${FILES[@]}"; do rm -f "$f"; done
  rm -rf "$WORK"
}
trap cleanup EXIT

# Is there a GPU at all? dnvme's own answer, so the reason is the one `dnvme io --gpu` would give.
"$DNVME" report --dir "$DIR" --json >"$WORK/report.json" || die "dnvme report failed"
GPU_LINE=$($PY -c '
import json, sys
g = json.load(open(sys.argv[1]))["checks"]["gpu"]
print(g["device_count"], g["reason"] or "")' "$WORK/report.json") ||
  die "cannot parse dnvme report's JSON"
read -r DEVICE_COUNT GPU_REASON <<<"$GPU_LINE"
if [[ $DEVICE_COUNT -eq 0 ]]; then
  echo "gpu_io: no usable GPU: $GPU_REASON"
  echo "gpu_io: SKIPPED"
  exit 0
fi
((DEVICE < DEVICE_COUNT)) || die "--gpu-device $DEVICE: this machine has $DEVICE_COUNT device(s)"
command -v fio >/dev/null || die "fio is missing; run scripts/install-deps.sh"

DNVME_CMD=("$DNVME" io --dir "$DIR" --size "$BYTES" --json --loops 1 --warmup 0
  --block-size "$BS_BYTES" --queue-depth "$IODEPTH" "${EXTRA[@]}")
FIO_FILE=$DIR/gpu_io.fio.dat
FIO_CMD=(fio --name=gpu_io --filename="$FIO_FILE" --ioengine=libaio --direct=1 --bs="$BS_BYTES"
  --iodepth="$IODEPTH" --size="$BYTES" --numjobs=1 --output-format=json)
FILES+=("$FIO_FILE" "$DIR/gpu_io.host.dat" "$DIR/gpu_io.gpu.dat" "$DIR/gpu_io.gds.dat"
  "$DIR/gpu_io.probe.dat")

# The flags each dnvme tool adds.
tool_flags() {
  case $1 in
    host) ;;
    gpu) echo "--gpu --gpu-device $DEVICE" ;;
    gds) echo "--gpu --gpu-device $DEVICE --gds" ;;
  esac
}

# GDS: one small write decides; when cuFile cannot run, its reason is printed and gds is left out.
TOOLS=(host gpu gds fio)
GDS_SKIPPED=
if ! "$DNVME" io --dir "$DIR" --file gpu_io.probe.dat --size 1M --write --loops 1 --warmup 0 \
  --gpu --gpu-device "$DEVICE" --gds >/dev/null 2>"$WORK/gds_probe.err"; then
  GDS_SKIPPED=$(grep -v '^\[' "$WORK/gds_probe.err" | tail -n 1)
  [[ -n $GDS_SKIPPED ]] || GDS_SKIPPED=$(tail -n 1 "$WORK/gds_probe.err")
  echo "gpu_io: gds runs skipped: $GDS_SKIPPED"
  TOOLS=(host gpu fio)
fi
rm -f "$DIR/gpu_io.probe.dat"

RESULTS=$WORK/results.jsonl  # one JSON object per run

run_fio() {  # round op
  local out=$WORK/fio.json
  "${FIO_CMD[@]}" --rw="$2" >"$out" || die "fio --rw=$2 failed (round $1)"
  $PY - "$out" "$1" "$2" >>"$RESULTS" <<'PYEOF' || die "cannot parse fio's JSON output"
import json, sys
path, rnd, rw = sys.argv[1:4]
text = open(path).read()
side = json.loads(text[text.index("{"):])["jobs"][0][rw]
print(json.dumps({"round": int(rnd), "tool": "fio", "op": rw,
                  "gib_per_s": side["bw_bytes"] / 2**30, "seconds": side["runtime"] / 1000.0}))
PYEOF
}

run_dnvme() {  # round op tool
  local out=$WORK/dnvme.json
  local -a flags
  read -r -a flags <<<"$(tool_flags "$3")"
  "${DNVME_CMD[@]}" --file "gpu_io.$3.dat" "${flags[@]}" --"$2" >"$out" 2>"$WORK/dnvme.err" || {
    cat "$WORK/dnvme.err" >&2
    die "dnvme io --$2 ($3) failed (round $1):" \
      "${DNVME_CMD[*]} --file gpu_io.$3.dat ${flags[*]} --$2"
  }
  $PY - "$out" "$1" "$3" >>"$RESULTS" <<'PYEOF' || die "cannot parse dnvme's JSON output"
import json, sys
path, rnd, tool = sys.argv[1:4]
for line in open(path):
    r = json.loads(line)
    row = {"round": int(rnd), "tool": tool, "op": r["op"], "gib_per_s": r["gib_per_s"],
           "seconds": r["seconds"]}
    if "gpu" in r:
        g = r["gpu"]
        row.update({k: g[k] for k in ("name", "mode", "mode_reason", "h2d_gib_per_s",
                                      "d2h_gib_per_s")})
    print(json.dumps(row))
PYEOF
}

echo "gpu_io: $(date -u +%Y-%m-%dT%H:%M:%SZ) dir=$DIR size=$BYTES rounds=$ROUNDS bs=$BS_BYTES" \
  "iodepth=$IODEPTH device=$DEVICE loadavg=$(cut -d' ' -f1-3 /proc/loadavg)"
echo "  dnvme: ${DNVME_CMD[*]} --file gpu_io.TOOL.dat [--gpu [--gds]] --write|--read"
echo "  fio:   ${FIO_CMD[*]} --rw=write|read"
: >"$RESULTS"
for ((round = 1; round <= ROUNDS; round++)); do
  # Rotate the order: round r starts with tool r-1.
  order=()
  for ((i = 0; i < ${#TOOLS[@]}; i++)); do
    order+=("${TOOLS[(i + round - 1) % ${#TOOLS[@]}]}")
  done
  for op in write read; do
    for tool in "${order[@]}"; do
      [[ $op == read ]] && drop_caches
      echo "  round $round: $tool $op" >&2
      if [[ $tool == fio ]]; then run_fio "$round" "$op"; else run_dnvme "$round" "$op" "$tool"; fi
    done
  done
done

$PY - "$RESULTS" "$JSON_OUT" "$BYTES" "$ROUNDS" "$DIR" "$GDS_SKIPPED" "${DNVME_CMD[*]}" \
  "${FIO_CMD[*]}" <<'PYEOF'
import json, statistics, sys, time
results_path, json_out, size, rounds, directory, gds_skipped, dnvme_cmd, fio_cmd = sys.argv[1:9]
rows = [json.loads(l) for l in open(results_path) if l.strip()]
tools = [t for t in ("host", "gpu", "gds", "fio") if any(r["tool"] == t for r in rows)]

print()
print(f"{'round':>5}  {'tool':<5}  {'op':<5}  {'GiB/s':>7}  {'seconds':>8}  mode")
for r in rows:
    print(f"{r['round']:>5}  {r['tool']:<5}  {r['op']:<5}  {r['gib_per_s']:>7.3f}  "
          f"{r['seconds']:>8.3f}  {r.get('mode', '')}")

def med(tool, op, key="gib_per_s"):
    v = [r[key] for r in rows if r["tool"] == tool and r["op"] == op and key in r]
    return statistics.median(v) if v else None

def ratio(a, b):
    return round(a / b, 3) if a is not None and b else None

gpu_rows = [r for r in rows if "h2d_gib_per_s" in r]
copy = {"h2d": statistics.median(r["h2d_gib_per_s"] for r in gpu_rows),
        "d2h": statistics.median(r["d2h_gib_per_s"] for r in gpu_rows)}
modes = {r["tool"]: (r["mode"], r["mode_reason"]) for r in gpu_rows}
print()
print(f"GPU: {gpu_rows[0]['name']}; pinned copy of {int(size) / 2**30:.2f} GiB: "
      f"host->device {copy['h2d']:.2f} GiB/s, device->host {copy['d2h']:.2f} GiB/s")
for tool, (mode, why) in modes.items():
    print(f"  {tool}: mode {mode} ({why})")
if gds_skipped:
    print(f"  gds: skipped: {gds_skipped}")

print()
print(f"median of {rounds} round(s), {int(size) / 2**30:.2f} GiB per run (GiB/s)")
head = "".join(f"{t:>8}" for t in tools)
print(f"{'op':<5} {head}  {'gpu/host':>8}  {'gds/host':>8}  {'limit':>7}  {'gpu/lim':>7}  "
      f"{'gds/lim':>7}")
summary = {}
for op in ("write", "read"):
    m = {t: med(t, op) for t in tools}
    # The bound for GPU memory: the disk (fio) or the copy in this op's direction.
    c = copy["d2h"] if op == "write" else copy["h2d"]
    limit = min(c, m["fio"]) if m.get("fio") else None
    s = {f"{t}_gib_per_s": m[t] for t in tools}
    s.update({"copy_gib_per_s": c, "limit_gib_per_s": limit,
              "gpu_vs_host": ratio(m.get("gpu"), m.get("host")),
              "gds_vs_host": ratio(m.get("gds"), m.get("host")),
              "gpu_vs_limit": ratio(m.get("gpu"), limit),
              "gds_vs_limit": ratio(m.get("gds"), limit),
              "host_vs_fio": ratio(m.get("host"), m.get("fio"))})
    summary[op] = s
    fmt = lambda v, w=8: f"{v:>{w}.3f}" if v is not None else f"{'-':>{w}}"
    print(f"{op:<5} " + "".join(fmt(m[t]) for t in tools) +
          f"  {fmt(s['gpu_vs_host'])}  {fmt(s['gds_vs_host'])}  {fmt(limit, 7)}  "
          f"{fmt(s['gpu_vs_limit'], 7)}  {fmt(s['gds_vs_limit'], 7)}")
print("limit = min(fio, pinned copy in the op's direction: device->host for write, "
      "host->device for read)")

if json_out:
    with open(json_out, "w") as out:
        json.dump({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "dir": directory,
                   "bytes": int(size), "rounds": int(rounds), "dnvme_cmd": dnvme_cmd,
                   "fio_cmd": fio_cmd, "gpu": gpu_rows[0]["name"], "copy_gib_per_s": copy,
                   "modes": {t: {"mode": m, "reason": w} for t, (m, w) in modes.items()},
                   "gds_skipped": gds_skipped or None, "results": rows, "median": summary},
                  out, indent=2)
        out.write("\n")
    print(f"\nwrote {json_out}")
PYEOF
