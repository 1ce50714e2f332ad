#!/usr/bin/env bash
# Usage: bench/mount_vs_fio.sh [--dir|--backing DIR] [--size 1G] [--runs 3] [-o dnvmefs-options]
#                              [--no-passthrough] [--settle SECONDS] [--json-out FILE]
#                              [--hold-freed-memory]
#
# A dnvmefs mount against fio straight on its backing directory and against libfuse's own
# passthrough_ll example, all on the same disk in one run. Every round runs five variants, each a
# write then a cold read (sync + drop caches before the read) of SIZE with bs=1M; the order of
# the variants is reversed every other round so none always gets the warmer disk:
#   raw       fio on BACKING itself:   ioengine=libaio direct=1 iodepth=32
#   ext_buf   fio on BACKING itself:   ioengine=psync (buffered): the dnv_buf client without the
#                                      mount (plain ext4)
#   dnv_buf   fio through dnvmefs:     ioengine=psync (buffered), like a program writing a
#                                      checkpoint with write(2)
#   dnv_dir   fio through dnvmefs:     ioengine=libaio direct=1 iodepth=32 (the raw job)
#   pll_buf   fio through passthrough_ll (compiled at bench time from
#             /usr/share/doc/libfuse3-dev/examples/passthrough_ll.c into a temp dir, default
#             options): the dnv_buf job
# Every write job ends with an fsync (end_fsync=1), so buffered writes are timed to the disk;
# every job uses fallocate=none so no variant gets preallocated blocks another does not. Each
# variant's file is removed after its read, then the disk is left SETTLE seconds (--settle, 3)
# before the next write, so no write pays for the previous variant's freed blocks (bench/lib.sh).
# dnvmefs runs in the foreground (-f) from this script, so its CPU time can be read from
# /proc/PID/stat (utime + stime, all threads) around each job; the same for passthrough_ll. fio's
# own CPU is (usr_cpu + sys_cpu)% x job_runtime from its JSON. The machine's CPU (every process
# and kernel thread: user, nice, system, irq and softirq from /proc/stat's cpu line) is read
# around each job as well: on a fast device the kernel's share (page cache, FUSE copies, loop
# device) is most of it.
#
# Prints every job, then medians over the rounds and the ratios:
#   (a) dnv_buf / raw         (b) dnv_dir / raw         (c) dnv_buf / pll_buf      GiB/s
#   (d) daemon CPU seconds per GiB moved (write + read) / raw fio's CPU seconds per GiB
#   (e) dnv_buf / ext_buf (the same buffered client through the mount and on plain ext4)
#   (f) machine CPU seconds per GiB of each variant / raw's
# GiB = 2^30 bytes. Always unmounts both filesystems and removes its files (trap).
# --hold-freed-memory: on a VM whose kernel hands freed memory back to the host at once (free
# page reporting), delay that for the run; fresh page cache then costs what it costs on a real
# machine (bench/lib.sh, hold_freed_memory). Without the knob it does nothing.
# Run as root (drop caches; dnvmefs pins buffers). DNVMEFS=path overrides the binary.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DNVMEFS=${DNVMEFS:-$ROOT/build/bin/dnvmefs}
PY=/usr/bin/python3
PLL_SRC_DIR=/usr/share/doc/libfuse3-dev/examples

BACKING=$ROOT/var/bench-backing
SIZE=1G
RUNS=3
OPTS=
PASSTHROUGH=1
JSON_OUT=
HOLD_FREED=0
while [[ $# -gt 0 ]]; do
  case $1 in
    --backing | --dir) BACKING=${2:?$1 needs a directory}; shift 2 ;;
    --size) SIZE=${2:?--size needs a value}; shift 2 ;;
    --runs) RUNS=${2:?--runs needs a number}; shift 2 ;;
    -o) OPTS=${2:?-o needs options}; shift 2 ;;
    --no-passthrough) PASSTHROUGH=0; shift ;;
    --json-out) JSON_OUT=${2:?--json-out needs a file}; shift 2 ;;
    --settle) SETTLE=${2:?--settle needs seconds}; shift 2 ;;
    --hold-freed-memory) HOLD_FREED=1; shift ;;
    -h | --help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
    *) echo "mount_vs_fio: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

