#!/usr/bin/env bash
# Usage: mount-scripts/quickstart.sh [--size 1G] [-o dnvmefs-options]
#
# Mounts var/backing on var/mnt with build/bin/dnvmefs (builds nothing: run scripts/build.sh
# first), writes a demo "checkpoint" of SIZE through the mount like a training job would
# (fio psync, bs=1M, fsync at the end), drops the page cache, reads it back, and prints the GiB/s
# next to fio's raw speed on the backing directory in the same run (libaio, O_DIRECT, bs=1M,
# iodepth=32). The mount stays up at the end; the last lines say how to unmount.
# Both directories are under var/ (git-ignored). DNVMEFS_BIN=path overrides the binary.
# Run as root so the page cache can be dropped before reads (otherwise reads may be cached).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DNVMEFS=${DNVMEFS_BIN:-$ROOT/build/bin/dnvmefs}
PY=/usr/bin/python3
BACKING=$ROOT/var/backing
MNT=$ROOT/var/mnt
LOG=$ROOT/var/dnvmefs-quickstart.log
SIZE=1G
OPTS=
while [[ $# -gt 0 ]]; do
  case $1 in
    --size) SIZE=${2:?--size needs a value}; shift 2 ;;
    -o) OPTS=${2:?-o needs options}; shift 2 ;;
    -h | --help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
    *) echo "quickstart: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

die() { echo "quickstart: $*" >&2; exit 1; }
[[ -x $DNVMEFS ]] || die "$DNVMEFS is missing; build it first: scripts/build.sh"
command -v fio >/dev/null || die "fio is missing; run scripts/install-deps.sh"
command -v fusermount3 >/dev/null || die "fusermount3 is missing; run scripts/install-deps.sh"
[[ -x $PY ]] || die "$PY is missing (needed to parse fio's JSON)"
[[ -e /dev/fuse ]] || die "/dev/fuse is missing: load the module (modprobe fuse) or, in a" \
  "container, pass the device through (--device /dev/fuse)"

# var/ is root's alone (0700): nobody else reaches the backing directory except through the
# mount (docs/security.md, "Set-up"; the daemon warns when another user could).
install -d -m 0700 "$ROOT/var" && chmod 0700 "$ROOT/var"
mkdir -p "$BACKING" "$MNT"
WORK=$(mktemp -d)
RAW_FILE=$BACKING/quickstart_raw.dat
mounted=0
keep_mount=0
cleanup() {
  pipe_max_restore
  rm -f "$RAW_FILE"
  rm -rf "$WORK"
  if [[ $mounted -eq 1 && $keep_mount -eq 0 ]]; then
    fusermount3 -u "$MNT" 2>/dev/null || fusermount3 -u -z "$MNT" 2>/dev/null || true
  fi
}
trap cleanup EXIT
# shellcheck source=scripts/pipe-max.sh
source "$ROOT/scripts/pipe-max.sh"

# A mount left by an earlier run (or a dead one after a crash) is ours: take it down first.
if findmnt -rn -M "$MNT" >/dev/null 2>&1; then
  echo "quickstart: $MNT is already mounted ($(findmnt -rn -o FSTYPE -M "$MNT")); unmounting it"
  fusermount3 -u "$MNT" || die "cannot unmount the earlier mount on $MNT (busy?): close what" \
    "uses it, or run: fusermount3 -u -z $MNT"
fi

can_drop=0
[[ $(id -u) -eq 0 ]] && can_drop=1
[[ $can_drop -eq 1 ]] || echo "quickstart: not root: cannot drop the page cache, reads may be cached" >&2
drop_caches() {
  sync
  if [[ $can_drop -eq 1 ]]; then echo 3 >/proc/sys/vm/drop_caches || can_drop=0; fi
}

# Mount. Without -f dnvmefs daemonizes and its parent exits 0 only once the mount is live.
mount_cmd=("$DNVMEFS" "$BACKING" "$MNT" -o "log_file=$LOG${OPTS:+,$OPTS}")
echo "quickstart: ${mount_cmd[*]}"
# A daemon of an earlier run may still be writing its last lines: keep those apart.
[[ -e $LOG ]] && mv -f "$LOG" "$LOG.old"
rc=0
pipe_max_raise
"${mount_cmd[@]}" >"$WORK/mount.out" 2>&1 || rc=$?
if [[ $rc -ne 0 ]]; then
  echo "quickstart: mount failed: dnvmefs exited $rc$([[ $rc -eq 2 ]] && echo ' (bad options)')" >&2
  sed 's/^/  | /' "$WORK/mount.out" >&2
  [[ -s $LOG ]] && { echo "  last lines of $LOG:" >&2; tail -n 20 "$LOG" | sed 's/^/  | /' >&2; }
  exit 1
