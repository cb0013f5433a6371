#!/usr/bin/env bash
# Reproduces the foundation numbers in benchmarks/RESULTS.md (CPU, shared memory).
# Run alone on the machine: every figure is a ratio measured side by side, but
# a second job still skews both sides.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench-results}
mkdir -p "$out"
./dev build
python benchmarks/memcpy_reference.py | tee "$out/memcpy.txt"
for n in 2 4 8; do
  pycomm-bench --nproc "$n" -b 1K -e 64M -f 4 --json "$out/allreduce_$n.json" --plot "$out/allreduce_$n.png" | tee "$out/allreduce_$n.txt"
done
for c in reduce_scatter all_gather broadcast; do
  pycomm-bench --nproc 2 -c "$c" -b 1K -e 64M -f 16 --json "$out/${c}_2.json" | tee "$out/${c}_2.txt"
done
# The 64 MiB point repeated: its spread is the machine's (see RESULTS.md).
for i in 1 2 3; do
  pycomm-bench --nproc 2 -b 64M -e 64M -n 10 | tail -n 3 | tee -a "$out/allreduce_2_64M_repeats.txt"
done
