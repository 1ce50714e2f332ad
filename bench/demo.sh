#!/usr/bin/env bash
# The quick-start demo, in two parts on the embedded default directories (under var/, git-ignored):
#   1. the engine: writes then reads 1 GiB with `dnvme io` and with fio on var/offload and prints
#      dnvme's GiB/s next to fio's;
#   2. the mount: mounts var/backing on var/mnt with dnvmefs, writes and reads a 1 GiB demo
#      checkpoint through it, prints GiB/s next to fio raw on var/backing, and leaves the mount up
#      with instructions to unmount (mount-scripts/quickstart.sh).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DIR=${DNVME_DEMO_DIR:-$ROOT/var/offload}
# var/ is the caller's alone (0700), as docs/security.md's set-up asks of a backing directory.
install -d -m 0700 "$ROOT/var" && chmod 0700 "$ROOT/var"
mkdir -p "$DIR"
echo "== 1/2: the engine (dnvme io) against fio on $DIR"
"$ROOT/bench/engine_vs_fio.sh" --dir "$DIR" --runs 1 --size 1G
echo
echo "== 2/2: the mount (dnvmefs) against fio raw"
exec "$ROOT/mount-scripts/quickstart.sh" --size 1G
