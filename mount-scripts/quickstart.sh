#!/usr/bin/env bash
# Usage: mount-scripts/quickstart.sh [--size 1G] [--rounds 3] [-o dnvmefs-options]
#
# Mounts var/backing on var/mnt with build/bin/dnvmefs (builds nothing: run scripts/build.sh
# first), then writes a demo "checkpoint" of SIZE like a training job would (fio psync, bs=1M,
# fsync at the end), drops the page cache and reads it back cold, then again at once (warm: the
# page cache holds it now, as on a node that loads the same weights twice), four ways in the
# same run:
#   plain ext4   the same fio client on the backing directory itself: no dnvmefs at all
#   mount        the same client through the mount (dnvmefs)
#   dnvme run    the same client through the mount under `dnvme run` (libdnvme_preload.so:
#                its large reads and writes go to the engine, docs/preload.md)
#   raw fio      fio libaio O_DIRECT iodepth 32 on the backing directory: the device's limit
# and prints GiB/s with each one's ratio to plain ext4 and to raw fio: medians of ROUNDS rounds,
# the four in the opposite order every other round (a shared machine's disk drifts within
# minutes: one run of each said 0.35x or 1.56x for the same cold read). The mount stays up at the
# end; the last lines say how to unmount.
# Both directories are under var/ (git-ignored; DNVME_QUICKSTART_DIR=DIR puts them in DIR instead,
# as tests/mount_scripts/quickstart_test.sh does). DNVMEFS_BIN=path overrides the binary.
# Run as root so the page cache can be dropped before reads (otherwise reads may be cached).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DNVMEFS=${DNVMEFS_BIN:-$ROOT/build/bin/dnvmefs}
DNVME=$(dirname "$DNVMEFS")/dnvme
PY=/usr/bin/python3
VAR=${DNVME_QUICKSTART_DIR:-$ROOT/var}
BACKING=$VAR/backing
MNT=$VAR/mnt
LOG=$VAR/dnvmefs-quickstart.log
SIZE=1G
ROUNDS=3
OPTS=
while [[ $# -gt 0 ]]; do
  case $1 in
    --size) SIZE=${2:?--size needs a value}; shift 2 ;;
    --rounds) ROUNDS=${2:?--rounds needs a value}; shift 2 ;;
    -o) OPTS=${2:?-o needs options}; shift 2 ;;
    -h | --help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
    *) echo "quickstart: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

die() { echo "quickstart: $*" >&2; exit 1; }
[[ $ROUNDS =~ ^[1-9][0-9]?$ ]] || { echo "quickstart: --rounds takes 1 to 99, not '$ROUNDS'" >&2; exit 2; }
[[ -x $DNVMEFS ]] || die "$DNVMEFS is missing; build it first: scripts/build.sh --demo"
[[ -x $DNVME ]] || die "$DNVME is missing; build it first: scripts/build.sh --demo"
command -v fio >/dev/null || die "fio is missing; run scripts/install-deps.sh"
command -v fusermount3 >/dev/null || die "fusermount3 is missing; run scripts/install-deps.sh"
[[ -x $PY ]] || die "$PY is missing (needed to parse fio's JSON)"
[[ -e /dev/fuse ]] || die "/dev/fuse is missing: load the module (modprobe fuse) or, in a" \
  "container, pass the device through (--device /dev/fuse)"

# var/ is root's alone (0700): nobody else reaches the backing directory except through the
# mount (docs/security.md, "Set-up"; the daemon warns when another user could).
# A directory named by DNVME_QUICKSTART_DIR is never chmod'ed (it might be /tmp). It is made with
# one mkdir, which fails when anything already has the name, and checked after, however it came
# to be: a user who creates the name first (a race in a world-writable directory) gets a refusal,
# not root's mount of the user's directory and root's log in it. No directory above it may be
# writable by another user without the sticky bit (they could rename it away and put their own
# in its place after the check).
refuse_var() {
  echo "quickstart: DNVME_QUICKSTART_DIR=$VAR $*" >&2
  exit 2
}
# (The checkout's own var/ is as safe as the checkout whose scripts root runs.)
if [[ $VAR == "$ROOT/var" ]]; then
  install -d -m 0700 "$VAR" && chmod 0700 "$VAR"
else
  mkdir -m 0700 "$VAR" 2>/dev/null || true
  if [[ -L $VAR || ! -d $VAR || ! -O $VAR || $(stat -c %a "$VAR") != 700 ]]; then
    refuse_var "must be a directory of yours with mode 0700 (or not exist yet)"
  fi
  up=$(cd -P "$VAR/.." && pwd)
