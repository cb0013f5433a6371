#!/usr/bin/env bash
# Runs tests against a sanitizer build of the whole extension.
#
#   tests/sanitize.sh address [pytest args]   ASan + UBSan
#   tests/sanitize.sh thread  [pytest args]   TSan (tests/tsan.supp: torch's and Python's own internals)
#   tests/sanitize.sh address|thread --build  the build only
#
# Without test paths (options alone, such as -x, are added to them) it runs
# the failure suites: a CI-sized part of them, all of them under
# PYCOMM_LONG=1 (with ASan, 10,000 fuzzed calls and 200 kill/freeze trials
# of 8 ranks). The build lives beside the normal one
# (build/sanitize-<kind>/, incremental) and is loaded through
# PYCOMM_CORE_PATH, so the normal build is untouched. The sanitizer runtime
# is preloaded into every Python process (ranks and zygotes inherit it).
# Each report goes to a file of its process under $PYCOMM_SANITIZE_LOGS
# (default build/sanitize-<kind>/logs, emptied first); the script fails when
# pytest fails or any process reported anything. PYCOMM_RACE_WINDOW_US
# (default 300) widens the hand-overs between threads
# (csrc/core/race_window.h); 0 turns that off.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
kind=${1:-}
shift || true
case "$kind" in
  address) sanitize=address,undefined; runtime=libasan.so ;;
  thread)  sanitize=thread; runtime=libtsan.so ;;
  *) sed -n '2,6p' "$0"; exit 2 ;;
esac

dir=build/sanitize-$kind
echo "sanitize.sh: building the $sanitize build in $dir (incremental)" >&2
PYCOMM_SANITIZE=$sanitize MAX_JOBS=${MAX_JOBS:-2} "$PY" setup.py -q build_ext \
  --build-lib "$dir/lib" --build-temp "$dir/temp" >"$dir.build.log" 2>&1 \
  || { tail -n 40 "$dir.build.log" >&2; exit 1; }
[[ "${1:-}" == --build ]] && exit 0
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
# TSan turns itself off in a child forked from a process that runs threads:
# the failure tests' ranks are spawned instead (tests/reliability_cases.py).
[[ $kind == thread ]] && export PYCOMM_RANK_START=${PYCOMM_RANK_START:-spawn}

only_options=1
for a in "$@"; do [[ $a == -* ]] || only_options=0; done
if [[ $only_options == 1 ]]; then
  # The failure suites. Left out: trainings whose accuracy bound assumes an
  # uninstrumented build's speed (a deadline average drops more late
  # contributions when every rank runs 5-15x slower) and the pipeline's
  # numerics; kept: every error, kill, freeze, shrink and fuzz test.
  if [[ ${PYCOMM_LONG:-} == 1 ]]; then
    set -- "$@" tests/test_errors.py tests/test_reliability.py tests/test_elastic.py tests/test_ft_ddp.py \
      tests/test_ft_pipeline.py tests/test_registered.py tests/test_straggler.py tests/test_pipeline.py \
      tests/test_multihost.py -k "not convergence and (not test_pipeline or errors or raises or abort_ends \
      or two_hosts or larger_than) and (not test_multihost or abort_fails or killed_rank or late_peer)"
    if [[ $kind == address ]]; then
      export PYCOMM_FUZZ_EXAMPLES=${PYCOMM_FUZZ_EXAMPLES:-10000} PYCOMM_TRIALS_8=${PYCOMM_TRIALS_8:-200}
    fi
  else
    # CI: every error test, the kill, freeze, shrink, mismatch, soak and fuzz
    # tests at CI's counts, deaths inside a bootstrap, a pipeline stage that
    # raises, an abort's last message between hosts, an abort's mark on
    # the heartbeat board (66 tests, ~5 minutes; the fault-tolerant DDP and
    # pipeline trainings and the other simulated hosts are left to PYCOMM_LONG).
    set -- "$@" tests/test_errors.py tests/test_reliability.py tests/test_elastic.py tests/test_registered.py \
      tests/test_pipeline.py tests/test_multihost.py -k "test_errors or peer_death_random or 8_ranks or fuzzed \
      or mismatch_matrix or soak or survivors_shrink or frozen_rank_is_declared or second_death or busy_rank \
      or newcomer_that_fails or before_attaching or abort_fails_every_host \
      or kill_9_with_registered or (test_pipeline and (raises or abort_ends) and not two_hosts)"
  fi
fi
set +e
LD_PRELOAD="$preload${LD_PRELOAD:+:$LD_PRELOAD}" PYCOMM_CORE_PATH="$PWD/$core" "$PY" -m pytest -q -p no:cacheprovider "$@"
status=$?
set -e

# A runtime writes a log only to report something: every log counts, but
# one. TSan keeps the threads of a forked child's parent in its registry and
# turns itself off in that child; when the child starts a thread at an
# address one of those used, it says "dup thread with used id" and nothing
# else: a line about its own bookkeeping, in a process it does not check.
if [[ $kind == thread ]]; then
  for f in $(grep -L -v "ThreadSanitizer: dup thread with used id" $(find "$logs" -type f -size +0) /dev/null 2>/dev/null); do
    [[ $f == /dev/null ]] && continue
    echo "sanitize.sh: TSan's registry after fork (not a report): $(cat "$f")" >&2
    rm -f "$f"
  done
fi
reports=$(find "$logs" -type f -size +0 | sort)
if [[ -n "$reports" ]]; then
  echo "sanitize.sh: $(echo "$reports" | wc -l) process(es) reported (in $logs):" >&2
  for f in $reports; do echo "== $f" >&2; head -n 60 "$f" >&2; done
  exit 1
fi
echo "sanitize.sh: 0 sanitizer reports ($sanitize)" >&2
exit $status
