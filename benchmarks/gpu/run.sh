#!/usr/bin/env bash
# The GPU part of the project in one call on a GPU machine, stage by stage:
#   bash benchmarks/gpu/run.sh                # every stage, in this order
#   bash benchmarks/gpu/run.sh tests mps      # only these (the build is kept
#                                             # between calls on a warm machine)
#   BUDGET=570 bash benchmarks/gpu/run.sh build tests crash mps   # within 570 s
# Stages:
#   build      the CUDA extension with the torch found there
#   tests      the CUDA tests (tests/test_cuda.py and the docs' CUDA examples,
#              TESTS_TIMEOUT s in all, default 420;
#              CUDA_TESTS= to narrow them)
#   kernels    the kernel benchmark against the device's copy bandwidth, in
#              KERNEL_LAUNCHES fresh processes (default 3), summarized,
#              and one on tensors one element off (KERNEL_OFFSET=0: not)
#   profile    Nsight Compute's view of pycomm's memory-bound kernels (speed of
#              light, memory workload, occupancy, launch) on 16M elements:
#              what to read before changing a kernel (ncu.txt)
#   overlap    DDP on CUDA with int8_hook under torch.profiler: pycomm's
#              kernels' share of a step and their overlap with the backward
#              on another stream (benchmarks/gpu/overlap_trace.py; the trace
#              lands with the logs)
#   allreduce  IPC all-reduce (one-shot, two-shot, ring, tree, quantized;
#              double-buffered one-shot and two-shot) against gloo, 2 and 4
#              processes sharing the GPU (ALLREDUCE_RAN, ALLREDUCE_NEW: the
#              two runs' algorithms)
#   mps        the same with CUDA MPS (processes' kernels run at the same
#              time), then NCCL's all-reduce under MPS, each rank a testbed
#              host (MPS_NCCL_WORLDS, default 2 4; none if set empty); the
#              daemon is stopped again afterwards
#   nccl       NCCL with ranks sharing the GPU, each in a network namespace of
#              its own with its own NCCL_HOSTID (benchmarks/gpu/nccl_one_gpu.py
#              at NCCL_WORLDS ranks, default 2 4, none if set empty: NCCL's answer, the group
#              path's bits, every hook); if it runs,
#              DDP on CUDA over NCCL on the 4-host testbed, NCCL_RATES
#              (default 1gbit 10gbit) x NCCL_LAUNCHES (default 3) fresh launches
#   tta        time to accuracy at 1 Gbit/s on the 4-host testbed with a core
#              per rank (issue 39's last target; TTA_LAUNCHES, TTA_CONFIGS,
#              TTA_TIMEOUT s in all, default 540; TTA_ARGS: more options)
#   tta_bg     the same in the background on cores of its own (the last
#              TTA_CORES, default 4: a core per rank), while the stages after
#              it run on the other cores: the CPU-only benchmark shares a
#              call with the correctness stages instead of needing one of its
#              own. Start it after build; it is waited for at tta_wait (or
#              at the end). Put the GPU timing stages (mps, allreduce,
#              kernels) after tta_wait: they measure host-side latency too.
#   crash      the CPU failure suites (kill -9, timeouts, aborts) on this
#              machine's torch and cores, with faulthandler and core dumps
#              (backtraces by cuda-gdb, the debugger there)
# The testbed's stages need ip and tc: carry .iproute (pack_iproute.sh) in
# case the image lacks them.
# Logs go to ./gpu-logs; with $OUT set (the device tool), to a folder packed
# into $OUT/gpu-logs.tgz after every stage (one file: few come back). Every
# stage, and every test, runs under a timeout: a hang must not eat the lease.
set -uo pipefail
cd "$(dirname "$0")/../.."
LOG=${OUT:+/tmp/gpu-logs}
LOG=${LOG:-gpu-logs}
mkdir -p "$LOG"
pack() { [ -n "${OUT:-}" ] && tar czf "$OUT/gpu-logs.tgz" -C "$LOG" . ; return 0; }
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
# The lent machines are Hopper (H100, H200): one target halves nvcc's time.
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-"9.0"}
STEP_TIMEOUT=${STEP_TIMEOUT:-240}
# BUDGET (seconds, optional): the whole call's limit. Every step's timeout is
# cut to what is left of it (10 s kept to pack the logs), and a stage that
# would start with under 40 s left is skipped: the call returns, logs packed,
# before the device tool's limit kills it. Set it a little under the call's
# timeout_s.
cap() {
  local want=$1
  [ -n "${BUDGET:-}" ] || { echo "$want"; return; }
  local left=$((BUDGET - SECONDS - 10))
  [ "$left" -lt "$want" ] && want=$left
  [ "$want" -lt 5 ] && want=5
  echo "$want"
}
# Every test under its own limit too (pytest-timeout, where installed).
PER_TEST=$("$PY" -c "import pytest_timeout" 2>/dev/null && echo "--timeout=${TEST_TIMEOUT:-120}")
STAGES=${*:-build tests kernels profile overlap allreduce mps nccl crash tta}
# The testbed (nccl, tta) needs ip and tc; an image without iproute2 gets the
# ones packed by pack_iproute.sh, when the call carried them.
if ! { command -v ip && command -v tc; } >/dev/null && [ -x .iproute/bin/ip ]; then
  export PATH="$PWD/.iproute/bin:$PATH"
  echo "ip and tc from .iproute (the image has no iproute2)"