fi
fstype=$(findmnt -rn -o FSTYPE -M "$MNT" 2>/dev/null || true)
if [[ $fstype != fuse.dnvmefs ]]; then
  echo "quickstart: mount failed: dnvmefs exited 0 but $MNT shows '${fstype:-no mount}'" \
    "instead of fuse.dnvmefs" >&2
  sed 's/^/  | /' "$WORK/mount.out" >&2
  [[ -s $LOG ]] && tail -n 20 "$LOG" | sed 's/^/  | /' >&2
  exit 1
fi
mounted=1
# Any answer through the mount comes from the daemon's loop, created after its pipes: those keep
# their size, the sysctl can go back.
cat "$MNT/.dnvme/stats" >/dev/null || true
pipe_max_restore
echo "quickstart: mounted $BACKING on $MNT ($(findmnt -rn -o SOURCE,FSTYPE,OPTIONS -M "$MNT"))"

RESULTS=$WORK/results.tsv
: >"$RESULTS"
fio_run() {  # label rw file fio-args...
  local label=$1 rw=$2 file=$3
  shift 3
  local out=$WORK/fio.json
  if ! fio --name=quickstart --filename="$file" --rw="$rw" --bs=1M --size="$SIZE" --numjobs=1 \
    --output-format=json "$@" >"$out" 2>"$WORK/fio.err"; then
    echo "quickstart: fio $label $rw failed:" >&2
    cat "$WORK/fio.err" >&2
    exit 1
  fi
  $PY - "$out" "$label" "$rw" >>"$RESULTS" <<'PYEOF'
import json, sys
path, label, rw = sys.argv[1:4]
text = open(path).read()
side = json.loads(text[text.index("{"):])["jobs"][0][rw]
print(f"{label}\t{rw}\t{side['io_bytes']}\t{side['bw_bytes'] / 2**30:.3f}\t{side['runtime'] / 1000:.3f}")
PYEOF
}

CKPT=$MNT/demo_checkpoint.bin
echo "quickstart: writing a $SIZE checkpoint through the mount, then reading it back cold"
fio_run "dnvmefs (checkpoint, psync)" write "$CKPT" --ioengine=psync --end_fsync=1
drop_caches
fio_run "dnvmefs (checkpoint, psync)" read "$CKPT" --ioengine=psync
echo "quickstart: the same with fio straight on $BACKING (libaio, O_DIRECT, iodepth 32)"
fio_run "raw fio (libaio direct qd32)" write "$RAW_FILE" --ioengine=libaio --direct=1 --iodepth=32 --end_fsync=1
drop_caches
fio_run "raw fio (libaio direct qd32)" read "$RAW_FILE" --ioengine=libaio --direct=1 --iodepth=32

$PY - "$RESULTS" <<'PYEOF'
import sys
rows = [line.rstrip("\n").split("\t") for line in open(sys.argv[1])]
print()
print(f"{'':<30} {'op':<6} {'GiB/s':>7} {'seconds':>8}")
for label, rw, _, gib, sec in rows:
    print(f"{label:<30} {rw:<6} {float(gib):>7.3f} {float(sec):>8.3f}")
bw = {(r[0].split(" ")[0], r[1]): float(r[3]) for r in rows}
for rw in ("write", "read"):
    raw = bw.get(("raw", rw), 0)
    if raw > 0:
        print(f"{rw}: dnvmefs/raw = {bw[('dnvmefs', rw)] / raw:.2f}")
PYEOF

keep_mount=1
cat <<EOF

The mount stays up: $MNT (backing $BACKING, log $LOG).
  ls -l $MNT                # demo_checkpoint.bin ($SIZE) is also in $BACKING
  rm $MNT/demo_checkpoint.bin   # free the space
To unmount:
  fusermount3 -u $MNT       # or, as root: umount $MNT
EOF
