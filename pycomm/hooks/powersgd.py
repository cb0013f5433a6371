"""PowerSGD (Vogels et al., 2019): each matrix-shaped gradient M (n x m, a
layer's weight gradient viewed as ``shape[0] x rest``) travels as two rank-r
factors, P = M Q (n x r) and Q = M^T P (m x r), one power-iteration step from
last step's Q (warm start), with error feedback for what the approximation
P Q^T left out. Vectors (biases, norms) and matrices too small to gain
travel plain, in one message.

The math is torch's ``powerSGD_hook``'s (same random start, same order of
factors in memory, the same ``state_dict`` contents), with three differences
in how it runs:

* P's all-reduce of one bucket travels while the next bucket's backward and
  its own P = M Q are computed: a bucket's Q phase runs when the next bucket
  arrives (the last bucket's at once). Collectives are issued in the same
  order on every rank, from the hook's thread only.
* The orthogonalization is one fused operator of the extension
  (``torch.ops.pycomm.orthogonalize_``, batched modified Gram-Schmidt, CPU
  and CUDA), instead of five tensor operations per column in Python.
* P and Q go through pycomm (the communicator on CPU, the group path on
  CUDA), optionally as int8/int4 codes (``wire=``).

Example::

    state = hooks.PowerSGDState(rank=4, start_iter=10)
    ddp.register_comm_hook(state, hooks.powersgd_hook)
"""

import inspect
import logging
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.profiler import record_function

from .. import communicator as _communicator
from .. import compression as _compression
from .plain import _average
from .policy import Group
from .state import HookState

logger = logging.getLogger("pycomm")


