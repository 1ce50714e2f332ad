#!/usr/bin/env bash
# Usage: bench/warm_shared.sh --old DNVMEFS --new DNVMEFS --dir DIR [--size 2G] [--rounds 2]
#
# Reads that the page cache can serve, for two dnvmefs binaries (a change and the commit before
# it) against plain ext4 and raw fio, on one directory in one run. Per round, with the binaries'
# order alternated each round and freed memory held (bench/lib.sh):
#   raw       fio libaio O_DIRECT qd32 1 MiB read of the file on DIR (the device's limit)
#   cold      fio psync 1 MiB read after drop_caches (one reader)
#   warm      the same read again at once (the file read a second time)
#   shared    4 fio psync jobs reading the one file at once, after drop_caches
# each on plain ext4 (the backing file) and through each binary's mount (the same file). Prints
# GiB/s per round and the medians, with each mount's ratio to plain ext4. Run as root.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BENCH_NAME=warm_shared
# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"
OLD= NEW= DIR= SIZE=2G ROUNDS=2
while [[ $# -gt 0 ]]; do
  case $1 in
    --old) OLD=${2:?}; shift 2 ;;
    --new) NEW=${2:?}; shift 2 ;;
    --dir) DIR=${2:?}; shift 2 ;;
    --size) SIZE=${2:?}; shift 2 ;;
    --rounds) ROUNDS=${2:?}; shift 2 ;;
    -h | --help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[[ -x $OLD && -x $NEW && -n $DIR ]] || die "--old, --new (dnvmefs binaries) and --dir are needed"
[[ $(id -u) -eq 0 ]] || die "run as root (drop_caches, mounts)"
BACKING=$DIR/ws-backing MNT=$DIR/ws-mnt FILE=ws.bin
mkdir -p "$BACKING" "$MNT"
cleanup() {
  fusermount3 -u "$MNT" 2>/dev/null || true
  release_freed_memory
}
trap cleanup EXIT
hold_freed_memory
fio --name=make --filename="$BACKING/$FILE" --rw=write --bs=1M --size="$SIZE" --direct=1 \
  --ioengine=libaio --iodepth=32 --end_fsync=1 >/dev/null

gibs() {  # fio job args...: the read bandwidth in GiB/s
  fio --output-format=json "$@" | python3 -c '
import json, sys
j = json.load(sys.stdin)
print("%.3f" % (sum(x["read"]["bw_bytes"] for x in j["jobs"]) / 2**30))'
}
psync() { gibs --name=r --filename="$1" --rw=read --bs=1M --size="$SIZE" --ioengine=psync "${@:2}"; }
measure() {  # label path: cold, warm and shared reads of path
  drop_caches
  local cold warm shared
  cold=$(psync "$2")
  warm=$(psync "$2")
  drop_caches
  shared=$(psync "$2" --numjobs=4 --group_reporting)
  echo "$1 cold $cold warm $warm shared $shared"
}
declare -A results
for ((r = 0; r < ROUNDS; r++)); do
  drop_caches
  echo "round $r raw $(gibs --name=raw --filename="$BACKING/$FILE" --rw=read --bs=1M \
    --size="$SIZE" --direct=1 --ioengine=libaio --iodepth=32)" | tee -a /dev/stderr
  line=$(measure ext4 "$BACKING/$FILE"); echo "round $r $line" >&2; results[ext4]+="$line"$'\n'
  bins=(old new)
  ((r % 2 == 1)) && bins=(new old)
  for b in "${bins[@]}"; do
    bin=$OLD
    [[ $b == new ]] && bin=$NEW
    "$bin" "$BACKING" "$MNT" -o allow_other
    line=$(measure "$b" "$MNT/$FILE"); echo "round $r $line" >&2; results[$b]+="$line"$'\n'
    fusermount3 -u "$MNT"
  done
done
echo "medians (GiB/s; x plain ext4):"
printf '%s' "${results[ext4]}${results[old]}${results[new]}" | python3 -c '
import statistics, sys
rows = {}
for line in sys.stdin:
    f = line.split()
    if not f:
        continue
    for i in range(1, len(f), 2):
        rows.setdefault(f[0], {}).setdefault(f[i], []).append(float(f[i + 1]))
med = {k: {m: statistics.median(v) for m, v in d.items()} for k, d in rows.items()}
for k in ("ext4", "old", "new"):
    print(k.ljust(5), "  ".join("%s %.3f (%.2fx)" % (m, med[k][m], med[k][m] / med["ext4"][m])
                              for m in ("cold", "warm", "shared")))'