BENCH_NAME=mount_vs_fio
# shellcheck source=bench/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
# shellcheck source=scripts/pipe-max.sh
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/pipe-max.sh"
[[ -x $DNVMEFS ]] || die "$DNVMEFS is missing; build it first: scripts/build.sh"
command -v fio >/dev/null || die "fio is missing; run scripts/install-deps.sh"
command -v fusermount3 >/dev/null || die "fusermount3 is missing; run scripts/install-deps.sh"
[[ -x $PY ]] || die "$PY is missing (needed to parse fio's JSON)"
[[ -c /dev/fuse ]] || die "/dev/fuse is missing (modprobe fuse, or pass the device to the container)"
[[ $RUNS =~ ^[1-9][0-9]*$ ]] || die "--runs must be a positive integer, got '$RUNS'"
BYTES=$(size_bytes "$SIZE")
mkdir -p "$BACKING"
BACKING=$(cd "$BACKING" && pwd -P)
[[ -w $BACKING ]] || die "--backing $BACKING is not writable"

WORK=$(mktemp -d)
MNT_D=$WORK/mnt-dnvmefs
MNT_P=$WORK/mnt-passthrough_ll
mkdir -p "$MNT_D" "$MNT_P"
DNV_PID=
PLL_PID=
FILES=("$BACKING/mvf_raw.dat" "$BACKING/mvf_ext_buf.dat" "$BACKING/mvf_dnv_buf.dat" "$BACKING/mvf_dnv_dir.dat"
  "$BACKING/mvf_pll_buf.dat")