def orthogonalize_(matrices: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """The columns of each matrix of ``matrices`` ((batch, rows, cols) or
    (rows, cols)) made orthonormal in place by modified Gram-Schmidt; a zero
    column stays zero. 16-bit matrices are orthogonalized in float32.

    Example::

        q = orthogonalize_(torch.randn(8, 512, 4))   # q[i].T @ q[i] == I (4 x 4)
    """
    if matrices.dtype in (torch.float32, torch.float64) and matrices.is_contiguous():
        torch.ops.pycomm.orthogonalize_(matrices, float(epsilon))
    else:
        work = matrices.to(torch.float32).contiguous()
        torch.ops.pycomm.orthogonalize_(work, float(epsilon))
        matrices.copy_(work)
    return matrices


class PowerSGD:
    """PowerSGD as a wire format for hooks that take one
    (:class:`~pycomm.hooks.StaleState`): rank-``rank`` factors with error
    feedback and warm start; the other arguments as :class:`PowerSGDState`'s.

    Example::

        state = hooks.StaleState(staleness=1, wire=hooks.PowerSGD(rank=4))
        ddp.register_comm_hook(state, hooks.stale_hook)
    """

    def __init__(self, rank: int = 1, *, min_compression_rate: float = 2.0, warm_start: bool = True,
                 epsilon: float = 0.0, seed: int = 0, wire: Optional[_compression.Codec] = None) -> None:
        self.rank, self.min_compression_rate, self.warm_start = rank, min_compression_rate, warm_start
        self.epsilon, self.seed, self.wire = epsilon, seed, wire

    def state(self, process_group: Group = None, **where: Any) -> "PowerSGDState":
        """A :class:`PowerSGDState` with these settings (starting after DDP's bucket rebuild)."""
        return PowerSGDState(process_group, self.rank, start_iter=2, min_compression_rate=self.min_compression_rate,
                             warm_start=self.warm_start, epsilon=self.epsilon, seed=self.seed, wire=self.wire,
                             **where)

    def __repr__(self) -> str:
        return f"PowerSGD(rank={self.rank}, wire={self.wire!r})"


class _Layout:
    """How one bucket's gradients split: the matrices PowerSGD compresses,
    grouped by shape (torch's order: groups in order of first appearance),
    where each group's P and Q sit in the bucket's P and Q memory, and the
    tensors sent plain."""

    def __init__(self, grads: List[torch.Tensor], rank: int, min_rate: float) -> None:
        groups: Dict[Tuple[int, int], List[int]] = {}
        self.plain: List[int] = []
        self.numel_before = self.numel_after = 0
        for i, g in enumerate(grads):
            n = g.shape[0] if g.dim() > 0 else 1
            m = g.numel() // n if n else 0
            r = min(n, m, rank)
            self.numel_before += g.numel()
            if g.dim() > 1 and (n + m) * r * min_rate < n * m:
                groups.setdefault((n, m), []).append(i)
                self.numel_after += (n + m) * r
            else:
                self.plain.append(i)
                self.numel_after += g.numel()
        # (shape, members, rank, p offset, q offset)
        self.groups: List[Tuple[Tuple[int, int], List[int], int, int, int]] = []
        p_off = q_off = 0
        for (n, m), members in groups.items():
            r = min(n, m, rank)
            self.groups.append(((n, m), members, r, p_off, q_off))
            p_off += len(members) * n * r
            q_off += len(members) * m * r
        self.p_numel, self.q_numel = p_off, q_off
        self.numels = [g.numel() for g in grads]
        self.key = tuple(tuple(g.shape) for g in grads)


def _signature_defaults(fn) -> Dict[str, Any]:
    """``fn``'s parameters' defaults, by name."""
    return {name: p.default for name, p in inspect.signature(fn).parameters.items()
            if p.default is not inspect.Parameter.empty}


# torch's PowerSGDState keywords -> this state's (None: accepted, ignored).
_TORCH_NAMES: Dict[str, Optional[str]] = {
    "matrix_approximation_rank": "rank",
    "start_powerSGD_iter": "start_iter",
    "use_error_feedback": "error_feedback",
    "orthogonalization_epsilon": "epsilon",
    "random_seed": "seed",
    "batch_tensors_with_same_shape": "batch_same_shape",
    "compression_stats_logging_frequency": None,
}


class PowerSGDState(HookState):
    """State of :func:`powersgd_hook`.

    Args:
        rank: the rank r of the approximation (torch's
            ``matrix_approximation_rank``); 1 to 4 is typical.
        start_iter: iterations averaged plain first (torch's
            ``start_powerSGD_iter``); at least 2 with error feedback or warm
            start, since DDP rebuilds its buckets after the first iteration.
        min_compression_rate: compress a matrix only when its factors are at
            least this many times smaller than it.
        error_feedback: carry what the approximation dropped into the next
            iteration's bucket.
        warm_start: start each power iteration from last step's Q instead of
            a random one.
        epsilon: added to column norms in the orthogonalization (torch's
            ``orthogonalization_epsilon``; 0 leaves zero columns zero here).
        seed: the seed of the random starts (every rank draws the same).
        batch_same_shape: one batched product and orthogonalization for
            matrices of one shape (torch's ``batch_tensors_with_same_shape``;
            the result is the same).
        wire: ``None`` (P and Q as they are) or :class:`pycomm.Int8` /
            :class:`pycomm.Int4`: P and Q travel as blockwise codes.
        process_group, communicator, path: see :class:`HookState`.
        **torch_names: torch's ``PowerSGDState`` keywords, for code written
            for it: ``matrix_approximation_rank``, ``start_powerSGD_iter``,
            ``use_error_feedback``, ``orthogonalization_epsilon``,
            ``random_seed``, ``batch_tensors_with_same_shape`` (the
            arguments above), and ``compression_stats_logging_frequency``
            (ignored: :meth:`stats` is always kept).

    Example::

        state = hooks.PowerSGDState(rank=4, start_iter=10, wire=pycomm.Int8())
        ddp.register_comm_hook(state, hooks.powersgd_hook)
        state.stats()["compression_ratio"]
        # or, as written for torch's hook:
        hooks.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=10)
    """

    def __init__(self, process_group: Group = None, rank: int = 1, *, start_iter: int = 10,
                 min_compression_rate: float = 2.0, error_feedback: bool = True, warm_start: bool = True,
                 epsilon: float = 0.0, seed: int = 0, batch_same_shape: bool = True,
                 wire: Optional[_compression.Codec] = None,
                 communicator: Optional["_communicator.Communicator"] = None, path: Optional[str] = None,
                 **torch_names: Any) -> None:
        given = dict(rank=rank, start_iter=start_iter, error_feedback=error_feedback, epsilon=epsilon, seed=seed,
                     batch_same_shape=batch_same_shape)
        defaults = _signature_defaults(PowerSGDState.__init__)
        for name, value in torch_names.items():
            ours = _TORCH_NAMES.get(name, "")
            if ours == "":
                raise TypeError(f"pycomm.hooks.PowerSGDState got an unexpected keyword argument {name!r}")
            if ours is None:
                continue
            if given[ours] != defaults[ours]:
                raise TypeError(f"pycomm.hooks.PowerSGDState: {name} and {ours} name one setting; pass one")
            given[ours] = value
        rank, start_iter, error_feedback = given["rank"], given["start_iter"], given["error_feedback"]
        epsilon, seed, batch_same_shape = given["epsilon"], given["seed"], given["batch_same_shape"]
        if type(rank) is not int or rank < 1:
            raise ValueError(f"pycomm.hooks.PowerSGDState: rank must be an int >= 1, got {rank!r}")
        if (error_feedback or warm_start) and int(start_iter) < 2:
            raise ValueError("pycomm.hooks.PowerSGDState: start_iter must be >= 2 with error_feedback or warm_start "
                             "(DDP rebuilds its buckets after the first iteration), got " + str(start_iter))
        if wire is not None and not _compression.is_quantizer(wire):
            raise TypeError(f"pycomm.hooks.PowerSGDState: wire={wire!r}; use None, pycomm.Int8() or pycomm.Int4()")
        if epsilon < 0 or min_compression_rate <= 0:
            raise ValueError("pycomm.hooks.PowerSGDState: epsilon must be >= 0 and min_compression_rate > 0")
        super().__init__(process_group, communicator=communicator, path=path)
        import numpy as np  # torch's hook draws its seeds so; the same draws give the same start

        self.rank, self.start_iter, self.min_compression_rate = rank, int(start_iter), float(min_compression_rate)
        self.error_feedback, self.warm_start, self.epsilon = error_feedback, warm_start, float(epsilon)
        self.seed, self.batch_same_shape, self.wire = seed, batch_same_shape, wire
        self._rng = np.random.RandomState(seed)
        self.error_dict: Dict[int, torch.Tensor] = {}
        self.p_memory_dict: Dict[int, torch.Tensor] = {}
        self.q_memory_dict: Dict[int, torch.Tensor] = {}
        self._layouts: Dict[int, _Layout] = {}
        self._waiting: Optional["_Bucket"] = None  # the bucket whose Q phase runs when the next arrives
        # Per bucket index, the bucket last sent, until its future is waited
        # for: the next step's P phase of that index needs its Q and residual.
        self._inflight: Dict[int, "_Bucket"] = {}
        # Each bucket's parameters, and what a loaded checkpoint still has to
        # put back, per parameter position (HookState._observe numbers them).
        self._bucket_params: Dict[int, List[int]] = {}
        self._pending: Dict[str, Dict[int, torch.Tensor]] = {"error": {}, "p": {}, "q": {}}
        self.numel_before = self.numel_after = 0

    def state_dict(self) -> Dict[str, Any]:
        """The iteration, the random stream, and per parameter (in the order
        of DDP's first iteration, so that a fresh process finds each one's
        again whatever its bucket layout): the error-feedback residual and,
        for a compressed matrix, its P and Q (warm start).

        Example::

            torch.save({"model": ddp.state_dict(), "hook": state.state_dict()}, path)
        """
        out = super().state_dict()
        errors, ps, qs = self._per_parameter()
        out.update(errors=errors, p=ps, q=qs, rng=self._rng.get_state())
        return out

    def _per_parameter(self) -> Tuple[Dict[int, torch.Tensor], ...]:
        """Residuals and factors per parameter position (what is still
        pending from a checkpoint included), from the buckets as last seen."""
        self._settle()
        errors, ps, qs = dict(self._pending["error"]), dict(self._pending["p"]), dict(self._pending["q"])
        for idx, ids in self._bucket_params.items():
            layout = self._layouts.get(idx)
            if layout is None:
                continue
            positions = [self._position.get(i) for i in ids]
            err = self.error_dict.get(idx)
            if err is not None and err.numel() == sum(layout.numels):
                off = 0
                for pos, n in zip(positions, layout.numels):
                    errors[pos] = err[off:off + n].detach().clone()
                    off += n
            if idx not in self.q_memory_dict or self.q_memory_dict[idx].numel() != layout.q_numel:
                continue
            p_mem, q_mem = self.p_memory_dict[idx], self.q_memory_dict[idx]
            for (n, m), members, r, p_off, q_off in layout.groups:
                for k, i in enumerate(members):
                    ps[positions[i]] = p_mem[p_off + k * n * r:p_off + (k + 1) * n * r].detach().clone()
                    qs[positions[i]] = q_mem[q_off + k * m * r:q_off + (k + 1) * m * r].detach().clone()
        errors.pop(None, None), ps.pop(None, None), qs.pop(None, None)
        return errors, ps, qs

    def _relayout(self) -> None:
        """DDP rebuilt its buckets (a fresh process's first iteration, after
        a checkpoint): every residual and factor goes back per parameter, to
        be put where its parameter now sits."""
        errors, ps, qs = self._per_parameter()
        self._pending = {"error": errors, "p": ps, "q": qs}
        self.error_dict, self.p_memory_dict, self.q_memory_dict = {}, {}, {}
        self._layouts, self._bucket_params = {}, {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: each parameter's residual and
        factors go back when its bucket is next compressed."""
        super().load_state_dict(state)
        self._settle()
        self.error_dict, self.p_memory_dict, self.q_memory_dict = {}, {}, {}
        self._pending = {name: {int(pos): t.clone() for pos, t in state.get(key, {}).items()}
                         for name, key in (("error", "errors"), ("p", "p"), ("q", "q"))}
        if "rng" in state:
            self._rng.set_state(state["rng"])
        self._layouts, self._bucket_params = {}, {}

    def _settle(self) -> None:
        """Waits for the buckets still on their way (a staleness wrapper
        leaves the last step's in flight)."""
        for b in list(self._inflight.values()):
            b.future.wait()
        self._inflight.clear()

    def compression_stats(self) -> Tuple[float, int, int]:
        """(rate, elements before, elements after) over the compressed iterations, as torch's state."""
        rate = self.numel_before / self.numel_after if self.numel_after else 0.0
        return rate, self.numel_before, self.numel_after


class _Bucket:
    """One bucket between its P and its Q phase."""

    def __init__(self, state: PowerSGDState, bucket: dist.GradBucket, route: str) -> None:
        self.state, self.route = state, route
        self.buf = bucket.buffer()
        self.index, self.last = bucket.index(), bucket.is_last()
        # CUDA-aware for CUDA buckets: the last products are written into the
        # bucket on the thread and stream that saw Q arrive (the group path),
        # so whoever waits (DDP, on its stream) must be ordered after them; a
        # plain future let DDP read the bucket before they ran (ranks disagreed
        # on an H200).
        self.future: torch.futures.Future = torch.futures.Future(
            devices=[self.buf.device] if self.buf.is_cuda else None)
        self.started = time.perf_counter()
        self.sent = 0
        grads = bucket.gradients()
        ids = [id(p) for p in bucket.parameters()]
        prev = state._inflight.get(self.index)
        if prev is not None:  # last step's bucket of this index, still on its way (staleness)
            prev.future.wait()
        if state._bucket_params.get(self.index, ids) != ids:
            state._relayout()
        state._bucket_params[self.index] = ids
        state._inflight[self.index] = self
        layout = state._layouts.get(self.index)
        if layout is None or layout.key != tuple(tuple(g.shape) for g in grads):
            layout = state._layouts[self.index] = _Layout(grads, state.rank, state.min_compression_rate)
        self.layout, self.grads = layout, grads
        state.numel_before += layout.numel_before
        state.numel_after += layout.numel_after
        self.mats: List[List[torch.Tensor]] = []

    def matrices(self, source: torch.Tensor) -> None:
        """Each group's matrices, read from ``source`` (laid out as the
        bucket), as (count, n, m) tensors: views when alone, a stacked copy
        when batched (torch's hook keeps them one by one unless asked to)."""
        views, off = [], 0
        for n in self.layout.numels:
            views.append(source[off:off + n])
            off += n
        self.mats = []
        for (n, m), members, _, _, _ in self.layout.groups:
            group = [views[i].view(n, m) for i in members]
            if self.state.batch_same_shape and len(group) > 1:
                self.mats.append([torch.stack(group)])
            else:
                self.mats.append([v.unsqueeze(0) for v in group])
        self.plain = [views[i] for i in self.layout.plain]

    def factors(self, memory: torch.Tensor, which: str) -> List[List[torch.Tensor]]:
        """The P (or Q) of each matrix batch, as views of the bucket's memory."""
        out = []
        for ((n, m), members, r, p_off, q_off), mats in zip(self.layout.groups, self.mats):
            rows, off = (n, p_off) if which == "p" else (m, q_off)
            views = []
            for mat in mats:
                count = mat.shape[0]
                views.append(memory[off:off + count * rows * r].view(count, rows, r))
                off += count * rows * r
            out.append(views)
        return out


def _all_reduce(state: PowerSGDState, b: _Bucket, tensor: torch.Tensor, op: str, codec) -> Any:
    """Starts ``tensor``'s all-reduce on the bucket's path, counting what it sends; returns its work."""
    work = state._start_all_reduce(b.route, tensor, op, codec)
    b.sent += work.bytes_sent if codec is not None else state._plain_bytes(tensor.numel(), tensor.element_size())
    return work


def _p_phase(state: PowerSGDState, b: _Bucket) -> None:
    """Error feedback in, P = M Q for every matrix, and P (with the plain
    tensors) on its way."""
    buf, idx, layout = b.buf, b.index, b.layout
    positions = [state._position.get(i) for i in state._bucket_params[idx]]
    if state.error_feedback:
        err = state.error_dict.get(idx)
        if err is None or err.numel() != buf.numel():
            err = state.error_dict[idx] = torch.zeros_like(buf)
            off = 0
            for pos, n in zip(positions, layout.numels):
                saved = state._pending["error"].pop(pos, None)
                if saved is not None and saved.numel() == n:
                    err[off:off + n].copy_(saved)
                off += n
        # The residual's buffer becomes M = gradient + residual, what the
        # factors are computed from; after the output is written into the
        # bucket, M - output is the next residual. No copy of the bucket and
        # no fresh bucket-sized memory per step (torch's hook makes two, and
        # the first touch of fresh pages costs as much as the arithmetic).
        err.add_(buf)
        b.matrices(err)
    else:
        b.matrices(buf)
    fresh = (not state.warm_start or idx not in state.p_memory_dict
             or state.p_memory_dict[idx].numel() != layout.p_numel)
    if fresh:
        p_mem = state.p_memory_dict[idx] = torch.empty(layout.p_numel, device=buf.device, dtype=buf.dtype)
        q_mem = state.q_memory_dict[idx] = torch.empty(layout.q_numel, device=buf.device, dtype=buf.dtype)
        if state.warm_start:  # a checkpoint's factors, when it has every one of this bucket's
            wanted = [(positions[i], p_off + k * n * r, n * r, q_off + k * m * r, m * r)
                      for (n, m), members, r, p_off, q_off in layout.groups for k, i in enumerate(members)]
            pend_p, pend_q = state._pending["p"], state._pending["q"]
            if wanted and all(pend_q.get(pos) is not None and pend_q[pos].numel() == qn
                              and pend_p.get(pos) is not None and pend_p[pos].numel() == pn
                              for pos, _, pn, _, qn in wanted):
                for pos, po, pn, qo, qn in wanted:
                    p_mem[po:po + pn].copy_(pend_p.pop(pos))
                    q_mem[qo:qo + qn].copy_(pend_q.pop(pos))
                fresh = False
    b.ps = b.factors(state.p_memory_dict[idx], "p")
    b.qs = b.factors(state.q_memory_dict[idx], "q")
    if fresh:
        # torch's draws: a seed from the state's stream per fresh bucket, then
        # one CPU normal tensor per Q (the same on every rank).
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(state._rng.randint(1_000_000_000))
            for group in b.qs:
                for q in group:
                    q.copy_(torch.randn(*q.shape, device="cpu", dtype=buf.dtype))
    for group in b.qs:
        for q in group:
            orthogonalize_(q, state.epsilon)
    for mats, ps, qs in zip(b.mats, b.ps, b.qs):
        for mat, p, q in zip(mats, ps, qs):
            torch.bmm(mat, q, out=p)
    p_mem = state.p_memory_dict[idx]
    plain = b.plain
    if state.wire is None:
        # One message: P, then the plain tensors (summed; divided after).
        b.p_message = torch.cat([p_mem] + plain) if plain else p_mem
        b.p_work = _all_reduce(state, b, b.p_message, "sum", None)
        b.plain_work = None
    else:
        b.p_message = p_mem
        b.p_work = _all_reduce(state, b, p_mem, "sum", state.wire)
        b.plain_message = torch.cat(plain) if plain else None
        b.plain_work = (_all_reduce(state, b, b.plain_message, "avg", None)
                        if b.plain_message is not None else None)


def _q_phase(state: PowerSGDState, b: _Bucket) -> None:
    """P arrived: orthogonalize it, Q = M^T P, and Q on its way; the bucket's
    future completes when Q is back."""
    idx, layout = b.index, b.layout
    b.p_work.wait()
    p_mem = state.p_memory_dict[idx]
    world = state.world_size
    if state.wire is None:
        if b.p_message is not p_mem:
            p_mem.copy_(b.p_message[:layout.p_numel])
            plain = b.p_message[layout.p_numel:].div_(world)
        else:
            plain = None
    else:
        if b.plain_work is not None:
            b.plain_work.wait()
        plain = b.plain_message
    if plain is not None:
        off = 0
        for i in layout.plain:
            g = b.grads[i]
            g.copy_(plain[off:off + g.numel()].view_as(g))
            off += g.numel()
    # Inf or NaN in any rank's bucket (an overflow step of a scaled loss,
    # which GradScaler skips) reaches every rank's P or plain tensors, then
    # Q and the output: the same verdict everywhere, kept on the device.
    finite = torch.isfinite(p_mem).all()
    if plain is not None:
        finite = finite & torch.isfinite(plain).all()
    q_mem = state.q_memory_dict[idx]
    q_before = q_mem.clone() if state.warm_start else None  # small: (n + m) r per matrix
    for group in b.ps:
        for p in group:
            orthogonalize_(p, state.epsilon)
    for mats, ps, qs in zip(b.mats, b.ps, b.qs):
        for mat, p, q in zip(mats, ps, qs):
            torch.bmm(mat.transpose(1, 2), p, out=q)
    work = _all_reduce(state, b, q_mem, "avg", state.wire)

    def done(_: Any) -> None:
        try:
            for ((n, m), members, _, _, _), ps, qs in zip(layout.groups, b.ps, b.qs):
                outs = [b.grads[i].view(1, n, m) for i in members]  # the bucket's own memory
                if len(ps) == 1 and len(outs) > 1:  # a batch: one product, then into the bucket
                    approx = torch.bmm(ps[0], qs[0].transpose(1, 2))
                    for k, out in enumerate(outs):
                        out.copy_(approx[k:k + 1])
                else:
                    for p, q, out in zip(ps, qs, outs):
                        torch.bmm(p, q.transpose(1, 2), out=out)
            ok = finite & torch.isfinite(q_mem).all()
            if state.error_feedback:
                state.error_dict[idx].sub_(b.buf)  # M - output
                _revert_unless(ok, state.error_dict[idx], 0.0)
            if q_before is not None:
                _revert_unless(ok, q_mem, q_before)
            if not state.warm_start:
                state.p_memory_dict.pop(idx, None)
                state.q_memory_dict.pop(idx, None)
            state._record(time.perf_counter() - b.started, b.sent,
                          state._plain_bytes(b.buf.numel(), 4 if b.buf.is_floating_point() else b.buf.element_size()),
                          compressed=True)
            # What only this call needed goes now; the future stays (for the next step's wait).
            b.mats = b.ps = b.qs = b.grads = b.plain = b.p_message = None
            b.future.set_result(b.buf)
        except BaseException as e:  # noqa: BLE001 - DDP raises it from the bucket's future
            b.future.set_exception(e)

    if b.route == "communicator":
        work.get_future().then(done)
    else:
        state._group_future(work, done, b.buf.device)


def _revert_unless(ok: torch.Tensor, t: torch.Tensor, before: Any) -> None:
    """``t`` becomes ``before`` (a tensor, or 0.0) unless ``ok``: after a
    step whose factors or plain tensors were not finite on some rank (``ok``
    false, the same on every rank), the state must not carry them into the
    next steps, as torch's hook does (its residual and warm start stay NaN
    for good). On CPU ``ok`` is read (free); on CUDA it stays on the device
    (no synchronisation in a step)."""
    scalar = not isinstance(before, torch.Tensor)
    if ok.is_cuda:
        if scalar:
            t.masked_fill_(~ok, before)
        else:
            t.copy_(torch.where(ok, t, before))
    elif not bool(ok):
        if scalar:
            t.fill_(before)
        else:
            t.copy_(before)


def powersgd_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average buckets by PowerSGD (see :mod:`pycomm.hooks.powersgd`): the
    same math as torch's ``powerSGD_hook``, P and Q through pycomm.

    Example::

        ddp.register_comm_hook(hooks.PowerSGDState(rank=4, start_iter=10), hooks.powersgd_hook)
    """
    if not isinstance(state, PowerSGDState):
        raise TypeError(f"pycomm.hooks.powersgd_hook: state must be a pycomm.hooks.PowerSGDState, got "
                        f"{type(state).__name__}")
    state._observe(bucket)
    sparse = state._sparse_future(bucket)
    if sparse is not None:
        # A sparse last bucket still ends the step: the bucket waiting for
        # its Q phase (the one before) takes it now.
        if bucket.is_last() and state._waiting is not None:
            waiting, state._waiting = state._waiting, None
            with record_function("pycomm::powersgd_hook"):
                _q_phase(state, waiting)
        state._end_bucket(bucket)
        return sparse
    buf = bucket.buffer()
    if state.iteration < state.start_iter or not buf.is_floating_point():
        return _average(state, bucket, None, "pycomm::powersgd_hook")
    route = state._route(buf, compressed=True)
    with record_function("pycomm::powersgd_hook"):
        b = _Bucket(state, bucket, route)
        _p_phase(state, b)
        # The previous bucket's P has travelled behind this bucket's backward
        # and P = M Q: its Q phase now (the order is the same on every rank).
        waiting, state._waiting = state._waiting, b
        if waiting is not None:
            _q_phase(state, waiting)
        if b.last:
            state._waiting = None
            _q_phase(state, b)
    state._end_bucket(bucket)
    return b.future
