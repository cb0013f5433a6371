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


def run_ipc_async(rank: int, world: int, name: str) -> dict:
    """The all-reduce runs on the group's stream, after the caller's stream's work on the input; wait() orders
    the caller's stream after it; the future is CUDA-aware (waiting on it orders the stream, the CPU never
    blocks)."""
    ipc = pycomm.cuda_ipc.IpcAllReduce(worker_store(), rank, world, device="cuda:0", buffer_bytes=1 << 20,
                                       prefix=name)
    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda._sleep(50_000_000)  # the fill below lands long after the call is issued
    x.fill_(rank + 1)
    work = ipc.all_reduce(x, async_op=True)
    fut = work.get_future()
    work.wait()
    y = x * 2  # on the caller's stream, after wait()
    got = fut.wait()
    z = (got + 1).cpu()  # on the caller's stream, after the future
    yc = y.cpu()  # synchronizes: the kernels are done by now
    return {"y": yc, "z": z, "future_is_x": got.data_ptr() == x.data_ptr(), "done": work.is_completed()}
