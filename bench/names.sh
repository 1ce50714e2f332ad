#!/usr/bin/env bash
# Usage: bench/names.sh DNVMEFS PARENT_DIR [N] [--user UID]
#
# The cost of names through the mount: mounts PARENT_DIR/b on PARENT_DIR/m with the daemon
# DNVMEFS (-o allow_other), then a Python loop makes N empty files (open O_CREAT + close), N
# directories and unlinks the N files, and prints microseconds per operation of each; unmounts
# and removes both directories. With --user UID the loop runs as that user (setpriv, no groups)
# in a 0777 backing directory: the mount acts on names as their caller (docs/security.md), which
# a user pays for and root does not. Alternate two binaries by hand to compare them
# (docs/performance.md, "Mount"). Root only.
set -euo pipefail
BIN=${1:?usage: bench/names.sh DNVMEFS PARENT_DIR [N] [--user UID]}
P=${2:?usage: bench/names.sh DNVMEFS PARENT_DIR [N] [--user UID]}
shift 2
N=3000
RUN=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --user) RUN=(setpriv "--reuid=${2:?--user needs a uid}" "--regid=$2" --clear-groups); shift 2 ;;
    *) N=$1; shift ;;
  esac
done
B=$P/b
M=$P/m
rm -rf "$B"
mkdir -p "$B" "$M"
chmod 0777 "$B"
"$BIN" "$B" "$M" -o allow_other >/dev/null 2>&1
trap 'fusermount3 -u "$M" 2>/dev/null || true; rm -rf "$B"' EXIT
sleep 0.5
"${RUN[@]}" /usr/bin/python3 - "$M" "$N" <<'PY'
import os, sys, time
m, n = sys.argv[1], int(sys.argv[2])
t = time.perf_counter()
for i in range(n):
    os.close(os.open(os.path.join(m, "f%d" % i), os.O_CREAT | os.O_WRONLY, 0o644))
c = time.perf_counter() - t
t = time.perf_counter()
for i in range(n):
    os.mkdir(os.path.join(m, "d%d" % i))
d = time.perf_counter() - t
t = time.perf_counter()
for i in range(n):
    os.unlink(os.path.join(m, "f%d" % i))
u = time.perf_counter() - t
print("create %.1f us  mkdir %.1f us  unlink %.1f us" % (c / n * 1e6, d / n * 1e6, u / n * 1e6))
PY
