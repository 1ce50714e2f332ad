#!/usr/bin/env bash
# Usage: tests/mount_scripts/mount_helper_test.sh DNVMEFS_BINARY SCRATCH_DIR
#
# The mount helper end to end, through util-linux mount(8):
#   - mount-scripts/install.sh into a scratch prefix (no system paths touched), checks the files;
#   - a temporary /sbin/mount.fuse.dnvmefs link to the scratch helper (only when none exists;
#     removed at the end), so `mount -t fuse.dnvmefs` finds it the way a real install does and
#     the helper finds dnvmefs in ../bin next to itself;
#   - mount -t fuse.dnvmefs, write + read a file, the file is in the backing dir, umount;
#   - the same from an fstab line: mount --fstab TEMPFILE MNT;
#   - ro, mount -f (fake), a bad option, a missing backing directory;
#   - the helper called directly: mount(8)-only options are dropped;
#   - the systemd unit: `systemd-analyze verify` has nothing to say about it, and its ExecStart
#     and ExecStop, run the way systemd would (the unit's EnvironmentFile loaded, `$$` -> `$`),
#     mount (exiting only once the mount is live, as Type=forking needs) and unmount. No systemd
#     runs as PID 1 here, so that is as close to `systemctl start` as the test can get;
#   - setuid=USER: the daemon runs as `nobody`, the mount is nobody's, data round-trips as nobody,
#     files land owned by nobody; an unknown user is refused before anything is mounted. The
#     non-root mount needs /dev/fuse mode 0666 (Debian's udev default); where it is 0600 (some
#     containers) the test sets 0666 for the duration and puts the old mode back.
# Skips (exit 77) with the reason when not root, /dev/fuse or fusermount3 is missing, or the
# binary is not built. Always unmounts and removes the link (trap).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
DNVMEFS=${1:?usage: $0 DNVMEFS_BINARY SCRATCH_DIR}
SCRATCH=${2:?usage: $0 DNVMEFS_BINARY SCRATCH_DIR}

# shellcheck source=tests/mount_scripts/test_lib.sh
source "$HERE/test_lib.sh"
[[ $(id -u) -eq 0 ]] || skip "not root: mount(8) and the /sbin helper link need root"
need_fuse
[[ -x $DNVMEFS ]] || skip "$DNVMEFS is not built"
DNVMEFS=$(cd "$(dirname "$DNVMEFS")" && pwd)/$(basename "$DNVMEFS")
unset DNVMEFS_BIN

rm -rf "$SCRATCH"
mkdir -p "$SCRATCH"
SCRATCH=$(cd "$SCRATCH" && pwd)
PREFIX=$SCRATCH/prefix
BACKING=$SCRATCH/backing
MNT=$SCRATCH/mnt
mkdir -p "$BACKING" "$MNT"
LINK=/sbin/mount.fuse.dnvmefs
made_link=0
USERDIR=
MNT_U=
FUSE_MODE=$(stat -c %a /dev/fuse)

is_mounted() { findmnt -rn -M "$MNT" >/dev/null 2>&1; }
unmount() {
  is_mounted || return 0
  umount "$MNT" 2>/dev/null || fusermount3 -u "$MNT" 2>/dev/null || fusermount3 -u -z "$MNT" || true
}
cleanup() {
  unmount
  if [[ -n $MNT_U ]] && findmnt -rn -M "$MNT_U" >/dev/null 2>&1; then
    umount "$MNT_U" 2>/dev/null || fusermount3 -u -z "$MNT_U" || true
  fi
  [[ -n $USERDIR ]] && rm -rf "$USERDIR"
  [[ $(stat -c %a /dev/fuse) == "$FUSE_MODE" ]] || chmod "$FUSE_MODE" /dev/fuse
  if [[ $made_link -eq 1 && -L $LINK && $(readlink "$LINK") == "$PREFIX/sbin/mount.dnvmefs" ]]; then
    rm -f "$LINK"
  fi
  rm -rf "$SCRATCH"
}
trap cleanup EXIT

