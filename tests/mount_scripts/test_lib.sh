# shellcheck shell=bash
# What the mount-scripts tests share (sourced): ctest's skip convention, the checks' report, and
# the FUSE prerequisites. Each test says its own other reasons to skip.
#   skip REASON...        prints "SKIP: REASON" and exits 77 (ctest's SKIP_RETURN_CODE)
#   need_fuse             skips unless /dev/fuse and fusermount3 are there
#   pass / fail WHAT      one check's line ("ok   - WHAT" / "FAIL - WHAT"; fail counts it)
#   check WHAT CMD...     runs CMD: pass or fail WHAT by its exit status
#   finish NAME           exits 1 with the count of failed checks, or says all passed

skip() { echo "SKIP: $*"; exit 77; }
need_fuse() {
  [[ -c /dev/fuse ]] || skip "/dev/fuse is missing (modprobe fuse, or pass the device to the container)"
  command -v fusermount3 >/dev/null || skip "fusermount3 is missing (apt-get install fuse3)"
}

failures=0
pass() { echo "ok   - $*"; }
fail() { echo "FAIL - $*"; failures=$((failures + 1)); }
check() {  # description command...
  local what=$1
  shift
  if "$@"; then pass "$what"; else fail "$what"; fi
}

finish() {  # name
  if [[ $failures -gt 0 ]]; then
    echo "$1: $failures check(s) failed"
    exit 1
  fi
  echo "$1: all checks passed"
}
