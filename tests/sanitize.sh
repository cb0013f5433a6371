#!/usr/bin/env bash
# Runs tests against a sanitizer build of the whole extension.
#
#   tests/sanitize.sh address [pytest args]   ASan + UBSan
#   tests/sanitize.sh thread  [pytest args]   TSan (tests/tsan.supp: torch's and Python's own internals)
#
# The build lives beside the normal one (build/sanitize-<kind>/, incremental)
# and is loaded through PYCOMM_CORE_PATH, so the normal build is untouched.
# The sanitizer runtime is preloaded into every Python process (ranks and
# zygotes inherit it). Each report goes to a file of its process under
# $PYCOMM_SANITIZE_LOGS (default build/sanitize-<kind>/logs, emptied first);
# the script fails when pytest fails or any process reported anything.
# PYCOMM_RACE_WINDOW_US (default 300) widens the hand-overs between threads
# (csrc/core/race_window.h); 0 turns that off.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
kind=${1:-}
shift || true
case "$kind" in
  address) sanitize=address,undefined; runtime=libasan.so ;;
  thread)  sanitize=thread; runtime=libtsan.so ;;
  *) sed -n '2,5p' "$0"; exit 2 ;;
esac

dir=build/sanitize-$kind
echo "sanitize.sh: building the $sanitize build in $dir (incremental)" >&2
PYCOMM_SANITIZE=$sanitize MAX_JOBS=${MAX_JOBS:-2} "$PY" setup.py -q build_ext \
  --build-lib "$dir/lib" --build-temp "$dir/temp" >"$dir.build.log" 2>&1 \
  || { tail -n 40 "$dir.build.log" >&2; exit 1; }
core=$(ls "$dir"/lib/pycomm/_C*.so)
preload=$(gcc -print-file-name="$runtime")
[[ -f "$preload" ]] || { echo "sanitize.sh: gcc has no $runtime" >&2; exit 1; }
# libstdc++ too: Python does not link it, and a runtime that finds no
# __cxa_throw to wrap when it starts cannot let C++ exceptions through.
preload="$preload:$(gcc -print-file-name=libstdc++.so.6)"

logs=${PYCOMM_SANITIZE_LOGS:-$PWD/$dir/logs}
rm -rf "$logs" && mkdir -p "$logs"
# Python's allocator keeps its arenas to the end: leak checking would report
# the interpreter, not pycomm. halt_on_error: a memory error must not run on.
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:log_path=$logs/asan:verify_asan_link_order=0:${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=0:log_path=$logs/ubsan:${UBSAN_OPTIONS:-}"
# TSan sees memory accesses in pycomm only (torch and Python are not
# instrumented), but by default still counts what torch's and Python's calls
# to free, memcpy or close do, without the atomics that ordered them (a
# tensor's last reference dropped inside libc10 after a pycomm thread dropped
# its own): ignore_noninstrumented_modules leaves those calls out and keeps
# their locks. A use after free there is ASan's to find. die_after_fork=0:
# the failure tests fork ranks from processes that already run threads (as
# torch.multiprocessing's fork does), and a child must start its own.
export TSAN_OPTIONS="log_path=$logs/tsan:second_deadlock_stack=1:ignore_noninstrumented_modules=1:die_after_fork=0:suppressions=$PWD/tests/tsan.supp:${TSAN_OPTIONS:-}"
export PYCOMM_RACE_WINDOW_US=${PYCOMM_RACE_WINDOW_US:-300}
set +e
LD_PRELOAD="$preload${LD_PRELOAD:+:$LD_PRELOAD}" PYCOMM_CORE_PATH="$PWD/$core" "$PY" -m pytest -q -p no:cacheprovider "$@"
status=$?
set -e

# A runtime writes a log only to report something: every log counts.
reports=$(find "$logs" -type f -size +0 | sort)
if [[ -n "$reports" ]]; then
  echo "sanitize.sh: $(echo "$reports" | wc -l) process(es) reported (in $logs):" >&2
  for f in $reports; do echo "== $f" >&2; head -n 60 "$f" >&2; done
  exit 1
fi
echo "sanitize.sh: 0 sanitizer reports ($sanitize)" >&2
exit $status
