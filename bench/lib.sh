# Shared helpers for the bench scripts (sourced, not run). Set BENCH_NAME before sourcing.

die() { echo "$BENCH_NAME: $*" >&2; exit 1; }

# size_bytes SIZE: prints SIZE ("512M", "1G", "4096"; powers of 1024, like dnvme and fio) in
# bytes, so both tools get the same byte count; dies on anything else or on 0.
size_bytes() {
  /usr/bin/python3 -c '
import re, sys
m = re.fullmatch(r"(\d+)\s*([kKmMgGtT]?)(i?[bB])?", sys.argv[1])
if not m or int(m.group(1)) == 0: sys.exit("bad --size " + repr(sys.argv[1]))
print(int(m.group(1)) * 1024 ** " KMGT".index((m.group(2) or " ").upper()))' "$1" 2>/dev/null ||
    die "--size '$1' is not a size (use e.g. 512M or 1G)"
}

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

# settle_after_delete: after a large file is removed, sync and leave the disk SETTLE seconds
# (--settle) before the next timed write. On the reference VM (ext4 mounted with online
# `discard`, on a virtual disk) a write that starts right after 1 GiB was freed ran at 0.2-0.3
# GiB/s instead of 1.5-2 for its first few hundred MiB, whichever variant came next; 2 s after
# the sync it no longer did (docs/performance-journal.md, "Mount, sixth run").
SETTLE=${SETTLE:-3}
settle_after_delete() {
  [[ $SETTLE =~ ^[0-9]+([.][0-9]+)?$ ]] || die "--settle '$SETTLE' is not a number of seconds"
  sync
  sleep "$SETTLE"
}

# machine_busy_ticks: the whole machine's CPU time so far, in clock ticks (getconf CLK_TCK), from
# /proc/stat's cpu line: what a job costs every process and kernel thread (page cache, FUSE
# copies, the loop device), read around it.
machine_busy_ticks() {  # every CPU's busy time so far (all processes and kernel threads)
  # Fields: user nice system idle iowait irq softirq steal ...; idle, iowait and steal (time the
  # hypervisor gave to someone else) are not work done here.
  local label user nice system irq softirq rest
  read -r label user nice system _ _ irq softirq rest </proc/stat
  [[ $label == cpu ]] || die "unexpected first line of /proc/stat: $label"
  echo $((user + nice + system + irq + softirq))
}
