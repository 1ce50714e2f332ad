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

# hold_freed_memory / release_freed_memory (--hold-freed-memory): the reference VM's kernel
# reports freed memory to the host at once (virtio-balloon free page reporting with
# /sys/module/page_reporting/parameters/min_free_ms = 0), and the host takes it back, so the
# next use of such a page faults in the host. A job that fills fresh page cache right after
# drop_caches then runs up to 10x slower (a cold buffered read of the backing file: 0.5 instead
# of 7.6 GB/s; docs/performance-journal.md, "Freed memory taken back by the host"); one that
# reuses resident memory (pinned buffers, O_DIRECT) does not. A real machine has no such cost.
# hold delays the reporting for the run (5 min after a page is freed, the most the knob
# takes); release puts the old value back. Where the knob does not exist, both do nothing and say so once.
PAGE_REPORTING_KNOB=/sys/module/page_reporting/parameters/min_free_ms
PAGE_REPORTING_SAVED=
hold_freed_memory() {
  if [[ ! -w $PAGE_REPORTING_KNOB ]]; then
    echo "$BENCH_NAME: no $PAGE_REPORTING_KNOB here: freed memory is not reported early" >&2
    return 0
  fi
  PAGE_REPORTING_SAVED=$(<"$PAGE_REPORTING_KNOB")
  echo 300000 >"$PAGE_REPORTING_KNOB" || die "cannot write $PAGE_REPORTING_KNOB"
  echo "$BENCH_NAME: freed memory held for 5 min before it is reported to the host" \
    "(min_free_ms $PAGE_REPORTING_SAVED -> 300000 for this run)" >&2
}
release_freed_memory() {
  [[ -n $PAGE_REPORTING_SAVED ]] || return 0
  echo "$PAGE_REPORTING_SAVED" >"$PAGE_REPORTING_KNOB" ||
    echo "$BENCH_NAME: could not put $PAGE_REPORTING_KNOB back to $PAGE_REPORTING_SAVED" >&2
  PAGE_REPORTING_SAVED=
}
