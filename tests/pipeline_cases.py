"""Worker-side cases for point-to-point messages and the pipeline runner
(run inside harness workers). Every worker joins one default Gloo group;
the pipelines run on pycomm communicators over subsets of the pool."""
from __future__ import annotations

import os
import signal
import time
from typing import Dict, List

import torch
import torch.distributed as dist
from torch import nn

import pycomm
from harness import all_reached, join_default_group, make_comm
from pycomm.pipeline import Pipeline, StageModule, grid

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool, torch.complex64]


def init_default(rank: int, world: int, name: str) -> str:
    join_default_group(rank, world, name)
    return dist.get_backend()


def _random(dtype: torch.dtype, shape, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=dtype)
    return torch.randint(0, 100, shape, generator=gen).to(dtype)


# ------------------------------------------------------- point-to-point


def p2p_matrix(rank: int, world: int, name: str, seed: int, **comm_kwargs) -> Dict[str, int]:
    """Every rank sends every other rank messages of every dtype and shape
    (empty, 0-d, non-contiguous, lists, larger than the ring) and checks what
    it receives against the sender's generator. ``comm_kwargs`` may put
    ranks on different (simulated) hosts or force the process group."""
    comm = make_comm(rank, world, name, timeout=60, **comm_kwargs)
    shapes = [(0,), (), (7,), (3, 5), (2, 3, 4, 5)]

    def message(src: int, dst: int) -> List[List[torch.Tensor]]:
        gen = torch.Generator().manual_seed(seed * 1000 + src * 10 + dst)
        msgs = [[_random(d, s, gen)] for d in DTYPES for s in shapes]
        msgs.append([_random(torch.float32, (5, 6), gen).t(), _random(torch.int64, (4,), gen)])
        # 3 rings' worth: the sender streams while the receiver drains.
        msgs.append([_random(torch.float32, (3 * (1 << 20) + 17,), gen)])
        return msgs

    works = []
    for dst in range(world):
        if dst != rank:
            msgs = message(rank, dst)
            for i, msg in enumerate(msgs):
                # Some small sends are synchronous: they run on this thread when
                # the lane is idle and queue behind the asynchronous ones when
                # not; either way they must arrive in order.
                if i % 3 == 1 and i < len(msgs) - 1:
                    comm.send(msg, dst, tag=i)
                else:
                    works.append(comm.send(msg, dst, tag=i, async_op=True))
    checked = 0
    for src in range(world):
        if src == rank:
            continue
        for i, want in enumerate(message(src, rank)):
            if i % 2:
                got = comm.recv(src, tag=i)
                got = [got] if isinstance(got, torch.Tensor) else got
            else:
                got = [torch.empty(t.shape, dtype=t.dtype) for t in want]
                comm.recv(src, out=got if len(got) > 1 else got[0], tag=i)
            assert len(got) == len(want), (src, i)
            for g, w in zip(got, want):
                assert g.dtype == w.dtype and g.shape == w.shape, (src, i, g.dtype, g.shape, w.dtype, w.shape)
                assert torch.equal(g, w), (src, i)
                checked += 1
    for w in works:
        w.wait()
    comm.close()
    return {"checked": checked}


def p2p_crossing_large(rank: int, name: str) -> bool:
    """Two ranks send each other 64 MiB at once, synchronously on one side:
    neither blocks the other's receive (each direction has its own lane)."""
    comm = make_comm(rank, 2, name, timeout=60)
    peer = 1 - rank
    mine = torch.full((16 << 20,), float(rank + 1))
    work = comm.send(mine, peer, async_op=True)
    got = comm.recv(peer)
    work.wait()
    comm.close()
    return bool(torch.all(got == float(peer + 1)))


