#!/usr/bin/env bash
# Usage: mount-scripts/install.sh [--prefix DIR] [--sbindir DIR] [--unitdir DIR] [--bin FILE]
#                                 [--destdir DIR] [--no-helper-link] [--uninstall]
#
# Installs the dnvmefs daemon, its mount(8) helper and the systemd unit template:
#   PREFIX/bin/dnvmefs                    the daemon (from --bin, default build/bin/dnvmefs)
#   PREFIX/sbin/mount.dnvmefs             the mount helper (mount-scripts/mount.dnvmefs)
#   SBINDIR/mount.fuse.dnvmefs -> PREFIX/sbin/mount.dnvmefs
#                                         where mount(8) looks for the helper of type
#                                         fuse.dnvmefs (libmount searches /sbin, /sbin/fs.d and
#                                         /sbin/fs only; on Debian 12 /sbin is /usr/sbin)
#   UNITDIR/dnvmefs@.service              the systemd template, its ExecStart/ExecStop paths
#                                         rewritten for PREFIX
#   PREFIX/share/doc/dnvmefs/             README.md and example.conf
# Defaults: --prefix /usr/local, --sbindir /usr/sbin, --unitdir /etc/systemd/system (with a
# --prefix other than /usr/local and no --unitdir: PREFIX/lib/systemd/system).
# --destdir stages everything under DIR (packaging). --no-helper-link skips the SBINDIR link (a
# test install into a scratch prefix). Idempotent: running it again replaces the files.
# --uninstall removes what this script installs (and nothing else).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)

PREFIX=/usr/local
SBINDIR=/usr/sbin
UNITDIR=
BIN=$ROOT/build/bin/dnvmefs
DESTDIR=
LINK=1
UNINSTALL=0
die() { echo "install.sh: $*" >&2; exit 1; }
while [[ $# -gt 0 ]]; do
  case $1 in
    --prefix) PREFIX=${2:?--prefix needs a directory}; shift 2 ;;
    --sbindir) SBINDIR=${2:?--sbindir needs a directory}; shift 2 ;;
    --unitdir) UNITDIR=${2:?--unitdir needs a directory}; shift 2 ;;
    --bin) BIN=${2:?--bin needs a file}; shift 2 ;;
    --destdir) DESTDIR=${2:?--destdir needs a directory}; shift 2 ;;
    --no-helper-link) LINK=0; shift ;;
    --uninstall) UNINSTALL=1; shift ;;
    -h | --help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[[ $PREFIX == /* ]] || die "--prefix must be an absolute path, got '$PREFIX'"
[[ $SBINDIR == /* ]] || die "--sbindir must be an absolute path, got '$SBINDIR'"
if [[ -z $UNITDIR ]]; then
  if [[ $PREFIX == /usr/local ]]; then UNITDIR=/etc/systemd/system; else UNITDIR=$PREFIX/lib/systemd/system; fi
fi

bindir=$PREFIX/bin
helper=$PREFIX/sbin/mount.dnvmefs
link=$SBINDIR/mount.fuse.dnvmefs
unit=$UNITDIR/dnvmefs@.service
docdir=$PREFIX/share/doc/dnvmefs

if [[ $UNINSTALL -eq 1 ]]; then
  rm -fv "$DESTDIR$bindir/dnvmefs" "$DESTDIR$helper" "$DESTDIR$unit" \
    "$DESTDIR$docdir/README.md" "$DESTDIR$docdir/example.conf"
  # Only our own link: never a helper somebody else put there.
  if [[ -L $DESTDIR$link && $(readlink "$DESTDIR$link") == "$helper" ]]; then rm -fv "$DESTDIR$link"; fi
  rmdir "$DESTDIR$docdir" 2>/dev/null || true
  exit 0
fi

[[ -x $BIN ]] || die "$BIN is missing or not executable; build it first (scripts/build.sh) or pass --bin"
if [[ -z $DESTDIR && ! -w $(dirname "$PREFIX") && ! -w $PREFIX ]]; then
  die "cannot write to $PREFIX: run as root (sudo $0 ...) or choose --prefix"
fi

install -d "$DESTDIR$bindir" "$DESTDIR$PREFIX/sbin" "$DESTDIR$UNITDIR" "$DESTDIR$docdir"
install -m 0755 "$BIN" "$DESTDIR$bindir/dnvmefs"
install -m 0755 "$HERE/mount.dnvmefs" "$DESTDIR$helper"
# The unit names /usr/local paths; point them at this prefix.
sed -e "s|/usr/local/bin/dnvmefs|$bindir/dnvmefs|g" "$HERE/dnvmefs@.service" >"$DESTDIR$unit.tmp"
chmod 0644 "$DESTDIR$unit.tmp"
mv -f "$DESTDIR$unit.tmp" "$DESTDIR$unit"
install -m 0644 "$HERE/README.md" "$DESTDIR$docdir/README.md"
install -m 0644 "$HERE/example.conf" "$DESTDIR$docdir/example.conf"
echo "install.sh: $DESTDIR$bindir/dnvmefs, $DESTDIR$helper, $DESTDIR$unit, $DESTDIR$docdir/"

if [[ $LINK -eq 1 ]]; then
  install -d "$DESTDIR$SBINDIR"
  if [[ -e $DESTDIR$link && ! -L $DESTDIR$link ]]; then
    die "$DESTDIR$link exists and is not a link; not replacing it"
  fi
  ln -sfn "$helper" "$DESTDIR$link"
  echo "install.sh: $DESTDIR$link -> $helper"
fi

# Tell systemd about the (new) unit when we installed into the live system.
if [[ -z $DESTDIR && -d /run/systemd/system ]] && command -v systemctl >/dev/null; then
  systemctl daemon-reload || echo "install.sh: systemctl daemon-reload failed (ignored)" >&2
fi
cat <<EOF
install.sh: done. Try:
  mkdir -p /srv/backing /mnt/dnvme
  mount -t fuse.dnvmefs /srv/backing /mnt/dnvme -o queue_depth=64
  umount /mnt/dnvme
fstab:   /srv/backing /mnt/dnvme fuse.dnvmefs defaults,queue_depth=64 0 0
systemd: /etc/dnvmefs/NAME.conf (see $docdir/example.conf), then systemctl enable --now dnvmefs@NAME
EOF