is_mounted() { findmnt -rn -M "$1" >/dev/null 2>&1; }
stop_fs() {  # mountpoint pid
  local mnt=$1 pid=$2
  if is_mounted "$mnt"; then
    fusermount3 -u "$mnt" 2>/dev/null || fusermount3 -u -z "$mnt" 2>/dev/null ||
      echo "mount_vs_fio: could not unmount $mnt" >&2
  fi
  if [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null; then
    # Unmounting ends the daemon's loop; give it a moment, then make sure.
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  fi
}
cleanup() {
  pipe_max_restore
  release_freed_memory
  stop_fs "$MNT_D" "$DNV_PID"
  stop_fs "$MNT_P" "$PLL_PID"
  rm -f "${FILES[@]}"
  # Never rm -r a directory that still has a mount under it (it would reach the backing files).
  if is_mounted "$MNT_D" || is_mounted "$MNT_P"; then
    echo "mount_vs_fio: leaving $WORK (a mount is still there)" >&2
  else
    rm -rf "$WORK"
  fi
}
trap cleanup EXIT
pipe_max_raise  # for the whole run: every variant mounts anew
[[ $HOLD_FREED == 1 ]] && hold_freed_memory  # bench/lib.sh: a VM's host reclaim, not the mount


wait_mounted() {  # mountpoint pid log name
  local mnt=$1 pid=$2 log=$3 name=$4
  for _ in $(seq 150); do
    if [[ $(findmnt -rn -o FSTYPE -M "$mnt" 2>/dev/null) == fuse* ]]; then return 0; fi
    if ! kill -0 "$pid" 2>/dev/null; then
      wait "$pid" 2>/dev/null && rc=0 || rc=$?
      echo "mount_vs_fio: $name exited ($rc) before mounting $mnt:" >&2
      sed 's/^/  | /' "$log" >&2
      exit 1
    fi
    sleep 0.1
  done
  echo "mount_vs_fio: $name did not mount $mnt within 15 s:" >&2
  sed 's/^/  | /' "$log" >&2
  exit 1
}

# dnvmefs in the foreground so that $! is the daemon itself.
DNV_CMD=("$DNVMEFS" "$BACKING" "$MNT_D" -f ${OPTS:+-o "$OPTS"})
"${DNV_CMD[@]}" >"$WORK/dnvmefs.log" 2>&1 &
DNV_PID=$!
wait_mounted "$MNT_D" "$DNV_PID" "$WORK/dnvmefs.log" dnvmefs

PLL_CMD=()
if [[ $PASSTHROUGH -eq 1 ]]; then
  if [[ ! -f $PLL_SRC_DIR/passthrough_ll.c ]]; then
    echo "mount_vs_fio: $PLL_SRC_DIR/passthrough_ll.c is missing (apt-get install" \
      "libfuse3-dev); skipping (c)" >&2
    PASSTHROUGH=0
  elif ! command -v gcc >/dev/null || ! pkg-config --exists fuse3 2>/dev/null; then
    echo "mount_vs_fio: gcc or pkg-config fuse3 missing; skipping (c)" >&2
    PASSTHROUGH=0
  else
    # shellcheck disable=SC2046  # pkg-config prints several flags
    gcc -O2 -Wall -I"$PLL_SRC_DIR" "$PLL_SRC_DIR/passthrough_ll.c" -o "$WORK/passthrough_ll" \
      $(pkg-config --cflags --libs fuse3) >"$WORK/pll-build.log" 2>&1 ||
      { sed 's/^/  | /' "$WORK/pll-build.log" >&2; die "cannot compile passthrough_ll.c"; }
    PLL_CMD=("$WORK/passthrough_ll" -f -o "source=$BACKING" "$MNT_P")
    "${PLL_CMD[@]}" >"$WORK/passthrough_ll.log" 2>&1 &
    PLL_PID=$!
    wait_mounted "$MNT_P" "$PLL_PID" "$WORK/passthrough_ll.log" passthrough_ll
  fi
fi

CLK_TCK=$(getconf CLK_TCK)
cpu_ticks() {  # pid -> utime + stime of the whole process, in clock ticks
  local stat rest
  [[ -n $1 ]] || { echo 0; return; }
  stat=$(<"/proc/$1/stat")
  rest=${stat##*) }  # fields from 3 on; comm (field 2) may contain spaces
  read -ra f <<<"$rest"
  echo $((f[11] + f[12]))
}

COMMON=(--bs=1M --size="$BYTES" --numjobs=1 --fallocate=none --output-format=json)
RAW_ARGS=(--ioengine=libaio --direct=1 --iodepth=32)
BUF_ARGS=(--ioengine=psync)
declare -A VFILE=([raw]=$BACKING/mvf_raw.dat [ext_buf]=$BACKING/mvf_ext_buf.dat [dnv_buf]=$MNT_D/mvf_dnv_buf.dat
  [dnv_dir]=$MNT_D/mvf_dnv_dir.dat [pll_buf]=$MNT_P/mvf_pll_buf.dat)
declare -A VPID=([raw]="" [ext_buf]="" [dnv_buf]=$DNV_PID [dnv_dir]=$DNV_PID [pll_buf]=$PLL_PID)
RESULTS=$WORK/results.tsv  # run variant op gib_per_s seconds fio_cpu_s daemon_cpu_s machine_cpu_s
: >"$RESULTS"

run_job() {  # run variant op
  local run=$1 v=$2 op=$3 args before after m_before m_after out=$WORK/fio.json
  case $v in
    raw | dnv_dir) args=("${RAW_ARGS[@]}") ;;
    *) args=("${BUF_ARGS[@]}") ;;
  esac
  [[ $op == write ]] && args+=(--end_fsync=1)
  before=$(cpu_ticks "${VPID[$v]}")
  m_before=$(machine_busy_ticks)
  if ! fio --name="mvf_$v" --filename="${VFILE[$v]}" --rw="$op" "${COMMON[@]}" "${args[@]}" \
    >"$out" 2>"$WORK/fio.err"; then
    sed 's/^/  | /' "$WORK/fio.err" >&2
    die "fio $op on $v failed (run $run): fio --filename=${VFILE[$v]} --rw=$op ${COMMON[*]} ${args[*]}"
  fi
  after=$(cpu_ticks "${VPID[$v]}")
  m_after=$(machine_busy_ticks)
  $PY - "$out" "$run" "$v" "$op" "$((after - before))" "$CLK_TCK" "$((m_after - m_before))" >>"$RESULTS" <<'PYEOF' || die "cannot parse fio's JSON output"
import json, sys
path, run, variant, rw, ticks, clk, machine_ticks = sys.argv[1:8]
text = open(path).read()
job = json.loads(text[text.index("{"):])["jobs"][0]
side = job[rw]
runtime_ms = job.get("job_runtime") or side["runtime"]
fio_cpu = (job["usr_cpu"] + job["sys_cpu"]) / 100.0 * runtime_ms / 1000.0
print(f"{run}\t{variant}\t{rw}\t{side['bw_bytes'] / 2**30:.6f}\t{side['runtime'] / 1000:.6f}"
      f"\t{fio_cpu:.6f}\t{int(ticks) / int(clk):.6f}\t{int(machine_ticks) / int(clk):.6f}")
PYEOF
}