def p2p_on_one_cpu(rank: int, name: str, pinned: bool) -> Dict[str, object]:
    """Two ranks that start on one CPU exchange 300 round trips of fresh
    random messages. ``pinned``: both may run only there (waits must yield
    to the peer instead of spinning); else their affinity is the machine
    and a waiter that finds its peer on its CPU moves itself off it, and
    must leave its affinity as it found it."""
    original = os.sched_getaffinity(0)
    cpu = min(original)
    comm = make_comm(rank, 2, name, timeout=60)
    peer = 1 - rank
    gen = torch.Generator().manual_seed(1234)
    wrong = 0
    try:
        os.sched_setaffinity(0, {cpu})
        if not pinned:
            os.sched_setaffinity(0, original)  # both start on `cpu`, free to move
        for i in range(300):
            n = 1024 if i % 10 else 1 << 18
            msgs = [torch.randn(n, generator=gen) for _ in range(2)]  # the same on both ranks
            if rank == 0:
                comm.send(msgs[0], peer)
                got = comm.recv(peer)
            else:
                got = comm.recv(peer)
                comm.send(msgs[1], peer)
            wrong += int(not torch.equal(got, msgs[peer]))
        after = os.sched_getaffinity(0)
    finally:
        os.sched_setaffinity(0, original)
        comm.close()
    return {"wrong": wrong, "affinity_kept": after == ({cpu} if pinned else original)}


def p2p_errors(rank: int, name: str, **comm_kwargs) -> Dict[str, str]:
    """Bad calls raise on the caller with a clear message, and a failed send
    or a tag mismatch reaches the receiver instead of leaving it waiting."""
    comm = make_comm(rank, 2, name, timeout=30, **comm_kwargs)
    out: Dict[str, str] = {}

    def catch(key, fn):
        t0 = time.perf_counter()
        try:
            fn()
            out[key] = "no error"
        except pycomm.CommError as e:
            out[key] = str(e)
        out[key + "_s"] = time.perf_counter() - t0

    catch("self", lambda: comm.send(torch.ones(2), rank))
    catch("range", lambda: comm.recv(5))
    catch("tag", lambda: comm.send(torch.ones(1), 1 - rank, tag=-1))
    # A lazy conjugate view: its memory holds the unconjugated values, which
    # the receiver got (silently wrong data) before the check. The refused
    # send fails the channel, so the receiver learns why; a refused out
    # tensor is refused before any message is taken.
    z = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)
    if rank == 0:
        catch("conj_send", lambda: comm.send(z.conj(), 1))
    else:
        catch("conj_out", lambda: comm.recv(0, out=torch.empty(2, dtype=torch.complex64).conj()))
        catch("conj_send", lambda: comm.recv(0))
    if rank == 0:
        catch("bad_send", lambda: comm.send(torch.ones(2).to_sparse(), 1))
        comm.send(torch.ones(2, 3), 1)
        catch("mismatch", lambda: comm.recv(1))  # rank 1 fails the channel; the abort reaches us
    else:
        catch("bad_send", lambda: comm.recv(0))
        catch("mismatch", lambda: comm.recv(0, out=torch.empty(3, 2)))
    comm.close()
    return out


def p2p_sender_killed_before_the_receiver_attached(rank: int, name: str) -> Dict[str, object]:
    """Rank 1 sends to rank 0 (creating their channel's segment and leaving
    the message in its ring) and is killed with SIGKILL before rank 0
    receives, so its own close never runs. Rank 0 never maps the segment;
    its close must remove the name, which nobody else can."""
    from harness import worker_store

    comm = make_comm(rank, 2, name, timeout=30)
    store = worker_store()
    before = {f for f in os.listdir("/dev/shm") if f.startswith("pycomm.")}
    if rank == 1:
        comm.send(torch.randn(64), 0)
        store.set(f"{name}/sent", str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    store.wait([f"{name}/sent"])
    pid = int(store.get(f"{name}/sent"))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.01)
    channel = sorted(f for f in os.listdir("/dev/shm") if f.startswith("pycomm.") and ".p2p." in f and f not in before)
    comm.close()
    return {"peer_gone": not _alive(pid), "channel": channel,
            "left": [f for f in channel if os.path.exists("/dev/shm/" + f)]}


def _alive(pid: int) -> bool:
    """False once `pid` is gone or a zombie (its state read as the bootstrap reads it)."""
    from pycomm.bootstrap import _proc_stat

    stat = _proc_stat(pid)
    return stat is not None and stat[0] != "Z"


