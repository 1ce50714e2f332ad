#!/usr/bin/env bash
# Usage: dnvme_cli_test.sh DNVME_BINARY SCRATCH_DIR
# Checks the `dnvme io` command line: usage errors exit 2 with a message, a small write+read run
# prints one JSON line per op, and a read of a missing file exits 1. Then the GPU flags: misuse
# exits 2; on a machine without a usable GPU `dnvme io --gpu` exits 1 with the reason `dnvme
# report` gives, and on one with a GPU the bounce path (and --gds where cuFile can run) writes,
# reads and validates for real. Stops at the first failure.
# DNVME_TEST_EXPECT_GPU=1 makes a missing GPU a failure (set on GPU runners; /dev/nvidia0 implies
# it), so a broken driver set-up cannot pass as "no GPU here".
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
expect "--block-size 0" 2 "block" -- io --dir "$D" --size 8M --write --block-size 0
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

# DeepSpeed's ds_io names run unchanged (the command name aside); --folder brings ds_io's defaults:
# write unless --read, overlap_events unless --sequential_requests, queue depth 32, and a read of a
# missing file writes it first. Any positive block size is accepted, as in DeepSpeed (1K here).
expect "ds_io names: a write by default" 0 "" -- io --folder "$D" --io_size 4M --block_size 1K \
  --queue_depth 2 --io_parallel 2 --single_submit --loops 1 --warmup_loops 0 --file ds.dat
grep -qE '^write +4\.00 MiB .*block_size=1K qd=2 intra_op_parallelism=2 single_submit=1 overlap_events=1' \
  "$OUT" || fail "ds_io names: the write did not use the ds_io flags"
expect "ds_io --read of a missing file writes it first" 0 "writing it first" -- io --folder "$D" \
  --io_size 4M --read --validate --sequential_requests --file ds-new.dat --loops 1
grep -qE '^write .*qd=32 .*overlap_events=0' "$OUT" && grep -qE '^read .*validate=yes' "$OUT" ||
  fail "ds_io --read: want the untimed-for-ds_io write, then a validated read, qd 32, lock-step"
expect "ds_io --engine torch_io" 2 "aio_handle" -- io --folder "$D" --io_size 4M --engine torch_io
expect "--dir and --folder" 2 "folder" -- io --dir "$D" --folder "$D" --io_size 4M
expect "neither --dir nor --folder" 2 "--dir DIR" -- io --io_size 4M --write
expect "ds_io --multi_process 2" 2 "multi_process" -- io --folder "$D" --io_size 4M --multi_process 2
expect "--sequential_requests with --overlap_events" 2 "contradict" -- io --folder "$D" \
  --io_size 4M --sequential_requests --overlap_events
expect "--use_gds without --gpu" 2 "gpu" -- io --folder "$D" --io_size 4M --use_gds

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

# --- GPU flags (--gpu, --gpu-device, --gds, --gds-compat, --disk-gibps) -----------------------
expect "--gds without --gpu" 2 "--gds needs --gpu" -- io --dir "$D" --size 1M --write --gds
expect "--gds-compat without --gds" 2 "--gds-compat needs" -- \
  io --dir "$D" --size 1M --write --gpu --gds-compat
expect "--gpu-device without --gpu" 2 "--gpu-device needs --gpu" -- \
  io --dir "$D" --size 1M --write --gpu-device 0
expect "--gpu-device -1" 2 "gpu-device" -- io --dir "$D" --size 1M --write --gpu --gpu-device -1
expect "--disk-gibps without --gpu" 2 "disk-gibps" -- io --dir "$D" --size 1M --write --disk-gibps 2
expect "--disk-gibps 0" 2 "disk-gibps" -- io --dir "$D" --size 1M --write --gpu --disk-gibps 0
expect "--gpu with --no-pin" 2 "no-pin" -- io --dir "$D" --size 1M --write --gpu --no-pin
expect "tune --gds without --gpu" 2 "--gds needs --gpu" -- \
  tune --dir "$D" --gds --log-dir "$SCRATCH/tune-logs"

# What this machine has, as dnvme itself reports it: the branch below is chosen from it, and the
# expectations cross-checked against the build (CMakeCache.txt next to bin/) and /dev/nvidia0.
expect "report --json" 0 "" -- report --dir "$D" --json
cp "$OUT" "$SCRATCH/report.json"
CACHE=$(dirname "$(dirname "$DNVME")")/CMakeCache.txt
WANT_CUDA=unknown
if [[ -f $CACHE ]]; then
  WANT_CUDA=0
  if grep -q '^DNVME_WITH_CUDA:BOOL=ON' "$CACHE" &&
    grep -qE '^CUDA_cudart_static_LIBRARY:FILEPATH=.*libcudart_static\.a$' "$CACHE"; then
    WANT_CUDA=1
  fi
