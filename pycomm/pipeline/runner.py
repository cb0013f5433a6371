"""The pipeline runner: runs one stage of a model on each rank of a
communicator, micro-batch by micro-batch, following a schedule.

Activations and gradients travel over pycomm's point-to-point channels. Each
message carries its tensors' dtypes and shapes, so nobody declares shapes and
a step whose shapes change (a shorter last batch) just works. Receives are
posted when a step starts and complete in the background, and sends return as
soon as their data is in the channel, so a stage computes the next micro-batch
while the last one travels.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint as _checkpoint

from .._loader import CommError
from ..communicator import Communicator
from .autograd import MemoryTracker, SplitState, as_list, cut_forward, needs_grad
from .catalog import get_schedule, stage_placement
from .schedule import Schedule, placement, plans, split_backward, validate
from .stage import Layer, stage_layers

logger = logging.getLogger("pycomm.pipeline")

Tensors = Union[torch.Tensor, Sequence[torch.Tensor]]


class Pipeline:
    """Runs this rank's stages of a pipeline.

    The model is cut into stages: one per rank (GPipe, 1F1B, ZB-H1), or v
    per rank (``virtual_stages``: interleaved schedules, looped so that rank
    r holds stages r, r + p, ...; ZB-V, where rank r holds stages r and
    2p - 1 - r). Every rank calls :meth:`step` once per batch: the rank
    holding the first stage with the inputs, the rank holding the last with
    the targets (both on one rank for a one-stage pipeline and for ZB-V's
    rank 0), the others with nothing. The rank holding the last stage returns
    the batch's loss; gradients accumulate into the stages' parameters
    exactly as ``loss_fn(model(inputs), targets).backward()`` on one process
    would put them (micro-batch losses are weighted by their share of the
    batch); call your optimizer after it, as usual.

    Example::

        comm = pycomm.Communicator()                       # 4 ranks
        layers = [functools.partial(nn.Linear, 512, 512) for _ in range(16)]
        pipe = Pipeline.from_layers(layers, comm, num_microbatches=8, schedule="interleaved-1f1b",
                                    virtual_stages=2, loss_fn=nn.functional.mse_loss)
        opt = torch.optim.SGD(pipe.module.parameters(), lr=0.1)
        for x, y in data:
            opt.zero_grad()
            loss = pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
            opt.step()

    Args:
        module: this rank's stage (takes the previous stage's output, a
            tensor or tuple of tensors, and returns its own), or a list of
            its stages in ascending stage order when it holds several
            (:func:`stages_of` says which).
        comm: the pipeline's communicator; ranks on one host or on several
            (then messages between hosts travel over its process group).
        num_microbatches: micro-batches per step; the batch is cut along
            dimension 0 (``torch.tensor_split``: sizes may differ by one),
            so it needs at least that many rows.
        schedule: ``"1f1b"`` (default), ``"gpipe"``, ``"interleaved-1f1b"``,
            ``"zb-h1"``, ``"interleaved-zb"``, ``"zbv"`` or a schedule
            function (see :mod:`pycomm.pipeline.schedule`).
        virtual_stages: stages per rank for the interleaved schedules
            (default 2).
        loss_fn: ``loss_fn(output, target)`` on the last stage; without it
            the last stage's output must be a scalar loss per micro-batch.
        loss_reduction: ``"mean"`` (default: the loss averages over the
            batch, so micro-batch ``k`` weighs ``len_k / len(batch)``) or
            ``"sum"``.
        checkpoint: recompute each stage's forward during backward instead
            of keeping its activations (only the stage's inputs are kept).
        dp_comm: data parallelism: a communicator over the replicas of this
            rank's stages; each step ends with their gradients averaged over it.
        track_memory: record the bytes of activations kept for backward
            (``stats()["peak_activation_bytes"]``).
        grad_scaler: loss scaling (float16): the last stage's backward starts
            from the loss times the scaler's scale (``step()`` still returns
            the loss unscaled), and every stage's scaler is readied, so that
            ``scaler.step(opt); scaler.update()`` works on every rank. Every
            stage's gradients carry that one scale, so the stages must agree
            on overflows: pass a scaler that syncs them, e.g. torch's
            ``ShardedGradScaler(process_group=...)`` over the pipeline's ranks
            (and its replicas'). A plain ``GradScaler`` decides per rank
            from its own gradients, letting one stage skip a step another
            takes and their scales part; it is refused with more than one rank.

    Zero-bubble schedules split a stage's backward per layer (a layer of an
    ``nn.Sequential`` stage; any other module is one layer): B computes the
    gradient of each layer's inputs, W later the gradient of its weights.

    If any rank's step raises, the runner aborts its communicators with the
    reason, so every rank of the pipeline (and of its replicas) raises
    :class:`pycomm.CommError` naming it instead of waiting; the communicators
    are unusable afterwards.
    """

    def __init__(
        self,
        module: Union[nn.Module, Sequence[nn.Module]],
        comm: Communicator,
        *,
        num_microbatches: int,
        schedule: Union[str, Schedule] = "1f1b",
        virtual_stages: Optional[int] = None,
        loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
        loss_reduction: str = "mean",
        checkpoint: bool = False,
        dp_comm: Optional[Communicator] = None,
        track_memory: bool = False,
        grad_scaler: Optional["torch.amp.GradScaler"] = None,
    ) -> None:
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        fn = get_schedule(schedule, virtual_stages)
        p, m, rank = comm.world_size, num_microbatches, comm.rank
        if grad_scaler is not None:
            ranks = p * (dp_comm.world_size if dp_comm is not None else 1)
            if type(grad_scaler).unscale_ is torch.amp.GradScaler.unscale_ and ranks > 1:
                raise ValueError(
                    f"pycomm.pipeline: grad_scaler is a {type(grad_scaler).__name__}, which decides overflows per "
                    f"rank from its own gradients; the {ranks} ranks would skip different steps and their scales "
                    "part. Use torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler(process_group=...) "
                    "over a group of the pipeline's ranks (and its replicas'), which agrees on them")
        all_plans = plans(fn, p, m)
        for r, plan in enumerate(all_plans):
            validate(plan, m, r)
        self._owner = placement(all_plans)
        self.comm = comm
        self.dp_comm = dp_comm
        self.rank: int = rank
        self.stages: List[int] = [s for s, r in enumerate(self._owner) if r == rank]
        modules = [module] if isinstance(module, nn.Module) else list(module)
        if len(modules) != len(self.stages) or not all(isinstance(x, nn.Module) for x in modules):
            raise ValueError(f"pycomm.pipeline: rank {rank} holds stages {self.stages} under this schedule, so it "
                             f"needs {len(self.stages)} module(s) in that order, got {len(modules)}")
        self._modules: Dict[int, nn.Module] = dict(zip(self.stages, modules))
        self.module: nn.Module = modules[0] if len(modules) == 1 else nn.ModuleList(modules)
        # ``stage`` names this rank in messages (its first stage; with one stage per rank, its rank).
        self.stage: int = self.stages[0]
        self.num_stages: int = len(self._owner)
        self.num_microbatches = num_microbatches
        self.loss_fn = loss_fn
        self.loss_reduction = loss_reduction
        self.checkpoint = checkpoint
        self.grad_scaler = grad_scaler
        self._loss_scale: Optional[torch.Tensor] = None  # this step's, from grad_scaler
        self.actions = all_plans[rank]
        self._split = split_backward(self.actions)
        # What this rank receives from each peer, in the order that peer sends it.
        self._inbox: Dict[int, List[Tuple[int, int, int]]] = {}
        for src, plan in enumerate(all_plans):
            if src != rank:
                self._inbox[src] = [msg[1] for a in plan for msg in [self._message(a)] if msg and msg[0] == rank]
        self._memory = MemoryTracker(self.module) if track_memory else None
        self._stats: Dict[str, float] = {"steps": 0}

    def _message(self, a: Any) -> Optional[Tuple[int, Tuple[int, int, int]]]:
        """Where action ``a``'s result goes, if to another rank: (rank, (kind, stage, micro-batch)),
        kind 0 for activations into ``stage``, 1 for gradients of ``stage``'s outputs."""
        if a.op == "F" and a.stage < self.num_stages - 1:
            return self._owner[a.stage + 1], (0, a.stage + 1, a.microbatch)
        if a.op == "B" and a.stage > 0:
            return self._owner[a.stage - 1], (1, a.stage - 1, a.microbatch)
        return None

    def _tag(self, key: Tuple[int, int, int]) -> int:
        kind, stage, k = key
        return ((stage * 2 + kind) * self.num_microbatches + k) % (1 << 32)

    @classmethod
    def from_layers(cls, layers: Union[nn.Sequential, Sequence[Layer]], comm: Communicator, *,
                    balance: Optional[Sequence[int]] = None, schedule: Union[str, Schedule] = "1f1b",
                    virtual_stages: Optional[int] = None, **kwargs: Any) -> "Pipeline":
        """Builds this rank's stages from the whole model's layers (see :func:`stage_layers`),
        cut into as many stages as the schedule has (ranks x virtual stages).

        Example::

            pipe = Pipeline.from_layers(layers, comm, num_microbatches=8, loss_fn=F.cross_entropy)
        """
        fn = get_schedule(schedule, virtual_stages)
        owner = stage_placement(fn, comm.world_size)
        modules = [stage_layers(layers, s, len(owner), balance) for s, r in enumerate(owner) if r == comm.rank]
        return cls(modules if len(modules) > 1 else modules[0], comm, schedule=fn, **kwargs)

    @property
    def is_first(self) -> bool:
        """This rank holds the first stage (it takes the inputs)."""
        return self._owner[0] == self.rank

    @property
    def is_last(self) -> bool:
        """This rank holds the last stage (it takes the targets and returns the loss)."""
        return self._owner[-1] == self.rank

    def stats(self) -> Dict[str, float]:
        """Of the last step: ``step_seconds``, ``compute_seconds`` (forwards and
        backwards), ``bubble`` (1 - compute/step), and with ``track_memory``
        ``peak_activation_bytes``; ``steps`` counts steps."""
        out = dict(self._stats)
        if self._memory is not None:
            out["peak_activation_bytes"] = self._memory.peak
        return out

    # ------------------------------------------------------------------ step

    def step(self, inputs: Optional[Tensors] = None, targets: Any = None) -> Optional[torch.Tensor]:
        """Forward and backward of one batch; returns the loss on the last stage's rank, else None."""
        self._current = self.stage
        try:
            return self._step(inputs, targets)
        except BaseException as e:
            self._abort(e)
            raise

    def _abort(self, error: BaseException) -> None:
        if isinstance(error, CommError):
            why = str(error)  # a peer's failure (or ours, already published): pass it on as it is
        else:
            where = f" (rank {dist.get_rank()})" if dist.is_available() and dist.is_initialized() else ""
            why = (f"pycomm.pipeline: stage {self._current} of {self.num_stages}{where} raised "
                   f"{type(error).__name__}: {error}")
        logger.error("%s; aborting the pipeline", why)
        for comm in (self.comm, self.dp_comm):
            if comm is not None:
                try:
                    # The reason already names its origin: a sub-communicator's
                    # rank would only confuse it.
                    comm.abort(why, name_rank=False)
                except Exception:  # noqa: BLE001 - already failing; the first reason wins
                    pass

    def _split_batch(self, x: Tensors, what: str) -> List[List[torch.Tensor]]:
        tensors = as_list(x)
        m = self.num_microbatches
        for t in tensors:
            if t.dim() == 0 or t.shape[0] < m:
                raise ValueError(f"pycomm.pipeline: {what} of shape {tuple(t.shape)} cannot be cut into "
                                 f"{m} micro-batches along dimension 0")
        parts = [torch.tensor_split(t, m) for t in tensors]
        return [[p[k] for p in parts] for k in range(m)]

    def _step(self, inputs: Optional[Tensors], targets: Any) -> Optional[torch.Tensor]:
        t_start = time.perf_counter()
        m, comm, last = self.num_microbatches, self.comm, self.num_stages - 1
        # 1. Inputs and targets, cut into micro-batches.
        if self.is_first:
            if inputs is None:
                raise ValueError("pycomm.pipeline: the first stage's step() needs the inputs")
            in_chunks = self._split_batch(inputs, "inputs")
        elif inputs is not None:
            raise ValueError(f"pycomm.pipeline: rank {self.rank} got inputs; only the first stage's rank takes them")
        weights = [1.0] * m
        if self.is_last and self.loss_fn is not None:
            if targets is None:
                raise ValueError("pycomm.pipeline: the last stage's step() needs the targets")
            parts = self._split_batch(targets, "targets")
            tgt_chunks = [c[0] for c in parts] if isinstance(targets, torch.Tensor) else parts
            if self.loss_reduction == "mean":
                rows = [len(c[0]) for c in parts]
                weights = [r / sum(rows) for r in rows]
        elif self.is_last and self.loss_reduction == "mean":
            weights = [1.0 / m] * m
        if self.grad_scaler is not None:
            # scale() readies the scaler on every rank (step() needs that)
            # and gives the scale as a tensor, with no host sync.
            device = next((p.device for mod in self._modules.values() for p in mod.parameters()),
                          torch.device("cpu"))
            self._loss_scale = self.grad_scaler.scale(torch.ones((), device=device))
        # 2. Post every receive of the step, per peer in the order that peer
        #    sends: they complete in the background while this rank computes.
        inbox: Dict[Tuple[int, int, int], Any] = {}
        for src, keys in self._inbox.items():
            for key in keys:
                inbox[key] = comm.recv(src, tag=self._tag(key), async_op=True)
        local: Dict[Tuple[int, int, int], List[torch.Tensor]] = {}  # hand-offs between this rank's stages
        sends = []

        def deliver(key: Tuple[int, int, int], tensors: List[torch.Tensor]) -> None:
            dst = self._owner[key[1]]
            if dst == self.rank:
                local[key] = tensors
            else:
                sends.append(comm.send(tensors, dst, tag=self._tag(key), async_op=True))

        def take(key: Tuple[int, int, int]) -> List[torch.Tensor]:
            if key in local:
                return local.pop(key)
            work = inbox.pop(key)
            work.wait()
            return work.result()

        saved: Dict[Tuple[int, int], Any] = {}
        losses: List[torch.Tensor] = []
        compute = 0.0
        # 3. Run the schedule.
        for action in self.actions:
            s, k = action.stage, action.microbatch
            self._current = s
            split = (s, k) in self._split
            if action.op == "F":
                if s == 0:
                    xs = in_chunks[k]
                else:
                    xs = [t.detach().requires_grad_() if needs_grad(t) else t for t in take((0, s, k))]
                t0 = time.perf_counter()
                out, state = self._forward(s, xs, k, split)
                if s == last:
                    loss = out if self.loss_fn is None else self.loss_fn(out, tgt_chunks[k])
                    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                        raise ValueError("pycomm.pipeline: the loss of a micro-batch must be a scalar tensor")
                    loss = loss.reshape(()) * weights[k]
                    losses.append(loss.detach())
                    outs = [self._scaled(loss)]
                else:
                    outs = as_list(out)
                    deliver((0, s + 1, k), [o.detach() for o in outs])
                saved[(s, k)] = (xs, outs, state)
                compute += time.perf_counter() - t0
            elif action.op == "B":
                xs, outs, state = saved[(s, k)] if split else saved.pop((s, k))
                grads = None if s == last else take((1, s, k))
                t0 = time.perf_counter()
                if split:
                    back = self._input_backward(s, k, outs, grads, state, tgt_chunks[k] if s == last and
                                                self.loss_fn is not None else None, weights[k])
                else:
                    if s == last:
                        outs[0].backward()
                    else:
                        pairs = [(o, g) for o, g in zip([o for o in outs if needs_grad(o)], grads)
                                 if o.requires_grad]
                        if pairs:
                            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                    # The first stage sends nothing back (its inputs may be the
                    # caller's views, whose .grad autograd leaves unset).
                    back = [x.grad if x.grad is not None else torch.zeros_like(x) for x in xs
                            if needs_grad(x)] if s > 0 else []
                    if self._memory is not None:
                        self._memory.release((s, k))
                if s > 0 and back:
                    deliver((1, s - 1, k), back)
                compute += time.perf_counter() - t0
            else:
                _, _, state = saved.pop((s, k))
                t0 = time.perf_counter()
                for outs_w, grads_w, params in state.stash:
                    torch.autograd.backward(outs_w, grads_w, inputs=params)
                state.stash = []
                if self._memory is not None:
                    self._memory.release_all(s, k)
                compute += time.perf_counter() - t0
        # 4. Every send must have left before the buffers it reads go away.
        for work in sends:
            work.wait()
        # 5. Data parallelism: average this rank's gradients over its replicas.
        if self.dp_comm is not None and self.dp_comm.world_size > 1:
            t0 = time.perf_counter()
            self._average_gradients()
            compute += time.perf_counter() - t0
        step = time.perf_counter() - t_start
        self._stats.update(steps=self._stats["steps"] + 1, step_seconds=step, compute_seconds=compute,
                           bubble=max(0.0, 1.0 - compute / step) if step > 0 else 0.0)
        return torch.stack(losses).sum() if self.is_last else None

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss the backward starts from: times the step's loss scale."""
        return loss if self._loss_scale is None else loss * self._loss_scale

    def _forward(self, s: int, xs: List[torch.Tensor], k: int, split: bool) -> Tuple[Any, Optional[SplitState]]:
        module = self._modules[s]
        if not split:
            if self._memory is None:
                return self._call(module, xs), None
            with self._memory.hooks((s, k)):
                return self._call(module, xs), None
        state = SplitState(xs, torch.get_rng_state() if self.checkpoint else None)
        if self.checkpoint and torch.is_grad_enabled():
            # Keep only the inputs (and the RNG state, for dropout); B recomputes.
            with torch.no_grad():
                return module(*xs), state
        hooks = None if self._memory is None else (lambda i: self._memory.hooks((s, k, i)))
        out, state.segments = cut_forward(module, xs, hooks)
        return out, state

    def _input_backward(self, s: int, k: int, outs: List[torch.Tensor], grads: Optional[List[torch.Tensor]],
                        state: SplitState, target: Any, weight: float) -> List[torch.Tensor]:
        """B of a split backward: input gradients, layer by layer from the last,
        leaving each layer's (outputs, output gradients, parameters) for W."""
        last = s == self.num_stages - 1
        if state.rng is not None:  # checkpointed: recompute the forward, autograd on
            with torch.random.fork_rng(devices=[]), torch.enable_grad():
                torch.set_rng_state(state.rng)
                out, state.segments = cut_forward(self._modules[s], state.xs)
                if last:
                    loss = out if self.loss_fn is None else self.loss_fn(out, target)
                    outs = [self._scaled(loss.reshape(()) * weight)]
                else:
                    outs = as_list(out)
        segments = state.segments
        final = [t for t in segments[-1].leaves if t is not None] if segments else []
        if last:
            # The loss is a parameter-free layer after the stage's last one.
            got = torch.autograd.grad(outs, final, allow_unused=True) if final else []
            current = {id(t): g for t, g in zip(final, got)}
        else:
            needs = [o for o in outs if needs_grad(o)]
            current = {id(o): g for o, g in zip(needs, grads) if o.requires_grad}
        for index in range(len(segments) - 1, -1, -1):
            seg = segments[index]
            pairs = [(o, current.get(id(leaf))) for o, leaf in zip(seg.outs, seg.leaves) if leaf is not None]
            pairs = [(o, g) for o, g in pairs if g is not None]
            current = {}
            if not pairs:
                continue
            o_list, g_list = [o for o, _ in pairs], [g for _, g in pairs]
            if seg.ins:
                got = torch.autograd.grad(o_list, seg.ins, g_list, retain_graph=bool(seg.params), allow_unused=True)
                current = {id(x): g for x, g in zip(seg.ins, got)}
            if seg.params:
                state.stash.append((o_list, g_list, seg.params))
                if self._memory is not None:  # the output gradients W will need are held too
                    self._memory.add((s, k), sum(g.numel() * g.element_size() for g in g_list))
            elif self._memory is not None:  # its graph is freed: nothing of it waits for W
                self._memory.release((s, k, index))
        state.segments = []
        back = []
        for x in state.xs:
            if needs_grad(x):
                g = current.get(id(x))
                back.append(g if g is not None else torch.zeros_like(x))
        return back

    def _call(self, module: nn.Module, xs: List[torch.Tensor]) -> Any:
        if self.checkpoint and torch.is_grad_enabled():
            return _checkpoint(module, *xs, use_reentrant=False)
        return module(*xs)

    def _average_gradients(self) -> None:
        params = [p for p in self.module.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        # One flat all-reduce per dtype: a few large messages, not one per tensor.
        self.dp_comm.all_reduce_coalesced([p.grad for p in params], op="avg")
