"""Worker-side CUDA IPC cases (run inside harness workers, every rank on GPU 0)."""
from __future__ import annotations

from typing import List

import torch

import pycomm
from collective_cases import make_input
from harness import worker_store

# (dtype, op, n, algorithm): one-shot and two-shot, tails after the last
# 16-byte pack, a call larger than the 1 MiB staging buffer (several
# launches).
IPC_CASES = [
    (torch.float32, "sum", 1, "auto"),
    (torch.float32, "sum", 1000003, "two_shot"),
    (torch.float32, "avg", 4099, "one_shot"),
    (torch.float32, "max", 300001, "auto"),
    (torch.float64, "sum", 70001, "two_shot"),
    (torch.float16, "sum", 65537, "one_shot"),
    (torch.bfloat16, "avg", 65539, "two_shot"),
    (torch.int32, "min", 12345, "auto"),
    (torch.int64, "sum", 777, "two_shot"),
    (torch.uint8, "sum", 4096 + 5, "one_shot"),
]


def run_ipc(rank: int, world: int, name: str, cases: List[tuple]) -> List[torch.Tensor]:
    ipc = pycomm.cuda_ipc.IpcAllReduce(worker_store(), rank, world, device="cuda:0", buffer_bytes=1 << 20,
                                       prefix=name)
    outs = []
    for i, (dtype, op, n, algo) in enumerate(cases):
        x = make_input(i, rank, n, dtype).cuda()
        outs.append(ipc.all_reduce(x, op=op, algorithm=algo).cpu())
        # Out of place into a misaligned view, same call again: same bits.
        buf = torch.empty(n + 1, dtype=dtype, device="cuda")
        ipc.all_reduce(make_input(i, rank, n, dtype).cuda(), op=op, algorithm=algo, out=buf[1:])
        outs.append(buf[1:].cpu())
    torch.cuda.synchronize()
    return outs


def run_ipc_graph_capture(rank: int, world: int, name: str) -> str:
    ipc = pycomm.cuda_ipc.IpcAllReduce(worker_store(), rank, world, device="cuda:0", buffer_bytes=1 << 20,
                                       prefix=name)
    x = torch.ones(1024, device="cuda")
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            ipc.all_reduce(x)
    except RuntimeError as e:
        return str(e)
    return "captured"
