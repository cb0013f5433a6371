"""NCCL with several ranks on one GPU: each rank in a network namespace of
its own (benchmarks/multihost/testbed.py), which gives it an NCCL_HOSTID of its
own, so that NCCL takes it for a host of its own (it refuses two ranks on one GPU of
one host); peer-to-peer and shared memory off, the socket transport only.

    python benchmarks/multihost/testbed.py --hosts 2 --timeout 200 -- benchmarks/gpu/nccl_one_gpu.py

1. An NCCL all-reduce: prints "NCCL RAN" (and whether the sum is right), or
   "NCCL REFUSED: <its message>" and stops.
   Then its time per all-reduce of float32 sums of 4 KB, 64 KB and 1 MB
   (nccl-tests' way: calls back to back between CUDA events, the slowest
   rank's median of 3 batches): what "against NCCL where it runs" can mean
   here, NCCL over the testbed's sockets and link rate, not over the GPU's
   memory as the IPC kernels are (benchmarks/gpu/allreduce.py).
2. pycomm.GroupCommunicator on NCCL (CUDA tensors) against the same on Gloo
   (CPU tensors, which equals pycomm's CPU path bit for bit: tests/test_group.py)
   over 3 steps with error feedback: outputs and residuals, bit for bit.
3. Every DDP hook on a CUDA model over NCCL against DDP without a hook: the
   relative error of the summed gradients, and every rank's gradients the same.
Rank 0 prints one line per check; the exit code is 0 when everything held.
``--cpu``: steps 2 and 3 on CPU tensors over Gloo (no GPU: checks the script).
``--timing``: step 1 only, timed from 4 KB to 64 MB (benchmarks/gpu/run.sh's
mps stage runs it under CUDA MPS, beside the IPC kernels' sweep).
"""
import hashlib
import os
import sys

# NCCL reads these when it starts: before torch.distributed does. (The
# testbed gives each host its NCCL_HOSTID and the socket interface.)
for _k, _v in (("NCCL_P2P_DISABLE", "1"), ("NCCL_SHM_DISABLE", "1"), ("NCCL_DEBUG", "WARN")):
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import pycomm  # noqa: E402
from pycomm import hooks  # noqa: E402


def say(rank, msg):
    if rank == 0:
        print(msg, flush=True)