fi

build() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$LOG/device.txt"
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$LOG/device.txt"
  # The machine's own torch (no network there): no pinned install, no isolation.
  local t0=$SECONDS
  PYCOMM_FORCE_CUDA=1 MAX_JOBS=${MAX_JOBS:-16} "$PY" -m pip install -q --no-build-isolation --no-deps -e . \
    > "$LOG/build.log" 2>&1 || { tail -50 "$LOG/build.log"; return 1; }
  echo "built in $((SECONDS - t0))s" | tee -a "$LOG/device.txt"
  # The extension must share torch's C++ runtime (setup.py says why); record
  # what the toolchain would have linked on its own. (Should the link fail
  # against torch's runtime, PYCOMM_CXX_RUNTIME=toolchain is the old way, and
  # tests/test_build.py then says what it costs.)
  echo "the compiler's libstdc++.so: $(c++ -print-file-name=libstdc++.so)" | tee -a "$LOG/device.txt"
  "$PY" -m pytest -q -p no:cacheprovider tests/test_build.py 2>&1 | tail -3
}

tests() {
  "$PY" -c "import pycomm, pycomm._C as c; assert c.has_cuda, 'built without CUDA'; print('pycomm built with CUDA')" \
    || return 1
  # A sticky CUDA error skips the in-process CUDA tests after it (conftest.py
  # lists them in $rerun): up to 3 more passes, each in a fresh process.
  local rerun="$LOG/cuda_rerun.txt" pass=1 ids
  # cuda_pytest LIMIT_S ARGS...: one pass, appended to tests.log.
  cuda_pytest() {
    PYCOMM_CUDA_RERUN=$rerun timeout "$(cap "$1")" "$PY" -m pytest -q -m cuda -p no:cacheprovider $PER_TEST -rfs \
      "${@:2}" 2>&1 | tee -a "$LOG/tests.log" | tail -30
  }
  : > "$rerun"
  : > "$LOG/tests.log"
  cuda_pytest "${TESTS_TIMEOUT:-420}" --durations=15 ${CUDA_TESTS:-tests/test_cuda.py tests/test_docs.py}
  while [ -s "$rerun" ] && [ "$pass" -lt 4 ]; do
    pass=$((pass + 1))
    mapfile -t ids < "$rerun"
    : > "$rerun"
    echo "=== tests, pass $pass: ${#ids[@]} skipped after a sticky CUDA error, in a fresh process" \
      | tee -a "$LOG/tests.log"
    cuda_pytest 240 "${ids[@]}"
  done
}

# The SM clock and why it is held back, before and after a timing stage: the
# kernels bound by instruction issue (quantize, dequantize) follow the SM
# clock, the copy they are measured against does not (on 2026-11-27 they
# ran 15-20 % under the lease before at the same copy rate).
clocks() {
  nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv,noheader | sed "s/^/# clocks $1: sm, max sm, mem, power, temperature, throttle: /" \
    | tee -a "$LOG/clocks.txt"
}

kernels() {
  # KERNEL_LAUNCHES fresh processes (default 3), then min / median / max.
  local i logs=()
  for i in $(seq "${KERNEL_LAUNCHES:-3}"); do
    clocks "before kernels $i"
    timeout "$(cap "$STEP_TIMEOUT")" "$PY" benchmarks/gpu/kernels.py 2>&1 | tee "$LOG/kernels_$i.log"
    logs+=("$LOG/kernels_$i.log")
  done
  # The same tensors one element off: the one-element-a-lane kernels
  # beside the runs of 4 (one launch, not summarized; KERNEL_OFFSET=0: none).
  if [ "${KERNEL_OFFSET:-1}" = 1 ]; then
    timeout "$(cap "$STEP_TIMEOUT")" "$PY" benchmarks/gpu/kernels.py --offset 2>&1 | tee "$LOG/kernels-offset.log"
  fi
  clocks "after kernels"
  "$PY" benchmarks/gpu/kernels.py --summarize "${logs[@]}" | tee "$LOG/kernels.log"
}

