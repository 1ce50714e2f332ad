#!/usr/bin/env bash
# Usage: scripts/gpu-check.sh bundle [BUILD_DIR] [--fio STATIC_FIO]
#        scripts/gpu-check.sh run [--budget SECONDS] [--size 1G] [--rounds 3] [--udev-shim]
#
# The GPU path on a machine with a GPU, from a bundle made on another machine (issue 38).
#
# bundle: copies what a bare CUDA machine lacks into .gpubundle/ in the repository root (ignore it
# in .git/info/exclude and carry it): dnvme, dnvmefs, gpu_tests and the fake libcufile from
# BUILD_DIR (default build-gpu, a -DDNVME_WITH_CUDA=ON build), fusermount3, a static fio (--fio,
# else the fio on PATH if it is static), the shared libraries `ldd` lists beyond glibc and
# libstdc++ (libaio, spdlog, fmt, fuse3, liburing, libcap, ...), and what it takes to build the
# Python extension deepnvme._C there for that machine's Python: the engine's static libraries,
# the static CUDA runtime, pybind11's headers (a fallback), the sources and headers the build
# used, and deepnvme's .py files. A checkout that others edit meanwhile is best built from a
# snapshot (git archive HEAD plus the files under test) so the bundle is one consistent build:
#   git archive HEAD | tar -x -C /tmp/gpu-src
#   cmake -S /tmp/gpu-src -B build-gpu -DCMAKE_BUILD_TYPE=Release -DDNVME_WITH_CUDA=ON
#   cmake --build build-gpu --target dnvme dnvmefs gpu_tests fake_cufile dnvme_client
# fio: Debian's is linked against ~80 MiB of libraries (rbd, gluster, ...); a static one from
# its source (apt-get source fio; ./configure --build-static --disable-{rdma,rbd,rados,gfapi,
# http,pmem,numa}; make) is 3 MiB stripped.
#
# run: on the GPU machine (or here, where every GPU case skips with its reason), from the
# repository root. Every log goes under $OUT (default /tmp/gpu-check-out), seven files at most:
#   summary.txt  every step with PASS/FAIL/SKIP/TIMEOUT, its time and the headline lines
#   env.log      nvidia-smi, the driver, kernel, disk, FUSE, nvidia-fs, cuFile, Python, ldd
#   gtest.log    gpu_tests (tests/engine/gpu: the fake-cuFile cases and the real-device cases)
#                and `dnvme report`
#   pyext.log    the build of deepnvme._C for this machine's python3
#   pytest.log   tests/python/test_gpu.py (python3 with CUDA torch)
#   bench.log    bench/gpu_io.sh --mount (host/gpu/gds/fio, the pinned copy rates, a CUDA
#                tensor through a real mount); bench.json its JSON
# Each step has its own timeout and the whole run ends within --budget seconds (default 330):
# a step that would start too late is recorded as NOT RUN. libcufile is looked for under the
# Python's site-packages (the nvidia-cufile wheel: nvidia/cufile/lib) and put on
# LD_LIBRARY_PATH so `--gds` can dlopen it (else the system's, through ldconfig).
# --udev-shim: cuFile's compat mode asks udev for the filesystem on the block device under each
# file (ID_FS_USAGE) and refuses the file (cuFileHandleRegister: CU_FILE_HANDLE_NOT_REGISTERED)
# when udev has no entry, as in a VM without udevd; this writes the minimal entry,
# /run/udev/data/b<major>:<minor>, when there is none (only on a machine thrown away after use).
# Exits non-zero when a step failed.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUNDLE=$ROOT/.gpubundle

die() { echo "gpu-check: $*" >&2; exit 1; }

# --- bundle -------------------------------------------------------------------------------------

# Libraries every glibc Linux has (or that must come from the machine itself: the loader, libc,
# libstdc++ of a newer GCC): never carried.
BASE_LIBS='^(linux-vdso|ld-linux|libc|libm|libpthread|libdl|librt|libutil|libresolv|libstdc\+\+|libgcc_s|libcuda|libnvidia)[.-]'