VARIANTS=(raw ext_buf dnv_buf dnv_dir)
[[ $PASSTHROUGH -eq 1 ]] && VARIANTS+=(pll_buf)

echo "mount_vs_fio: $(date -u +%Y-%m-%dT%H:%M:%SZ) backing=$BACKING size=$BYTES runs=$RUNS" \
  "settle=${SETTLE}s loadavg=$(cut -d' ' -f1-3 /proc/loadavg) kernel=$(uname -r)"
echo "  dnvmefs:        ${DNV_CMD[*]}"
echo "                  $(findmnt -rn -o FSTYPE,OPTIONS -M "$MNT_D")"
[[ $PASSTHROUGH -eq 1 ]] && echo "  passthrough_ll: ${PLL_CMD[*]}"
echo "  fio common:     ${COMMON[*]} (+ --end_fsync=1 on writes)"
echo "  raw, dnv_dir:   ${RAW_ARGS[*]}      ext_buf, dnv_buf, pll_buf: ${BUF_ARGS[*]}"
for ((run = 1; run <= RUNS; run++)); do
  order=("${VARIANTS[@]}")
  if ((run % 2 == 0)); then
    order=()
    for ((i = ${#VARIANTS[@]} - 1; i >= 0; i--)); do order+=("${VARIANTS[i]}"); done
  fi
  for v in "${order[@]}"; do
    echo "  run $run: $v" >&2
    sync
    run_job "$run" "$v" write
    drop_caches
    run_job "$run" "$v" read
    rm -f "${VFILE[$v]}"
    settle_after_delete
  done
done

$PY - "$RESULTS" "$JSON_OUT" "$BYTES" "$RUNS" <<'PYEOF'
import json, statistics, sys, time
results_path, json_out, size, runs = sys.argv[1:5]
gib = int(size) / 2**30
rows = []
for line in open(results_path):
    run, v, op, bw, sec, fcpu, dcpu, mcpu = line.rstrip("\n").split("\t")
    rows.append({"run": int(run), "variant": v, "op": op, "gib_per_s": float(bw),
                 "seconds": float(sec), "fio_cpu_s": float(fcpu), "daemon_cpu_s": float(dcpu),
                 "machine_cpu_s": float(mcpu)})
variants = [v for v in ("raw", "ext_buf", "dnv_buf", "dnv_dir", "pll_buf") if any(r["variant"] == v for r in rows)]

print()
print(f"{'run':>3}  {'variant':<8} {'op':<5} {'GiB/s':>7} {'seconds':>8} {'fio cpu s':>9} {'daemon cpu s':>12} {'machine cpu s':>13}")
for r in rows:
    d = "-" if r["variant"] in ("raw", "ext_buf") else f"{r['daemon_cpu_s']:.2f}"
    print(f"{r['run']:>3}  {r['variant']:<8} {r['op']:<5} {r['gib_per_s']:>7.3f} {r['seconds']:>8.3f}"
          f" {r['fio_cpu_s']:>9.2f} {d:>12} {r['machine_cpu_s']:>13.2f}")

def med(v, op, key="gib_per_s"):
    return statistics.median(r[key] for r in rows if r["variant"] == v and r["op"] == op)

def cpu_per_gib(v, key):  # median over rounds of (write + read CPU) / GiB moved
    per_run = {}
    for r in rows:
        if r["variant"] == v:
            per_run[r["run"]] = per_run.get(r["run"], 0.0) + r[key]
    return statistics.median(per_run.values()) / (2 * gib)

print()
print(f"median of {runs} round(s), {gib:.2f} GiB per job; CPU s/GiB over write + read")
print(f"{'variant':<8} {'write GiB/s':>11} {'read GiB/s':>10} {'fio cpu s/GiB':>13} {'daemon cpu s/GiB':>16} {'machine cpu s/GiB':>17}")
summary = {}
for v in variants:
    s = {"write_gib_per_s": med(v, "write"), "read_gib_per_s": med(v, "read"),
         "fio_cpu_s_per_gib": cpu_per_gib(v, "fio_cpu_s"),
         "daemon_cpu_s_per_gib": None if v in ("raw", "ext_buf") else cpu_per_gib(v, "daemon_cpu_s"),
         "machine_cpu_s_per_gib": cpu_per_gib(v, "machine_cpu_s")}
    summary[v] = s
    d = "-" if s["daemon_cpu_s_per_gib"] is None else f"{s['daemon_cpu_s_per_gib']:.3f}"
    print(f"{v:<8} {s['write_gib_per_s']:>11.3f} {s['read_gib_per_s']:>10.3f}"
          f" {s['fio_cpu_s_per_gib']:>13.3f} {d:>16} {s['machine_cpu_s_per_gib']:>17.3f}")

def ratio(a, b):
    return a / b if b else float("nan")

print()
ratios = {}
def show(key, label, a, b):
    ratios[key] = round(ratio(a, b), 3)
    print(f"{label:<58} {ratios[key]:>6.3f}")
raw = summary["raw"]
for op in ("write", "read"):
    show(f"a_{op}", f"(a) {op:<5} dnvmefs buffered psync / raw fio", summary["dnv_buf"][f"{op}_gib_per_s"], raw[f"{op}_gib_per_s"])
for op in ("write", "read"):
    show(f"b_{op}", f"(b) {op:<5} dnvmefs direct libaio qd32 / raw fio", summary["dnv_dir"][f"{op}_gib_per_s"], raw[f"{op}_gib_per_s"])
if "pll_buf" in summary:
    for op in ("write", "read"):
        show(f"c_{op}", f"(c) {op:<5} dnvmefs buffered / passthrough_ll buffered", summary["dnv_buf"][f"{op}_gib_per_s"], summary["pll_buf"][f"{op}_gib_per_s"])
show("d_buf", "(d) dnvmefs daemon CPU/GiB (a, buffered) / raw fio CPU/GiB", summary["dnv_buf"]["daemon_cpu_s_per_gib"], raw["fio_cpu_s_per_gib"])
show("d_dir", "(d) dnvmefs daemon CPU/GiB (b, direct) / raw fio CPU/GiB", summary["dnv_dir"]["daemon_cpu_s_per_gib"], raw["fio_cpu_s_per_gib"])
for op in ("write", "read"):
    show(f"e_{op}", f"(e) {op:<5} dnvmefs buffered / the same client on plain ext4", summary["dnv_buf"][f"{op}_gib_per_s"], summary["ext_buf"][f"{op}_gib_per_s"])
for v in variants:
    if v != "raw":
        show(f"f_{v}", f"(f) machine CPU/GiB, {v} / raw", summary[v]["machine_cpu_s_per_gib"], raw["machine_cpu_s_per_gib"])
if "pll_buf" in summary:
    show("d_pll", "    dnvmefs daemon CPU/GiB (a) / passthrough_ll daemon CPU/GiB", summary["dnv_buf"]["daemon_cpu_s_per_gib"], summary["pll_buf"]["daemon_cpu_s_per_gib"])

if json_out:
    with open(json_out, "w") as out:
        json.dump({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "bytes": int(size),
                   "runs": int(runs), "results": rows, "median": summary, "ratios": ratios}, out, indent=2)
        out.write("\n")
    print(f"\nwrote {json_out}")
PYEOF