# --- install into a scratch prefix -------------------------------------------------------------
"$ROOT/mount-scripts/install.sh" --prefix "$PREFIX" --no-helper-link --bin "$DNVMEFS" >/dev/null
check "install.sh put dnvmefs in PREFIX/bin" test -x "$PREFIX/bin/dnvmefs"
check "install.sh put the helper in PREFIX/sbin" test -x "$PREFIX/sbin/mount.dnvmefs"
check "install.sh put the unit in PREFIX/lib/systemd/system" \
  test -f "$PREFIX/lib/systemd/system/dnvmefs@.service"
check "the unit runs PREFIX/bin/dnvmefs" \
  grep -q "exec $PREFIX/bin/dnvmefs " "$PREFIX/lib/systemd/system/dnvmefs@.service"

# --- the helper called directly ----------------------------------------------------------------
out=$("$PREFIX/sbin/mount.dnvmefs" "$BACKING" "$MNT" -f -v \
  -o rw,defaults,noauto,user,_netdev,nofail,x-systemd.automount,comment=x,queue_depth=64 2>&1)
check "helper -f: mount(8)-only options dropped, the rest passed ($out)" \
  grep -q -- "would run: $PREFIX/bin/dnvmefs $BACKING $MNT -o queue_depth=64$" <<<"$out"
check "helper -f (fake) mounts nothing" bash -c "! findmnt -rn -M '$MNT' >/dev/null"
rc=0
"$PREFIX/sbin/mount.dnvmefs" "$SCRATCH/missing" "$MNT" 2>"$SCRATCH/err" || rc=$?
check "helper: missing backing dir -> exit 32 with the reason" \
  bash -c "[[ $rc -eq 32 ]] && grep -q 'does not exist' '$SCRATCH/err'"

# --- through mount(8) --------------------------------------------------------------------------
if [[ -e $LINK || -L $LINK ]]; then
  echo "note: $LINK already exists ($(readlink -f "$LINK")); testing mount(8) with it as installed"
else
  ln -s "$PREFIX/sbin/mount.dnvmefs" "$LINK"
  made_link=1
fi

roundtrip() {  # name: write a file through the mount, read it back, find it in the backing dir
  local name=$1
  head -c $((3 * 1024 * 1024 + 123)) /dev/urandom >"$SCRATCH/$name.src"
  cp "$SCRATCH/$name.src" "$MNT/$name" && sync "$MNT/$name" &&
    cmp -s "$SCRATCH/$name.src" "$MNT/$name" && cmp -s "$SCRATCH/$name.src" "$BACKING/$name"
}

rc=0
mount -t fuse.dnvmefs "$BACKING" "$MNT" -o queue_depth=64 || rc=$?
check "mount -t fuse.dnvmefs exits 0 (got $rc)" test "$rc" -eq 0
check "the mount is there as fuse.dnvmefs" \
  bash -c "[[ \$(findmnt -rn -o FSTYPE -M '$MNT') == fuse.dnvmefs ]]"
check "write + read through mount -t" roundtrip via_mount_t
rc=0
umount "$MNT" || rc=$?
check "umount exits 0 (got $rc)" test "$rc" -eq 0
check "unmounted" bash -c "! findmnt -rn -M '$MNT' >/dev/null"
unmount

printf '%s %s fuse.dnvmefs defaults,queue_depth=64 0 0\n' "$BACKING" "$MNT" >"$SCRATCH/fstab"
rc=0
mount --fstab "$SCRATCH/fstab" "$MNT" || rc=$?
check "mount --fstab FILE MNT exits 0 (got $rc)" test "$rc" -eq 0
check "the fstab mount is there" bash -c "[[ \$(findmnt -rn -o FSTYPE -M '$MNT') == fuse.dnvmefs ]]"
check "write + read through the fstab mount" roundtrip via_fstab
check "the file written earlier is visible" cmp -s "$SCRATCH/via_mount_t.src" "$MNT/via_mount_t"
rc=0
umount "$MNT" || rc=$?
check "umount of the fstab mount exits 0 (got $rc)" test "$rc" -eq 0
unmount