copy_needed_libs() {  # binary...: copies what ldd resolves, beyond BASE_LIBS, into $BUNDLE/lib
  local f name path
  for f in "$@"; do
    while read -r name _ path _; do
      [[ $path == /* ]] || continue
      [[ $name =~ $BASE_LIBS ]] && continue
      [[ -e $BUNDLE/lib/$name ]] || cp -L "$path" "$BUNDLE/lib/$name" || die "cannot copy $path"
    done < <(ldd "$f" 2>/dev/null | grep "=>")
  done
}

make_bundle() {
  local build=$ROOT/build-gpu fio=
  while [[ $# -gt 0 ]]; do
    case $1 in
      --fio) fio=$2; shift 2 ;;
      *) build=$(cd "$1" && pwd) || die "no build directory $1"; shift ;;
    esac
  done
  local b
  for b in bin/dnvme bin/dnvmefs bin/gpu_tests lib/libfakecufile.so lib/libdnvme_engine.a \
    lib/libdnvme_gpu.a lib/libdnvme_client.a python/deepnvme/__init__.py; do
    [[ -e $build/$b ]] || die "$build/$b is missing: scripts/build.sh $build -DDNVME_BUILD_TESTS=ON -DDNVME_WITH_CUDA=ON"
  done
  # Only the CUDA build names cudaGetDeviceCount (in its "no usable CUDA device" message).
  grep -q cudaGetDeviceCount "$build/bin/dnvme" || die "$build was built without CUDA"
  if [[ -z $fio ]]; then
    fio=$(command -v fio) || die "no fio: pass --fio STATIC_FIO"
  fi
  [[ $(ldd "$fio" 2>&1) == *'not a dynamic executable'* ]] ||
    die "$fio is dynamically linked (its Debian build needs ~80 MiB of libraries): build a static one (./configure --build-static) and pass --fio"
  local cudart
  cudart=$(sed -n 's/^CUDA_cudart_static_LIBRARY:FILEPATH=//p' "$build/CMakeCache.txt")
  [[ -f $cudart ]] || cudart=/usr/local/cuda/lib64/libcudart_static.a
  [[ -f $cudart ]] || die "libcudart_static.a not found"

  rm -rf "$BUNDLE"
  mkdir -p "$BUNDLE"/{bin,lib,pyext/lib,pyext/include,python/deepnvme}
  cp "$build"/bin/{dnvme,dnvmefs,gpu_tests} "$fio" "$(command -v fusermount3)" "$BUNDLE/bin/" ||
    die "cannot copy the binaries"
  [[ -x $BUNDLE/bin/fio ]] || mv "$BUNDLE/bin/$(basename "$fio")" "$BUNDLE/bin/fio"
  cp "$build/lib/libfakecufile.so" "$BUNDLE/lib/"
  copy_needed_libs "$BUNDLE"/bin/* "$BUNDLE/lib/libfakecufile.so"
  # libstdc++ of this build, used there only when the machine's own is older (run checks).
  mkdir -p "$BUNDLE/lib-fallback"
  cp -L "$(g++ -print-file-name=libstdc++.so.6)" "$BUNDLE/lib-fallback/" ||
    die "cannot copy libstdc++.so.6"
  # The Python extension's link line, as python/CMakeLists.txt has it (link.txt), minus LTO.
  cp "$build"/lib/libdnvme_{engine,gpu,client}.a "$cudart" "$BUNDLE/pyext/lib/"
  cp -r /usr/include/pybind11 "$BUNDLE/pyext/include/" 2>/dev/null ||
    echo "gpu-check: no /usr/include/pybind11 here: the GPU machine's pip pybind11 must do" >&2
  cp "$build"/python/deepnvme/*.py "$BUNDLE/python/deepnvme/"
  # The extension's sources as the build saw them (the tree may have moved on since).
  local src
  src=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$build/CMakeCache.txt")
  mkdir -p "$BUNDLE/pyext/src/python"
  if ! cp -r "$src/include" "$BUNDLE/pyext/src/" ||
    ! cp "$src"/python/*.cc "$src"/python/*.h "$BUNDLE/pyext/src/python/"; then
    die "cannot copy the extension's sources from $src"
  fi
  {
    echo "made $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -n) from $build (sources $src)"
    echo "repository HEAD $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null)"
    grep -E '^CMAKE_BUILD_TYPE|^CMAKE_CXX_FLAGS:' "$build/CMakeCache.txt"
  } >"$BUNDLE/MANIFEST"
  (cd "$BUNDLE" && find . -type f | sort | xargs ls -l) >>"$BUNDLE/MANIFEST"
  echo "gpu-check: bundle $BUNDLE: $(du -sh "$BUNDLE" | cut -f1)"
  grep -qx '/.gpubundle/' "$ROOT/.git/info/exclude" 2>/dev/null ||
    echo "gpu-check: add '/.gpubundle/' to .git/info/exclude so it travels only when carried" >&2
}

# --- run ----------------------------------------------------------------------------------------

BUDGET=330
SIZE=1G
ROUNDS=3
OUT=${OUT:-/tmp/gpu-check-out}
WORK=/tmp/gpu-check-work
FAILED=0

note() { echo "$*" | tee -a "$OUT/summary.txt"; }

# step NAME TIMEOUT LOG CMD...: runs CMD with its output appended to LOG, bounded by TIMEOUT and
# by what is left of the budget; records the outcome in summary.txt. Exit status 77 is a skip.
step() {
  local name=$1 want=$2 log=$3
  shift 3
  local left=$((DEADLINE - SECONDS - 5))
  local t=$((want < left ? want : left))
  if ((t < 5)); then
    note "$(printf '%-10s NOT RUN (out of time: %d s of the budget left)' "$name" "$left")"
    FAILED=1
    return 1
  fi
  echo "=== $name: $* (timeout ${t}s)" >>"$log"
  local t0=$SECONDS rc
  # timeout signals its whole process group: whatever the step started goes too.
  timeout -k 5 "$t" bash -c '"$@"' "$name" "$@" >>"$log" 2>&1
  rc=$?
  local verdict=PASS
  case $rc in
    0) ;;
    77) verdict=SKIP ;;
    124 | 137) verdict="TIMEOUT after ${t}s"; FAILED=1 ;;
    *) verdict="FAIL (exit $rc)"; FAILED=1 ;;
  esac
  echo "=== $name: exit $rc in $((SECONDS - t0)) s" >>"$log"
  note "$(printf '%-10s %-22s %4d s  %s' "$name" "$verdict" $((SECONDS - t0)) "$(basename "$log")")"
  return $rc
}

# The first directory where O_DIRECT works (tmpfs and overlay roots may refuse it).
pick_scratch() {
  local d
  for d in "$ROOT/var/gpu-check" /var/tmp/gpu-check /root/gpu-check /tmp/gpu-check; do
    mkdir -p "$d" 2>/dev/null || continue
    if dd if=/dev/zero of="$d/.odirect" bs=1M count=4 oflag=direct status=none 2>/dev/null; then
      rm -f "$d/.odirect"
      echo "$d"
      return 0
    fi
    rm -f "$d/.odirect"
  done
  return 1
}

env_report() {
  set -x
  date -u
  uname -a
  head -2 /etc/os-release
  nproc
  free -g
  nvidia-smi
  nvidia-smi --query-gpu=name,driver_version,pci.bus_id,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv
  cat /proc/driver/nvidia/version
  ls -l /dev/fuse /dev/nvidia* 2>&1
  lsmod 2>/dev/null | grep -E 'nvidia|fuse' || grep -E 'nvidia|fuse' /proc/modules
  ls /proc/driver/nvidia-fs 2>&1
  cat /proc/driver/nvidia-fs/version 2>&1
  ls /etc/cufile.json 2>&1
  df -hT "$SCRATCH" "$ROOT"
  findmnt -T "$SCRATCH" 2>/dev/null
  command -v python3 g++ c++ nvcc cmake fio fusermount3 umount
  g++ --version | head -1
  nvcc --version | tail -2
  "$PYTHON" -c 'import sys, torch; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())'
  echo "libcufile: ${CUFILE_DIR:-not found under the site-packages of python}"
  ls -l "$CUFILE_DIR" 2>&1
  ldconfig -p | grep -i cufile
  find /usr/local/cuda*/ /usr/lib /opt -name 'libcufile.so*' 2>/dev/null | head
  grep -E '"(allow_compat_mode|force_compat_mode|use_pci_p2pdma|logging)"' /etc/cufile.json
  find /run/udev/data -maxdepth 1 -name 'b*' 2>&1 | head -5
  set +x
  local f
  for f in "$BUNDLE"/bin/* "$BUNDLE"/lib/*.so*; do
    ldd "$f" 2>&1 | grep -q 'not found' && { echo "MISSING for $f:"; ldd "$f" | grep 'not found'; }
  done
  echo "ldd check done (only MISSING lines above are problems)"
  [[ -n $CUFILE_DIR ]] && ldd "$CUFILE_DIR"/libcufile.so.0 2>&1
  return 0
}

# deepnvme._C for this machine's python3: the bundle's static engine, pybind11 from pip (else the
# bundle's headers), Python.h from sysconfig.
build_pyext() {
  local dst=$WORK/py/deepnvme
  rm -rf "$WORK/py"
  mkdir -p "$dst" "$WORK/pyobj"
  cp "$BUNDLE"/python/deepnvme/*.py "$dst/"
  local pyinc suffix cxx pb11 pb11s=()
  pyinc=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
  [[ -f $pyinc/Python.h ]] || { echo "SKIP: no Python.h under $pyinc (no Python headers)"; return 77; }
  suffix=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
  cxx=$(command -v g++ || command -v c++) || { echo "SKIP: no C++ compiler"; return 77; }
  # pip's pybind11 first (made for this Python), else the bundle's (Debian's 2.10).
  pb11=$("$PYTHON" -c 'import pybind11; print(pybind11.get_include())' 2>/dev/null) && pb11s+=("$pb11")
  [[ -f $BUNDLE/pyext/include/pybind11/pybind11.h ]] && pb11s+=("$BUNDLE/pyext/include")
  [[ ${#pb11s[@]} -gt 0 ]] || { echo "SKIP: no pybind11 headers"; return 77; }
  local built=0 src p pids
  for pb11 in "${pb11s[@]}"; do
    echo "python headers $pyinc, pybind11 $pb11, $cxx ($("$cxx" -dumpfullversion))"
    local S=$BUNDLE/pyext/src
    local flags=(-O2 -DNDEBUG -fPIC -fvisibility=hidden -std=c++20 -Ddeepnvme_py_EXPORTS
      -I"$S" -I"$S/include" -isystem "$pyinc" -isystem "$pb11")
    pids=()
    for src in core_module ctl_client; do
      "$cxx" "${flags[@]}" -c "$S/python/$src.cc" -o "$WORK/pyobj/$src.o" &
      pids+=($!)
    done
    built=1
    for p in "${pids[@]}"; do wait "$p" || built=0; done
    [[ $built -eq 1 ]] && break
    echo "the compile with pybind11 from $pb11 failed"
  done
  [[ $built -eq 1 ]] || return 1
  local L=$BUNDLE/pyext/lib
  "$cxx" -shared -o "$dst/_C$suffix" "$WORK"/pyobj/*.o "$L/libdnvme_engine.a" "$L/libdnvme_gpu.a" \
    "$L/libdnvme_client.a" "$L/libcudart_static.a" -ldl -lrt "$L/libdnvme_engine.a" \
    "$BUNDLE"/lib/libaio.so.* "$BUNDLE"/lib/libspdlog.so.* "$BUNDLE"/lib/libfmt.so.* -lpthread ||
    return 1
  PYTHONPATH=$WORK/py "$PYTHON" -c 'import deepnvme, sys
print("deepnvme", deepnvme.__file__, "built_with_cuda", deepnvme._C.built_with_cuda(),
      "reason", repr(deepnvme._C.cuda_unavailable_reason()))'
}

run_gtests() {
  "$BUNDLE/bin/dnvme" report --dir "$SCRATCH" --json || echo "dnvme report exited $?"
  "$BUNDLE/bin/gpu_tests" --gtest_color=no
}

run_pytest() {
  local extra=()
  "$PYTHON" -c 'import pytest_timeout' 2>/dev/null && extra=(--timeout 120)
  [[ -f $WORK/py/deepnvme/__init__.py ]] && ls "$WORK"/py/deepnvme/_C*.so >/dev/null 2>&1 ||
    echo "deepnvme._C was not built here (pyext.log): the tests skip with the import error"
  PYTHONPATH=$WORK/py:$ROOT DNVMEFS_BIN=$BUNDLE/bin/dnvmefs DNVME_TEST_DIR=$SCRATCH/py \
    "$PYTHON" -m pytest -v -rs -p no:cacheprovider "${extra[@]}" tests/python/test_gpu.py
}

run_bench() {
  local mount=()
  ls "$WORK"/py/deepnvme/_C*.so >/dev/null 2>&1 && mount=(--mount)
  [[ ${#mount[@]} -eq 0 ]] && echo "gpu_io: the mount part needs deepnvme._C, which did not build"
  PYTHONPATH=$WORK/py:$ROOT DNVME=$BUNDLE/bin/dnvme DNVMEFS=$BUNDLE/bin/dnvmefs PYTHON=$PYTHON \
    FIO=$BUNDLE/bin/fio bench/gpu_io.sh --dir "$SCRATCH/bench" --size "$SIZE" --rounds "$ROUNDS" \
    --json-out "$OUT/bench.json" "${mount[@]}"
  local rc=$?
  # cuFile logs into the working directory (cufile.log) unless told otherwise.
  if [[ -f cufile.log ]]; then
    echo "--- cufile.log (last 40 lines)"
    tail -n 40 cufile.log
  fi
  return $rc
}

# The udev entry cuFile's compat mode reads for the scratch directory's block device (--udev-shim).
udev_shim() {
  local majmin fstype f
  majmin=$(mountpoint -d "$(stat -c %m "$SCRATCH")" 2>/dev/null) || return 0
  f=/run/udev/data/b$majmin
  [[ -e $f ]] && return 0
  fstype=$(findmnt -no FSTYPE -T "$SCRATCH" 2>/dev/null)
  mkdir -p /run/udev/data &&
    printf 'I:1000000\nE:ID_FS_USAGE=filesystem\nE:ID_FS_TYPE=%s\n' "${fstype:-ext4}" >"$f" &&
    note "note: --udev-shim wrote $f (ID_FS_USAGE=filesystem, ID_FS_TYPE=${fstype:-ext4}): no udev entry for the scratch disk"
}

run_all() {
  local shim=0
  while [[ $# -gt 0 ]]; do
    case $1 in
      --udev-shim) shim=1; shift ;;
      --budget) BUDGET=$2; shift 2 ;;
      --size) SIZE=$2; shift 2 ;;
      --rounds) ROUNDS=$2; shift 2 ;;
      *) die "unknown argument $1" ;;
    esac
  done
  DEADLINE=$((SECONDS + BUDGET))
  [[ -d $BUNDLE/bin ]] || die "no bundle at $BUNDLE: run '$0 bundle' first (and carry .gpubundle)"
  cd "$ROOT" || exit 1
  mkdir -p "$OUT" "$WORK"
  rm -f "$OUT"/{summary.txt,env.log,gtest.log,pyext.log,pytest.log,bench.log,bench.json}
  : >"$OUT/summary.txt"
  PYTHON=${PYTHON:-$(command -v python3)}
  export PATH=$BUNDLE/bin:$PATH
  export LD_LIBRARY_PATH=$BUNDLE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export DNVME_FAKE_CUFILE=$BUNDLE/lib/libfakecufile.so
  if ldd "$BUNDLE/bin/dnvme" 2>&1 | grep -q "GLIBCXX.*not found"; then
    export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$BUNDLE/lib-fallback
    note "note: this machine's libstdc++ is older than the build's: using the bundle's"
  fi
  export PYTHONUNBUFFERED=1
  # bench/lib.sh parses sizes with /usr/bin/python3; a machine whose only python3 is elsewhere
  # gets a link (the GPU machines are thrown away after use).
  if [[ ! -x /usr/bin/python3 && -w /usr/bin ]]; then
    ln -s "$PYTHON" /usr/bin/python3 && note "note: linked /usr/bin/python3 -> $PYTHON"
  fi
  CUFILE_DIR=$("$PYTHON" - <<'EOF' 2>/dev/null
import glob, os, site, sys
roots = site.getsitepackages() + [site.getusersitepackages()] + sys.path
for r in roots:
    hits = sorted(glob.glob(os.path.join(r, "nvidia", "cufile", "lib", "libcufile.so*")))
    if hits:
        print(os.path.dirname(hits[0]))
        break
EOF
  )
  [[ -n $CUFILE_DIR ]] && export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$CUFILE_DIR
  SCRATCH=$(pick_scratch) || die "no directory here takes O_DIRECT writes"
  export DNVME_TEST_DIR=$SCRATCH/gtest
  # What the steps (bash -c, under timeout) need.
  export ROOT BUNDLE WORK OUT PYTHON SCRATCH CUFILE_DIR SIZE ROUNDS
  export -f die env_report build_pyext run_gtests run_pytest run_bench

  note "gpu-check on $(uname -n) $(date -u +%Y-%m-%dT%H:%M:%SZ): budget ${BUDGET}s, scratch $SCRATCH ($(stat -f -c %T "$SCRATCH")), python $PYTHON, libcufile ${CUFILE_DIR:-none}"
  note "$(head -2 "$BUNDLE/MANIFEST" | tr '\n' ' ')"
  note "gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -1)"

  [[ $shim -eq 1 ]] && udev_shim
  step env 30 "$OUT/env.log" env_report
  # The extension builds in the background while the gtests run.
  (step pyext 150 "$OUT/pyext.log" build_pyext; echo $? >"$WORK/pyext.rc") &
  local pyext_pid=$!
  step gtest 90 "$OUT/gtest.log" run_gtests
  { grep -E '^\[  (PASSED|SKIPPED|FAILED) +\] [0-9]+ tests?' "$OUT/gtest.log"
    grep -E '^\[  (SKIPPED|FAILED) +\] [A-Za-z][^ ]*$' "$OUT/gtest.log" | sort -u; } |
    sed 's/^/  /' >>"$OUT/summary.txt"
  wait "$pyext_pid"
  case $(cat "$WORK/pyext.rc" 2>/dev/null) in 0 | 77) ;; *) FAILED=1 ;; esac
  step bench 170 "$OUT/bench.log" run_bench
  sed -n '/^GPU: /,$p' "$OUT/bench.log" | grep -v '^wrote ' | head -30 >>"$OUT/summary.txt"
  grep -E 'gds runs|cannot run' "$OUT/bench.log" >>"$OUT/summary.txt"
  step pytest 150 "$OUT/pytest.log" run_pytest
  grep -E '^(FAILED|ERROR|SKIPPED)|[0-9]+ (passed|failed|skipped)' "$OUT/pytest.log" |
    head -40 >>"$OUT/summary.txt"
  rm -rf "$SCRATCH/bench" "$SCRATCH/gtest" "$SCRATCH/py"
  note "gpu-check: done in $SECONDS s, $([[ $FAILED -eq 0 ]] && echo 'every step passed or skipped' || echo 'SOME STEPS FAILED')"
  return $FAILED
}

case ${1:-} in
  bundle) shift; make_bundle "$@" ;;
  run) shift; run_all "$@" ;;
  *) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 2 ;;
esac