def p2p_abort_between_hosts(rank: int, name: str) -> Dict[str, object]:
    """Two ranks on hosts of their own (simulated), timeout 30 s. An abort's
    failure message is the last of its stream: every later receive from that
    rank raises it at once, and a close waits for no send that a failed rank
    will never take. Each of those waited for the whole timeout: the
    pipeline's queued receives held its lanes (and the close that joins
    them), and two aborted ranks each waited at close for the other to take
    its last messages."""
    out: Dict[str, object] = {}

    def both_reached(key: str) -> None:
        all_reached(rank, 2, f"{name}/{key}")

    def outcome(key: str, fn) -> None:
        t0 = time.perf_counter()
        try:
            out[key] = ("ok", fn())
        except pycomm.CommError as e:
            out[key] = ("error", str(e))
        out[key + "_s"] = time.perf_counter() - t0

    # 1. Rank 0 sends one message and aborts; rank 1 has three receives
    # queued: data, rank 0's reason, and one that must raise that reason at
    # once. Rank 1 then aborts too (as a pipeline's ranks do).
    comm = make_comm(rank, 2, name + "-a", timeout=30, local_size=1)
    x = torch.randn(5, generator=torch.Generator().manual_seed(sum(map(ord, name))))  # the same on both ranks
    if rank == 0:
        first = comm.recv(1, async_op=True)
        comm.send(x, 1)
        comm.abort("rank 0's stage raised", name_rank=False)
        outcome("first", lambda: first.wait())
        outcome("second", lambda: comm.recv(1))
    else:
        works = [comm.recv(0, async_op=True) for _ in range(3)]
        outcome("data", lambda: works[0].wait() and float((works[0].result()[0] - x).abs().max()))
        outcome("reason", lambda: works[1].wait())
        outcome("after", lambda: works[2].wait())
        comm.abort("rank 1 stopped", name_rank=False)
    outcome("close_a", comm.close)

    # 2. Rank 1 takes one of two messages and aborts; rank 0 reads its reason,
    # then closes while its second message is still untaken (rank 1 stays
    # up until rank 0 closed, so no broken connection ends the wait).
    comm = make_comm(rank, 2, name + "-b", timeout=30, local_size=1)
    if rank == 0:
        reply = comm.recv(1, async_op=True)
        comm.send(torch.ones(3), 1)
        comm.send(torch.ones(3), 1)
        outcome("reply", lambda: reply.wait())
        outcome("close_b", comm.close)
        both_reached("b")
    else:
        comm.recv(0)
        comm.abort("rank 1 took one", name_rank=False)
        both_reached("b")
        outcome("close_b", comm.close)

    # 3. Both ranks send a message the other never takes and abort; neither
    # reads the other's reason (each finds it on the failure board), and both
    # close at once.
    comm = make_comm(rank, 2, name + "-c", timeout=30, local_size=1)
    comm.send(torch.ones(2), 1 - rank)
    both_reached("c-sent")
    comm.abort(f"rank {rank} gave up", name_rank=False)
    both_reached("c-aborted")
    outcome("close_c", comm.close)

    # 4. Rank 1 takes rank 0's message and aborts; rank 0 never receives from
    # it, so rank 1's reason stays untaken: its close gives up on it after a
    # grace instead of the whole timeout. Rank 0 closes once rank 1 did.
    comm = make_comm(rank, 2, name + "-d", timeout=30, local_size=1)
    if rank == 0:
        comm.send(torch.ones(3), 1)
        both_reached("d")
        outcome("close_d", comm.close)
    else:
        comm.recv(0)
        comm.abort("rank 1 quit", name_rank=False)
        outcome("close_d", comm.close)
        both_reached("d")

    # 5. Rank 0 aborts after a send; once rank 1 read the reason, a send to
    # rank 0 raises it at once (it used to be queued for a rank that
    # receives nothing more).
    comm = make_comm(rank, 2, name + "-e", timeout=30, local_size=1)
    if rank == 0:
        comm.send(torch.ones(3), 1)
        comm.abort("rank 0 quit", name_rank=False)
        both_reached("e")
    else:
        comm.recv(0)
        outcome("reason_e", lambda: comm.recv(0))
        outcome("send_e", lambda: comm.send(torch.ones(1 << 16), 0))
        both_reached("e")
    outcome("close_e", comm.close)

    # 6. Rank 1 waits for a first message from rank 0, which aborts before it
    # sent any: the reason reaches rank 1 unasked, and its receive raises at
    # once (it waited for the whole timeout: no stream carried the reason).
    comm = make_comm(rank, 2, name + "-f", timeout=30, local_size=1)
    if rank == 0:
        both_reached("f")
        time.sleep(0.2)  # rank 1 is inside its receive
        comm.abort("rank 0 failed before it sent", name_rank=False)
        both_reached("f-raised")
    else:
        work = comm.recv(0, async_op=True)
        both_reached("f")
        outcome("first_f", lambda: work.wait())
        both_reached("f-raised")
    outcome("close_f", comm.close)

    # 7. Rank 0 aborts with no message exchanged, and closes before rank 1
    # receives: the unasked reason does not hold rank 0's close (2 s, the
    # bound for an aborted rank's sends) while rank 1 is still up. Rank 1's
    # receives, posted only then, raise at once with rank 0's reason (its
    # unasked message, or its closed connection explained by the failure
    # board).
    comm = make_comm(rank, 2, name + "-g", timeout=30, local_size=1)
    if rank == 0:
        comm.abort("rank 0 quit before any message", name_rank=False)
        outcome("close_g", comm.close)
        both_reached("g")
    else:
        both_reached("g")
        outcome("late_g", lambda: comm.recv(0))
        outcome("again_g", lambda: comm.recv(0))
        outcome("close_g", comm.close)
    return out