rc=0
mount -t fuse.dnvmefs "$BACKING" "$MNT" -o ro || rc=$?
check "mount -o ro exits 0 (got $rc)" test "$rc" -eq 0
check "ro: the file is readable" cmp -s "$SCRATCH/via_fstab.src" "$MNT/via_fstab"
check "ro: writing fails" bash -c "! : 2>/dev/null >'$MNT/ro_write'"
unmount

rc=0
mount -f -t fuse.dnvmefs "$BACKING" "$MNT" || rc=$?
check "mount -f (fake) exits 0 and mounts nothing" \
  bash -c "[[ $rc -eq 0 ]] && ! findmnt -rn -M '$MNT' >/dev/null"

rc=0
mount -t fuse.dnvmefs "$BACKING" "$MNT" -o no_such_option_xyz 2>"$SCRATCH/err" || rc=$?
check "a bad option fails (exit $rc) and mounts nothing" \
  bash -c "[[ $rc -ne 0 ]] && ! findmnt -rn -M '$MNT' >/dev/null"
sed 's/^/    | /' "$SCRATCH/err"
unmount

rc=0
mount -t fuse.dnvmefs "$SCRATCH/missing" "$MNT" 2>"$SCRATCH/err" || rc=$?
check "a missing backing directory fails (exit $rc) with the reason" \
  bash -c "[[ $rc -ne 0 ]] && grep -q 'does not exist' '$SCRATCH/err'"
unmount

# --- the systemd unit ----------------------------------------------------------------------------
UNIT=$PREFIX/lib/systemd/system/dnvmefs@.service
if command -v systemd-analyze >/dev/null; then
  mkdir -p "$SCRATCH/units"
  cp "$UNIT" "$SCRATCH/units/"
  out=$(cd "$SCRATCH/units" && systemd-analyze verify --man=no ./dnvmefs@t.service 2>&1) || true
  check "systemd-analyze verify finds nothing wrong with the unit ('$out')" test -z "$out"
else
  echo "skip - systemd-analyze is missing (apt-get install systemd): unit syntax not verified"
fi
unit_cmd() {  # KEY: the unit's KEY= command line with systemd's `$$` -> `$`
  local line
  line=$(sed -n "s/^$1=//p" "$UNIT")
  printf '%s\n' "${line//\$\$/\$}"
}
# An EnvironmentFile like example.conf, pointing at the scratch directories.
sed -e "s#^BACKING=.*#BACKING=$BACKING#" -e "s#^MOUNTPOINT=.*#MOUNTPOINT=$MNT#" \
  -e "s#^OPTIONS=.*#OPTIONS=queue_depth=16#" "$ROOT/mount-scripts/example.conf" >"$SCRATCH/t.conf"
run_unit() {  # KEY: run the unit's command in a clean environment holding only the conf's keys
  env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin bash -c \
    'set -a; . "$1"; set +a; eval "$2"' _ "$SCRATCH/t.conf" "$(unit_cmd "$1")"
}
rc=0
run_unit ExecStart || rc=$?
check "the unit's ExecStart exits 0 (got $rc) with the mount already live" \
  bash -c "[[ $rc -eq 0 && \$(findmnt -rn -o FSTYPE -M '$MNT') == fuse.dnvmefs ]]"
check "the unit passed OPTIONS on (queue_depth=16 in the live config)" \
  grep -q '"queue_depth": *16' "$MNT/.dnvme/config"
check "write + read through the unit's mount" roundtrip via_unit
rc=0
run_unit ExecStop || rc=$?
check "the unit's ExecStop exits 0 (got $rc) and unmounts" \
  bash -c "[[ $rc -eq 0 ]] && ! findmnt -rn -M '$MNT' >/dev/null"