fi
WANT_GPU=${DNVME_TEST_EXPECT_GPU:-0}
[[ -e /dev/nvidia0 ]] && WANT_GPU=1
GPU_DEVICES=$(
  $PY - "$SCRATCH/report.json" "$WANT_CUDA" "$WANT_GPU" <<'PYEOF'
import ctypes, json, sys
doc, want_cuda, want_gpu = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3] == "1"
g, cf = doc["checks"]["gpu"], doc["checks"]["cufile"]
if want_cuda != "unknown":
    assert g["built_with_cuda"] == (want_cuda == "1"), ("built_with_cuda", g["built_with_cuda"])
assert doc["checks"]["dnvmefs"]["cuda_built"] == g["built_with_cuda"]
assert (g["cuda_runtime_version"] is not None) == g["built_with_cuda"], g
assert g["device_count"] == len(g["devices"]), g
assert g["ok"] == (g["device_count"] > 0), g
try:
    ctypes.CDLL("libcufile.so.0")
    have_cufile = True
except OSError:
    have_cufile = False
if not have_cufile:
    # The reason is dlopen's own, naming the library.
    assert cf["found"] is False and cf["loaded"] is False, cf
    assert "libcufile.so.0" in cf["error"], cf["error"]
    assert cf["ok"] is False and cf["fix"], cf
if g["device_count"] == 0:
    assert not want_gpu, "a GPU is expected here, but dnvme finds none: %s" % g["reason"]
    assert isinstance(g["reason"], str) and g["reason"].strip(), g
    if not g["built_with_cuda"]:
        assert "built without CUDA" in g["reason"], g["reason"]
    assert cf["mode"] is None and cf["mode_reason"] == "no device: " + g["reason"], cf
else:
    assert g["reason"] is None, g
    for i, d in enumerate(g["devices"]):
        assert d["index"] == i and d["name"] and d["pci_bus_id"], d
        assert d["total_memory_bytes"] > 0 and d["compute_capability"], d
    assert cf["mode"] in ("gds", "p2pdma", "compat", "bounce"), cf
    assert cf["mode_reason"], cf
print(g["device_count"])
PYEOF
) || fail "report --json: the gpu/cufile checks are wrong (see the assertion above)"
report_value() {  # CHECK KEY: a value from the saved report, "" for null
  $PY -c 'import json, sys; print(json.load(open(sys.argv[1]))["checks"][sys.argv[2]][sys.argv[3]] or "")' \
    "$SCRATCH/report.json" "$1" "$2"
}
GPU_REASON=$(report_value gpu reason)
CUFILE_MODE=$(report_value cufile mode)
echo "  gpu devices: $GPU_DEVICES${GPU_REASON:+ ($GPU_REASON)}; cufile mode: ${CUFILE_MODE:-none}"

if [[ $GPU_DEVICES -eq 0 ]]; then
  # No device: every GPU request fails at once, on one line naming CUDA's reason, and leaves
  # nothing behind.
  G=$SCRATCH/gpu
  mkdir -p "$G"
  for args in "--write" "--write --read --validate" "--write --gds" "--write --gds --gds-compat"; do
    # shellcheck disable=SC2086
    expect "io --gpu $args without a GPU" 1 "CUDA|device" -- io --dir "$G" --size 1M --gpu $args
    grep -qF -- "--gpu: $GPU_REASON" "$ERR" ||
      fail "io --gpu $args: stderr lacks the reason '$GPU_REASON'"
    [[ $(wc -l <"$ERR") -eq 1 ]] || fail "io --gpu $args: want one line on stderr"
    [[ ! -s $OUT ]] || fail "io --gpu $args: printed results"
  done
  expect "tune --gpu without a GPU" 1 "CUDA|device" -- tune --dir "$G" --gpu --log-dir "$G/logs"
  grep -qF -- "--gpu: $GPU_REASON" "$ERR" || fail "tune --gpu: stderr lacks the reason"
  [[ -z $(ls -A "$G") ]] || fail "tune --gpu without a GPU left files: $(ls -A "$G")"
  expect "report text without a GPU" 0 "" -- report --dir "$D"
  # A CUDA build without a device says why there is none; a build without CUDA says that.
  if [[ $WANT_CUDA == 0 ]]; then
    grep -qE '^\[NO\] +gpu +built without CUDA' "$OUT" ||
      fail "report: no '[NO] gpu built without CUDA' line"
  else
    grep -qE '^\[NO\] +gpu +.*no device: ' "$OUT" || fail "report: no '[NO] gpu ... no device:' line"
  fi