# ------------------------------------------------------------- pipeline


class Fork(nn.Module):
    """Returns two tensors (and an integer one), so that tuples cross stages."""

    def forward(self, x):
        return x, 0.5 * x, (x[:, 0] > 0).long()


class TwoLinear(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)

    def forward(self, x, y, idx):
        return torch.tanh(self.a(x)), self.b(y) + idx.to(y.dtype)[:, None] * 1e-3, idx


class Join(nn.Module):
    def forward(self, x, y, idx):
        return x + y


class Boom(nn.Module):
    """Raises on the chosen micro-batch call (the error-propagation test)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = -1
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.armed:
            raise ValueError("boom in the forward")
        return x


WIDTH = 12


def make_layers(seed: int = 0) -> List[nn.Module]:
    torch.manual_seed(seed)
    w = WIDTH
    return [nn.Linear(w, w), nn.Tanh(), Fork(), TwoLinear(w), TwoLinear(w), Join(), nn.Linear(w, w), nn.Tanh(),
            nn.Linear(w, 4)]


# Cuts that pass the tuple between stages (after Fork, between the TwoLinears);
# with two stages per rank, some stages hold no parameters (Tanh alone).
BALANCE = {1: [9], 2: [3, 6], 4: [3, 1, 2, 3]}
BALANCE_V2 = {1: [3, 6], 2: [2, 1, 3, 3], 4: [1, 1, 1, 1, 2, 1, 1, 1]}
# Every schedule, with its stages per rank.
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2), ("interleaved-zb", 2), ("zbv", 2)]


def _reference(layers: List[nn.Module], x, y, loss_fn):
    model = StageModule(*layers)
    model.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    return loss.detach(), [[p.grad.clone() for p in layer.parameters()] for layer in layers]


def _stage_params(layers, stage, num_stages, balance):
    start = sum(balance[:stage])
    return list(nn.Sequential(*layers[start:start + balance[stage]]).parameters())


def pipeline_matches(rank: int, num_stages: int, name: str, schedules=None, **comm_kwargs) -> List[dict]:
    """Loss and every gradient equal the single-process run, for every
    schedule (one and two stages per rank), 1/2/3/4/8 micro-batches (fewer
    than the ranks too), with and without checkpointing, and batches that do
    not divide evenly."""
    if rank >= num_stages:
        return []
    comm = make_comm(rank, num_stages, name, timeout=60, **comm_kwargs)
    torch.set_default_dtype(torch.float64)
    try:
        results = []
        gen = torch.Generator().manual_seed(7 + num_stages)
        for schedule, v in SCHEDULES if schedules is None else schedules:
            balance = BALANCE[num_stages] if v == 1 else BALANCE_V2[num_stages]
            for m in (1, 2, 3, 4, 8):
                for ckpt in (False, True):
                    layers = make_layers(seed=m)
                    batch = 8 * m + 3  # micro-batches of unequal size
                    x = torch.randn(batch, WIDTH, generator=gen)
                    y = torch.randn(batch, 4, generator=gen)
                    ref_loss, ref_grads = _reference(layers, x, y, nn.functional.mse_loss)
                    for layer in layers:
                        layer.zero_grad()
                    pipe = Pipeline.from_layers(layers, comm, balance=balance, num_microbatches=m,
                                                schedule=schedule, loss_fn=nn.functional.mse_loss, checkpoint=ckpt)
                    loss = pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
                    err, has_grads, compared = 0.0, True, 0
                    for stage in pipe.stages:
                        start = sum(balance[:stage])
                        for i in range(start, start + balance[stage]):
                            for got, want in zip(layers[i].parameters(), ref_grads[i]):
                                compared += 1
                                if got.grad is None:
                                    has_grads = False
                                    continue
                                err = max(err, (got.grad - want).abs().max().item() / max(1e-12, want.abs().max().item()))
                    results.append({"schedule": schedule, "m": m, "ckpt": ckpt, "grad_rel_err": err,
                                    "has_grads": has_grads, "compared": compared, "stages": pipe.stages,
                                    "last": pipe.is_last,
                                    "loss_err": abs(loss.item() - ref_loss.item()) if loss is not None else None})
        return results
    finally:
        torch.set_default_dtype(torch.float32)
        comm.close()


def loss_scaling(rank: int, name: str, scaler_kind: str, schedule: str = "1f1b", checkpoint: bool = False,
                 steps: int = 6, overflow_at: int = 3) -> dict:
    """A 2-stage pipeline with ``grad_scaler=``, against the same pipeline
    without loss scaling whose step ``overflow_at`` is skipped. At that step
    only stage 0's gradients overflow (a value set to Inf after backward).
    ``scaler_kind`` "sharded": ShardedGradScaler over the pipeline's ranks;
    "plain": torch's GradScaler (the runner refuses it: the error)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    group = dist.new_group([0, 1])  # collective over the pool's default group
    if rank >= 2:
        return {}
    comm = make_comm(rank, 2, name, timeout=60)
    try:
        v = 2 if schedule in ("interleaved-1f1b", "interleaved-zb", "zbv") else 1
        balance = BALANCE[2] if v == 1 else BALANCE_V2[2]
        runs = {}
        for scaled in (True, False):
            if scaled and scaler_kind == "plain":
                try:
                    Pipeline.from_layers(make_layers(seed=5), comm, balance=balance, num_microbatches=4,
                                         schedule=schedule, loss_fn=nn.functional.mse_loss,
                                         grad_scaler=torch.amp.GradScaler("cpu"))
                except ValueError as e:
                    return {"refused": str(e)}
                return {"refused": ""}
            scaler = ShardedGradScaler("cpu", init_scale=2.0 ** 10, process_group=group) if scaled else None
            pipe = Pipeline.from_layers(make_layers(seed=5), comm, balance=balance, num_microbatches=4,
                                        schedule=schedule, loss_fn=nn.functional.mse_loss, checkpoint=checkpoint,
                                        grad_scaler=scaler)
            opt = torch.optim.SGD(pipe.module.parameters(), lr=0.1, momentum=0.9)
            gen = torch.Generator().manual_seed(21)
            scales, moved, losses = [], [], []
            for t in range(1, steps + 1):
                x, y = torch.randn(16, WIDTH, generator=gen), torch.randn(16, 4, generator=gen)
                opt.zero_grad()
                loss = pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
                losses.append(None if loss is None else loss.item())
                before = [p.detach().clone() for p in pipe.module.parameters()]
                if scaler is not None:
                    if t == overflow_at and pipe.is_first:
                        next(pipe.module.parameters()).grad[0, 0] = float("inf")
                    scaler.step(opt)
                    scaler.update()
                    scales.append(scaler.get_scale())
                elif t != overflow_at:
                    opt.step()
                moved.append(any(not torch.equal(a, b) for a, b in zip(before, pipe.module.parameters())))
            runs[scaled] = {"scales": scales, "moved": moved, "losses": losses,
                            "params": [p.detach().clone() for p in pipe.module.parameters()]}
        same = all(torch.equal(a, b) for a, b in zip(runs[True]["params"], runs[False]["params"]))
        return {"scales": runs[True]["scales"], "moved": runs[True]["moved"], "same_params": same,
                "same_losses": runs[True]["losses"] == runs[False]["losses"], "last": pipe.is_last}
    finally:
        comm.close()


