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
from .gpipe import gpipe
from .one_f_one_b import one_f_one_b
from .schedule import Schedule, validate
from .stage import Layer, stage_layers

logger = logging.getLogger("pycomm.pipeline")

SCHEDULES: Dict[str, Schedule] = {"gpipe": gpipe, "1f1b": one_f_one_b}

Tensors = Union[torch.Tensor, Sequence[torch.Tensor]]


def _as_list(x: Any) -> List[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in x):
        return list(x)
    raise TypeError(f"a pipeline stage must take and return a tensor or a tuple of tensors, got {type(x).__name__}")


def _needs_grad(t: torch.Tensor) -> bool:
    # Both sides of a link apply the same rule, so the gradients sent back
    # line up with the activations sent forward.
    return t.is_floating_point() or t.is_complex()


class _MemoryTracker:
    """Bytes autograd saves for backward per micro-batch (parameters
    excluded, a tensor saved twice counted once): the activation memory a
    schedule keeps alive."""

    def __init__(self, module: nn.Module) -> None:
        self.param_storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.live = 0
        self.peak = 0
        self.per_mb: Dict[int, int] = {}

    def hooks(self, mb: int):
        seen = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            ptr = t.untyped_storage().data_ptr()
            # A view counts its own bytes (a micro-batch of the inputs is a
            # view of the whole batch); one tensor saved twice counts once.
            key = (ptr, t.storage_offset(), tuple(t.shape))
            if ptr not in self.param_storages and key not in seen:
                seen.add(key)
                n = t.numel() * t.element_size()
                self.per_mb[mb] = self.per_mb.get(mb, 0) + n
                self.live += n
                self.peak = max(self.peak, self.live)
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def release(self, mb: int) -> None:
        self.live -= self.per_mb.pop(mb, 0)