else
  # A device: the bounce path moves, validates and reports for real.
  expect "io --gpu write+read --validate --json" 0 "" -- \
    io --dir "$D" --file gpu.dat --size 8M --write --read --validate --json --loops 1 --warmup 0 \
    --queue-depth 4 --gpu --disk-gibps 1.5
  $PY - "$OUT" "$SCRATCH/report.json" <<'PYEOF' || fail "io --gpu --json: bad JSON lines"
import json, sys
lines = [l for l in open(sys.argv[1]).read().splitlines() if l.strip()]
dev = json.load(open(sys.argv[2]))["checks"]["gpu"]["devices"][0]
assert len(lines) == 2, f"want 2 JSON lines, got {len(lines)}"
for want_op, line in zip(("write", "read"), lines):
    r = json.loads(line)
    assert r["op"] == want_op and r["gib_per_s"] > 0 and r["memory"] == "gpu", r
    g = r["gpu"]
    assert g["device"] == 0 and g["name"] == dev["name"], g
    assert g["cufile"] == "never" and g["mode"] == "bounce" and g["mode_reason"], g
    assert g["h2d_gib_per_s"] > 0 and g["d2h_gib_per_s"] > 0, g
    want_copy = g["d2h_gib_per_s"] if want_op == "write" else g["h2d_gib_per_s"]
    assert g["copy_gib_per_s"] == want_copy, g
    assert g["disk_gib_per_s"] == 1.5, g
    limit = min(want_copy, 1.5)
    assert abs(g["limit_gib_per_s"] - limit) < 1e-9, g
    assert abs(g["ratio_vs_limit"] - r["gib_per_s"] / limit) < 1e-6, g
    # The bounce path moved the data (GdsStats, with the engine's stats inside).
    assert r["stats"]["bytes_bounce"] >= 8 << 20, r["stats"]
    assert r["stats"]["ops_written" if want_op == "write" else "ops_read"] == 1, r["stats"]
    assert r["stats"]["ops_failed"] == 0, r["stats"]
print("  gpu json ok:", ", ".join(f"{json.loads(l)['op']} {json.loads(l)['gib_per_s']:.3f} GiB/s"
                                 for l in lines))
PYEOF
  expect "io --gpu read alone --validate (text)" 0 "" -- \
    io --dir "$D" --file gpu.dat --size 8M --read --validate --loops 1 --warmup 0 --gpu
  grep -qE '^read +8\.00 MiB +median .* gpu=0 mode=bounce$' "$OUT" || fail "io --gpu: text line"
  grep -qE '^ +gpu 0 .*mode bounce .*host->device [0-9.]+ GiB/s, device->host [0-9.]+ GiB/s' \
    "$OUT" || fail "io --gpu: no gpu line in the text report"
  if grep -q ratio_vs_limit "$OUT"; then fail "io --gpu: ratio without --disk-gibps"; fi
  expect "io --gpu --json without --disk-gibps" 0 "" -- \
    io --dir "$D" --file gpu.dat --size 1M --write --json --loops 1 --warmup 0 --gpu
  $PY -c '
import json, sys
g = json.loads(open(sys.argv[1]).read())["gpu"]
assert "ratio_vs_limit" not in g and "disk_gib_per_s" not in g, g
' "$OUT" || fail "io --gpu: ratio_vs_limit without --disk-gibps"
  expect "--gpu-device past the last" 2 "gpu-device" -- \
    io --dir "$D" --size 1M --write --gpu --gpu-device "$GPU_DEVICES"
  if [[ $CUFILE_MODE == gds || $CUFILE_MODE == p2pdma ]]; then
    expect "io --gpu --gds" 0 "" -- io --dir "$D" --file gpu.dat --size 8M --write --read \
      --validate --json --loops 1 --warmup 0 --gpu --gds
    $PY -c '
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    assert r["gpu"]["mode"] == sys.argv[2] and r["gpu"]["cufile"] == "require", r["gpu"]
    assert r["stats"]["bytes_cufile"] >= 8 << 20, r["stats"]
' "$OUT" "$CUFILE_MODE" || fail "io --gpu --gds: not through cuFile"
  else
    # cuFile cannot run GDS here: --gds refuses with the reason instead of timing the bounce path.
    expect "io --gpu --gds without GDS" 1 "GPUDirect Storage required but unavailable" -- \
      io --dir "$D" --file gpu.dat --size 1M --write --gpu --gds
    [[ ! -s $OUT ]] || fail "io --gpu --gds without GDS: printed results"
  fi
fi

rm -rf "$SCRATCH"
echo "dnvme_cli_test: all $checks checks passed"
