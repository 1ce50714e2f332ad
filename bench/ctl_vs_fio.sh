#!/usr/bin/env bash
# Usage: bench/ctl_vs_fio.sh [--dir|--backing DIR] [--size 1G] [--runs 3] [-o dnvmefs-options]
#                            [--ctl-args "--queue-depth 32 ..."]
#
# Transfers through the control file against fio on the same backing directory, in one run:
#   raw      fio straight on BACKING: ioengine=libaio direct=1 iodepth=32 bs=1M, a write
#            (end_fsync=1) then a cold read (sync + drop caches first)
#   ext_buf  the same bytes moved by a program without the mount: fio psync (buffered write(2)
#            + fsync, read(2)) bs=1M on BACKING, plain ext4
#   ctl      `dnvme ctl MNT bench`: SIZE bytes of a client's shared memory (/dev/shm) written to a
#            file of a dnvmefs mount of BACKING through .dnvme/ctl (pwrite + fsync), then, after
#            sync + drop caches, read back into the shared memory (pread). The bytes go between
#            the client's memory (mapped by the daemon) and the disk through the engine: no FUSE
#            copy.
# They alternate, and their order is reversed every other round. The machine's CPU (every
# process and kernel thread, /proc/stat) is read around each fio job, and by `dnvme ctl bench`
# around its transfer (its buffer's set-up excluded). Prints every job, the medians,
# ctl/raw (goal >= 0.97 both ways), ctl/ext_buf, and machine CPU seconds per GiB of each against
# raw's. Run as root (drop caches).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DNVMEFS=${DNVMEFS:-$ROOT/build/bin/dnvmefs}
DNVME=${DNVME:-$ROOT/build/bin/dnvme}
PY=/usr/bin/python3
BACKING=$ROOT/var/bench-backing
SIZE=1G
RUNS=3
OPTS=
CTL_ARGS=
while [[ $# -gt 0 ]]; do
  case $1 in
    --backing | --dir) BACKING=${2:?$1 needs a directory}; shift 2 ;;
    --size) SIZE=${2:?--size needs a value}; shift 2 ;;
    --runs) RUNS=${2:?--runs needs a number}; shift 2 ;;
    -o) OPTS=${2:?-o needs options}; shift 2 ;;
    --ctl-args) CTL_ARGS=${2?--ctl-args needs a value}; shift 2 ;;
    -h | --help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
    *) echo "ctl_vs_fio: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
BENCH_NAME=ctl_vs_fio
# shellcheck source=bench/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
# shellcheck source=scripts/pipe-max.sh
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/pipe-max.sh"
[[ -x $DNVMEFS && -x $DNVME ]] || die "build first: scripts/build.sh ($DNVMEFS, $DNVME)"
command -v fio >/dev/null || die "fio is missing; run scripts/install-deps.sh"
[[ -c /dev/fuse ]] || die "/dev/fuse is missing"
[[ $RUNS =~ ^[1-9][0-9]*$ ]] || die "--runs must be a positive integer, got '$RUNS'"
mkdir -p "$BACKING"
BACKING=$(cd "$BACKING" && pwd -P)

WORK=$(mktemp -d)
MNT=$WORK/mnt
mkdir -p "$MNT"
DNV_PID=
cleanup() {
  if findmnt -rn -M "$MNT" >/dev/null 2>&1; then
    fusermount3 -u "$MNT" 2>/dev/null || fusermount3 -u -z "$MNT" 2>/dev/null || true
  fi
  if [[ -n $DNV_PID ]]; then
    for _ in $(seq 50); do kill -0 "$DNV_PID" 2>/dev/null || break; sleep 0.1; done
    kill "$DNV_PID" 2>/dev/null || true
    wait "$DNV_PID" 2>/dev/null || true
  fi
  pipe_max_restore
  rm -f "$BACKING/cvf_raw.dat" "$BACKING/cvf_ext_buf.dat" "$BACKING/cvf_ctl.dat"
  findmnt -rn -M "$MNT" >/dev/null 2>&1 || rm -rf "$WORK"
}
trap cleanup EXIT
pipe_max_raise

"$DNVMEFS" "$BACKING" "$MNT" -f ${OPTS:+-o "$OPTS"} >"$WORK/dnvmefs.log" 2>&1 &
DNV_PID=$!
for _ in $(seq 150); do
  [[ $(findmnt -rn -o FSTYPE -M "$MNT" 2>/dev/null) == fuse* ]] && break
  kill -0 "$DNV_PID" 2>/dev/null || { sed 's/^/  | /' "$WORK/dnvmefs.log" >&2; die "dnvmefs exited"; }
  sleep 0.1
done
[[ $(findmnt -rn -o FSTYPE -M "$MNT" 2>/dev/null) == fuse* ]] || die "dnvmefs did not mount"