profile() {
  # One pass per kernel (its demangled name matched), each with its own
  # launch count: in one shared count the first kernels of kernels.py (the
  # quantize kernel's warm-up and repeats) used it all up.
  local sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats"
  # Demangled names spell template arguments as "(int)8" and "(bool)1", and
  # SumValue has a second argument: patterns match a prefix (on 2026-11-27
  # all but the first matched nothing).
  # The fused IPC kernel in its group of one rank (kernels.py's last line);
  # the plain reduce kernel, at its target, is left out.
  local kernels=("InputValue<float>" "SumValue<float" "dequantize_warp_kernel<(\\(int\\))?8, float"
                 "dequantize_warp_kernel<(\\(int\\))?8, .*BFloat16" "ipc_quantized_kernel"
                 "histogram_kernel" "range_count_kernel|kept_write_kernel|gather_kernel|tie_cutoff_kernel")
  : > "$LOG/ncu.txt"
  for k in "${kernels[@]}"; do
    timeout "$(cap 60)" ncu --clock-control none --kernel-name-base demangled --kernel-name "regex:$k" \
      --launch-count 3 $sections "$PY" benchmarks/gpu/kernels.py --elems $((16 << 20)) --repeats 1 \
      >> "$LOG/ncu.txt" 2>&1
  done
  grep -E "^  [A-Za-z_:<> ]*[Kk]ernel|^  void|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Duration|Registers Per" \
    "$LOG/ncu.txt" | head -150
}

overlap() {
  timeout "$(cap "$STEP_TIMEOUT")" "$PY" benchmarks/gpu/overlap_trace.py --out "$LOG" 2>&1 | tee "$LOG/overlap.log"
}

allreduce() {
  local tag=${1:-} w
  # Two runs per world: the kernels that ran on a GPU before, then those
  # changed since and not yet run (the fused quantized kernel on its new
  # grid and on the old one), so that a failure among the new ones (a sweep
  # stops at its first) leaves the others' rows whole.
  # int8_g<blocks>: the fused kernel on the grid it had before it sized its
  # grid by the GPU (the group's blocks: 144 / world), beside the default.
  local ran=${ALLREDUCE_RAN:-one_shot,two_shot,one_shot_db,two_shot_db,ring,tree,int8_split,gloo} new
  for w in 2 4; do
    new=${ALLREDUCE_NEW:-int8,int4,int8_g$((144 / w))}
    timeout "$(cap "$STEP_TIMEOUT")" "$PY" benchmarks/gpu/allreduce.py --world "$w" --max-bytes $((256 << 20)) \
      --algorithms "$ran" 2>&1 | tee "$LOG/allreduce_${w}${tag}.log"
    timeout "$(cap "$STEP_TIMEOUT")" "$PY" benchmarks/gpu/allreduce.py --world "$w" --max-bytes $((256 << 20)) \
      --algorithms "$new" 2>&1 | tee "$LOG/allreduce_${w}${tag}_new.log"
  done
}

mps() {
  # MPS needs root and a GPU in the default compute mode; say so when it
  # does not start, and never leave the daemon running.
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if ! nvidia-cuda-mps-control -d 2>&1 | tee "$LOG/mps.log"; then
    echo "MPS did not start" | tee -a "$LOG/mps.log"
    return 1
  fi
  allreduce _mps
  # NCCL under MPS too, each rank a testbed host (issue 42: "against NCCL
  # where it runs"): its socket transport, not the GPU's memory.
  local hosts
  for hosts in ${MPS_NCCL_WORLDS-2 4}; do
    timeout "$(cap 90)" "$PY" benchmarks/multihost/testbed.py --hosts "$hosts" --timeout 70 -- \
      benchmarks/gpu/nccl_one_gpu.py --timing 2>&1 | tee "$LOG/nccl_mps_$hosts.log" | grep -v "^W1\|^\*\*\*"
  done
  echo quit | nvidia-cuda-mps-control
  cat "$CUDA_MPS_LOG_DIRECTORY"/control.log >> "$LOG/mps.log" 2>/dev/null
}

nccl() {
  local tb=benchmarks/multihost/testbed.py
  # Issue 41 asks for 2 and 4 ranks (each a host of its own).
  for hosts in ${NCCL_WORLDS-2 4}; do
    timeout "$(cap "$STEP_TIMEOUT")" "$PY" "$tb" --hosts "$hosts" --timeout $((STEP_TIMEOUT - 20)) -- \
      benchmarks/gpu/nccl_one_gpu.py 2>&1 | tee "$LOG/nccl_$hosts.log" | grep -v "^W1\|^\*\*\*"
    grep -q "NCCL RAN" "$LOG/nccl_$hosts.log" || { echo "NCCL did not run: see nccl_$hosts.log"; return 1; }
  done
  for rate in ${NCCL_RATES:-1gbit 10gbit}; do
    for launch in $(seq "${NCCL_LAUNCHES:-3}"); do
      timeout "$(cap "$STEP_TIMEOUT")" "$PY" "$tb" --hosts 4 --rate "$rate" --timeout $((STEP_TIMEOUT - 20)) -- \
        benchmarks/ddp_hooks.py e2e --device cuda --backend cpu:gloo,cuda:nccl --steps "${NCCL_STEPS:-12}" \
        --configs gloo,torch-bf16,torch-powersgd,int8,topk,stale1-int8 --json "$LOG/nccl_ddp_${rate}_${launch}.json" \
        2>&1 | tee "$LOG/nccl_ddp_${rate}_${launch}.log" | grep -v "^W1\|^\*\*\*"
    done
  done
  # min / median / max over the launches, per rate
  "$PY" benchmarks/ddp_hooks.py summarize "$LOG"/nccl_ddp_*.json 2>&1 | tee "$LOG/nccl_ddp_summary.md"
}

