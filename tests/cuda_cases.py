"""Worker-side CUDA IPC cases (run inside harness workers, every rank on GPU 0)."""
from __future__ import annotations

import itertools
from typing import Callable, List

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


def run_ipc(rank: int, world: int, name: str, cases: List[tuple], double_buffer: bool = False) -> List[torch.Tensor]:
    ipc = pycomm.cuda_ipc.IpcAllReduce(worker_store(), rank, world, device="cuda:0", buffer_bytes=1 << 20,
                                       prefix=name, double_buffer=double_buffer)
    # Ranks sharing GPU 0 split 144 blocks per launch (36 to 72 each).
    assert ipc.blocks == (36 if world == 1 else min(72, max(36, 144 // world))), ipc.blocks
    outs = []
    for i, (dtype, op, n, algo) in enumerate(cases):
        x = make_input(i, rank, n, dtype).cuda()
        outs.append(ipc.all_reduce(x, op=op, algorithm=algo).cpu())
        # Out of place into a misaligned view, same call again: same bits.
        buf = torch.empty(n + 1, dtype=dtype, device="cuda")
        ipc.all_reduce(make_input(i, rank, n, dtype).cuda(), op=op, algorithm=algo, out=buf[1:])
        outs.append(buf[1:].cpu())
        # In place on a misaligned view (the kernel stages its input itself,
        # element by element where it is not 16-byte aligned).
        view = torch.empty(n + 1, dtype=dtype, device="cuda")[1:]
        view.copy_(make_input(i, rank, n, dtype).cuda())
        ipc.all_reduce(view, op=op, algorithm=algo)
        outs.append(view.cpu())
    torch.cuda.synchronize()
    return outs


# What one captured graph holds: (dtype, op, n, algorithm), one-shot,
# two-shot in two launches (more than the 1 MiB staging buffer) and auto.
GRAPH_CASES = [
    (torch.float32, "avg", 4099, "one_shot"),
    (torch.float32, "sum", 300001, "two_shot"),
    (torch.bfloat16, "sum", 65539, "auto"),
]


def run_ipc_graph(rank: int, world: int, name: str, replays: int = 12, double_buffer: bool = False) -> dict:
    """One-shot, two-shot and auto calls captured in one CUDA graph and
    replayed on fresh inputs, with eager calls between the replays (they
    share the launch counters): every replay's results are the CPU
    reduction's bits. The schedules and the compressed call refuse capture
    with a message, and the group still works after a refusal."""
    ipc = pycomm.cuda_ipc.IpcAllReduce(worker_store(), rank, world, device="cuda:0", buffer_bytes=1 << 20,
                                       prefix=name, timeout=60, double_buffer=double_buffer)
    ops = torch.ops.pycomm
    static = [torch.empty(n, dtype=dtype, device="cuda") for dtype, _, n, _ in GRAPH_CASES]
    for t, (dtype, _, n, _) in zip(static, GRAPH_CASES):
        t.copy_(make_input(999, rank, n, dtype))
    for t, (_, op, _, algo) in zip(static, GRAPH_CASES):  # eager first: the counters are not at zero
        ipc.all_reduce(t, op=op, algorithm=algo)
    def eager_one_shot_right(seed: int) -> bool:
        x = make_input(seed, rank, 4099, torch.float32).cuda()
        exp = ops.reduce([make_input(seed, q, 4099, torch.float32) for q in range(world)], "sum")
        return torch.equal(ipc.all_reduce(x, algorithm="one_shot").cpu(), exp)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for t, (_, op, _, algo) in zip(static, GRAPH_CASES):
            ipc.all_reduce(t, op=op, algorithm=algo)
    bad = []
    for k in range(replays):
        seed = 1000 + k
        for i, (t, (dtype, _, n, _)) in enumerate(zip(static, GRAPH_CASES)):
            t.copy_(make_input(seed + 50 * i, rank, n, dtype))
        graph.replay()
        for i, (t, (dtype, op, n, algo)) in enumerate(zip(static, GRAPH_CASES)):
            exp = ops.reduce([make_input(seed + 50 * i, q, n, dtype) for q in range(world)], op)
            got = t.cpu()
            if not torch.equal(got.view(torch.uint8), exp.view(torch.uint8)):
                bad.append(f"replay {k}, {algo}/{dtype}/{op}/{n}: {(got != exp).sum().item()} elements differ")
        if k % 3 == 1 and not eager_one_shot_right(seed):  # an eager call between replays
            bad.append(f"eager call after replay {k} differs")
    ipc.check()
    refusals = []
    for kwargs in ({"algorithm": "ring"}, {"algorithm": "tree", "async_op": True}, {"compression": pycomm.Int8()}):
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g):
                ipc.all_reduce(static[0], **kwargs)
            refusals.append(f"{kwargs} captured")
        except (RuntimeError, pycomm.CommError) as e:
            refusals.append(str(e))
    if not eager_one_shot_right(7):
        bad.append("the group does not work after a refused capture")
    ipc.check()
    return {"bad": bad, "refusals": refusals}


# What run_ipc_mixed draws from: the kinds of call, and sizes (float32
# elements) from one thread block to more than half the 1 MiB buffer (a
# double-buffered group's launch: several launches per call).
MIXED_KINDS = ("one_shot", "two_shot", "auto", "ring", "tree", "int8", "replay")
MIXED_SIZES = (1, 17, 4099, 65537, 140001, 300001)


def run_ipc_mixed(rank: int, world: int, name: str, double_buffer: bool, kernels: str, steps: int = 80) -> List[str]:
    """One group, a long random sequence of calls of every kind back to
    back (the same on every rank): one-shot, two-shot, auto, ring, tree, the
    quantized call, and replays of a CUDA graph of one-shot and two-shot
    calls, at sizes whose grids differ from call to call. Each call's
    result is checked, so a call that refilled a buffer a peer was still
    reading (the end barrier a double-buffered group leaves out, the
    barrier a call of another kind owes it) shows as a wrong value. Inputs
    are small integers: every order of summation is exact. Returns the
    mismatches."""
    ipc = pycomm.cuda_ipc.IpcAllReduce(worker_store(), rank, world, device="cuda:0", buffer_bytes=1 << 20,
                                       prefix=name, timeout=60, double_buffer=double_buffer,
                                       quantized_kernels=kernels)

    def ints(seed: int, q: int, n: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed * 131 + q)
        return torch.randint(-100, 101, (n,), generator=g).float()

    def want(seed: int, n: int) -> torch.Tensor:
        return sum(ints(seed, q, n) for q in range(world))

    static = [torch.empty(n, device="cuda") for n in (4099, 140001)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ipc.all_reduce(static[0], algorithm="one_shot")
        ipc.all_reduce(static[1], algorithm="two_shot")
    pick = torch.Generator().manual_seed(7)  # the same sequence on every rank
    bad = []
    for step in range(steps):
        kind = MIXED_KINDS[int(torch.randint(len(MIXED_KINDS), (1,), generator=pick))]
        n = MIXED_SIZES[int(torch.randint(len(MIXED_SIZES), (1,), generator=pick))]
        seed = 1000 + step
        if kind == "replay":
            for k, t in enumerate(static):
                t.copy_(ints(seed + k, rank, t.numel()))
            graph.replay()
            for k, t in enumerate(static):
                got, exp = t.cpu(), want(seed + k, t.numel())
                if not torch.equal(got, exp):
                    bad.append(f"step {step} replay {k}: {(got != exp).sum().item()} of {t.numel()} wrong")
            continue
        x = ints(seed, rank, n).cuda()
        if kind == "int8":
            ipc.all_reduce(x, compression=pycomm.Int8())
            got, exp = x.cpu(), want(seed, n)
            # Rounding: half a step of each rank's codes (blocks up to 100:
            # 100 / 127 a step) and half a step of the reduced shard's (sums
            # up to world x 100); anything else is a wrong value.
            if (got - exp).abs().max().item() > world * 100 / 127 + 1e-3:
                bad.append(f"step {step} int8 n={n}: off by {(got - exp).abs().max().item()}")
            continue
        ipc.all_reduce(x, algorithm=kind)
        got, exp = x.cpu(), want(seed, n)
        if not torch.equal(got, exp):
            bad.append(f"step {step} {kind} n={n}: {(got != exp).sum().item()} wrong")
    ipc.check()
    return bad


def run_ipc_async(rank: int, world: int, name: str) -> dict:
    """The all-reduce runs on the group's stream, after the caller's stream's work on the input; wait() orders
    the caller's stream after it; the future is CUDA-aware (waiting on it orders the stream, the CPU never
    blocks); a synchronous call is ordered the same way."""
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
    # The synchronous call (ordered in C++) likewise: after the caller's
    # stream's work on the input, before its later work on the output.
    s = torch.zeros(1 << 20, device="cuda")
    torch.cuda._sleep(50_000_000)
    s.fill_(rank + 1)
    ipc.all_reduce(s)
    s2 = (s * 2).cpu()
    # A tensor subclass without storage (as a DTensor) and a lazy negative
    # view are refused on every rank, synchronous, asynchronous and
    # quantized, and the group goes on.
    from torch.testing._internal.two_tensor import TwoTensor

    refused = []
    for call in (lambda t: ipc.all_reduce(t), lambda t: ipc.all_reduce(t, async_op=True).wait(),
                 lambda t: ipc.all_reduce(t, compression=pycomm.Int8())):
        for bad in (TwoTensor(torch.ones(1024, device="cuda"), torch.ones(1024, device="cuda")),
                    torch._neg_view(torch.ones(1024, device="cuda"))):
            try:
                call(bad)
                refused.append("")
            except Exception as e:  # noqa: BLE001 - the message is the result
                refused.append(str(e))
    after = torch.full((4096,), float(rank + 1), device="cuda")
    ipc.all_reduce(after)
    return {"y": yc, "z": z, "s": s2, "future_is_x": got.data_ptr() == x.data_ptr(), "done": work.is_completed(),
            "refused": refused, "after": after.cpu()}


# ---------------------------------------------------------------- the group path on CUDA tensors


def group_cuda_versus_cpu(rank: int, world: int, cases: List[tuple], steps: int = 3) -> List[list]:
    """Each case (codec, n, dtype, op) through the device-generic group path
    on CUDA tensors and on CPU tensors (the CPU one equals the shared-memory
    path, test_group.py), with error feedback over several steps: the
    mismatches in outputs and residuals (none expected). Sampled top-k draws
    its sample differently on a GPU, so its selection (and result) is
    compared across ranks only: a digest of each step's output. Runs on every pool
    rank; ranks >= world sit out. The default group is Gloo (NCCL refuses
    several ranks on one GPU), which takes CUDA tensors through host memory."""
    from group_cases import CODECS, _input, digest, mismatches
    from hooks_cases import _group

    g, _ = _group(world)
    if rank >= world:
        return []
    gpu, cpu = pycomm.GroupCommunicator(g), pycomm.GroupCommunicator(g)
    out = []
    for ci, (codec_name, n, dtype, op) in enumerate(cases):
        codec = CODECS[codec_name]()
        ef_g, ef_c = pycomm.compression.ErrorFeedback(), pycomm.compression.ErrorFeedback()
        bad = []
        for step in range(steps):
            x = _input(ci, rank, step, n, dtype)
            a, b = x.cuda(), x.clone()
            gpu.all_reduce(a, op=op, compression=codec, error_feedback=ef_g, key="k")
            cpu.all_reduce(b, op=op, compression=codec, error_feedback=ef_c, key="k")
            if codec_name == "topk_sampled":
                bad.append(digest(a))
                continue
            bad += mismatches(step, a, b, ef_g, ef_c)
            if ef_g.get("k").worker.device.type != "cuda":
                bad.append((step, "worker residual not on the GPU"))
        out.append(bad)
    return out


def group_cuda_does_not_block(rank: int, world: int) -> dict:
    """An asynchronous compressed all-reduce of a CUDA tensor returns while
    the caller's stream is still busy (the caller never waits for the GPU),
    and waiting on its future orders the caller's stream after the result.
    Measured by the clock: the call returns in far less time than the GPU
    work queued before it takes to finish."""
    import time

    from hooks_cases import _group

    g, _ = _group(world)
    if rank >= world:
        return {}
    gc = pycomm.GroupCommunicator(g)
    x = torch.full((1 << 16,), float(rank + 1), device="cuda")
    gc.all_reduce(x.clone(), op="avg", compression=pycomm.Int8())  # warm-up: the private group exists
    a = torch.randn(8192, 8192, device="cuda")
    a @ a  # warm-up: cuBLAS handle and workspace
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):  # 20 x 1.1 TFLOP queued on the caller's stream
        a = (a @ a).clamp_(-1, 1)
    x.mul_(2)
    t1 = time.perf_counter()
    work = gc.all_reduce(x, op="avg", compression=pycomm.Int8(), async_op=True)
    t2 = time.perf_counter()
    work.get_future().wait()
    y = (x + 1).cpu()  # synchronizes
    t3 = time.perf_counter()
    return {"queue_s": t1 - t0, "returned_s": t2 - t1, "gpu_s": t3 - t0, "y": y}


# ---------------------------------------------------------------- the device executor of schedules

# (dtype, op, n): counts 0, 1, primes, odd sizes; several 64 KiB rounds.
SCHEDULE_CASES = [
    (torch.float32, "sum", 0), (torch.float32, "sum", 1), (torch.float32, "avg", 1021),
    (torch.float32, "sum", 70001), (torch.float32, "max", 16411), (torch.float32, "min", 7),
    (torch.float64, "sum", 30011), (torch.float64, "avg", 31),
    (torch.float16, "sum", 65537), (torch.bfloat16, "sum", 40009), (torch.bfloat16, "avg", 3),
    (torch.int32, "sum", 12345), (torch.int64, "max", 777), (torch.uint8, "sum", 4101),
]
SCHEDULES = ("ring", "tree", "direct")


def run_schedules(rank: int, world: int, name: str) -> List[str]:
    """Every schedule and case on GPU 0 through the device executor against the
    CPU communicator's all-reduce with the same algorithm and round size, in
    place and into a misaligned view: the mismatches (none expected)."""
    from harness import make_comm

    round_bytes = 64 * 1024
    comm = make_comm(rank, world, name + ".cpu", round_bytes=round_bytes, timeout=60)
    ipc = pycomm.cuda_ipc.IpcAllReduce(worker_store(), rank, world, device="cuda:0", buffer_bytes=1 << 20,
                                       round_bytes=round_bytes, prefix=name, timeout=60)
    bad = []
    for algo in SCHEDULES:
        for i, (dtype, op, n) in enumerate(SCHEDULE_CASES):
            x = make_input(i, rank, n, dtype)
            cpu = x.clone()
            comm.all_reduce(cpu, op, algorithm=algo)
            gpu = ipc.all_reduce(x.cuda(), op=op, algorithm=algo).cpu()
            buf = torch.empty(n + 1, dtype=dtype, device="cuda")
            ipc.all_reduce(x.cuda(), op=op, algorithm=algo, out=buf[1:])
            for what, got in (("in place", gpu), ("misaligned", buf[1:].cpu())):
                if not torch.equal(got.view(torch.uint8), cpu.view(torch.uint8)):
                    bad.append(f"{algo}/{dtype}/{op}/{n} {what}: {(got != cpu).sum().item()} elements differ")
    # One group, every algorithm in turn: a schedule call after a one-shot
    # call and the reverse (they share the staging buffer). The hand-written
    # kernels reduce in rank order (the CPU kernel's bits); the schedules give
    # the communicator's.
    for k, algo in enumerate(("one_shot", "ring", "two_shot", "tree", "one_shot", "direct") * 3):
        x = make_input(100 + k, rank, 50021, torch.float32)
        if algo in ("one_shot", "two_shot"):
            exp = torch.ops.pycomm.reduce([make_input(100 + k, q, 50021, torch.float32) for q in range(world)], "sum")
        else:
            exp = x.clone()
            comm.all_reduce(exp, "sum", algorithm=algo)
        got = ipc.all_reduce(x.cuda(), op="sum", algorithm=algo).cpu()
        if not torch.equal(got, exp):
            bad.append(f"interleaved call {k} ({algo}): {(got != exp).sum().item()} elements differ")
    ipc.check()
    comm.close()
    return bad


# The kinds of IPC call a dying peer is tested in.
DEATH_KINDS = ("one_shot", "two_shot", "ring", "tree", "int8", "int8_split")


def ipc_peer_dies(rank: int, world: int, path: str, mode: str, results) -> None:
    """A fresh process (spawned). Ranks 0 and 1 survive; rank 2 + k is the
    victim of kind k (DEATH_KINDS): one IPC group {0, 1, 2 + k} per kind.
    Kind by kind, the three make a call, then the survivors start another
    one and the victim is killed with SIGKILL (mode "kill") or stays alive and
    never calls (mode "silent"). Survivors put (kind, rank, error, seconds from
    the call to the error, error of the next call) into `results`."""
    import datetime
    import os
    import signal
    import time

    import torch.distributed as dist

    store = dist.FileStore(path, world)
    timeout = 3.0 if mode == "silent" else 60.0
    long = datetime.timedelta(seconds=120)
    kinds = range(len(DEATH_KINDS)) if rank < 2 else [rank - 2]
    groups = {k: pycomm.cuda_ipc.IpcAllReduce(store, min(rank, 2), 3, device="cuda:0", buffer_bytes=1 << 22,
                                              prefix=f"dies{k}", timeout=timeout,
                                              quantized_kernels="split" if DEATH_KINDS[k] == "int8_split" else "fused")
              for k in kinds}
    x = torch.ones(1 << 18, device="cuda")

    def call(k):
        kind = DEATH_KINDS[k]
        if kind.startswith("int8"):
            return groups[k].all_reduce(x, compression=pycomm.Int8())
        return groups[k].all_reduce(x, algorithm=kind)

    for k in kinds:
        if rank >= 2:  # the victim: one call with the survivors, then it dies or goes silent
            store.wait([f"warm/{k}"], long)
            call(k)
            groups[k].check()
            store.wait([f"launched/{k}/{q}" for q in range(2)], long)
            time.sleep(0.2)  # the survivors' kernels are waiting for this rank by now
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            store.wait([f"reported/{k}/{q}" for q in range(2)], long)
            return
        store.set(f"warm/{k}", "1")
        call(k)
        groups[k].check()
        t0 = time.monotonic()
        call(k)
        store.set(f"launched/{k}/{rank}", "1")
        err, took, later = None, time.monotonic() - t0, None
        try:
            groups[k].check()
        except pycomm.CommError as e:
            err, took = str(e), time.monotonic() - t0
        try:
            call(k)
        except pycomm.CommError as e:
            later = str(e)
        results.put((DEATH_KINDS[k], rank, err, took, later))
        store.set(f"reported/{k}/{rank}", "1")


def _on_gpu_misaligned_every_other_call() -> Callable[[torch.Tensor], torch.Tensor]:
    """x on GPU 0, every other call one element into a larger tensor
    (contiguous, but not where a run of elements may start: the fused kernel
    takes an aligned copy, the kernels per step one element a lane), else
    aligned as allocated: a case's steps take both, with one error feedback
    across them."""
    calls = itertools.count()

    def to_gpu(x: torch.Tensor) -> torch.Tensor:
        if next(calls) % 2 == 0:
            return x.cuda()
        return torch.empty(x.numel() + 1, dtype=x.dtype, device="cuda")[1:].copy_(x)
    return to_gpu


def run_ipc_quantized(rank: int, world: int, name: str, cases: List[tuple], steps: int = 3,
                      kernels: str = "fused") -> List[list]:
    """Each case (codec, n, dtype, op) through the quantized IPC all-reduce on
    GPU 0 (its kernels "fused", "fused_small": on a grid of 3 blocks, or
    "split") and the CPU communicator's
    compressed all-reduce, both fresh (their sequence numbers, which key
    stochastic rounding, start together), with error feedback over several
    steps: the mismatches in outputs and residuals per case (none expected)."""
    from group_cases import paired_steps, same_accounting, through_communicator
    from harness import make_comm

    comm = make_comm(rank, world, name + ".cpu", timeout=60)
    # "fused_small": each rank asks for a grid of 3 + rank blocks, and the
    # group takes the least (3): warps loop over many quantization blocks.
    ipc = pycomm.cuda_ipc.IpcAllReduce(worker_store(), rank, world, device="cuda:0", buffer_bytes=4 << 20,
                                       prefix=name, timeout=60,
                                       quantized_kernels="split" if kernels == "split" else "fused",
                                       fused_blocks=3 + rank if kernels == "fused_small" else None)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    want = 3 if kernels == "fused_small" else min(512, 3 * sms // world)
    assert ipc.fused_blocks == want, (ipc.fused_blocks, want)

    def through_ipc(b, op, codec, ef):
        work = ipc.all_reduce(b, op=op, compression=codec, error_feedback=ef, key="k", async_op=True)
        work.synchronize()
        return work

    out = [bad for bad, _ in paired_steps(rank, cases, steps, through_communicator(comm), through_ipc,
                                          to_other=_on_gpu_misaligned_every_other_call(),
                                          check=same_accounting(world))]
    msgs = []
    for call in (lambda: ipc.all_reduce(torch.randn(8, device="cuda"), op="max", compression=pycomm.Int8()),
                 lambda: ipc.all_reduce(torch.randn(8, device="cuda"), compression=pycomm.TopK(0.1)),
                 lambda: ipc.all_reduce(torch.randn(8, device="cuda", dtype=torch.float64), compression=pycomm.Int8()),
                 lambda: ipc.all_reduce(torch.randn(8 << 20, device="cuda"), compression=pycomm.Int8())):
        try:
            call()
            msgs.append("accepted")
        except pycomm.CommError as e:
            msgs.append(str(e))
    out.append(msgs)
    ipc.check()
    comm.close()
    return out


def read_at_once_from_another_stream(rank: int, world: int, calls: int = 200) -> dict:
    """Each path's future waited on, and its result read at once, on a stream
    other than the one that made the input (busy with a sleep first, so that
    an unordered read would come early): the plain group path (Gloo's CUDA
    all-reduce, completed by pycomm's hook-futures thread), the compressed
    group path, and CUDA IPC. Returns per path the number of wrong reads."""
    from hooks_cases import _group
    from pycomm import hooks

    g, _ = _group(world)
    if rank >= world:
        return {}
    state = hooks.AllReduceState(g, path="group")
    gc = pycomm.GroupCommunicator(g)
    ipc = pycomm.cuda_ipc.IpcAllReduce(worker_store(), rank, world, device="cuda:0", buffer_bytes=1 << 22,
                                       prefix=f"order.{world}", timeout=60)
    side = torch.cuda.Stream()
    n = 1 << 18
    exact = world * (world + 1) / 2

    def plain(x):
        work = state._start_all_reduce("group", x, "sum")
        return state._group_future(work, lambda f: f.value()[0], x.device)

    def compressed(x):
        return gc.all_reduce(x, compression=pycomm.Int8(), async_op=True).get_future()

    def through_ipc(x):
        return ipc.all_reduce(x, async_op=True).get_future()

    wrong = {}
    for name, start in (("group plain", plain), ("group compressed", compressed), ("ipc", through_ipc)):
        reads = []
        for i in range(calls):
            x = torch.empty(n, device="cuda")
            torch.cuda._sleep(200_000 if i % 4 == 0 else 20_000)  # the input lands late
            x.fill_(rank + 1)
            fut = start(x)
            with torch.cuda.stream(side):
                value = fut.wait()
                value = value[0] if isinstance(value, list) else value
                reads.append(value.clone())  # read at once, on another stream
        torch.cuda.synchronize()
        tol = 0.0 if name != "group compressed" else 1e-2 * exact
        wrong[name] = sum(int(((r - exact).abs() > tol).any()) for r in reads)
    ipc.check()
    return wrong
