#!/usr/bin/env bash
# The quick-start demo: writes then reads 1 GiB with `dnvme io` and with fio on the same directory
# (<repo>/var/offload, git-ignored) and prints dnvme's GiB/s next to fio's.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DIR=${DNVME_DEMO_DIR:-$ROOT/var/offload}
mkdir -p "$DIR"
exec "$ROOT/bench/engine_vs_fio.sh" --dir "$DIR" --runs 1 --size 1G "$@"
