#!/usr/bin/env bash
# Usage: bench/gpu_io.sh [--dir DIR] [--size 1G] [--rounds 3] [--bs 1M] [--iodepth 128]
#                        [--gpu-device N] [--json-out FILE] [--mount] [extra `dnvme io` flags...]
#
# What GPU memory costs against host memory and the disk, in one run on one directory. Each round
# writes, then reads, SIZE bytes with each of:
#   host:  dnvme io                  (pinned host memory, the AioHandle)
#   gpu:   dnvme io --gpu            (device memory through the gds_handle's bounce path)
#   gds:   dnvme io --gpu --gds      (cuFile; where GDS/P2PDMA cannot run but cuFile's compat
#                                     mode can, --gds-compat, and the mode says so; skipped,
#                                     with cuFile's reason, where neither runs)
#   fio:   ioengine=libaio direct=1, the same bs and iodepth as dnvme (the disk's own rate)
# every dnvme run with --json --loops 1 --warmup 0 --block-size BS --queue-depth IODEPTH. The page
# cache is dropped before every read when root; the order of the tools rotates from round to
# round so none always gets the warmer disk. Prints every run, the median GiB/s (GiB = 2^30
# bytes) of each tool and op, the raw pinned host<->device copy rates for SIZE (as dnvme io
# --gpu measured them), and the ratios gpu/host, gds/host and gpu/min(disk, copy), where disk is
# fio's median and copy is device->host for writes, host->device for reads. Each run's rate is
# also printed to stderr as it ends, so a run cut short still shows what it measured.
#
# --mount: afterwards, SIZE bytes of a CUDA tensor through a real dnvmefs mount with
# deepnvme.Mount.register_cuda (the daemon maps the tensor by CUDA IPC and moves it), ROUNDS
# writes and reads, checked byte for byte. Needs $PYTHON with torch (CUDA) and deepnvme on its
# path, the daemon ($DNVMEFS, default build/bin/dnvmefs) and /dev/fuse; otherwise it prints why
# and skips that part.
#
# Without a usable GPU it prints the reason (`dnvme report`'s) and SKIPPED, and exits 0, so it
# can run anywhere. Removes its files at the end. DNVME=path overrides the binary, PYTHON the
# interpreter (default /usr/bin/python3; --mount needs one with torch), FIO fio.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DNVME=${DNVME:-$ROOT/build/bin/dnvme}
DNVMEFS=${DNVMEFS:-$ROOT/build/bin/dnvmefs}
PY=${PYTHON:-/usr/bin/python3}
FIO=${FIO:-fio}

DIR=$ROOT/var/offload
SIZE=1G
ROUNDS=3
BS=1M
IODEPTH=128
DEVICE=0
JSON_OUT=
MOUNT=0
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
    --mount) MOUNT=1; shift ;;
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
command -v "$FIO" >/dev/null || die "fio ($FIO) is missing; run scripts/install-deps.sh"

DNVME_CMD=("$DNVME" io --dir "$DIR" --size "$BYTES" --json --loops 1 --warmup 0
  --block-size "$BS_BYTES" --queue-depth "$IODEPTH" "${EXTRA[@]}")
FIO_FILE=$DIR/gpu_io.fio.dat
FIO_CMD=("$FIO" --name=gpu_io --filename="$FIO_FILE" --ioengine=libaio --direct=1 --bs="$BS_BYTES"
  --iodepth="$IODEPTH" --size="$BYTES" --numjobs=1 --output-format=json)
FILES+=("$FIO_FILE" "$DIR/gpu_io.host.dat" "$DIR/gpu_io.gpu.dat" "$DIR/gpu_io.gds.dat"
  "$DIR/gpu_io.probe.dat")

# The flags each dnvme tool adds.
tool_flags() {
  case $1 in
    host) ;;
    gpu) echo "--gpu --gpu-device $DEVICE" ;;
    gds) echo "--gpu --gpu-device $DEVICE $GDS_FLAGS" ;;
  esac
}

