"""Worker-side compressed all-reduce cases (run inside harness workers).

Workers return their outputs and what they sent; the test process rebuilds
every rank's input (seeded) and checks against float64.
"""
from __future__ import annotations

from typing import List

import torch

import pycomm
from collective_cases import digest, make_input
from harness import make_comm

CODECS = {
    "int8": lambda: pycomm.Int8(block=256),
    "int8-b64-stoch": lambda: pycomm.Int8(block=64, stochastic=True, seed=3),
    "int4": lambda: pycomm.Int4(block=128),
    "int4-stoch": lambda: pycomm.Int4(block=256, stochastic=True),
    "topk": lambda: pycomm.TopK(ratio=0.05),
    "topk-exact": lambda: pycomm.TopK(ratio=0.02, exact=True),
}


def run_cases(rank: int, world: int, name: str, cases: List[tuple], **comm_kwargs) -> List[dict]:
    """cases: (seed, codec, n, dtype, op). Returns per case: output, what this rank sent, stats, digest."""
    comm = make_comm(rank, world, name, **comm_kwargs)
    out = []
    try:
        for seed, codec_name, n, dtype, op in cases:
            codec = CODECS[codec_name]()
            x = make_input(seed, rank, n, dtype)
            ef = pycomm.compression.ErrorFeedback()
            work = comm.all_reduce(x, op=op, compression=codec, error_feedback=ef, key="t", async_op=True)
            work.wait()
            res = ef.get("t")
            sent = make_input(seed, rank, n, dtype).float() - res.worker  # input + 0 - residual
            out.append({"out": x.clone(), "sent": sent, "bytes_sent": work.bytes_sent,
                        "bytes_uncompressed": work.bytes_uncompressed, "digest": digest(x)})
    finally:
        comm.close()
    return out


def run_error_feedback(rank: int, world: int, name: str, codec_name: str, n: int, steps: int) -> dict:
    """`steps` compressed all-reduces (avg) on one key; returns the sum of outputs and the final residuals."""
    comm = make_comm(rank, world, name)
    try:
        codec = CODECS[codec_name]()
        ef = pycomm.compression.ErrorFeedback()
        total = torch.zeros(n, dtype=torch.float64)
        for t in range(steps):
            x = make_input(1000 + t, rank, n, torch.float32)
            comm.all_reduce(x, op="avg", compression=codec, error_feedback=ef, key=("grad", 0))
            total += x.double()
        res = ef.get(("grad", 0))
        shard = 0 if res.server is None else res.server.numel()
        return {"total": total, "worker": res.worker.clone(),
                "server": None if res.server is None else res.server.clone(), "shard": shard,
                "stats": comm.stats}
    finally:
        comm.close()


def unchecked(codec, **fields):
    """``codec`` with ``fields`` set past the check a codec makes when built:
    what a caller reaching the core by another way could pass."""
    for k, v in fields.items():
        object.__setattr__(codec, k, v)
    return codec


def run_bad_calls(rank: int, world: int, name: str) -> List[str]:
    """Each bad call must raise CommError on every rank, and the communicator stays usable."""
    comm = make_comm(rank, world, name)
    msgs = []
    try:
        for kwargs, t in (
            ({"compression": unchecked(pycomm.Int8(), block=12)}, torch.randn(100)),
            ({"compression": pycomm.Int8(), "op": "max"}, torch.randn(100)),
            ({"compression": unchecked(pycomm.TopK(), ratio=0.0)}, torch.randn(100)),
            ({"compression": pycomm.Int4()}, torch.arange(100, dtype=torch.int32)),
            ({"compression": "int8"}, torch.randn(100)),
            ({"compression": pycomm.Int8(), "algorithm": "ring"}, torch.randn(100)),
            ({"error_feedback": pycomm.compression.ErrorFeedback()}, torch.randn(100)),
        ):
            try:
                comm.all_reduce(t, **kwargs)
                msgs.append("no error")
            except pycomm.CommError as e:
                msgs.append(str(e))
        t = torch.ones(10)
        comm.all_reduce(t, compression=pycomm.Int8())
        msgs.append(f"after: {t[0].item()}")
    finally:
        comm.close()
    return msgs


def run_mismatch(rank: int, world: int, name: str, **comm_kwargs) -> str:
    """Rank 0 asks for Int8, the others for Int4: every rank must raise, none hang."""
    comm = make_comm(rank, world, name, timeout=30, **comm_kwargs)
    try:
        codec = pycomm.Int8() if rank == 0 else pycomm.Int4()
        comm.all_reduce(torch.randn(4096), compression=codec)
        return "no error"
    except pycomm.CommError as e:
        return str(e)
    finally:
        comm.close()


def run_all_to_all(rank: int, world: int, name: str, n: int, dtype: torch.dtype,
                   **comm_kwargs) -> List[torch.Tensor]:
    """all_to_all_single of world blocks of n; returns the output."""
    comm = make_comm(rank, world, name, round_bytes=64 * 1024, **comm_kwargs)
    try:
        x = make_input(77, rank, world * n, dtype)
        out = torch.empty_like(x)
        comm.all_to_all_single(out, x)
        return out
    finally:
        comm.close()
