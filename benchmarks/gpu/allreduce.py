"""All-reduce among processes sharing one GPU: pycomm's CUDA IPC kernels
(one-shot, two-shot, and the ring and tree schedules run by the device
executor, and the quantized int8 / int4 all-reduce through the same buffers)
against gloo on the same CUDA tensors, nccl-tests style, in one run.

    python benchmarks/gpu/allreduce.py --world 2 [--max-bytes 268435456]
        [--algorithms one_shot,two_shot,one_shot_db,two_shot_db,ring,tree,int8,int8_split,int4,gloo]
        [--iters 20] [--runs 5]

int8_g72 (int4_g72, any count): the fused kernel on a grid of at most 72
blocks (IpcAllReduce's fused_blocks), beside int8's default, 3 blocks per SM
shared by the ranks (the header says how many).

Time per call as nccl-tests measures it: ``--iters`` calls issued back to back
between two CUDA events (the host's cost per call hides behind the device's
where it is smaller), the median of ``--runs`` such batches (a barrier before
the first), the slowest rank's. ``graph us``: the same calls captured in one
CUDA graph and replayed (nccl-tests' ``-G``; one-shot and two-shot, the
kernels that may be captured): the device's time without launch costs. ``1-call us``: one call
between events, waited for before the next (the latency a caller that
synchronizes after every call sees).

%copy: the memory traffic of the call's kernels (modelled for one-shot,
two-shot, int8 and int4, counted from the programs for ring and tree) per second, against
the device-to-device copy's measured in the same run. busbw = algbw x
2(n-1)/n of the float32 bytes (for int8 / int4 too: what
the caller's data would take); both from the back-to-back time. Every point
is checked (#wrong): rank r adds r + 1 everywhere, so the sum is n(n+1)/2
exactly (int8 / int4: within 1 %). All ranks share one GPU's HBM:
rank 0 first measures the device-to-device copy bandwidth alone (a copy
reads and writes each byte: GB/s counts the bytes copied), printed in the
header. Under CUDA MPS (benchmarks/gpu/run.sh mps) the header says so.
"""
import argparse
import datetime
import os
import re

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pycomm
from timing import batch_median_ms, event_median_ms, slowest

# The kernels a CUDA graph may capture (the others count their calls on the host);
# _db: in a double-buffered group (no end barrier, half the buffer a launch).
CAPTURABLE = ("one_shot", "two_shot", "one_shot_db", "two_shot_db")
# The quantized calls timed (default codecs, no error feedback) and modelled
# (traffic): as one fused kernel, and (_split) as a kernel per step.
QUANTIZED = {"int8": pycomm.Int8, "int4": pycomm.Int4, "int8_split": pycomm.Int8, "int4_split": pycomm.Int4}


