"""DeepSpeed ZeRO on pycomm and on Gloo, side by side: is the result right?

Each launch is a fresh torchrun of a small DeepSpeed training (2 ranks, its
CPU accelerator, SGD, 5 steps of ZeRO stage --stage) on one backend; each
rank then compares the trained parameters with the same steps run on every
rank's data in one process. Launches alternate between the backends; the
table counts, per backend, the launches whose result matched, differed,
held NaN/Inf, or failed. DeepSpeed is not a dependency of pycomm::

    pip install deepspeed
    python benchmarks/deepspeed_zero.py --launches 10 --stage 3
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The training each rank runs; prints one JSON line (its verdict).
RANK = r'''
import json, os, sys
os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch, torch.distributed as dist, pycomm, deepspeed

backend, stage, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
deepspeed.init_distributed(dist_backend=backend)
rank, world = dist.get_rank(), dist.get_world_size()
def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
data = [(torch.randn(8, 32, generator=torch.Generator().manual_seed(r)),
         torch.randn(8, 4, generator=torch.Generator().manual_seed(100 + r))) for r in range(world)]
config = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": stage},
          "zero_allow_untested_optimizer": True}
model = build()
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
for _ in range(steps):
    x, y = data[rank]
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()
with deepspeed.zero.GatheredParameters(list(model.parameters())):
    trained = [p.detach().clone() for p in model.parameters()]
ref = build()
opt = torch.optim.SGD(ref.parameters(), lr=0.1)
for _ in range(steps):
    opt.zero_grad()
    sum(torch.nn.functional.mse_loss(ref(x), y) for x, y in data).div(world).backward()
    opt.step()
finite = all(bool(torch.isfinite(t).all()) for t in trained)
err = max((a - b.detach()).abs().max().item() for a, b in zip(trained, ref.parameters()))
print("VERDICT " + json.dumps(dict(rank=rank, finite=finite, max_err=err if finite else None)), flush=True)
dist.destroy_process_group()
'''


def launch(script: str, backend: str, stage: int, steps: int, tol: float) -> str:
    """One fresh torchrun on `backend`: "right", "wrong", "NaN/Inf" or "failed"."""
    env = dict(os.environ, PYTHONPATH=ROOT, TORCH_CPP_LOG_LEVEL="ERROR")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        script, backend, str(stage), str(steps)],
                       env=env, capture_output=True, text=True, timeout=600)
    # (The ranks' lines may run together on torchrun's stdout.)
    verdicts = [json.loads(v) for v in re.findall(r"VERDICT (\{[^{}]*\})", p.stdout)]
    if p.returncode != 0 or len(verdicts) != 2:
        tail = (p.stderr.strip().splitlines() or ["?"])[-1]
        print(f"  {backend}: failed ({tail[:200]})", file=sys.stderr)
        return "failed"
    if not all(v["finite"] for v in verdicts):
        return "NaN/Inf"
    return "right" if max(v["max_err"] for v in verdicts) <= tol else "wrong"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--launches", type=int, default=10, help="per backend")
    ap.add_argument("--stage", type=int, default=3, choices=(0, 1, 2, 3))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--backends", default="pycomm,gloo")
    ap.add_argument("--tol", type=float, default=1e-5, help="largest parameter difference counted right")
    args = ap.parse_args()
    backends = args.backends.split(",")
    counts: Dict[str, collections.Counter] = {b: collections.Counter() for b in backends}
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "rank.py")
        with open(script, "w") as f:
            f.write(RANK)
        for i in range(args.launches):
            for b in backends:
                counts[b][launch(script, b, args.stage, args.steps, args.tol)] += 1
            print(f"launch {i + 1}: " + ", ".join(f"{b} {dict(counts[b])}" for b in backends), flush=True)
    print(f"\nDeepSpeed ZeRO stage {args.stage}, 2 ranks, {args.steps} steps, {args.launches} fresh launches each\n")
    print("| backend | right | wrong | NaN/Inf | failed |")
    print("|---|---:|---:|---:|---:|")
    for b in backends:
        c = counts[b]
        print(f"| {b} | {c['right']} | {c['wrong']} | {c['NaN/Inf']} | {c['failed']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
