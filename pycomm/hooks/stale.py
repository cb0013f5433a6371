"""Bounded staleness: a step applies the average of the gradients computed
``staleness`` steps earlier, while its own travel behind the next forward
and backward.

Example::

    state = hooks.StaleState(staleness=1, wire=pycomm.Int8())
    ddp.register_comm_hook(state, hooks.stale_hook)
"""
from typing import Any, Callable, Dict, Iterator, List, Optional, Union

import torch
import torch.distributed as dist
from torch.profiler import record_function

from .. import communicator as _communicator
from .. import compression as _compression
from .._lanes import stream_point
from .compressed import CompressionState, compression_hook
from .plain import _WIRE_DTYPES, AllReduceState, allreduce_hook
from .policy import Group, completed
from .powersgd import PowerSGD, powersgd_hook
from .state import HookState


class _Snapshot:
    """What a hook reads of a bucket (its buffer, parameters, index, whether
    it is the last), with the buffer replaced by a copy: a stale all-reduce
    keeps travelling after DDP has reused the bucket's own buffer."""

    def __init__(self, bucket: dist.GradBucket, buf: torch.Tensor) -> None:
        self._buf, self._index, self._last = buf, bucket.index(), bucket.is_last()
        self._params = bucket.parameters()

    def buffer(self) -> torch.Tensor:
        return self._buf

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def parameters(self) -> List[torch.Tensor]:
        return self._params

    def gradients(self) -> List[torch.Tensor]:
        out, off = [], 0
        for p in self._params:
            out.append(self._buf[off:off + p.numel()].view_as(p))
            off += p.numel()
        return out


class _InFlight:
    """One bucket's average on its way: the future, the parameters it holds
    and where each sits in the flat bucket."""

    def __init__(self, params: List[torch.Tensor], future: torch.futures.Future) -> None:
        self.params, self.future = params, future
        self.ids = tuple(id(p) for p in params)
        self.offsets, off = [], 0
        for p in params:
            self.offsets.append(off)
            off += p.numel()


