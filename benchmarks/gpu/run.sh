#!/usr/bin/env bash
# One call on a GPU machine: build the CUDA extension with the torch found
# there, run the CUDA tests, then the kernel benchmark. Logs go to $OUT when
# it is set (else to ./gpu-logs).
#   bash benchmarks/gpu/run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
LOG=${OUT:-gpu-logs}
mkdir -p "$LOG"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-"8.0;9.0"}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$LOG/device.txt"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$LOG/device.txt"
# The machine's own torch (no network there): no pinned install, no isolation.
SECONDS=0
PYCOMM_FORCE_CUDA=1 MAX_JOBS=${MAX_JOBS:-16} "$PY" -m pip install -q --no-build-isolation --no-deps -e . \
  > "$LOG/build.log" 2>&1 || { tail -50 "$LOG/build.log"; exit 1; }
echo "built in ${SECONDS}s"
"$PY" -c "import pycomm, pycomm._C as c; assert c.has_cuda, 'built without CUDA'; print('pycomm built with CUDA')"
# Every step under a timeout: a hang must not eat the GPU lease.
STEP_TIMEOUT=${STEP_TIMEOUT:-240}
# Every test under its own limit too (pytest-timeout, where installed).
PER_TEST=$("$PY" -c "import pytest_timeout" 2>/dev/null && echo "--timeout=${TEST_TIMEOUT:-120}")
timeout "$STEP_TIMEOUT" "$PY" -m pytest -q -m cuda -p no:cacheprovider $PER_TEST -rf ${CUDA_TESTS:-tests/test_cuda.py} 2>&1 \
  | tee "$LOG/tests.log" | tail -30
[ -n "${SKIP_BENCH:-}" ] && exit 0
timeout "$STEP_TIMEOUT" "$PY" benchmarks/gpu/kernels.py 2>&1 | tee "$LOG/kernels.log"
for w in 2 4; do
  timeout "$STEP_TIMEOUT" "$PY" benchmarks/gpu/allreduce.py --world "$w" --max-bytes $((64 << 20)) 2>&1 \
    | tee "$LOG/allreduce_$w.log"
done
