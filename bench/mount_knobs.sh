#!/usr/bin/env bash
# Usage: bench/mount_knobs.sh [--dir DIR] [--hold-freed-memory] [--size 1G] [--rounds 2]
#                             [--only "default clone_fd=0 ..."] [--keep OUTDIR]
#
# Measures what each of the mount's knobs is worth: runs bench/mount_vs_fio.sh (one round, no
# passthrough_ll) once per variant below, ROUNDS times with the variant order reversed every other
# round, and prints for each variant the median of every ratio mount_vs_fio.sh prints: (a)
# buffered psync write/read through the mount / raw fio, (b) O_DIRECT libaio qd32 write/read
# through the mount / raw fio, (d) daemon CPU, (e) against plain ext4, (f) machine CPU (raw is
# measured in the same mount_vs_fio run, so every ratio compares runs seconds apart).
#   default                 the defaults
#   write_behind=0          no write-behind: every write waits for the disk
#   read_ahead=0            no daemon read-ahead (kernel read-ahead only)
#   max_background=12       libfuse's default background-request limit instead of our 64
#   queue_depth=32          the engine at fio's depth
#   intra_op_parallelism=2  two engine workers
#   async_reply=1           O_DIRECT reads answered from the engine's completion callback
#   clone_fd=1              one /dev/fuse fd per loop thread (default: all share one)
# A variant is one -o string: "splice_reply=1,passthrough=off" sets both. --dir runs every
# mount_vs_fio round in DIR (e.g. the RAM ext4 of bench/fastdev.sh: --dir /mnt/dnvram/bench).
# --hold-freed-memory is passed on to mount_vs_fio.sh (bench/lib.sh: a VM's free page reporting).
# --keep OUTDIR keeps every round's mount_vs_fio.sh output (VARIANT.ROUND.txt/.err) there.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SIZE=1G
ROUNDS=2
ONLY=
KEEP=
DIR_ARGS=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --dir) DIR_ARGS+=(--dir "${2:?--dir needs a directory}"); shift 2 ;;
    --hold-freed-memory) DIR_ARGS+=(--hold-freed-memory); shift ;;
    --size) SIZE=${2:?--size needs a value}; shift 2 ;;
    --rounds) ROUNDS=${2:?--rounds needs a number}; shift 2 ;;
    --only) ONLY=${2:?--only needs a list of variants}; shift 2 ;;
    --keep) KEEP=${2:?--keep needs a directory}; shift 2 ;;
    -h | --help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
    *) echo "mount_knobs: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
VARIANTS=(default write_behind=0 read_ahead=0 max_background=12 queue_depth=32
  intra_op_parallelism=2 async_reply=1 clone_fd=1)
if [[ -n $ONLY ]]; then
  read -r -a VARIANTS <<<"$ONLY"
fi
if [[ -n $KEEP ]]; then
  mkdir -p "$KEEP" || { echo "mount_knobs: cannot create $KEEP" >&2; exit 2; }
  OUT=$KEEP
else
  OUT=$(mktemp -d)
  trap 'rm -rf "$OUT"' EXIT
fi
for ((r = 1; r <= ROUNDS; r++)); do
  order=("${VARIANTS[@]}")
  if ((r % 2 == 0)); then
    order=()
    for ((i = ${#VARIANTS[@]} - 1; i >= 0; i--)); do order+=("${VARIANTS[i]}"); done
  fi
  for v in "${order[@]}"; do
    echo "round $r: $v" >&2
    opt=()
    [[ $v != default ]] && opt=(-o "$v")
    "$ROOT/bench/mount_vs_fio.sh" --runs 1 --size "$SIZE" --no-passthrough "${DIR_ARGS[@]}" "${opt[@]}" \
      >"$OUT/$v.$r.txt" 2>"$OUT/$v.$r.err" || {
      echo "mount_knobs: variant $v failed:" >&2
      tail -5 "$OUT/$v.$r.err" >&2
      exit 1
    }
  done
done
/usr/bin/python3 - "$OUT" "$ROUNDS" "${VARIANTS[@]}" <<'PY'
import re, statistics, sys
out, rounds, variants = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
# Every ratio line of mount_vs_fio.sh's summary ("(a) write ... 1.234"), median over the rounds,
# one column per variant, in the order the first round printed them.
ratio = re.compile(r"^(\([a-z]\) .*?)\s+([0-9.]+)\s*$", re.M)
labels, vals = [], {}
for v in variants:
    for r in range(1, rounds + 1):
        for label, x in ratio.findall(open("%s/%s.%d.txt" % (out, v, r)).read()):
            if label not in labels:
                labels.append(label)
            vals.setdefault((label, v), []).append(float(x))
print("ratios to raw fio (or as labelled), median of %d rounds" % rounds)
width = max(len(l) for l in labels)
print("%-*s  %s" % (width, "", "  ".join("%14s" % v[:14] for v in variants)))
for label in labels:
    cells = ["%14.3f" % statistics.median(vals[(label, v)]) if (label, v) in vals else "%14s" % "-"
             for v in variants]
    print("%-*s  %s" % (width, label, "  ".join(cells)))
PY