RESULTS=$WORK/results.tsv  # run variant op gib_per_s (then, from timed_job, machine_cpu_s)
: >"$RESULTS"
CLK_TCK=$(getconf CLK_TCK)
FIO=(--bs=1M --size="$SIZE" --numjobs=1 --fallocate=none --output-format=json)
RAW_ARGS=(--ioengine=libaio --direct=1 --iodepth=32)
BUF_ARGS=(--ioengine=psync)
fio_job() {  # variant run op: fio on BACKING with the variant's engine
  local out=$WORK/fio.json extra=() args=("${RAW_ARGS[@]}")
  [[ $1 == ext_buf ]] && args=("${BUF_ARGS[@]}")
  [[ $3 == write ]] && extra=(--end_fsync=1)
  fio --name="cvf_$1" --filename="$BACKING/cvf_$1.dat" --rw="$3" "${FIO[@]}" "${args[@]}" \
    "${extra[@]}" >"$out" 2>"$WORK/fio.err" || { cat "$WORK/fio.err" >&2; die "fio $3 failed"; }
  $PY - "$out" "$2" "$3" "$1" >>"$RESULTS.part" <<'PYEOF'
import json, sys
text = open(sys.argv[1]).read()
job = json.loads(text[text.index("{"):])["jobs"][0]
print(f"{sys.argv[2]}\t{sys.argv[4]}\t{sys.argv[3]}\t{job[sys.argv[3]]['bw_bytes'] / 2**30:.6f}",
      end="")
PYEOF
}
raw_job() { fio_job raw "$@"; }
ext_buf_job() { fio_job ext_buf "$@"; }
timed_job() {  # variant run op: the job, with the machine's CPU seconds around it appended
  local before after
  : >"$RESULTS.part"
  before=$(machine_busy_ticks)
  "${1}_job" "$2" "$3"
  after=$(machine_busy_ticks)
  if [[ $1 == ctl ]]; then  # measured by the tool around the transfer itself
    printf '%s\n' "$(<"$RESULTS.part")" >>"$RESULTS"
  else
    printf '%s\t%s\n' "$(<"$RESULTS.part")" \
      "$($PY -c "print($((after - before)) / $CLK_TCK)")" >>"$RESULTS"
  fi
}
ctl_job() {  # run op
  local flag=--no-read
  [[ $2 == read ]] && flag=--no-write
  # shellcheck disable=SC2086  # CTL_ARGS is a list of flags
  "$DNVME" -v warn ctl "$MNT" bench --size "$SIZE" --file cvf_ctl.dat --loops 1 --keep --json \
    $flag $CTL_ARGS >"$WORK/ctl.json" 2>"$WORK/ctl.err" || { cat "$WORK/ctl.err" >&2; die "dnvme ctl bench $2 failed"; }
  $PY - "$WORK/ctl.json" "$1" "$2" >>"$RESULTS.part" <<'PYEOF'
import json, sys
j = json.loads(open(sys.argv[1]).read())
# The tool's own machine-CPU reading covers the transfer only, not its 1 GiB buffer's set-up.
print(f"{sys.argv[2]}\tctl\t{sys.argv[3]}\t{j[sys.argv[3] + '_gibps']:.6f}"
      f"\t{j[sys.argv[3] + '_machine_cpu_s']}", end="")
if sys.argv[3] == "write":
    print("# ctl handle config " + json.dumps(j["config"]), file=sys.stderr)
PYEOF
}

echo "ctl_vs_fio: $(date -u +%Y-%m-%dT%H:%M:%SZ) backing=$BACKING size=$SIZE runs=$RUNS" \
  "loadavg=$(cut -d' ' -f1-3 /proc/loadavg) kernel=$(uname -r)"
echo "  raw: fio ${FIO[*]} ${RAW_ARGS[*]} (+ --end_fsync=1 on the write)"
echo "  ext_buf: fio ${FIO[*]} ${BUF_ARGS[*]} (+ --end_fsync=1 on the write)"
echo "  ctl: dnvme ctl MNT bench --size $SIZE --loops 1 --keep {--no-read|--no-write} $CTL_ARGS"
for ((run = 1; run <= RUNS; run++)); do
  order=(raw ext_buf ctl)
  ((run % 2 == 0)) && order=(ctl ext_buf raw)
  for v in "${order[@]}"; do
    echo "  run $run: $v" >&2
    sync
    timed_job "$v" "$run" write
    drop_caches
    timed_job "$v" "$run" read
    # The ctl file is removed through the mount: removed behind its back, the daemon's O_PATH
    # fd would keep its blocks allocated until the next create made the kernel forget it, and
    # with ext4's online discard (`discard`) freeing 1 GiB would then compete with that write.
    if [[ $v == ctl ]]; then rm -f "$MNT/cvf_ctl.dat"; else rm -f "$BACKING/cvf_$v.dat"; fi
    settle_after_delete
  done
done

$PY - "$RESULTS" "$(size_bytes "$SIZE")" <<'PYEOF'
import statistics, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1])]
gib = int(sys.argv[2]) / 2**30
print(f"\n{'run':>3}  {'variant':<7} {'op':<5} {'GiB/s':>7} {'machine cpu s':>13}")
for run, v, op, bw, cpu in rows:
    print(f"{run:>3}  {v:<7} {op:<5} {float(bw):>7.3f} {float(cpu):>13.2f}")
med, cpu = {}, {}
variants = ("raw", "ext_buf", "ctl")
for v in variants:
    for op in ("write", "read"):
        sel = [r for r in rows if r[1] == v and r[2] == op]
        med[v, op] = statistics.median(float(r[3]) for r in sel)
        cpu[v, op] = statistics.median(float(r[4]) for r in sel) / gib
print(f"\nmedians, {gib:.2f} GiB per job: GiB/s (machine CPU s/GiB)")
for v in variants:
    print(f"  {v:<8} write {med[v, 'write']:.3f} ({cpu[v, 'write']:.3f})"
          f"   read {med[v, 'read']:.3f} ({cpu[v, 'read']:.3f})")
print()
for op in ("write", "read"):
    print(f"median {op:<5}  raw {med['raw', op]:.3f}  ctl {med['ctl', op]:.3f} GiB/s"
          f"   ctl/raw {med['ctl', op] / med['raw', op]:.3f}  (goal >= 0.97)"
          f"   ctl/ext_buf {med['ctl', op] / med['ext_buf', op]:.3f}"
          f"   machine CPU/GiB ctl/raw {cpu['ctl', op] / cpu['raw', op]:.3f}")
PYEOF