def bits(t):
    return hashlib.sha1(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def nccl_runs(rank, world):
    x = torch.full((1 << 20,), float(rank + 1), device="cuda")
    try:
        dist.all_reduce(x)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - what NCCL said is the result
        print(f"rank {rank}: NCCL REFUSED: {e}", flush=True)
        return False
    right = bool((x == world * (world + 1) / 2).all())
    print(f"rank {rank}: NCCL RAN, all_reduce {'right' if right else 'WRONG'}", flush=True)
    return right


def nccl_timing(rank, world, sizes=(4 << 10, 64 << 10, 1 << 20)):
    from timing import batch_median_ms, slowest  # beside this script

    mps = "MPS" if os.environ.get("CUDA_MPS_PIPE_DIRECTORY") else "no MPS"
    say(rank, f"# NCCL all-reduce, float32 sum, {mps}; busbw as nccl-tests counts it; #wrong: rank r adds r + 1")
    say(rank, f"{'size':>11} | {'NCCL us':>9} {'busbw GB/s':>10} {'#wrong':>6}")
    want = world * (world + 1) / 2
    for size in sizes:
        x = torch.ones(size // 4, device="cuda")
        t = slowest(batch_median_ms(lambda: dist.all_reduce(x), 10, 3, before=dist.barrier) / 1e3)
        x.fill_(rank + 1)
        dist.all_reduce(x)
        wrong = int((x != want).sum())
        say(rank, f"{size:>11} | {t * 1e6:9.1f} {size / t / 1e9 * 2 * (world - 1) / world:10.3f} {wrong:>6}")


DEV = "cpu" if "--cpu" in sys.argv else "cuda"


def group_path_bits(rank, world):
    """GroupCommunicator on NCCL against GroupCommunicator on Gloo over CPU tensors."""
    nccl_group = dist.new_group(backend="nccl" if DEV == "cuda" else "gloo")
    gloo_group = dist.new_group(backend="gloo")
    ok = True
    codecs = {"int8": pycomm.Int8(), "int8_b64_stoch": pycomm.Int8(block=64, stochastic=True, seed=5),
              "int4": pycomm.Int4(), "topk": pycomm.TopK(0.05, exact=True)}
    for name, codec in codecs.items():
        gpu, cpu = pycomm.GroupCommunicator(nccl_group), pycomm.GroupCommunicator(gloo_group, backend="gloo")
        ef_gpu, ef_cpu = pycomm.compression.ErrorFeedback(), pycomm.compression.ErrorFeedback()
        bad = []
        for step in range(3):
            g = torch.Generator().manual_seed(1000 * step + 31 * rank)
            x = torch.randn(70001, generator=g) * (1 + rank)
            a, b = x.clone(), x.to(DEV)
            cpu.all_reduce(a, op="avg", compression=codec, error_feedback=ef_cpu, key="k")
            gpu.all_reduce(b, op="avg", compression=codec, error_feedback=ef_gpu, key="k", async_op=True) \
                .get_future().wait()
            if DEV == "cuda":
                torch.cuda.synchronize()
            if bits(a) != bits(b):
                bad.append(f"step {step} output")
            if bits(ef_cpu.get("k").worker) != bits(ef_gpu.get("k").worker):
                bad.append(f"step {step} worker residual")
        ok = ok and not bad
        say(rank, f"group path on NCCL vs Gloo/CPU, {name}: {'same bits' if not bad else 'DIFFERS: ' + ', '.join(bad)}")
    return ok


def every_hook(rank, world):
    bounds = {"allreduce": 1e-6, "bf16": 1e-2, "int8": 2e-2, "int4": 0.25, "topk": 0.8, "powersgd": 0.6,
              "stale": None}
    ok = True
    for name, bound in bounds.items():
        def make():  # the same parameters for both
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.Linear(32, 96), torch.nn.Tanh(), torch.nn.Linear(96, 8)).to(DEV)

        ref, ours = DDP(make(), bucket_cap_mb=0.002), DDP(make(), bucket_cap_mb=0.002)
        state = {"allreduce": lambda: hooks.AllReduceState(), "bf16": lambda: hooks.AllReduceState(
                 wire_dtype=torch.bfloat16), "int8": lambda: hooks.CompressionState(codec=pycomm.Int8(), start_iter=0),
                 "int4": lambda: hooks.CompressionState(codec=pycomm.Int4(), start_iter=0),
                 "topk": lambda: hooks.CompressionState(codec=pycomm.TopK(0.25), start_iter=0),
                 "powersgd": lambda: hooks.PowerSGDState(rank=2, start_iter=2),
                 "stale": lambda: hooks.StaleState(staleness=1)}[name]()
        hook = {"allreduce": hooks.allreduce_hook, "bf16": hooks.allreduce_hook, "int8": hooks.int8_hook,
                "int4": hooks.int4_hook, "topk": hooks.topk_hook, "powersgd": hooks.powersgd_hook,
                "stale": hooks.stale_hook}[name]
        ours.register_comm_hook(state, hook)
        gen = torch.Generator().manual_seed(2000 + rank)
        sums = [0, 0]
        for _ in range(4):
            x, y = torch.randn(16, 32, generator=gen).to(DEV), torch.randn(16, 8, generator=gen).to(DEV)
            for i, m in enumerate((ref, ours)):
                m.zero_grad(set_to_none=True)
                torch.nn.functional.mse_loss(m(x), y).backward()
                sums[i] = sums[i] + torch.cat([p.grad.reshape(-1) for p in m.parameters()]).double()
        digest = torch.tensor(list(bytes.fromhex(bits(sums[1]))[:8]), dtype=torch.int64, device=DEV)
        digests = [torch.empty_like(digest) for _ in range(world)]
        dist.all_gather(digests, digest)
        same = all(torch.equal(d, digests[0]) for d in digests)
        err = ((sums[1] - sums[0]).norm() / sums[0].norm()).item()
        good = same and (bound is None or err <= bound)
        ok = ok and good
        say(rank, f"hook {name} on NCCL: rel err {err:.2e} (bound {bound}), ranks {'agree' if same else 'DIFFER'}, "
                  f"routes {state.routes()}{'' if good else '  <- FAILED'}")
        del ref, ours
    return ok


def main():
    if DEV == "cpu":
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        say(rank, f"# {world} ranks, CPU tensors over Gloo (--cpu: the script's own check)")
    else:
        torch.cuda.set_device(0)
        dist.init_process_group("cpu:gloo,cuda:nccl")
        rank, world = dist.get_rank(), dist.get_world_size()
        say(rank, f"# {world} ranks on one {torch.cuda.get_device_name()}, NCCL_HOSTID per rank, socket transport; "
                  f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
        if not nccl_runs(rank, world):
            raise SystemExit(3)
        if "--timing" in sys.argv:
            nccl_timing(rank, world, sizes=[4 << (2 * k + 10) for k in range(8)])  # 4 KB to 64 MB
            dist.destroy_process_group()
            return
        nccl_timing(rank, world)
    ok = group_path_bits(rank, world)
    ok = every_hook(rank, world) and ok
    dist.destroy_process_group()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