class StaleState(HookState):
    """State of :func:`stale_hook`: bounded-staleness gradient averaging.

    Every bucket's average starts at once and keeps travelling behind the
    next ``staleness`` forwards and backwards; the gradients a step applies
    are the average of the ones computed ``staleness`` steps earlier. With
    :math:`s` the staleness, :math:`g^i_t` rank :math:`i`'s gradient at step
    :math:`t` (computed at the parameters :math:`w_t`) and :math:`A` the wire
    format's average (exact for float32, quantized with error feedback for
    int8/int4/top-k)::

        w_{t+1} = w_t - lr * A(g^0_{t-s}, ..., g^{n-1}_{t-s})     for t >= s
        w_{t+1} = w_t - lr * 0                                    for t <  s

    (written for SGD; any optimizer receives ``A(...)`` as the gradient).
    The first ``staleness`` steps therefore apply zero gradients (no average
    has arrived yet; with weight decay or momentum the optimizer still moves:
    check :attr:`has_update` to skip its step), and :meth:`flush` applies the
    last ``staleness`` averages at the end, so every gradient is applied
    exactly once. This is delayed-gradient SGD (Agarwal & Duchi, "Distributed
    delayed stochastic optimization", 2011), the bounded staleness of stale
    synchronous parallel (Ho et al., 2013) with every rank at the same clock,
    and the delayed averaging of DaSGD (Zhou et al., 2020) without its local
    step: parameters stay bitwise identical on every rank, and the step's
    communication hides entirely behind the next step's computation as long
    as it is shorter.

    A delay acts like extra momentum (Mitliagkas et al., "Asynchrony begets
    momentum", 2016): a recipe at the edge of stability needs a smaller
    learning rate or momentum. Measured on digits (4 ranks, 500 steps, SGD
    with momentum 0.9, cosine decay): at lr 0.05 staleness 1 matches
    synchronous averaging (97.3-97.8 % against 96.7-97.3 %); at lr 0.1 it
    falls to 87-92 % against 98 %; staleness 2 diverges at lr 0.1 and
    reaches 94-96 % at lr 0.025 (synchronous 96-97 %).

    Args:
        staleness: ``s >= 1``, steps between computing a gradient and applying
            its average.
        wire: how buckets travel: ``None`` (their own dtype), ``torch.bfloat16``
            or ``torch.float16``, or a codec (:class:`pycomm.Int8`,
            :class:`pycomm.Int4`, :class:`pycomm.TopK`), compressed from the
            first step with error feedback, or :class:`pycomm.hooks.PowerSGD`
            (low-rank factors from the third step, after DDP's bucket rebuild).
        process_group, communicator, path: see :class:`HookState`.

    Example::

        state = hooks.StaleState(staleness=1, wire=pycomm.Int8())
        ddp.register_comm_hook(state, hooks.stale_hook)
        for x, y in data:
            opt.zero_grad(); loss_fn(ddp(x), y).backward(); opt.step()
        for _ in state.flush():          # the last averages still in flight
            opt.step()
    """

    def __init__(self, process_group: Group = None, *, staleness: int = 1,
                 wire: Union[None, torch.dtype, _compression.Codec] = None,
                 communicator: Optional["_communicator.Communicator"] = None, path: Optional[str] = None) -> None:
        if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 1:
            raise ValueError(f"pycomm.hooks.StaleState: staleness must be an int >= 1, got {staleness!r} (for "
                             "synchronous averaging use allreduce_hook or a compressed hook)")
        # The state that sends the buckets, built first: this state's
        # statistics are its (HookState's constructor resets them).
        where: Dict[str, Any] = dict(communicator=communicator, path=path)
        if isinstance(wire, PowerSGD):
            self.inner = wire.state(process_group, **where)
            self._inner_hook = powersgd_hook
        elif _compression.is_codec(wire):
            self.inner: HookState = CompressionState(process_group, wire, start_iter=0, **where)
            self._inner_hook: Callable = compression_hook
        elif wire in _WIRE_DTYPES:
            self.inner = AllReduceState(process_group, wire_dtype=wire, **where)
            self._inner_hook = allreduce_hook
        else:
            raise ValueError(f"pycomm.hooks.StaleState: wire={wire!r}; use None, torch.bfloat16, torch.float16, "
                             "pycomm.Int8(), pycomm.Int4(), pycomm.TopK(ratio) or pycomm.hooks.PowerSGD(rank)")
        super().__init__(process_group, communicator=communicator, path=path)
        self.staleness = staleness
        self.wire = wire
        # Steps started and not yet applied, oldest first: each a list of
        # the buckets' averages in flight.
        self._inflight: List[List[_InFlight]] = []
        self._started_step = -1  # the iteration whose list is _inflight[-1]
        #: Whether the step whose backward ran last handed DDP an average
        #: (False for the first ``staleness`` steps, and after :meth:`flush`).
        self.has_update = False

    @property
    def in_flight(self) -> int:
        """Steps whose averages are still to be applied (``staleness`` once warm)."""
        return len(self._inflight)

    def stats(self) -> Dict[str, float]:
        out = self.inner.stats()
        out["iterations"] = self.iteration
        out["staleness"] = self.staleness
        return out

    def reset_stats(self) -> None:
        self.inner.reset_stats()

    def routes(self) -> Dict[str, str]:
        return self.inner.routes()

    def state_dict(self) -> Dict[str, Any]:
        """The iteration count and the wire format's state (error-feedback
        residuals). Averages in flight are not part of it: call
        :meth:`flush` (and step) before saving, as at the end of training."""
        if self._inflight:
            raise RuntimeError(f"pycomm.hooks.StaleState: {len(self._inflight)} steps' averages are still in "
                               "flight; apply them with `for _ in state.flush(): opt.step()` before state_dict()")
        return {"iteration": self.iteration, "inner": self.inner.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.iteration = int(state["iteration"])
        self.inner.load_state_dict(state["inner"])
        self._inflight = []

    def flush(self) -> "Iterator[int]":
        """Waits for the averages still in flight and writes them, one step at
        a time and oldest first, into the parameters' ``.grad``; yields after
        each so that the caller steps its optimizer. Afterwards nothing is in
        flight, and the next ``staleness`` steps apply zeros again.

        Example::

            for _ in state.flush():
                opt.step()
        """
        while self._inflight:
            step = self._inflight.pop(0)
            for entry in step:
                avg = self._value(entry)
                for p, off in zip(entry.params, entry.offsets):
                    part = avg[off:off + p.numel()].view_as(p)
                    if p.grad is None:
                        p.grad = part.clone()
                    else:
                        p.grad.copy_(part)
            yield self.iteration - len(self._inflight) - 1
        self._started_step = -1

    # -------------------------------------------------------------- internals

    @staticmethod
    def _value(entry: _InFlight) -> torch.Tensor:
        # Every path's future is CUDA-aware for CUDA buckets: wait() orders
        # this thread's current stream after the data landed (the group
        # path's plain futures once were not: hooks/futures.py).
        value = entry.future.wait()
        return value[0] if isinstance(value, list) else value

    def _delayed(self, bucket: dist.GradBucket, buf: torch.Tensor) -> torch.futures.Future:
        """The average this bucket's parameters got ``staleness`` steps ago,
        as a future DDP waits on (normally complete already)."""
        old = self._inflight[0]
        ids = tuple(id(p) for p in bucket.parameters())
        same = next((e for e in old if e.ids == ids), None)
        if same is not None:
            # The copy runs on a stream of the future's choosing, ordered after
            # that old average only. The bucket's gradients (and this step's
            # snapshot of them) are still being written and read on this
            # stream, perhaps not yet run: the copy must come after them, or
            # a late gradient write lands on top of the average and ranks
            # diverge (seen on an H200 once the device-wide synchronize this
            # used to make was gone).
            ready = stream_point(buf)

            def copy(_: torch.futures.Future) -> torch.Tensor:
                if ready is not None:
                    torch.cuda.current_stream(buf.device).wait_event(ready)
                return buf.copy_(self._value(same))

            return same.future.then(copy)
        # DDP rebuilt its buckets since (after the first iteration): gather
        # each parameter's slice from wherever it travelled.
        where = {pid: (e, off) for e in old for pid, off in zip(e.ids, e.offsets)}
        off = 0
        for p in bucket.parameters():
            hit = where.get(id(p))
            if hit is None:  # not in that step's buckets (the model changed): nothing to apply
                buf[off:off + p.numel()].zero_()
            else:
                buf[off:off + p.numel()].copy_(self._value(hit[0])[hit[1]:hit[1] + p.numel()])
            off += p.numel()
        return completed(buf)


def stale_hook(state: StaleState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Start this bucket's average and hand DDP the one from ``staleness``
    steps ago (zeros during the first ``staleness`` steps); see
    :class:`StaleState` for the update rule.

    Example::

        ddp.register_comm_hook(hooks.StaleState(staleness=1, wire=torch.bfloat16), hooks.stale_hook)
    """
    if not isinstance(state, StaleState):
        raise TypeError(f"pycomm.hooks.stale_hook: state must be a pycomm.hooks.StaleState, got "
                        f"{type(state).__name__}")
    sparse = state.inner._sparse_future(bucket)
    if sparse is not None:
        # Sparse gradients: this step's average, no staleness (the inner
        # state's policy says how); the step's bookkeeping below as usual.
        result = sparse
    else:
        result = _stale_result(state, bucket)
    if bucket.is_last():
        state.has_update = len(state._inflight) > state.staleness
        if state.has_update:
            state._inflight.pop(0)
        state.iteration += 1
    return result


def _stale_result(state: StaleState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer()
    with record_function("pycomm::stale_hook"):
        # 1. Start this step's average on a copy: DDP writes the average we
        #    return into `buf` (the gradients themselves with
        #    gradient_as_bucket_view) while this one still travels.
        snapshot = _Snapshot(bucket, buf.clone())
        future = state._inner_hook(state.inner, snapshot)
        if state._started_step != state.iteration:
            state._inflight.append([])
            state._started_step = state.iteration
        state._inflight[-1].append(_InFlight(snapshot.parameters(), future))
        # 2. Hand back the average of `staleness` steps ago, or zeros while
        #    there is none yet.
        if len(state._inflight) > state.staleness:
            result = state._delayed(bucket, buf)
        else:
            buf.zero_()
            result = completed(buf)
    return result