fi
while [[ $VAR != "$ROOT/var" ]]; do
  read -r owner mode <<<"$(stat -c '%u %a' "$up")"
  if [[ $owner != 0 && $owner != "$(id -u)" ]]; then
    refuse_var "lies in $up, which uid $owner owns"
  fi
  if (((8#$mode & 8#022) != 0 && (8#$mode & 8#1000) == 0)); then
    refuse_var "lies in $up (mode $mode), which others may write without the sticky bit"
  fi
  [[ $up == / ]] && break
  up=$(dirname "$up")
done
mkdir -p "$BACKING" "$MNT"
WORK=$(mktemp -d)
RAW_FILE=$BACKING/quickstart_raw.dat
PLAIN_FILE=$BACKING/quickstart_plain.dat
mounted=0
keep_mount=0
cleanup() {
  pipe_max_restore
  rm -f "$RAW_FILE" "$PLAIN_FILE" "$MNT/demo_run.bin" 2>/dev/null || true
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
fio_run() {  # label rw file fio-args... (PRE=(...) runs fio under a wrapper; OP names the row)
  local label=$1 rw=$2 file=$3 op=${OP:-$2}
  shift 3
  local out=$WORK/fio.json
  if ! "${PRE[@]}" fio --name=quickstart --filename="$file" --rw="$rw" --bs=1M --size="$SIZE" --numjobs=1 \
    --output-format=json "$@" >"$out" 2>"$WORK/fio.err"; then
    echo "quickstart: fio $label $rw failed:" >&2
    cat "$WORK/fio.err" >&2
    exit 1
  fi
  $PY - "$out" "$label" "$rw" "$op" >>"$RESULTS" <<'PYEOF'
import json, sys
path, label, rw, op = sys.argv[1:5]
text = open(path).read()
side = json.loads(text[text.index("{"):])["jobs"][0][rw]
print(f"{label}\t{op}\t{side['io_bytes']}\t{side['bw_bytes'] / 2**30:.3f}\t{side['runtime'] / 1000:.3f}")
PYEOF
}

CKPT=$MNT/demo_checkpoint.bin
PRE=()
both() {  # label file fio-args...: write (fsync at the end), drop the page cache, read cold,
  # then warm (fio invalidates the file's cache before a job unless told not to)
  local label=$1 file=$2
  shift 2
  fio_run "$label" write "$file" --end_fsync=1 "$@"
  drop_caches
  fio_run "$label" read "$file" "$@" --invalidate=0
  OP=warm fio_run "$label" read "$file" "$@" --invalidate=0
}
echo "quickstart: writing a $SIZE checkpoint and reading it back cold and warm, four ways (fio, bs=1M),"
echo "  $ROUNDS round(s), every other one in reverse order:"
echo "  plain ext4 (no dnvmefs) on $BACKING"
echo "  the mount (dnvmefs) on $MNT"
echo "  dnvme run (the mount, its large transfers through the engine) on $MNT"
echo "  raw fio (libaio, O_DIRECT, iodepth 32) on $BACKING: the device's limit"
one_way() {  # the four ways by name
  case $1 in
    plain) both "plain ext4" "$PLAIN_FILE" --ioengine=psync; rm -f "$PLAIN_FILE" ;;
    mount) rm -f "$CKPT"; both "mount" "$CKPT" --ioengine=psync ;;  # a new file each time, as the others
    run)
      PRE=("$DNVME" run --mount "$MNT" --)
      both "dnvme run" "$MNT/demo_run.bin" --ioengine=psync
      PRE=()
      rm -f "$MNT/demo_run.bin"
      ;;
    raw) both "raw fio" "$RAW_FILE" --ioengine=libaio --direct=1 --iodepth=32; rm -f "$RAW_FILE" ;;
  esac
}
for ((round = 1; round <= ROUNDS; round++)); do
  order=(plain mount run raw)
  ((round % 2 == 0)) && order=(raw run mount plain)
  echo "  round $round/$ROUNDS: ${order[*]}"
  for way in "${order[@]}"; do one_way "$way"; done
done

$PY - "$RESULTS" "$ROUNDS" <<'PYEOF'
import statistics, sys
rows = [line.rstrip("\n").split("\t") for line in open(sys.argv[1])]
rounds = int(sys.argv[2])
runs = {}
for r in rows:
    runs.setdefault((r[0], r[1]), []).append(float(r[3]))
bw = {k: statistics.median(v) for k, v in runs.items()}
print()
print(f"the same fio client (psync, bs=1M) four ways; GiB/s (median of {rounds} round(s), lowest-highest)"
      " and the medians' ratios, higher is better")
print(f"{'':<12} {'op':<6} {'GiB/s':>7} {'range':>13} {'x plain ext4':>13} {'x raw fio':>10}")
for rw in ("write", "read", "warm"):
    for label in ("plain ext4", "mount", "dnvme run", "raw fio"):
        g = bw.get((label, rw), 0.0)
        v = runs.get((label, rw), [0.0])
        span = f"{min(v):.2f}-{max(v):.2f}" if len(v) > 1 else "-"
        plain, raw = bw.get(("plain ext4", rw), 0.0), bw.get(("raw fio", rw), 0.0)
        rp = f"{g / plain:.2f}" if plain > 0 else "-"
        rr = f"{g / raw:.2f}" if raw > 0 else "-"
        print(f"{label:<12} {rw:<6} {g:>7.3f} {span:>13} {rp:>13} {rr:>10}")
print("read: cold (page cache dropped); warm: read again at once (raw fio: O_DIRECT, never"
      " cached).\nplain ext4: no dnvmefs; mount: through dnvmefs; dnvme run: through dnvmefs with"
      " the preload library;\nraw fio: libaio O_DIRECT qd32, the device's limit."
      " A shared machine drifts: see docs/performance.md for the benchmarks' medians.")
PYEOF

keep_mount=1
cat <<EOF

The mount stays up: $MNT (backing $BACKING, log $LOG).
  ls -l $MNT                # demo_checkpoint.bin ($SIZE) is also in $BACKING
  rm $MNT/demo_checkpoint.bin   # free the space
To unmount:
  fusermount3 -u $MNT       # or, as root: umount $MNT
EOF