_GRID: Dict[str, tuple] = {}


def pp_dp_matches(rank: int, steps: int, schedule: str = "1f1b", v: int = 1) -> dict:
    """2 stages x 2 replicas on 4 ranks trains like one process on the
    whole batch: the parameters agree after several optimizer steps."""
    pipe_comm, dp_comm = grid(2, timeout=60)
    torch.set_default_dtype(torch.float64)
    try:
        layers = make_layers(seed=3)
        ref_layers = make_layers(seed=3)
        ref = StageModule(*ref_layers)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        balance = BALANCE[2] if v == 1 else BALANCE_V2[2]
        pipe = Pipeline.from_layers(layers, pipe_comm, balance=balance, num_microbatches=4, schedule=schedule,
                                    loss_fn=nn.functional.mse_loss, dp_comm=dp_comm)
        mine = pipe.module
        opt = torch.optim.SGD(mine.parameters(), lr=0.1, momentum=0.9)
        gen = torch.Generator().manual_seed(11)
        replica = dist.get_rank() // 2
        losses = []
        for _ in range(steps):
            x = torch.randn(32, WIDTH, generator=gen)
            y = torch.randn(32, 4, generator=gen)
            ref_opt.zero_grad()
            ref_loss = nn.functional.mse_loss(ref(x), y)
            ref_loss.backward()
            ref_opt.step()
            xs, ys = x[16 * replica:16 * (replica + 1)], y[16 * replica:16 * (replica + 1)]
            opt.zero_grad()
            loss = pipe.step(xs if pipe.is_first else None, ys if pipe.is_last else None)
            opt.step()
            losses.append((None if loss is None else loss.item(), ref_loss.item()))
        ref_params = [p for st in pipe.stages for p in _stage_params(ref_layers, st, pipe.num_stages, balance)]
        init = [p for st in pipe.stages for p in _stage_params(make_layers(seed=3), st, pipe.num_stages, balance)]
        err = max((a - b).abs().max().item() for a, b in zip(mine.parameters(), ref_params))
        moved = max((a - b).abs().max().item() for a, b in zip(mine.parameters(), init))
        assert len(ref_params) == len(list(mine.parameters()))
        return {"param_err": err, "moved": moved, "losses": losses, "stage": pipe_comm.rank, "last": pipe.is_last}
    finally:
        torch.set_default_dtype(torch.float32)
        pipe_comm.close()
        dp_comm.close()