# GDS: one small write decides. When GDS/P2PDMA cannot run, its reason is printed and cuFile's
# compat mode (--gds-compat: cuFile's own POSIX path, no nvidia-fs) is tried; when that cannot
# run either, gds is left out.
TOOLS=(host gpu gds fio)
GDS_FLAGS=--gds
GDS_SKIPPED=
gds_probe() {  # extra flags; prints the reason and fails when the probe write fails
  "$DNVME" io --dir "$DIR" --file gpu_io.probe.dat --size 1M --write --loops 1 --warmup 0 \
    --gpu --gpu-device "$DEVICE" "$@" >/dev/null 2>"$WORK/gds_probe.err" && return 0
  local why
  why=$(grep -v '^\[' "$WORK/gds_probe.err" | tail -n 1)
  [[ -n $why ]] || why=$(tail -n 1 "$WORK/gds_probe.err")
  echo "$why"
  return 1
}
if ! GDS_WHY=$(gds_probe --gds); then
  echo "gpu_io: --gds (GDS or P2PDMA) cannot run: $GDS_WHY"
  if COMPAT_WHY=$(gds_probe --gds --gds-compat); then
    echo "gpu_io: gds runs use cuFile's compat mode (--gds --gds-compat)"
    GDS_FLAGS="--gds --gds-compat"
  else
    GDS_SKIPPED="$GDS_WHY; with --gds-compat: $COMPAT_WHY"
    echo "gpu_io: gds runs skipped: $GDS_SKIPPED"
    TOOLS=(host gpu fio)
  fi
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
print(f"  round {rnd}: fio {rw}: {side['bw_bytes'] / 2**30:.3f} GiB/s", file=sys.stderr)
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
    print(f"  round {rnd}: {tool} {r['op']}: {r['gib_per_s']:.3f} GiB/s {row.get('mode', '')}",
          file=sys.stderr)
PYEOF
}

echo "gpu_io: $(date -u +%Y-%m-%dT%H:%M:%SZ) dir=$DIR size=$BYTES rounds=$ROUNDS bs=$BS_BYTES" \
  "iodepth=$IODEPTH device=$DEVICE loadavg=$(cut -d' ' -f1-3 /proc/loadavg)"
echo "  dnvme: ${DNVME_CMD[*]} --file gpu_io.TOOL.dat [--gpu [$GDS_FLAGS]] --write|--read"
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
      if [[ $tool == fio ]]; then run_fio "$round" "$op"; else run_dnvme "$round" "$op" "$tool"; fi
    done
  done
done

# --mount: a CUDA tensor through a real mount (Mount.register_cuda), written to $WORK/mount.json:
# {"skipped": why} or {"error": what} or {"rows": [...], "verified": true}.
MOUNT_JSON=$WORK/mount.json
if [[ $MOUNT -eq 1 ]]; then
  echo "  mount: Mount.register_cuda through dnvmefs ($DNVMEFS), $ROUNDS round(s)" >&2
  DNVMEFS_BIN=$DNVMEFS DNVME_TEST_DIR=$DIR/mount-scratch \
    $PY - "$ROOT" "$BYTES" "$ROUNDS" "$MOUNT_JSON" "$DEVICE" <<'PYEOF' ||
import json, os, sys, time
root, size, rounds, out_path, device = sys.argv[1:6]
size, rounds = int(size), int(rounds)
sys.path.insert(0, root)


def done(**result):
    with open(out_path, "w") as f:
        json.dump(result, f)
    sys.exit(0)


try:
    import torch
    import deepnvme
    from tests.fs import mount_harness as mh
except ImportError as e:
    done(skipped="cannot import torch/deepnvme/the mount harness: %s" % e)
why = mh.skip_reason()
if why is None and not torch.cuda.is_available():
    why = "torch %s has no usable CUDA" % torch.__version__
if why:
    done(skipped=why)


def drop_caches():
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
    except OSError:
        pass


