"""Compression kernels and compressed all-reduce, measured side by side.

    python benchmarks/compression_kernels.py [--size 64M] [--repeats 5] [--skip-allreduce] [--only PART]

1. Kernel throughput on one thread (GB/s of float32 input), next to a plain
   copy of the same tensor measured in the same run.
2. Top-k of 1% of 16M float32: pycomm (approximate, exact) vs torch.topk;
   then the approximate selection on structured tensors (a linear layer's
   weight gradient, rows with outlier columns) over many seeds: how often its
   sample's threshold missed the window [k, k (1 + tolerance)].
3. Compressed ring vs direct (gather-then-reduce) reduction, 8 simulated
   ranks in one process: error against float64 and kernel time per rank.
4. 2-rank all-reduce of the tensor: uncompressed pycomm vs Int8 / Int4 /
   TopK(0.01), time and bytes on the wire, in one run.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import pycomm  # noqa: E402
from pycomm import compression as C  # noqa: E402
from pycomm._env import parse_size  # noqa: E402


def timed(fn, repeats):
    fn()  # warm-up: first touch of outputs, code paths
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def kernels(n, repeats):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g)
    nbytes = n * 4
    res = torch.zeros(n)
    y = torch.empty_like(x)
    print(f"## Kernels, one thread, {nbytes / 2**20:.0f} MiB float32 (median of {repeats})\n")
    print("| kernel | time (ms) | GB/s of float32 input |")
    print("|---|---:|---:|")
    # The operators allocate their outputs: fresh pages cost first-touch
    # faults, which dequantize (64 MiB out) shows; dequantize-accumulate
    # writes into an existing tensor and shows the kernel alone.
    rows = [
        ("copy (reference: torch copy_)", lambda: y.copy_(x)),
        ("int8 quantize", lambda: C.quantize(x, 8)),
        ("int8 quantize + error feedback", lambda: C.quantize(x, 8, residual=res)),
        ("int8 quantize + EF, stochastic", lambda: C.quantize(x, 8, residual=res, stochastic=True)),
        ("int4 quantize + error feedback", lambda: C.quantize(x, 4, residual=res)),
    ]
    q8 = C.quantize(x, 8)
    q8b = C.quantize(x * 0.5, 8)
    rows += [
        ("int8 dequantize", lambda: C.dequantize(q8)),
        ("int8 dequantize-accumulate", lambda: C.dequantize_accumulate(y, q8)),
        ("int8 dequant-reduce-requant (2 sources)", lambda: C.dequant_reduce_requant([q8, q8b])),
    ]
    for name, fn in rows:
        t = timed(fn, repeats)
        print(f"| {name} | {t * 1e3:.1f} | {nbytes / t / 1e9:.2f} |")
    print()


def topk(repeats):
    n = 16 << 20
    k = n // 100
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, generator=g)
    res = torch.zeros(n)
    print(f"## Top-k, k = 1% of {n} float32, one thread (median of {repeats})\n")
    print("| method | time (ms) | vs torch.topk | kept |")
    print("|---|---:|---:|---:|")
    t_torch = timed(lambda: torch.topk(x.abs(), k, sorted=False), repeats)
    rows = [
        ("torch.topk(x.abs(), k)", t_torch, k),
        ("pycomm approximate", timed(lambda: C.topk(x, k), repeats), C.topk(x, k).values.numel()),
        ("pycomm approximate + error feedback", timed(lambda: C.topk(x, k, residual=res), repeats), None),
        ("pycomm exact", timed(lambda: C.topk(x, k, exact=True), max(1, repeats // 2)), k),
    ]
    for name, t, kept in rows:
        print(f"| {name} | {t * 1e3:.1f} | {t_torch / t:.1f}x | {kept if kept is not None else '-'} |")
    exact = C.topk(x, k, exact=True)
    approx = C.topk(x, k)
    mass = approx.values.double().pow(2).sum() / exact.values.double().pow(2).sum()
    print(f"\napproximate keeps {approx.values.numel()} entries ({approx.values.numel() / k:.3f} k), "
          f"{mass:.4f} of the exact top-k's L2 mass\n")


def structured_tensors(n):
    """Gradient-like tensors of n elements with structure along their rows."""
    g = torch.Generator().manual_seed(3)
    cols = 4096
    features = torch.randn(32, cols, generator=g)
    features[:, torch.randperm(cols, generator=g)[:20]] *= 30  # outlier features
    delta = torch.randn(32, n // cols, generator=g) * torch.rand(32, 1, generator=g)
    linear = (delta.t() @ features).reshape(-1).contiguous()  # batch 32's weight gradient
    rows = torch.randn(n // 1024, 1024, generator=g)
    rows[:, 5::128] *= 20  # 8 outlier columns in 1024, one in every 128
    return [("random", torch.randn(n, generator=g)),
            (f"linear layer's gradient, {n // cols} x {cols}, 20 outlier features", linear),
            ("rows of 1024, every 128th column 20x", rows.reshape(-1))]


def topk_structure(seeds):
    n = 16 << 20
    k = n // 100
    print(f"## Top-k's sample on structured tensors, k = 1% of {n} float32, {seeds} seeds, one thread\n")
    print("A call whose sample's threshold misses [k, 1.1 k] keeps exactly k (cut down, or passed again).\n")
    print("| tensor | sample_fraction | outside the window | kept / k, mean | time (ms) median / max |")
    print("|---|---:|---:|---:|---|")
    for name, x in structured_tensors(n):
        for fraction in (0.01, 1 / 128):
            C.topk(x, k, sample_fraction=fraction)
            kept, ts = [], []
            for seed in range(seeds):
                t0 = time.perf_counter()
                kept.append(C.topk(x, k, sample_fraction=fraction, seed=seed).values.numel())
                ts.append(time.perf_counter() - t0)
            print(f"| {name} | {fraction:.4g} | {sum(v == k for v in kept)} of {seeds} | "
                  f"{statistics.mean(kept) / k:.3f} | {statistics.median(ts) * 1e3:.1f} / {max(ts) * 1e3:.1f} |")
    print()


def ring_vs_direct(n, world, repeats):
    """Error and per-rank kernel time of the two reduce-scatter designs (no transport)."""
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(n, generator=g) for _ in range(world)]
    exact = torch.stack([x.double() for x in xs]).sum(0)
    print(f"## Compressed reduce-scatter design: ring vs direct, {world} simulated ranks, shard of {n} elements\n")
    print("| codec | design | rel. error (Frobenius) | max error / max scale | kernel time per rank (ms) |")
    print("|---|---|---:|---:|---:|")
    for bits in (8, 4):
        qs = [C.quantize(x, bits) for x in xs]

        def direct():
            return C.dequant_reduce_requant(qs)

        def ring():
            # Rank r receives the partial sum, adds its own chunk, requantizes: world-1 hops.
            acc = qs[0]
            for h in range(1, world):
                acc = C.dequant_reduce_requant([acc], xs[h])
            return acc

        # Per rank, both do the same amount of work as these single calls: the
        # direct design reduces its shard from world sources once; a ring
        # rank makes world-1 hops, each on a shard-sized chunk.
        for name, fn in (("direct (gather, reduce in fp32)", direct), ("ring (requantize per hop)", ring)):
            out = C.dequantize(fn()).double()
            rel = ((out - exact).norm() / exact.norm()).item()
            maxscale = max(q.scales.abs().max().item() for q in qs)
            t_rank = timed(fn, repeats)
            print(f"| int{bits} | {name} | {rel:.5f} | {(out - exact).abs().max().item() / maxscale:.2f} | "
                  f"{t_rank * 1e3:.2f} |")
    print()


def _ar_worker(rank, world, port, n, repeats, out_q):
    torch.set_num_threads(1)
    store = dist_store(port, rank == 0)
    comm = pycomm.Communicator(store=store, rank=rank, world_size=world, name="bench")
    g = torch.Generator().manual_seed(10 + rank)
    base = torch.randn(n, generator=g)
    x = base.clone()
    results = []
    codecs = [("uncompressed", None), ("Int8(block=256)", pycomm.Int8()), ("Int4(block=256)", pycomm.Int4()),
              ("TopK(ratio=0.01)", pycomm.TopK(ratio=0.01))]
    ef = pycomm.compression.ErrorFeedback()
    for name, codec in codecs:
        ts = []
        for it in range(repeats + 1):
            x.copy_(base)
            comm.barrier()
            t0 = time.perf_counter()
            if codec is None:
                comm.all_reduce(x, op="avg")
                sent = 2 * (world - 1) * n * 4 // world
                plain = sent
            else:
                w = comm.all_reduce(x, op="avg", compression=codec, error_feedback=ef, key=name, async_op=True)
                w.wait()
                sent, plain = w.bytes_sent, w.bytes_uncompressed
            ts.append(time.perf_counter() - t0)
        # Accuracy of one call without error feedback (the timed calls feed
        # their residuals forward on identical inputs), against the exact
        # average that every rank can rebuild.
        x.copy_(base)
        comm.all_reduce(x, op="avg", compression=codec)
        exact = sum(torch.randn(n, generator=torch.Generator().manual_seed(10 + r)).double() for r in range(world))
        exact /= world
        rel = ((x.double() - exact).norm() / exact.norm()).item()
        results.append((name, statistics.median(ts[1:]), sent, plain, rel))
    comm.close()
    if rank == 0:
        out_q.put(results)


def dist_store(port, master):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, world_size=2, is_master=master, timeout=datetime.timedelta(seconds=120))


def compressed_allreduce(n, repeats):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_ar_worker, args=(r, 2, port, n, repeats, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = q.get(timeout=1200)
    for p in procs:
        p.join()
    print(f"## All-reduce (avg) of {n * 4 / 2**20:.0f} MiB float32, 2 ranks, shared memory "
          f"(median of {repeats})\n")
    print("| codec | time (ms) | vs uncompressed | bytes sent per rank | vs uncompressed | rel. error |")
    print("|---|---:|---:|---:|---:|---:|")
    t0, b0 = results[0][1], results[0][3]
    for name, t, sent, plain, rel in results:
        print(f"| {name} | {t * 1e3:.1f} | {t / t0:.2f}x | {sent} | {sent / b0:.3f} | {rel:.2e} |")
    print()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="64M", help="bytes of float32 for kernels and all-reduce (default 64M)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-allreduce", action="store_true")
    ap.add_argument("--only", choices=("kernels", "topk", "ring", "allreduce"), help="run one part only")
    ap.add_argument("--seeds", type=int, default=40, help="seeds of the structured top-k table (default 40)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    n = parse_size(args.size) // 4
    parts = {args.only} if args.only else {"kernels", "topk", "ring", "allreduce"}
    if args.skip_allreduce:
        parts.discard("allreduce")
    if "kernels" in parts:
        kernels(n, args.repeats)
    if "topk" in parts:
        topk(args.repeats)
        topk_structure(args.seeds)
    if "ring" in parts:
        ring_vs_direct(1 << 20, 8, args.repeats)
    if "allreduce" in parts:
        compressed_allreduce(n, args.repeats)


if __name__ == "__main__":
    main()
