#!/usr/bin/env bash
# Usage: tests/layering_test.sh REPO_ROOT
# The seams of fs/, tools/ and the engine that the code review cannot keep by eye (docs/architecture.md):
#   1. only the Reply* helpers of fs/fuse/ops_common.cc reply to FUSE (fuse_reply_*): everything
#      else, the ops included, returns Status/Result or hands one to a Reply* helper, so a Status
#      becomes the kernel's errno in one place (ReplyStatus);
#   2. the request handlers learn about their request from the Transport, not from thread-local
#      state (no thread_local under fs/transport/);
#   3. fs/control/ reaches the core through ControlCore only: it includes nothing of fs/core/
#      (the control directory's nodes, which serve the core's files, are fs/fuse/control_dir.*);
#   3b. fs/broker/ reaches the core through BrokerCore only (nothing of fs/core/);
#   4. tools/ include public headers (include/dnvme/) and their own only;
#   5. no source file of fs/ is over 500 lines;
#   6. no source file of preload/ is over 500 lines (one file per job: docs/preload.md);
#   7. no two rooms include each other: a room is a folder under fs/ (fs/core, fs/fuse, ...), a
#      file directly in fs/ by its stem (fs/options.{h,cc} is fs/options), or datapath/ as a whole
#      when it exists. A pair that does is printed with every include that makes each direction;
#   8. nothing outside engine/ includes "engine/...": the engine's contract is include/dnvme/
#      (fs/, datapath/, preload/, tools/, client/, python/ and their tests use that alone). The
#      one exception is tests/engine/, the unit tests of the engine's internals (the cuFile ABI
#      the fake libcufile implements, the copy engine, IoFile).
# Prints every violation and exits 1 if there is one.
set -uo pipefail
ROOT=${1:?usage: layering_test.sh REPO_ROOT}
cd "$ROOT" || exit 2
bad=0
report() { echo "layering: $*"; bad=1; }

while IFS= read -r hit; do
  report "fuse_reply outside fs/fuse/ops_common.cc (reply through its Reply* helpers): $hit"
done < <(grep -rnE '\bfuse_reply_[a-z_]+\(' fs --include='*.cc' --include='*.h' |
         grep -v '^fs/fuse/ops_common\.cc:')

while IFS= read -r hit; do
  report "thread-local state in the transport: $hit"
done < <(grep -rn 'thread_local' fs/transport --include='*.cc' --include='*.h')

while IFS= read -r hit; do
  report "fs/control includes the core: $hit"
done < <(grep -rnE '#include "fs/(core/|fs\.h)' fs/control --include='*.cc' --include='*.h')

while IFS= read -r hit; do
  report "fs/broker includes the core: $hit"
done < <(grep -rnE '#include "fs/(core/|fs\.h)' fs/broker --include='*.cc' --include='*.h')

while IFS= read -r hit; do
  report "tools/ includes a private header: $hit"
done < <(grep -rn '#include "' tools --include='*.cc' --include='*.h' | grep -vE '#include "(dnvme|tools)/')

while IFS= read -r f; do
  n=$(wc -l <"$f")
  ((n > 500)) && report "$f has $n lines (over 500)"
done < <(find fs -name '*.cc' -o -name '*.h')

while IFS= read -r f; do
  n=$(wc -l <"$f")
  ((n > 500)) && report "$f has $n lines (over 500)"
done < <(find preload -name '*.cc' -o -name '*.h')

# The room of a path: fs/<dir> for what is under a folder of fs/, fs/<stem> for a file directly in
# fs/, datapath for anything under datapath/; empty for the rest.
room_of() {
  case "$1" in
    fs/*/*) local r=${1#fs/}; echo "fs/${r%%/*}" ;;
    fs/*) local f=${1#fs/}; echo "fs/${f%%.*}" ;;
    datapath/*) echo datapath ;;
  esac
}
# Every include of another room: "FROM TO FILE:LINE: #include ...", one a line.
edges=$(
  dirs=(fs)
  [[ -d datapath ]] && dirs+=(datapath)
  grep -rnE '^#include "(fs|datapath)/' "${dirs[@]}" --include='*.cc' --include='*.h' |
    while IFS= read -r hit; do
      file=${hit%%:*}
      target=$(sed -E 's/.*#include "([^"]+)".*/\1/' <<<"$hit")
      from=$(room_of "$file")
      to=$(room_of "$target")
      [[ -n $from && -n $to && $from != "$to" ]] && echo "$from $to $hit"
    done
)
while IFS= read -r pair; do
  [[ -z $pair ]] && continue
  a=${pair% *}
  b=${pair#* }
  # Each unordered pair once: from the direction whose first room sorts first.
  [[ $a < $b ]] || continue
  if grep -q "^$b $a " <<<"$edges"; then
    report "$a and $b include each other:"
    grep -E "^($a $b|$b $a) " <<<"$edges" | cut -d' ' -f3- | sed 's/^/layering:     /'
  fi
done < <(cut -d' ' -f1,2 <<<"$edges" | sort -u)

while IFS= read -r hit; do
  report "engine internals included outside engine/: $hit"
done < <(grep -rnE '^[[:space:]]*#[[:space:]]*include[[:space:]]*"engine/' . \
           --include='*.cc' --include='*.h' --include='*.cpp' --include='*.hpp' --include='*.c' \
           --include='*.cu' --exclude-dir='build*' --exclude-dir=var --exclude-dir=.git |
         sed 's|^\./||' | grep -vE '^(engine|tests/engine)/')

((bad == 0)) && echo "layering: all checks passed"
exit "$bad"