unmount

# --- setuid=USER ---------------------------------------------------------------------------------
out=$("$PREFIX/sbin/mount.dnvmefs" "$BACKING" "$MNT" -f -v -o setuid=nobody,queue_depth=8 2>&1)
check "helper -f setuid=nobody: runs dnvmefs through setpriv as nobody, setuid= not passed on ($out)" \
  grep -q -- "would run: setpriv --reuid=$(id -u nobody) --regid=$(id -g nobody) --init-groups .*--ambient-caps=+ipc_lock -- $PREFIX/bin/dnvmefs $BACKING $MNT -o queue_depth=8$" <<<"$out"
rc=0
mount -t fuse.dnvmefs "$BACKING" "$MNT" -o setuid=no_such_user_dnvme 2>"$SCRATCH/err" || rc=$?
check "setuid= an unknown user: exit $rc, the reason, nothing mounted" \
  bash -c "[[ $rc -ne 0 ]] && grep -q 'no such user' '$SCRATCH/err' && ! findmnt -rn -M '$MNT' >/dev/null"
unmount

as_nobody() { setpriv --reuid=nobody --regid="$(id -g nobody)" --init-groups -- "$@"; }
USERDIR=$(mktemp -d /var/tmp/dnvme-setuid.XXXXXX)
chmod 755 "$USERDIR"
mkdir "$USERDIR/backing" "$USERDIR/mnt"
chown nobody: "$USERDIR/backing" "$USERDIR/mnt"
MNT_U=$USERDIR/mnt
[[ $FUSE_MODE == 666 ]] || chmod 666 /dev/fuse
rc=0
mount -t fuse.dnvmefs "$USERDIR/backing" "$MNT_U" -o setuid=nobody,queue_depth=8 2>"$SCRATCH/err" || rc=$?
sed 's/^/    | /' "$SCRATCH/err"
check "mount -o setuid=nobody exits 0 (got $rc)" test "$rc" -eq 0
check "the mount belongs to nobody (user_id=$(id -u nobody))" \
  bash -c "findmnt -rn -o OPTIONS -M '$MNT_U' | grep -q 'user_id=$(id -u nobody),'"
check "the daemon runs as nobody" \
  bash -c "[[ \$(ps -o user= -p \$(pgrep -f -n '[d]nvmefs $USERDIR/backing')) == nobody ]]"
head -c $((5 * 1024 * 1024 + 77)) /dev/urandom >"$USERDIR/src"
chmod 644 "$USERDIR/src"
check "nobody writes and reads back through its mount" \
  as_nobody sh -c "cp '$USERDIR/src' '$MNT_U/f' && sync '$MNT_U/f' && cmp -s '$USERDIR/src' '$MNT_U/f'"
check "the file is in the backing dir, owned by nobody" \
  bash -c "cmp -s '$USERDIR/src' '$USERDIR/backing/f' && [[ \$(stat -c %U '$USERDIR/backing/f') == nobody ]]"
rc=0
umount "$MNT_U" || rc=$?
check "umount of nobody's mount exits 0 (got $rc) and the daemon exits" \
  bash -c "[[ $rc -eq 0 ]] && for i in \$(seq 50); do pgrep -f '[d]nvmefs $USERDIR/backing' >/dev/null || exit 0; sleep 0.1; done; exit 1"
[[ $FUSE_MODE == 666 ]] || chmod "$FUSE_MODE" /dev/fuse

"$ROOT/mount-scripts/install.sh" --prefix "$PREFIX" --uninstall >/dev/null
check "install.sh --uninstall removes the files" \
  bash -c "[[ ! -e '$PREFIX/bin/dnvmefs' && ! -e '$PREFIX/sbin/mount.dnvmefs' ]]"

finish mount_helper_test
