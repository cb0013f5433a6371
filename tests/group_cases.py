"""Worker-side cases for pycomm.GroupCommunicator: the device-generic
compressed all-reduce over a torch.distributed group, against the
shared-memory one on the same inputs (run inside harness workers)."""
from __future__ import annotations

import hashlib
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

import pycomm
from harness import join_default_group, make_comm

_PAIRS: Dict[Tuple[int, str], Tuple[object, object]] = {}

CODECS = {
    "int8": lambda: pycomm.Int8(),
    "int8_b64_stoch": lambda: pycomm.Int8(block=64, stochastic=True, seed=5),
    "int4": lambda: pycomm.Int4(),
    "int4_stoch": lambda: pycomm.Int4(block=128, stochastic=True),
    "int8_b96": lambda: pycomm.Int8(block=96),  # not a warp kernel's block: the CUDA IPC call runs a kernel per step
    "int4_b512": lambda: pycomm.Int4(block=512),
    "topk": lambda: pycomm.TopK(0.05, exact=True),
    "topk_sampled": lambda: pycomm.TopK(0.02, seed=3),
    "topk_half_entry": lambda: pycomm.TopK(0.25, exact=True),  # 0.25 x 10 = 2.5 entries: rounds away from zero
}


def pair(rank: int, world: int, name: str, device: str = "cpu"):
    """A shared-memory Communicator and a GroupCommunicator over ranks
    0..world-1, both fresh (so their sequence numbers, which key stochastic
    rounding, start together)."""
    key = (world, name)
    if key not in _PAIRS:
        # Every pool rank takes part in creating a subgroup; only its members
        # build communicators over it.
        g = dist.new_group(list(range(world)))
        member = rank < world
        gc = pycomm.GroupCommunicator(g, backend="gloo") if member else None
        comm = make_comm(rank, world, name) if member and device == "cpu" else None
        _PAIRS[key] = (comm, gc)
    return _PAIRS[key]


def init(rank: int, world: int, name: str) -> str:
    join_default_group(rank, world, name)
    return dist.get_backend()


def _input(seed: int, rank: int, step: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank * 31 + step)
    return (torch.randn(n, generator=g) * (1 + rank)).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, except that any NaN equals any NaN: IEEE leaves a NaN's
    payload to the hardware (x86 keeps the first operand's, a GPU returns its
    canonical NaN), and no two devices promise the same one."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.cpu(), b.cpu()
    if a.is_floating_point():
        nan = a.isnan()
        if not torch.equal(nan, b.isnan()):
            return False
        a, b = a[~nan], b[~nan]
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def digest(t: torch.Tensor) -> str:
    """A short fingerprint of a tensor's bits, to compare ranks' results."""
    return hashlib.sha1(t.cpu().view(torch.uint8).numpy().tobytes()).hexdigest()


def mismatches(step: int, a: torch.Tensor, b: torch.Tensor, ef_a, ef_b, key: str = "k") -> List[tuple]:
    """Where two runs of one compressed all-reduce step differ: the output and
    both residuals, bit for bit."""
    bad = []
    if not same_bits(a, b):
        bad.append((step, "output"))
    ra, rb = ef_a.get(key), ef_b.get(key)
    if not same_bits(ra.worker, rb.worker):
        bad.append((step, "worker residual"))
    if ra.server is not None and not same_bits(ra.server, rb.server):
        bad.append((step, "server residual"))
    return bad


def paired_steps(rank: int, cases: List[tuple], steps: int, reference: Callable, other: Callable,
                 to_other: Callable = torch.Tensor.clone, check: Optional[Callable] = None) -> List[tuple]:
    """Each case (codec, n, dtype, op) for `steps` steps with error feedback,
    on the same inputs, through ``reference(x, op, codec, ef)`` and
    ``other(x, op, codec, ef)`` (in place; ``other`` returns its work, done;
    ``to_other`` puts its copy of the input where it runs): per case the
    mismatches of outputs and residuals (and what ``check(step, n,
    reference's return, other's work)`` adds), and the other's last output."""
    out = []
    for ci, (codec_name, n, dtype, op) in enumerate(cases):
        codec = CODECS[codec_name]()
        ef_a, ef_b = pycomm.compression.ErrorFeedback(), pycomm.compression.ErrorFeedback()
        bad = []
        for step in range(steps):
            x = _input(ci, rank, step, n, dtype)
            a, b = x.clone(), to_other(x)
            ref = reference(a, op, codec, ef_a)
            work = other(b, op, codec, ef_b)
            bad += mismatches(step, a, b, ef_a, ef_b)
            if check is not None:
                bad += check(step, n, ref, work)
        out.append((bad, b))
    return out


def through_communicator(comm) -> Callable:
    """The reference of :func:`paired_steps`: the CPU communicator's
    compressed all-reduce, returning its (done) work."""
    def run(a, op, codec, ef):
        work = comm.all_reduce(a, op=op, compression=codec, error_feedback=ef, key="k", async_op=True)
        work.wait()
        return work
    return run


def same_accounting(world: int) -> Callable:
    """A ``check`` of :func:`paired_steps`: the other path reports the bytes
    the communicator reports for the same call (sent, and uncompressed)."""
    def check(step, n, ref, work):
        got, want = (work.bytes_sent, work.bytes_uncompressed), (ref.bytes_sent, ref.bytes_uncompressed)
        if got != want:
            return [(step, f"bytes sent/uncompressed {got}, the communicator's {want}")]
        return [(step, "bytes_sent")] if work.bytes_sent <= 0 and world > 1 and n > 0 else []
    return check


def versus_shm(rank: int, world: int, name: str, cases: List[tuple], steps: int = 3) -> List[dict]:
    """Each case (codec, n, dtype, op) for `steps` steps with error feedback,
    through both paths on the same inputs: do outputs and residuals agree
    bit for bit? Returns per case the mismatches and the group output."""
    comm, gc = pair(rank, world, name)
    if gc is None:
        return []

    def group_path(b, op, codec, ef):
        work = gc.all_reduce(b, op=op, compression=codec, error_feedback=ef, key="k", async_op=True)
        work.get_future().wait()
        return work

    res = paired_steps(rank, cases, steps, through_communicator(comm), group_path, check=same_accounting(world))
    return [{"bad": bad, "out": b, "digest": digest(b)} for bad, b in res]


def bad_calls(rank: int, world: int, name: str) -> List[str]:
    """Calls the group path refuses, each with its message; the communicator stays usable after."""
    _, gc = pair(rank, world, name)
    if gc is None:
        return []
    msgs = []
    for call in (lambda: gc.all_reduce(torch.randn(8), op="max", compression=pycomm.Int8()),
                 lambda: gc.all_reduce(torch.randn(8, dtype=torch.float64), compression=pycomm.Int8()),
                 lambda: gc.all_reduce(torch.randn(8), compression="int8"),
                 lambda: gc.all_reduce(torch.randn(4, 4).t(), compression=pycomm.Int8())):
        try:
            call()
            msgs.append("accepted")
        except pycomm.CommError as e:
            msgs.append(str(e))
    real = pycomm.group._capturing
    pycomm.group._capturing = lambda t: True  # as under CUDA graph capture
    try:
        gc.all_reduce(torch.randn(8), compression=pycomm.Int8())
        msgs.append("accepted")
    except pycomm.CommError as e:
        msgs.append(str(e))
    finally:
        pycomm.group._capturing = real
    x = torch.full((1000,), float(rank + 1))
    gc.all_reduce(x, op="avg", compression=pycomm.Int8())
    msgs.append(float(x[0]))
    return msgs