class Pipeline:
    """Runs this rank's stage of a pipeline.

    Rank ``i`` of ``comm`` runs stage ``i``. Every rank calls :meth:`step`
    once per batch: the first stage with the inputs, the last with the
    targets (a one-stage pipeline with both), the others with nothing. The
    last stage returns the batch's loss; gradients accumulate into the stage's
    parameters exactly as ``loss_fn(model(inputs), targets).backward()`` on
    one process would put them (micro-batch losses are weighted by their share
    of the batch); call your optimizer after it, as usual.

    Example::

        comm = pycomm.Communicator()                       # 4 ranks: 4 stages
        layers = [functools.partial(nn.Linear, 512, 512) for _ in range(16)]
        pipe = Pipeline(stage_layers(layers, comm.rank, comm.world_size), comm,
                        num_microbatches=8, schedule="1f1b", loss_fn=nn.functional.mse_loss)
        opt = torch.optim.SGD(pipe.module.parameters(), lr=0.1)
        for x, y in data:
            opt.zero_grad()
            loss = pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
            opt.step()

    Args:
        module: this rank's stage: takes the previous stage's output (a
            tensor or tuple of tensors), returns its own.
        comm: the pipeline's communicator (ranks of one host).
        num_microbatches: micro-batches per step; the batch is cut along
            dimension 0 (``torch.tensor_split``), so it needs at least that
            many rows.
        schedule: ``"1f1b"`` (default), ``"gpipe"`` or a schedule function
            (see :mod:`pycomm.pipeline.schedule`).
        loss_fn: ``loss_fn(output, target)`` on the last stage; without it
            the last stage's output must be a scalar loss per micro-batch.
        loss_reduction: ``"mean"`` (default: the loss averages over the
            batch, so micro-batch ``k`` weighs ``len_k / len(batch)``) or
            ``"sum"``.
        checkpoint: recompute the stage's forward during backward instead of
            keeping its activations (only the stage's inputs are kept).
        dp_comm: data parallelism: a communicator over the replicas of this
            stage; each step ends with the stage's gradients averaged over it.
        track_memory: record the bytes of activations kept for backward
            (``stats()["peak_activation_bytes"]``).

    If any rank's step raises, the runner aborts its communicators with the
    reason, so every rank of the pipeline (and of its replicas) raises
    :class:`pycomm.CommError` naming it instead of waiting; the communicators
    are unusable afterwards.
    """

    def __init__(
        self,
        module: nn.Module,
        comm: Communicator,
        *,
        num_microbatches: int,
        schedule: Union[str, Schedule] = "1f1b",
        loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
        loss_reduction: str = "mean",
        checkpoint: bool = False,
        dp_comm: Optional[Communicator] = None,
        track_memory: bool = False,
    ) -> None:
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        if isinstance(schedule, str):
            if schedule.lower() not in SCHEDULES:
                raise ValueError(f"unknown schedule {schedule!r}; use one of {', '.join(SCHEDULES)} or a function")
            schedule = SCHEDULES[schedule.lower()]
        self.module = module
        self.comm = comm
        self.dp_comm = dp_comm
        self.stage: int = comm.rank
        self.num_stages: int = comm.world_size
        self.num_microbatches = num_microbatches
        self.loss_fn = loss_fn
        self.loss_reduction = loss_reduction
        self.checkpoint = checkpoint
        self.actions = schedule(self.num_stages, num_microbatches, self.stage)
        validate(self.actions, num_microbatches, self.stage)
        self._memory = _MemoryTracker(module) if track_memory else None
        self._stats: Dict[str, float] = {"steps": 0}

    @classmethod
    def from_layers(cls, layers: Union[nn.Sequential, Sequence[Layer]], comm: Communicator, *,
                    balance: Optional[Sequence[int]] = None, **kwargs: Any) -> "Pipeline":
        """Builds this rank's stage from the whole model's layers (see :func:`stage_layers`).

        Example::

            pipe = Pipeline.from_layers(layers, comm, num_microbatches=8, loss_fn=F.cross_entropy)
        """
        return cls(stage_layers(layers, comm.rank, comm.world_size, balance), comm, **kwargs)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

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
        """Forward and backward of one batch; returns the loss on the last stage, else None."""
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
            why = (f"pycomm.pipeline: stage {self.stage} of {self.num_stages}{where} raised "
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

    def _split(self, x: Tensors, what: str) -> List[List[torch.Tensor]]:
        tensors = _as_list(x)
        m = self.num_microbatches
        for t in tensors:
            if t.dim() == 0 or t.shape[0] < m:
                raise ValueError(f"pycomm.pipeline: {what} of shape {tuple(t.shape)} cannot be cut into "
                                 f"{m} micro-batches along dimension 0")
        parts = [torch.tensor_split(t, m) for t in tensors]
        return [[p[k] for p in parts] for k in range(m)]

    def _step(self, inputs: Optional[Tensors], targets: Any) -> Optional[torch.Tensor]:
        t_start = time.perf_counter()
        m, comm = self.num_microbatches, self.comm
        prev, nxt = self.stage - 1, self.stage + 1
        # 1. Inputs and targets, cut into micro-batches.
        if self.is_first:
            if inputs is None:
                raise ValueError("pycomm.pipeline: the first stage's step() needs the inputs")
            in_chunks = self._split(inputs, "inputs")
        elif inputs is not None:
            raise ValueError(f"pycomm.pipeline: stage {self.stage} got inputs; only stage 0 takes them")
        weights = [1.0] * m
        if self.is_last and self.loss_fn is not None:
            if targets is None:
                raise ValueError("pycomm.pipeline: the last stage's step() needs the targets")
            parts = self._split(targets, "targets")
            tgt_chunks = [c[0] for c in parts] if isinstance(targets, torch.Tensor) else parts
            if self.loss_reduction == "mean":
                rows = [len(c[0]) for c in parts]
                weights = [r / sum(rows) for r in rows]
        elif self.is_last and self.loss_reduction == "mean":
            weights = [1.0 / m] * m
        # 2. Post every receive of the step: activations from the previous
        #    stage, gradients from the next, each arriving in micro-batch
        #    order on its own channel while this stage computes.
        act_recv = [comm.recv(prev, tag=k, async_op=True) for k in range(m)] if not self.is_first else []
        grad_recv = [comm.recv(nxt, tag=k, async_op=True) for k in range(m)] if not self.is_last else []
        sends = []
        saved: Dict[int, Tuple[List[torch.Tensor], Any]] = {}
        losses: List[torch.Tensor] = []
        compute = 0.0
        # 3. Run the schedule.
        for action in self.actions:
            k = action.microbatch
            if action.op == "F":
                if self.is_first:
                    xs = in_chunks[k]
                else:
                    act_recv[k].wait()
                    xs = [t.requires_grad_() if _needs_grad(t) else t for t in act_recv[k].result()]
                t0 = time.perf_counter()
                out = self._forward(xs, k)
                if self.is_last:
                    loss = out if self.loss_fn is None else self.loss_fn(out, tgt_chunks[k])
                    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                        raise ValueError("pycomm.pipeline: the loss of a micro-batch must be a scalar tensor")
                    loss = loss.reshape(()) * weights[k]
                    losses.append(loss.detach())
                    saved[k] = (xs, loss)
                else:
                    outs = _as_list(out)
                    sends.append(comm.send([o.detach() for o in outs], nxt, tag=k, async_op=True))
                    saved[k] = (xs, outs)
                compute += time.perf_counter() - t0
            else:
                xs, result = saved.pop(k)
                if self.is_last:
                    t0 = time.perf_counter()
                    result.backward()
                else:
                    grad_recv[k].wait()
                    grads = grad_recv[k].result()
                    t0 = time.perf_counter()
                    pairs = [(o, g) for o, g in zip([o for o in result if _needs_grad(o)], grads) if o.requires_grad]
                    if pairs:
                        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                if self._memory is not None:
                    self._memory.release(k)
                if not self.is_first:
                    back = [x.grad if x.grad is not None else torch.zeros_like(x) for x in xs if _needs_grad(x)]
                    sends.append(comm.send(back, prev, tag=k, async_op=True) if back else None)
                compute += time.perf_counter() - t0
        # 4. Every send must have left before the buffers it reads go away.
        for work in sends:
            if work is not None:
                work.wait()
        # 5. Data parallelism: average this stage's gradients over its replicas.
        if self.dp_comm is not None and self.dp_comm.world_size > 1:
            t0 = time.perf_counter()
            self._average_gradients()
            compute += time.perf_counter() - t0
        step = time.perf_counter() - t_start
        self._stats.update(steps=self._stats["steps"] + 1, step_seconds=step, compute_seconds=compute,
                           bubble=max(0.0, 1.0 - compute / step) if step > 0 else 0.0)
        return torch.stack(losses).sum() if self.is_last else None

    def _forward(self, xs: List[torch.Tensor], k: int) -> Any:
        if self._memory is None:
            return self._call(xs)
        with self._memory.hooks(k):
            return self._call(xs)

    def _call(self, xs: List[torch.Tensor]) -> Any:
        if self.checkpoint and torch.is_grad_enabled():
            return _checkpoint(self.module, *xs, use_reentrant=False)
        return self.module(*xs)

    def _average_gradients(self) -> None:
        params = [p for p in self.module.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        # One flat all-reduce per dtype: a few large messages, not one per tensor.
        self.dp_comm.all_reduce_coalesced([p.grad for p in params], op="avg")


def grid(num_stages: int, group: Optional["dist.ProcessGroup"] = None,
         **kwargs: Any) -> Tuple[Communicator, Optional[Communicator]]:
    """Communicators for pipeline x data parallelism over a torch.distributed group.

    Ranks ``r * num_stages .. (r + 1) * num_stages - 1`` form replica ``r``'s
    pipeline (consecutive ranks: one host, for shared memory); the ranks that
    run the same stage form its data-parallel group. Returns
    ``(pipeline_comm, dp_comm)`` for this rank (``dp_comm`` is None with one
    replica). Every rank of ``group`` must call it. ``kwargs`` go to each
    :class:`pycomm.Communicator`.

    Example::

        pipe_comm, dp_comm = grid(num_stages=2)       # 4 ranks: 2 stages x 2 replicas
        pipe = Pipeline(stage_layers(layers, pipe_comm.rank, 2), pipe_comm, dp_comm=dp_comm, ...)
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if num_stages < 1 or world % num_stages:
        raise ValueError(f"{world} ranks cannot form pipelines of {num_stages} stages")
    replicas = world // num_stages
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    pipe_comm = dp_comm = None
    # torch.distributed wants every rank to create every group, in one order.
    for r in range(replicas):
        members = [ranks[r * num_stages + s] for s in range(num_stages)]
        g = dist.new_group(members)
        if rank // num_stages == r:
            pipe_comm = Communicator(g, **kwargs)
    if replicas > 1:
        for s in range(num_stages):
            members = [ranks[r * num_stages + s] for r in range(replicas)]
            g = dist.new_group(members)
            if rank % num_stages == s:
                dp_comm = Communicator(g, **kwargs)
    return pipe_comm, dp_comm
