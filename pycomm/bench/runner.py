"""What every rank runs: time each size x algorithm for pycomm and for the
torch.distributed backend, check the results, gather the numbers on rank 0."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

import pycomm

from .compressed import CompressedCase, compressed_runs
from .report import busbw_factor, format_row

DTYPES = {
    "float32": torch.float32, "float": torch.float32, "float64": torch.float64, "double": torch.float64,
    "float16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16,
    "int32": torch.int32, "int": torch.int32, "int64": torch.int64, "long": torch.int64,
}
DIST_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@dataclass
class BenchConfig:
    collective: str
    sizes: List[int]
    algorithms: List[str]
    dtype: str
    op: str
    iters: Optional[int]
    warmup: Optional[int]
    baseline: bool
    c10d_group: Optional["dist.ProcessGroup"] = None  # for the "c10d" rows
    # Also run every pycomm algorithm on registered buffers (comm.empty;
    # "<algorithm>+reg" rows), and time a plain copy of the buffer on every
    # rank at once (the "memcpy" row: the machine's copy bandwidth, same run).
    registered: bool = False
    # DeepSpeed's shared-memory all-reduce (deepspeed_shm.setup), timed as
    # a second baseline in the same processes ("deepspeed" rows).
    deepspeed: Optional[Callable[[torch.Tensor], None]] = None
    # Codecs (pycomm.Int8(), ...) of compressed all-reduce rows, checked
    # against each codec's accuracy (compressed.py).
    codecs: List = field(default_factory=list)
    # Reduce-scatter and all-gather in place (Case), as nccl-tests'
    # in-place columns; all-reduce and broadcast always are.
    in_place: bool = False


def auto_iters(size: int) -> int:
    """Enough iterations for a stable median, about 64 MiB of traffic per point."""
    return max(5, min(200, (64 << 20) // max(size, 1)))


# Collectives whose input (reduce_scatter) or output (all_gather) holds a
# block per rank; all_to_all's both do.
_BLOCK_IN = ("reduce_scatter", "all_to_all")
_BLOCK_OUT = ("all_gather", "all_to_all")


class Case:
    """Buffers of one (collective, size) point, filled so that the result has
    a closed form: rank r holds r + 1 + (i % 7) at position i, which every
    supported dtype represents and sums exactly for up to 8 ranks.

    ``in_place`` (NCCL's forms): a reduce-scatter's output is this rank's
    block of its input, an all-gather's input this rank's block of its
    output (an all-to-all has none: it stays out of place)."""

    def __init__(self, collective: str, size: int, dtype: torch.dtype, op: str, rank: int, world: int,
                 empty: Callable[..., torch.Tensor] = torch.empty, in_place: bool = False) -> None:
        self.collective, self.op, self.rank, self.world = collective, op, rank, world
        esize = torch.empty((), dtype=dtype).element_size()
        # nccl-tests' size: the larger buffer (all_gather: the output,
        # reduce_scatter: the input, all_to_all: either); count: its
        # elements. self.count: the elements of one rank's block.
        blocks = world if collective in _BLOCK_IN + _BLOCK_OUT else 1
        self.count = max(size // esize // blocks, 1)
        total = self.count * blocks
        self.size_bytes = total * esize
        self.elements = total
        self.dtype = dtype
        n_in = self.count * (world if collective in _BLOCK_IN else 1)
        n_out = self.count * world if collective in _BLOCK_OUT else (self.count if collective in _BLOCK_IN else 0)
        self.in_place = in_place and collective in ("reduce_scatter", "all_gather")
        mine = slice(rank * self.count, (rank + 1) * self.count)
        if not self.in_place:
            self.inp = empty(n_in, dtype=dtype)
            self.out = empty(n_out, dtype=dtype)
        elif collective == "all_gather":
            self.out = empty(n_out, dtype=dtype)
            self.inp = self.out[mine]
        else:
            self.inp = empty(n_in, dtype=dtype)
            self.out = self.inp[mine]

    def pattern(self, n: int, rank: int) -> torch.Tensor:
        return (torch.arange(n, dtype=torch.int64) % 7 + rank + 1).to(self.dtype)

    def fill(self) -> None:
        if not (self.in_place and self.collective == "reduce_scatter"):  # else the output is in the input
            self.out.fill_(-1)
        self.inp.copy_(self.pattern(self.inp.numel(), self.rank))

    def expected(self) -> torch.Tensor:
        w = self.world
        if self.collective == "all_gather":
            return torch.cat([self.pattern(self.count, r) for r in range(w)])
        if self.collective == "broadcast":
            return self.pattern(self.count, 0)
        if self.collective == "all_to_all":
            # Block p of the output is block `rank` of rank p's input.
            c, r = self.count, self.rank
            return torch.cat([self.pattern(c * w, p)[r * c:(r + 1) * c] for p in range(w)])
        n = self.inp.numel()
        base = (torch.arange(n, dtype=torch.float64) % 7)
        exp = {"sum": base * w + w * (w + 1) / 2, "avg": base + (w + 1) / 2,
               "max": base + w, "min": base + 1}[self.op]
        if self.collective == "reduce_scatter":
            exp = exp[self.rank * self.count:(self.rank + 1) * self.count]
        return exp.to(self.dtype)

    def result(self) -> torch.Tensor:
        return self.inp if self.collective in ("all_reduce", "broadcast") else self.out

    def wrong(self) -> int:
        return int((self.result().double() != self.expected().double()).sum().item())


def _pycomm_call(comm: "pycomm.Communicator", case: Case, algorithm: str) -> Callable[[], None]:
    c = case.collective
    if c == "all_reduce":
        return lambda: comm.all_reduce(case.inp, case.op, algorithm=algorithm)
    if c == "reduce_scatter":
        return lambda: comm.reduce_scatter(case.out, case.inp, case.op, algorithm=algorithm)
    if c == "all_gather":
        return lambda: comm.all_gather(case.out, case.inp, algorithm=algorithm)
    if c == "all_to_all":
        return lambda: comm.all_to_all_single(case.out, case.inp)  # one algorithm: no choice to pass
    return lambda: comm.broadcast(case.inp, 0, algorithm=algorithm)


# torch 2.13 names the flat-tensor forms *_single and deprecates the old
# names (a FutureWarning in every table); older torch has only those.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _baseline_call(case: Case, group: Optional["dist.ProcessGroup"] = None) -> Callable[[], None]:
    """The torch.distributed equivalent on `group` (default: the default
    group); all-reduce is in place for both."""
    c = case.collective
    op = DIST_OPS.get(case.op, dist.ReduceOp.SUM)
    if c == "all_reduce":
        native_avg = group is not None  # the pycomm backend has AVG; gloo does not
        if case.op == "avg" and not native_avg:
            def run() -> None:
                dist.all_reduce(case.inp, dist.ReduceOp.SUM)
                case.inp.div_(case.world)
            return run
        return lambda: dist.all_reduce(case.inp, op, group=group)
    if c == "reduce_scatter":
        return lambda: _reduce_scatter_flat(case.out, case.inp, op, group=group)
    if c == "all_gather":
        return lambda: _all_gather_flat(case.out, case.inp, group=group)
    if c == "all_to_all":
        return lambda: dist.all_to_all_single(case.out, case.inp, group=group)
    return lambda: dist.broadcast(case.inp, 0, group=group)


def _time(fn: Callable[[], None], iters: int, warmup: int) -> float:
    """Median seconds per call on this rank (each call timed alone)."""
    for _ in range(warmup):
        fn()
    dist.barrier()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _copy_row(cfg: BenchConfig, case: Case, iters: int, warmup: int, world: int) -> Dict:
    """Every rank copies one buffer of the point's size at once: what the
    machine's memory moves in the same run, for the collectives to be read
    against."""
    src = torch.empty(case.size_bytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    slowest = torch.tensor([_time(lambda: dst.copy_(src), iters, warmup)], dtype=torch.float64)
    dist.all_reduce(slowest, dist.ReduceOp.MAX)
    t = slowest.item()
    wrong = torch.tensor([int((dst != 1).sum().item())], dtype=torch.int64)
    dist.all_reduce(wrong, dist.ReduceOp.SUM)
    return {"collective": cfg.collective, "backend": "memcpy", "algorithm": "memcpy", "label": "memcpy (each rank)",
            "dtype": "uint8", "op": "none", "size_bytes": case.size_bytes, "count": case.size_bytes, "nranks": world,
            "time_us": t * 1e6, "algbw_gbps": case.size_bytes / t / 1e9, "busbw_gbps": case.size_bytes / t / 1e9,
            "wrong": int(wrong.item()), "iters": iters}


def run_rank(cfg: BenchConfig, comm: "pycomm.Communicator") -> Optional[List[Dict]]:
    """Runs the sweep on this rank; returns the rows on rank 0, None elsewhere."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[cfg.dtype]
    backend = dist.get_backend()
    rows: List[Dict] = []
    for size in cfg.sizes:
        case = Case(cfg.collective, size, dtype, cfg.op, rank, world, in_place=cfg.in_place)
        iters = cfg.iters or auto_iters(case.size_bytes)
        warmup = cfg.warmup if cfg.warmup is not None else max(2, iters // 10)
        runs = []
        reg_case = (Case(cfg.collective, size, dtype, cfg.op, rank, world, comm.empty, in_place=cfg.in_place)
                    if cfg.registered else None)
        for a in cfg.algorithms:
            runs.append(("pycomm", a, case, _baseline_call(case, cfg.c10d_group) if a == "c10d"
                         else _pycomm_call(comm, case, a)))
            if reg_case is not None and a != "c10d":
                runs.append(("pycomm", a + "+reg", reg_case, _pycomm_call(comm, reg_case, a)))
        runs.extend(compressed_runs(comm, cfg.codecs, size, dtype, cfg.op))
        if cfg.baseline:
            runs.append((backend, backend, case, _baseline_call(case)))
        if cfg.deepspeed is not None:
            ds = cfg.deepspeed
            runs.append(("deepspeed", "deepspeed-shm", case, lambda: ds(case.inp)))
        point = []
        if reg_case is not None:
            point.append(_copy_row(cfg, case, iters, warmup, world))
        for backend_name, label, case, fn in runs:
            case.fill()
            seconds = _time(fn, iters, warmup)
            # Correctness on fresh data after the timed loop (in-place
            # calls have reduced their buffers many times over by now).
            case.fill()
            fn()
            wrong = case.wrong()
            # The slowest rank's median is the collective's time; #wrong sums.
            slowest = torch.tensor([seconds], dtype=torch.float64)
            wrong_total = torch.tensor([wrong], dtype=torch.int64)
            dist.all_reduce(slowest, dist.ReduceOp.MAX)
            dist.all_reduce(wrong_total, dist.ReduceOp.SUM)
            t = slowest.item()
            resolved = label
            algo, reg = (label[:-4], "+reg") if label.endswith("+reg") else (label, "")
            if backend_name == "pycomm" and cfg.collective == "all_to_all" and algo == "auto":
                resolved = "direct" + reg  # its only algorithm: every block reaches its owner in one step
            elif backend_name == "pycomm" and algo in ("auto", "direct"):
                # The tuner sizes a call by its larger buffer, as nccl-tests does.
                chosen = comm.resolve_algorithm(cfg.collective, algo, case.size_bytes)
                resolved = (f"auto:{chosen}" if algo == "auto" else chosen) + reg
            algbw = case.size_bytes / t / 1e9
            row = {
                "collective": cfg.collective, "backend": backend_name, "algorithm": label, "label": resolved,
                "dtype": cfg.dtype, "op": cfg.op if cfg.collective in ("all_reduce", "reduce_scatter") else "none",
                "size_bytes": case.size_bytes, "count": case.elements, "nranks": world,
                "time_us": t * 1e6, "algbw_gbps": algbw, "busbw_gbps": algbw * busbw_factor(cfg.collective, world),
                "wrong": int(wrong_total.item()), "iters": iters, "in_place": getattr(case, "in_place", False),
            }
            if isinstance(case, CompressedCase):
                # Lossy: the summary never names it the best algorithm.
                row.update(compression=label, wire_bytes=case.wire_bytes, plain_bytes=case.plain_bytes)
            point.append(row)
        base = [p for p in point if p["backend"] not in ("pycomm", "memcpy")]
        for p in point:
            if p["backend"] == "pycomm" and base:
                p["speedup_vs_baseline"] = base[0]["time_us"] / p["time_us"]
        rows.extend(point)
        if rank == 0:
            for p in point:
                print(format_row(p), flush=True)
    return rows if rank == 0 else None
