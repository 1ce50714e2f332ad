#!/usr/bin/env bash
# Usage: tests/layering_test.sh REPO_ROOT
# The seams of fs/ and tools/ that the code review cannot keep by eye (docs/architecture.md):
#   1. only fs/fuse/ replies to FUSE (fuse_reply_*): everything else returns Status/Result and
#      the ops turn it into an errno;
#   2. the request handlers learn about their request from the Transport, not from thread-local
#      state (no thread_local under fs/transport/);
#   3. fs/control/ reaches the core through ControlCore only: it does not include fs/fs.h
#      except virtual.cc, which serves the control nodes from Fs's inode table;
#   3b. fs/broker/ reaches the core through BrokerCore only (no fs/fs.h);
#   4. tools/ include public headers (include/dnvme/) and their own only;
#   5. no source file of fs/ is over 550 lines;
#   6. no source file of preload/ is over 500 lines (one file per job: docs/preload.md).
# Prints every violation and exits 1 if there is one.
set -uo pipefail
ROOT=${1:?usage: layering_test.sh REPO_ROOT}
cd "$ROOT" || exit 2
bad=0
report() { echo "layering: $*"; bad=1; }

while IFS= read -r hit; do
  report "fuse_reply outside fs/fuse/: $hit"
done < <(grep -rnE '\bfuse_reply_[a-z_]+\(' fs --include='*.cc' --include='*.h' | grep -v '^fs/fuse/')

while IFS= read -r hit; do
  report "thread-local state in the transport: $hit"
done < <(grep -rn 'thread_local' fs/transport --include='*.cc' --include='*.h')

while IFS= read -r hit; do
  report "fs/control includes the core: $hit"
done < <(grep -rn '#include "fs/fs.h"' fs/control --include='*.cc' --include='*.h' |
  grep -v '^fs/control/virtual.cc:')

while IFS= read -r hit; do
  report "fs/broker includes the core: $hit"
done < <(grep -rn '#include "fs/fs.h"' fs/broker --include='*.cc' --include='*.h')

while IFS= read -r hit; do
  report "tools/ includes a private header: $hit"
done < <(grep -rn '#include "' tools --include='*.cc' --include='*.h' | grep -vE '#include "(dnvme|tools)/')

while IFS= read -r f; do
  n=$(wc -l <"$f")
  ((n > 550)) && report "$f has $n lines (over 550)"
done < <(find fs -name '*.cc' -o -name '*.h')

while IFS= read -r f; do
  n=$(wc -l <"$f")
  ((n > 500)) && report "$f has $n lines (over 500)"
done < <(find preload -name '*.cc' -o -name '*.h')

((bad == 0)) && echo "layering: all checks passed"
exit "$bad"
