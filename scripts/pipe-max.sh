# Sourced helper: dnvmefs splices FUSE requests through 2 MiB pipes (fs/transport/session_loop.h), which a
# daemon can create only with CAP_SYS_RESOURCE or when fs.pipe-max-size >= 2 MiB. Containers
# often lack the capability. These functions raise the sysctl around a mount start and put the
# old value back afterwards (pipes keep the size they were given), saying so on stderr.
PIPE_MAX_WANT=2097152
PIPE_MAX_SAVED=

pipe_max_raise() {
  local f=/proc/sys/fs/pipe-max-size cur
  cur=$(cat "$f" 2>/dev/null) || return 0
  ((cur >= PIPE_MAX_WANT)) && return 0
  if [[ -w $f ]] && echo "$PIPE_MAX_WANT" >"$f" 2>/dev/null; then
    PIPE_MAX_SAVED=$cur
    echo "note: fs.pipe-max-size raised from $cur to $PIPE_MAX_WANT while dnvmefs starts (spliced requests; docs/tuning.md)" >&2
  else
    echo "note: fs.pipe-max-size is $cur and cannot be raised here: dnvmefs will read requests instead of splicing them (docs/tuning.md)" >&2
  fi
}

pipe_max_restore() {
  [[ -n $PIPE_MAX_SAVED ]] || return 0
  if echo "$PIPE_MAX_SAVED" >/proc/sys/fs/pipe-max-size 2>/dev/null; then
    echo "note: fs.pipe-max-size back to $PIPE_MAX_SAVED" >&2
  fi
  PIPE_MAX_SAVED=
}
