"""Local SGD (periodic model averaging): gradients averaged during a warm-up,
then each rank steps alone and :class:`LocalSGD` averages the parameters
every ``period`` steps.

Example::

    ddp.register_comm_hook(hooks.LocalSGDState(start_iter=100), hooks.local_sgd_hook)
    opt = hooks.LocalSGD(torch.optim.SGD(ddp.parameters(), lr=0.1), period=4, warmup_steps=100)
"""
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.profiler import record_function

from .. import communicator as _communicator
from .. import compression as _compression
from .._optim import WrappedOptimizer, local_tensor
from .plain import _average
from .policy import Group, _resolve_communicator, completed
from .state import HookState


class LocalSGDState(HookState):
    """State of :func:`local_sgd_hook`: gradients are averaged for
    ``start_iter`` iterations, then each rank steps on its own gradients and
    :class:`LocalSGD` averages the parameters every few steps.

    Example::

        state = hooks.LocalSGDState(start_iter=100)
        ddp.register_comm_hook(state, hooks.local_sgd_hook)
        opt = hooks.LocalSGD(torch.optim.SGD(ddp.parameters(), lr=0.1), period=4, warmup_steps=100)
    """

    def __init__(self, process_group: Group = None, *, start_iter: int = 0,
                 communicator: Optional["_communicator.Communicator"] = None, path: Optional[str] = None) -> None:
        if int(start_iter) < 0:
            raise ValueError(f"pycomm.hooks: start_iter must be >= 0, got {start_iter}")
        super().__init__(process_group, communicator=communicator, path=path)
        self.start_iter = int(start_iter)


def local_sgd_hook(state: LocalSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Averages gradients during the warm-up, then returns each rank's own."""
    if not isinstance(state, LocalSGDState):
        raise TypeError(f"pycomm.hooks.local_sgd_hook: state must be a pycomm.hooks.LocalSGDState, got "
                        f"{type(state).__name__}")
    if state.iteration < state.start_iter:
        return _average(state, bucket, None, "pycomm::local_sgd_hook")
    fut = completed(bucket.buffer())
    state._end_bucket(bucket)
    return fut


class LocalSGD(WrappedOptimizer):
    """An optimizer wrapper that averages the parameters over ranks every
    ``period`` steps (local SGD / periodic model averaging).

    Step ``s`` (counting from 1) is followed by an average when
    ``s > warmup_steps`` and ``(s - warmup_steps) % period == 0``. Parameters
    of one dtype travel as one flat all-reduce (optionally compressed). Ranks
    should start from the same parameters (DDP broadcasts them; without DDP,
    call :meth:`average` once before training).

    To torch it is an optimizer over the wrapped one's parameter groups: LR
    schedulers and step hooks take it, and under ``GradScaler``
    (``scaler.step(opt)``) a step skipped for an overflow on one rank still
    counts there, so every rank averages at the same steps.

    Args:
        optimizer: the wrapped optimizer (its ``step``, ``zero_grad``,
            ``param_groups`` and state dict stay usable).
        period: steps between averages (>= 1).
        warmup_steps: steps before the first average (pair with
            :class:`LocalSGDState`'s ``start_iter``).
        process_group, communicator: see :class:`HookState`.
        compression: an optional codec for the averages.

    Example::

        opt = hooks.LocalSGD(torch.optim.SGD(model.parameters(), lr=0.1), period=8)
        for x, y in data:
            opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    """

    def __init__(self, optimizer: torch.optim.Optimizer, period: int, *, warmup_steps: int = 0,
                 process_group: Group = None, communicator: Optional["_communicator.Communicator"] = None,
                 compression: Optional[_compression.Codec] = None) -> None:
        if int(period) < 1:
            raise ValueError(f"pycomm.hooks.LocalSGD: period must be >= 1, got {period}")
        if int(warmup_steps) < 0:
            raise ValueError(f"pycomm.hooks.LocalSGD: warmup_steps must be >= 0, got {warmup_steps}")
        self.optimizer = optimizer
        self._wrap(optimizer)
        self.period = int(period)
        self.warmup_steps = int(warmup_steps)
        self.communicator = _resolve_communicator(process_group, communicator)
        self.compression = compression
        self.step_count = 0
        self.averages = 0

    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """The wrapped optimizer's step, then the parameter average when one is due."""
        loss = self._inner_step(closure)
        self.step_count += 1
        if self.step_count > self.warmup_steps and (self.step_count - self.warmup_steps) % self.period == 0:
            self.average()
        return loss

    @torch.no_grad()
    def average(self) -> None:
        """Average every parameter over ranks now (one flat all-reduce per dtype)."""
        # A DTensor's (FSDP2's) shard: ranks of the same place hold the same ones.
        params = [local_tensor(p) for group in self.optimizer.param_groups for p in group["params"]]
        with record_function("pycomm::local_sgd_average"):
            self.communicator.all_reduce_coalesced(params, op="avg", compression=self.compression)
        self.averages += 1

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "step_count": self.step_count}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.step_count = int(state["step_count"])

    def __repr__(self) -> str:
        return f"LocalSGD(period={self.period}, warmup_steps={self.warmup_steps}, {self.optimizer!r})"