def stage_raises(rank: int, bad_rank: int, schedule: str = "1f1b", hosts: bool = False) -> dict:
    """One stage raises in its forward: every rank raises within seconds (its
    own error, or CommError naming that stage). With two stages per rank, the
    first stage of the bad rank raises. On one host: a 2 x 2 layout (pipeline
    x data parallel); with ``hosts``: one pipeline of 4 ranks, each on its
    own (simulated) host, so the reason travels as each failing rank's last
    message to its peers."""
    if hosts:
        pipe_comm, dp_comm = make_comm(rank, 4, f"raise{bad_rank}{schedule}", timeout=60, local_size=1), None
    else:
        pipe_comm, dp_comm = grid(2, timeout=60)
    stages = pipe_comm.world_size * (1 if schedule in ("gpipe", "1f1b", "zb-h1") else 2)
    # A Linear and a Boom per stage.
    layers = [m for i in range(stages) for m in (nn.Linear(WIDTH, WIDTH if i < stages - 1 else 4), Boom())]
    pipe = Pipeline.from_layers(layers, pipe_comm, schedule=schedule, num_microbatches=4,
                                loss_fn=nn.functional.mse_loss, dp_comm=dp_comm, balance=[2] * stages)
    if rank == bad_rank:
        first = pipe.module if isinstance(pipe.module, StageModule) else pipe.module[0]
        next(m for m in first if isinstance(m, Boom)).armed = 2  # the second micro-batch
    x, y = torch.randn(16, WIDTH), torch.randn(16, 4)
    t0 = time.perf_counter()
    try:
        pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
        return {"error": None, "seconds": time.perf_counter() - t0, "num_stages": pipe.num_stages}
    except BaseException as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.perf_counter() - t0,
                "num_stages": pipe.num_stages}
    finally:
        pipe_comm.close()
        if dp_comm is not None:
            dp_comm.close()
