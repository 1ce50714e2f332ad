# Shared helpers for the bench scripts (sourced, not run). Set BENCH_NAME before sourcing.

# drop_caches: sync, then drop the page cache so the next read comes from the disk. Needs root;
# without it, says so once and carries on (reads may then be served from the cache).
can_drop=1
if [[ $(id -u) -ne 0 ]]; then
  can_drop=0
  echo "$BENCH_NAME: not root: cannot drop the page cache, reads may be served from it" >&2
fi
drop_caches() {
  sync
  if [[ $can_drop -eq 1 ]]; then
    echo 3 >/proc/sys/vm/drop_caches 2>/dev/null || {
      echo "$BENCH_NAME: cannot write /proc/sys/vm/drop_caches" >&2
      can_drop=0
    }
  fi
}