dev = torch.device("cuda", int(device))
rows = []
try:
    with mh.Scratch("gpu-io-mount") as s, mh.Mount(s.backing, s.mnt) as mount, \
            deepnvme.Mount(s.mnt) as m:
        src = torch.randint(0, 256, (size,), dtype=torch.uint8, device=dev)
        dst = torch.zeros_like(src)
        torch.cuda.synchronize()
        m.register_cuda(src)
        m.register_cuda(dst, writable=True)
        for rnd in range(1, rounds + 1):
            t0 = time.monotonic()
            n = m.pwrite(src, "gpu_io.mount.dat")
            t1 = time.monotonic()
            rows.append({"round": rnd, "op": "write", "bytes": n, "seconds": t1 - t0,
                         "gib_per_s": n / (t1 - t0) / 2**30})
            print("  round %d: mount write: %.3f GiB/s" % (rnd, rows[-1]["gib_per_s"]),
                  file=sys.stderr)
            drop_caches()
            dst.zero_()
            torch.cuda.synchronize()
            t0 = time.monotonic()
            n = m.pread(dst, "gpu_io.mount.dat")
            t1 = time.monotonic()
            rows.append({"round": rnd, "op": "read", "bytes": n, "seconds": t1 - t0,
                         "gib_per_s": n / (t1 - t0) / 2**30})
            print("  round %d: mount read: %.3f GiB/s" % (rnd, rows[-1]["gib_per_s"]),
                  file=sys.stderr)
            if not torch.equal(src, dst):
                done(error="round %d: the bytes read back differ from those written" % rnd,
                     rows=rows)
        if not (mount.alive() and mount.is_mounted()):
            done(error="the daemon died or the mount went away: " + mount.log_tail(), rows=rows)
except Exception as e:  # the reason goes into the summary; the exit status says it failed
    done(error="%s: %s" % (type(e).__name__, e), rows=rows)
done(rows=rows, verified=True)
PYEOF
    echo '{"error": "the mount part exited abnormally"}' >"$MOUNT_JSON"
fi

$PY - "$RESULTS" "$JSON_OUT" "$BYTES" "$ROUNDS" "$DIR" "$GDS_SKIPPED" "${DNVME_CMD[*]}" \
  "${FIO_CMD[*]}" "$GDS_FLAGS" "$MOUNT_JSON" <<'PYEOF'
import json, os, statistics, sys, time
(results_path, json_out, size, rounds, directory, gds_skipped, dnvme_cmd, fio_cmd, gds_flags,
 mount_path) = sys.argv[1:11]
rows = [json.loads(l) for l in open(results_path) if l.strip()]
mount = json.load(open(mount_path)) if os.path.exists(mount_path) else None
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

if mount is not None:
    print()
    if "skipped" in mount:
        print(f"mount (Mount.register_cuda): skipped: {mount['skipped']}")
    else:
        for op in ("write", "read"):
            v = [r["gib_per_s"] for r in mount.get("rows", []) if r["op"] == op]
            if v:
                print(f"mount (Mount.register_cuda) {op}: median {statistics.median(v):.3f} GiB/s"
                      f" over {len(v)} round(s) "
                      f"({statistics.median(v) / summary[op]['fio_gib_per_s']:.3f}x fio)")
        print("mount: " + (f"FAILED: {mount['error']}" if "error" in mount else
                           "bytes read back equal those written"))

if json_out:
    with open(json_out, "w") as out:
        json.dump({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "dir": directory,
                   "bytes": int(size), "rounds": int(rounds), "dnvme_cmd": dnvme_cmd,
                   "fio_cmd": fio_cmd, "gds_flags": gds_flags, "gpu": gpu_rows[0]["name"],
                   "copy_gib_per_s": copy, "mount": mount,
                   "modes": {t: {"mode": m, "reason": w} for t, (m, w) in modes.items()},
                   "gds_skipped": gds_skipped or None, "results": rows, "median": summary},
                  out, indent=2)
        out.write("\n")
    print(f"\nwrote {json_out}")
sys.exit(1 if mount is not None and "error" in mount else 0)
PYEOF
