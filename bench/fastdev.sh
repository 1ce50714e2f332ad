#!/usr/bin/env bash
# Usage: bench/fastdev.sh up [--size 6G] [--dir /mnt/dnvram] [--image /dev/shm/dnv-ram.img]
#        bench/fastdev.sh down [--dir /mnt/dnvram] [--image /dev/shm/dnv-ram.img]
#        bench/fastdev.sh status [--dir /mnt/dnvram]
#
# A fast device for the benchmarks on a machine without a real NVMe: ext4 on a loop device with
# direct I/O over a fallocated file in /dev/shm. Raw fio O_DIRECT qd32 1M reaches 3-5 GiB/s on
# it here (against the virtio disk's 1.5-3), so the mount's own CPU cost per byte, not the disk,
# sets the speed, as on a real NVMe. Every mount benchmark takes --dir/--backing DIR to run there.
#
# up:     fallocate the image (refused unless MemAvailable exceeds the size by 2 GiB: the image
#         lives in RAM and benchmarks need memory beside it), attach it with
#         `losetup --direct-io=on` (so the loop device does not add a second page cache), mkfs.ext4
#         without discard, mount it at DIR, and write its free space once with dd oflag=direct (the
#         first write of each tmpfs page costs an allocation; later runs should not pay it).
#         Prints DIR/bench, the directory to pass as --dir.
# down:   unmount DIR, detach the loop device, remove the image. Safe to repeat.
# status: whether DIR is a fastdev mount, its loop device and size.
# Root only. Leaves nothing behind on failure (up undoes what it did).
set -euo pipefail
BENCH_NAME=fastdev
# shellcheck source=bench/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

CMD=${1:-}
[[ $CMD == up || $CMD == down || $CMD == status ]] || {
  [[ $CMD == -h || $CMD == --help ]] && { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0; }
  echo "fastdev: usage: bench/fastdev.sh up|down|status [--size 6G] [--dir DIR] [--image FILE]" >&2
  exit 2
}
shift
SIZE=6G
DIR=/mnt/dnvram
IMAGE=/dev/shm/dnv-ram.img
while [[ $# -gt 0 ]]; do
  case $1 in
    --size) SIZE=${2:?--size needs a value}; shift 2 ;;
    --dir) DIR=${2:?--dir needs a directory}; shift 2 ;;
    --image) IMAGE=${2:?--image needs a file}; shift 2 ;;
    *) echo "fastdev: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[[ $(id -u) -eq 0 ]] || die "must run as root (losetup, mount, mkfs)"

loop_of_image() {  # the loop device backed by IMAGE, if any
  losetup -j "$IMAGE" 2>/dev/null | cut -d: -f1 | head -1
}

case $CMD in
  status)
    if mountpoint -q "$DIR"; then
      src=$(findmnt -n -o SOURCE "$DIR")
      back=$(losetup -n -O BACK-FILE "$src" 2>/dev/null | tr -d ' ' || true)
      echo "fastdev: $DIR is mounted from $src ($(df -h --output=size "$DIR" | tail -1 | tr -d ' ')), over ${back:-no loop image}"
    else
      echo "fastdev: $DIR is not mounted"
      exit 1
    fi
    ;;
  down)
    if mountpoint -q "$DIR"; then umount "$DIR"; fi
    loop=$(loop_of_image)
    [[ -n $loop ]] && losetup -d "$loop"
    rm -f "$IMAGE"
    echo "fastdev: down ($DIR unmounted, $IMAGE removed)"
    ;;
  up)
    bytes=$(size_bytes "$SIZE")
    ((bytes >= 1 << 30)) || die "--size $SIZE is too small: at least 1G"
    mountpoint -q "$DIR" && die "$DIR is mounted already (bench/fastdev.sh down first)"
    [[ -e $IMAGE ]] && die "$IMAGE exists already (bench/fastdev.sh down first)"
    avail_kb=$(awk '/^MemAvailable:/ { print $2 }' /proc/meminfo)
    need_kb=$((bytes / 1024 + (2 << 20)))
    ((avail_kb > need_kb)) ||
      die "not enough free memory: $((avail_kb >> 20)) GiB available, $SIZE image + 2 GiB needed"
    shm_kb=$(df -k --output=avail "$(dirname "$IMAGE")" | tail -1 | tr -d ' ')
    ((shm_kb * 1024 > bytes)) || die "$(dirname "$IMAGE") has only $((shm_kb >> 20)) GiB free"
    loop=
    cleanup() {
      if mountpoint -q "$DIR"; then umount "$DIR" || true; fi
      [[ -n $loop ]] && losetup -d "$loop" 2>/dev/null
      rm -f "$IMAGE"
    }
    trap 'cleanup; die "up failed; undone"' ERR
    fallocate -l "$bytes" "$IMAGE"
    loop=$(losetup -f --show --direct-io=on "$IMAGE")
    # No lazy inode-table and journal initialisation: ext4lazyinit would otherwise zero them in
    # the background for minutes after the mount, taking device time from the first benchmarks.
    mkfs.ext4 -q -E nodiscard,lazy_itable_init=0,lazy_journal_init=0 "$loop"
    mkdir -p "$DIR"
    mount "$loop" "$DIR"
    # One pass over all the free space, so the benchmarks' writes do not pay tmpfs' first-touch
    # cost wherever ext4 puts them (with 2/3 of it warmed, the first 4 GiB write of a 10G image
    # ran at 1.35 GiB/s and 0.85 CPU s/GiB against 5-6 GiB/s and 0.25 afterwards).
    avail=$(df --output=avail -B1M "$DIR" | tail -1)
    dd if=/dev/zero of="$DIR/warm" bs=1M count=$((avail - 16)) oflag=direct status=none
    rm -f "$DIR/warm"
    mkdir -p "$DIR/bench"
    trap - ERR
    echo "fastdev: up: ext4 on $loop (direct I/O over $IMAGE, $SIZE) at $DIR; benchmark with --dir $DIR/bench"
    ;;
esac