tta() {
  # Three launches of eight configs: more than one step's limit. With a core
  # per rank the backward pass no longer competes with the transfers, so
  # DDP's two buckets and buckets of 0.5 MB (both sides: torch's bf16 too)
  # may hide all but the last bucket's transfer behind it.
  timeout "$(cap "${TTA_TIMEOUT:-540}")" "$PY" benchmarks/time_to_accuracy.py --launches "${TTA_LAUNCHES:-3}" --rates 1gbit \
    --out "$LOG/tta" --configs "${TTA_CONFIGS:-ddp,torch-bf16,torch-bf16-1b,torch-bf16-bc0.5,int8-1b,int4-b64-noef-1b,int4-b64-noef,int4-b64-noef-bc0.5}" \
    ${TTA_ARGS:-} 2>&1 | tee "$LOG/tta.log" | tail -25
}

TTA_PID=
tta_bg() {
  local n cores first
  n=$(nproc)
  cores=${TTA_CORES:-4}
  if ! command -v taskset > /dev/null; then
    echo "tta_bg: no taskset here to give the background run cores of its own; use the tta stage"
    return 1
  fi
  if [ "$n" -le "$cores" ]; then
    echo "tta_bg: $n cores, none left beside the $cores for the background run; use the tta stage"
    return 1
  fi
  first=$((n - cores))
  # Children inherit their parent's CPUs: this shell (and every later stage)
  # moves to the first cores, the background run to the last ones.
  taskset -pc "0-$((first - 1))" $$ > /dev/null
  ( taskset -pc "$first-$((n - 1))" "$BASHPID" > /dev/null; tta ) > "$LOG/tta_bg.out" 2>&1 &
  TTA_PID=$!
  echo "time to accuracy started in the background on cores $first-$((n - 1)); the next stages run on 0-$((first - 1))"
}

tta_wait() {
  [ -n "$TTA_PID" ] || { echo "tta_wait: no background time-to-accuracy run (tta_bg) to wait for"; return 0; }
  wait "$TTA_PID"  # bounded: its own timeout was cut to the budget when it started
  TTA_PID=
  taskset -pc "0-$(($(nproc) - 1))" $$ > /dev/null
  cat "$LOG/tta_bg.out"
}

crash() {
  ulimit -c unlimited
  mkdir -p /tmp/cores
  echo "/tmp/cores/core.%e.%p" > /proc/sys/kernel/core_pattern 2>/dev/null || echo "(core_pattern not writable)"
  PYTHONFAULTHANDLER=1 timeout "$(cap "$STEP_TIMEOUT")" "$PY" -m pytest -q -p no:cacheprovider $PER_TEST -rf \
    ${CRASH_TESTS:-tests/test_reliability.py tests/test_errors.py} 2>&1 | tee "$LOG/crash.log" | tail -30
  for c in /tmp/cores/core.*; do
    [ -e "$c" ] || continue
    timeout "$(cap 60)" cuda-gdb -batch -ex "thread apply all bt" "$(command -v "$PY")" "$c" > "$LOG/bt_$(basename "$c").txt" 2>&1
    rm -f "$c"
  done
}

for stage in $STAGES; do
  if [ -n "${BUDGET:-}" ] && [ $((BUDGET - SECONDS)) -lt 40 ]; then
    echo "=== $stage skipped: $((BUDGET - SECONDS)) s of the budget left"
    continue
  fi
  echo "=== $stage"
  case $stage in
    build | tests | kernels | profile | overlap | allreduce | mps | nccl | tta | tta_bg | tta_wait | crash)
      "$stage" || [ "$stage" != build ] || { pack; exit 1; } ;;
    *) echo "unknown stage $stage (build tests kernels profile overlap allreduce mps nccl tta tta_bg tta_wait crash)"
       exit 2 ;;
  esac
  pack
done
if [ -n "$TTA_PID" ]; then
  echo "=== tta_wait (the background run)"
  tta_wait
  pack
fi
