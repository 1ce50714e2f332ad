#!/usr/bin/env bash
# Usage: dnvme_cli_test.sh DNVME_BINARY SCRATCH_DIR
# Checks the `dnvme io` command line: usage errors exit 2 with a message, a small write+read run
# prints one JSON line per op, and a read of a missing file exits 1. Stops at the first failure.
set -uo pipefail
DNVME=${1:?usage: dnvme_cli_test.sh DNVME_BINARY SCRATCH_DIR}
SCRATCH=${2:?usage: dnvme_cli_test.sh DNVME_BINARY SCRATCH_DIR}
PY=/usr/bin/python3

rm -rf "$SCRATCH"
mkdir -p "$SCRATCH" || exit 1
OUT=$SCRATCH/stdout
ERR=$SCRATCH/stderr
checks=0

fail() {
  echo "FAIL: $*"
  echo "--- stdout:"; cat "$OUT"
  echo "--- stderr:"; cat "$ERR"
  exit 1
}

# expect NAME WANT_RC [PATTERN_IN_STDERR] -- ARGS...
expect() {
  local name=$1 want=$2 pattern=$3
  shift 4
  echo "check: $name: dnvme $*"
  "$DNVME" "$@" >"$OUT" 2>"$ERR"
  local rc=$?
  [[ $rc -eq $want ]] || fail "$name: exit code $rc, want $want"
  if [[ -n $pattern ]] && ! grep -qiE -- "$pattern" "$ERR"; then
    fail "$name: stderr does not match /$pattern/"
  fi
  if [[ $want -ne 0 ]]; then
    [[ -s $ERR ]] || fail "$name: no message on stderr"
  fi
  checks=$((checks + 1))
  echo "  ok (exit $rc)"
}

D=$SCRATCH/dir
mkdir -p "$D"
echo '{"queue_depth": 8,' >"$SCRATCH/broken.json"

expect "version" 0 "" -- --version
grep -q "dnvme" "$OUT" || fail "version: stdout lacks 'dnvme'"
expect "no subcommand" 2 "subcommand" --
expect "unknown flag" 2 "bogus" -- io --dir "$D" --size 8M --write --bogus
expect "--size 0" 2 "size" -- io --dir "$D" --size 0 --write
expect "--size junk" 2 "size" -- io --dir "$D" --size 12junk --write
expect "missing --size" 2 "size" -- io --dir "$D" --write
expect "no --write/--read" 2 "write" -- io --dir "$D" --size 8M
expect "--queue-depth 0" 2 "queue_depth|queue-depth" -- io --dir "$D" --size 8M --write --queue-depth 0
expect "--queue-depth junk" 2 "queue-depth" -- io --dir "$D" --size 8M --write --queue-depth x
expect "--block-size 1000" 2 "block" -- io --dir "$D" --size 8M --write --block-size 1000
expect "--direct bogus" 2 "direct" -- io --dir "$D" --size 8M --write --direct sometimes
expect "--loops 0" 2 "loops" -- io --dir "$D" --size 8M --write --loops 0
expect "nonexistent --dir" 2 "dir" -- io --dir "$SCRATCH/no/such/dir" --size 8M --write
expect "--dir is a file" 2 "dir" -- io --dir "$SCRATCH/broken.json" --size 8M --write
expect "broken --config" 2 "config" -- io --dir "$D" --size 8M --write --config "$SCRATCH/broken.json"
expect "missing --config" 2 "config" -- io --dir "$D" --size 8M --write --config "$SCRATCH/none.json"
expect "bad log level" 2 "log-level" -- -v loud io --dir "$D" --size 8M --write

expect "read of a missing file" 1 "--write" -- io --dir "$D" --size 8M --read
[[ ! -s $OUT ]] || fail "read of a missing file: printed results"

expect "write+read --validate --json" 0 "" -- \
  io --dir "$D" --size 8M --write --read --validate --json --loops 1 --warmup 0 --queue-depth 4
$PY - "$OUT" <<'PYEOF' || fail "write+read --json: bad JSON lines"
import json, sys
lines = [l for l in open(sys.argv[1]).read().splitlines() if l.strip()]
assert len(lines) == 2, f"want 2 JSON lines, got {len(lines)}"
for want_op, line in zip(("write", "read"), lines):
    r = json.loads(line)
    for key in ("op", "bytes", "seconds", "gib_per_s", "loops", "all_gib_per_s", "config", "stats"):
        assert key in r, f"{want_op}: missing key {key}"
    assert r["op"] == want_op, f"op {r['op']}, want {want_op}"
    assert r["bytes"] == 8 << 20, r["bytes"]
    assert r["seconds"] > 0 and r["gib_per_s"] > 0
    assert r["loops"] == 1 and len(r["all_gib_per_s"]) == 1
    assert isinstance(r["config"], dict) and r["config"]["queue_depth"] == 4, r["config"]
    assert isinstance(r["stats"], dict)
print("  json ok:", ", ".join(f"{json.loads(l)['op']} {json.loads(l)['gib_per_s']:.3f} GiB/s" for l in lines))
PYEOF

expect "read alone of the written file --validate" 0 "" -- \
  io --dir "$D" --size 8M --read --validate --loops 2 --warmup 1
grep -qE '^read +8\.00 MiB +median [0-9.]+ s +[0-9.]+ GiB/s +\(min [0-9.]+, max [0-9.]+, 2 loops\)' \
  "$OUT" || fail "read alone: unexpected text report"

expect "read larger than the file" 1 "--write" -- io --dir "$D" --size 16M --read

printf '{"block_size": "256K", "queue_depth": 16}\n' >"$SCRATCH/good.json"
expect "--config with a flag override, --no-pin" 0 "" -- \
  io --dir "$D" --size 1M --write --json --loops 1 --warmup 0 --no-pin \
  --config "$SCRATCH/good.json" --queue-depth 2
$PY -c '
import json, sys
r = json.loads(open(sys.argv[1]).read())
assert r["config"]["block_size"] == 256 << 10, r["config"]
assert r["config"]["queue_depth"] == 2, r["config"]
assert r["pinned"] is False
' "$OUT" || fail "--config override: config in the JSON is not the merged one"

rm -rf "$SCRATCH"
echo "dnvme_cli_test: all $checks checks passed"