def traffic(core, name: str, world: int, n: int, round_bytes: int) -> int:
    """Bytes all ranks' kernels of one float32 call read and write (0: not
    modelled). One-shot: each rank stages its input (n read, n written) and
    reduces every buffer (world x n read, n written); two-shot: the staging,
    its part reduced from every buffer (n read, n / world written), every part
    gathered (n read, n written); the schedules: counted from their programs.
    int8 / int4 (no error feedback, as timed here): each rank quantizes its
    input into one slot per rank (n read, world slots written), reduces its
    shard from every rank's slot for it and requantizes it (world slots read,
    one written), and decodes every rank's reduced slot (world slots read, n
    written); a slot is a shard's codes and scales, as the extension sizes it.
    Per rank that is 2n x 4 + (3 world + 1) slots: ~11n + n / world bytes for
    int8 against two-shot's ~20n + 4n / world, so on one GPU, whose HBM is the
    link too, int8 can be at most ~1.9x two-shot (int4 ~2.2x), and only with
    kernels as near the copy rate as two-shot's."""
    es = 4
    name = name[:-len("_db")] if name.endswith("_db") else name  # the same bytes, double-buffered
    if name == "one_shot":
        return world * (world + 3) * n * es
    if name == "two_shot":
        return world * (5 * n + n // world) * es
    if name in ("ring", "tree"):
        return core.program_traffic(core.algorithms[name], core.collectives.index("all_reduce"), world, 0, es, n,
                                    round_bytes)
    if fused_grid(name):
        name = fused_grid(name)[0]
    if name in QUANTIZED:
        codec = QUANTIZED[name]()
        shard = core.compressed_shard_elems(n, world, int(codec.block))
        slot = core.quant_payload_bytes(shard, int(codec.bits), int(codec.block))
        return world * (2 * n * es + (3 * world + 1) * slot)
    return 0


def fused_grid(name: str):
    """(codec name, blocks) for int8_g<blocks> / int4_g<blocks>, else None."""
    m = re.fullmatch(r"(int[48])_g(\d+)", name)
    return (m.group(1), int(m.group(2))) if m else None


def worker(rank, world, port, args):
    torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=dist.PrefixStore("gloo", store), rank=rank, world_size=world)
    ipc = pycomm.cuda_ipc.IpcAllReduce(store, rank, world, device="cuda:0", buffer_bytes=args.max_bytes,
                                       timeout=30)
    names = args.algorithms.split(",")
    split = double = None
    if any(name.endswith("_split") for name in names):
        split = pycomm.cuda_ipc.IpcAllReduce(store, rank, world, device="cuda:0", buffer_bytes=args.max_bytes,
                                             prefix="pycomm.ipc.split", quantized_kernels="split", timeout=30)
    if any(name.endswith("_db") for name in names):
        double = pycomm.cuda_ipc.IpcAllReduce(store, rank, world, device="cuda:0", buffer_bytes=args.max_bytes,
                                              prefix="pycomm.ipc.db", double_buffer=True, timeout=30)
    # One group per fused grid asked for (the grid is agreed when a group opens).
    grids = {}
    for name in names:
        if fused_grid(name) and fused_grid(name)[1] not in grids:
            blocks = fused_grid(name)[1]
            grids[blocks] = pycomm.cuda_ipc.IpcAllReduce(store, rank, world, device="cuda:0",
                                                         buffer_bytes=args.max_bytes, prefix=f"pycomm.ipc.g{blocks}",
                                                         timeout=30, fused_blocks=blocks)
    factor = 2 * (world - 1) / world
    want = world * (world + 1) / 2
    if rank == 0:
        a = torch.empty(args.max_bytes // 4, device="cuda")
        b = torch.empty_like(a)
        copy_s = event_median_ms(lambda: b.copy_(a), 10) / 1e3
        del a, b
        mps = "MPS" if os.environ.get("CUDA_MPS_PIPE_DIRECTORY") else "no MPS"
        # A copy reads and writes each byte: its memory traffic rate.
        copy_rate = 2 * args.max_bytes / copy_s
        print(f"# {torch.cuda.get_device_name()} | {world} processes on one GPU, {mps} | float32 sum | "
              f"device copy {args.max_bytes / copy_s / 1e9:.0f} GB/s ({args.max_bytes >> 20} MB; "
              f"{copy_rate / 1e9:.0f} GB/s read + written)")
        print("# %copy: the bytes the call's kernels read and write on the shared GPU, per second, against "
              "the copy's")
        print(f"# blocks per launch: one-shot / two-shot / schedules {ipc.blocks}, fused quantized up to "
              f"{ipc.fused_blocks}" + "".join(f", {n} up to {grids[fused_grid(n)[1]].fused_blocks}"
                                               for n in names if fused_grid(n)))
        print(f"{'size':>11} {'count':>10} {'algorithm':>10} | {'time us':>9} {'graph us':>9} {'1-call us':>9} "
              f"{'algbw GB/s':>10} {'busbw GB/s':>10} {'%copy':>7} {'#wrong':>6}")
    core = pycomm.load_core()
    size = 4096
    while size <= args.max_bytes:
        n = size // 4
        x = torch.empty(n, device="cuda")
        for name in args.algorithms.split(","):
            if name == "gloo":
                def call():
                    dist.all_reduce(x)
            elif name in QUANTIZED or fused_grid(name):
                codec = QUANTIZED[fused_grid(name)[0] if fused_grid(name) else name]()
                group = grids[fused_grid(name)[1]] if fused_grid(name) else split if name.endswith("_split") else ipc

                def call(codec=codec, group=group):
                    group.all_reduce(x, compression=codec)
            elif name.endswith("_db"):
                def call(name=name):
                    double.all_reduce(x, algorithm=name[:-len("_db")])
            else:
                def call(name=name):
                    ipc.all_reduce(x, algorithm=name)
            # Timed on whatever x holds (it grows: 4^25 stays finite); the
            # check is one more call on fresh values.
            x.fill_(rank + 1)
            slow = name == "gloo"
            iters = max(3, args.iters // 4) if slow else args.iters
            t = slowest(batch_median_ms(call, iters, args.runs, before=dist.barrier) / 1e3)
            tg = slowest(batch_median_ms(call, iters, args.runs, before=dist.barrier, graph=True) / 1e3) \
                if name in CAPTURABLE else 0.0
            t1 = slowest(event_median_ms(call, max(3, args.runs * 2), before=dist.barrier) / 1e3)
            x.fill_(rank + 1)
            call()
            torch.cuda.synchronize()
            tol = 0.01 * want if name in QUANTIZED or fused_grid(name) else 0.0
            wrong = int(((x - want).abs() > tol).sum())
            if rank == 0:
                algbw = size / t / 1e9
                moved = traffic(core, name, world, n, ipc.round_bytes)
                share = f"{moved / t / copy_rate:7.0%}" if moved else f"{'-':>7}"
                graph = f"{tg * 1e6:9.1f}" if tg else f"{'-':>9}"
                print(f"{size:>11} {n:>10} {name:>10} | {t * 1e6:9.1f} {graph} {t1 * 1e6:9.1f} {algbw:10.2f} "
                      f"{algbw * factor:10.2f} {share} {wrong:>6}", flush=True)
        size *= 4
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--max-bytes", type=int, default=256 << 20)
    p.add_argument("--iters", type=int, default=20, help="calls per timed batch (gloo: a quarter)")
    p.add_argument("--runs", type=int, default=5, help="timed batches; the median is reported")
    p.add_argument("--algorithms",
                   default="one_shot,two_shot,one_shot_db,two_shot_db,ring,tree,int8,int8_split,int4,gloo")
    args = p.parse_args()
    port = 29500 + os.getpid() % 1000
    mp.spawn(worker, args=(args.world, port, args), nprocs=args.world)


if __name__ == "__main__":
    main()
