"""DiLoCo (Douillard et al., 2023): ranks train on their own for H inner
steps, then average their pseudo-gradients (how far each moved from the last
global parameters) and take one outer Nesterov step on the global parameters;
about H times less communication than averaging every step. Streaming DiLoCo
(Douillard et al., 2025) syncs the model fragment by fragment on a staggered
schedule, so each sync moves 1/F of the model, and can overlap a fragment's
all-reduce with the next tau inner steps.

The pseudo-gradients travel through pycomm (the communicator for CPU
parameters, the group path for CUDA ones) in any wire format: plain,
``torch.bfloat16``, or int8 / int4 codes with error feedback.

Example::

    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt = pycomm.DiLoCo(model.parameters(), inner, sync_every=64, wire=pycomm.Int8())
    for x, y in data:
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    opt.sync()                       # the last partial round, at the end
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Iterable, List, Optional, Union

import torch

from . import compression as _compression
from ._optim import WrappedOptimizer, local_tensor
from .hooks.policy import Group, Router

logger = logging.getLogger("pycomm")

Wire = Union[None, torch.dtype, _compression.Codec]


class _Fragment:
    """A slice of the model that syncs together, and its sync in flight."""

    def __init__(self, index: int, local: List[torch.Tensor], glob: List[torch.Tensor], offset: int) -> None:
        self.index, self.local, self.glob, self.offset = index, local, glob, offset
        self.work: Any = None
        self.due = 0  # the step after which the sync in flight is applied
        self.flat: Optional[torch.Tensor] = None
        self.at_sync: Optional[List[torch.Tensor]] = None


class DiLoCo(WrappedOptimizer):
    """An optimizer wrapper: ``sync_every`` (H) steps of ``inner``, then the
    outer step.

    With :math:`\\theta` the global parameters, :math:`\\theta_i` rank i's
    after H inner steps from :math:`\\theta`, and :math:`A` the wire's average::

        delta = A(theta - theta_0, ..., theta - theta_{n-1})
        theta = OuterSGD(theta, grad=delta, lr=outer_lr, momentum=outer_momentum, nesterov)
        theta_i = theta                                    (every rank)

    Args:
        params: the parameters ``inner`` optimizes (a module's parameters), or
            the module.
        inner: any optimizer over them.
        sync_every: inner steps per outer step (H).
        outer_lr, outer_momentum, nesterov: the outer SGD (0.7, 0.9, True as
            in the paper).
        outer: instead, any outer optimizer, as a function of the parameter
            groups of the global parameters (one group per fragment) that
            builds it, e.g. ``lambda groups: torch.optim.Adam(groups,
            lr=1e-3)``; each outer step sets the fragment's ``.grad`` to its
            averaged pseudo-gradient (the others' to None) and calls
            ``step()``. ``DiLoCo.outer`` is the optimizer, in checkpoints too.
        wire: how pseudo-gradients travel: ``None``, ``torch.bfloat16`` /
            ``torch.float16``, :class:`pycomm.Int8` or :class:`pycomm.Int4`
            (with error feedback, per fragment).
        fragments: F > 1 is Streaming DiLoCo: the parameters are cut into F
            fragments of about equal size (in order), fragment f syncs at the
            steps ``t`` with ``t % H == f * H // F``.
        overlap: tau, the inner steps a fragment's all-reduce travels behind
            (Streaming DiLoCo's overlap): started at the fragment's sync step,
            applied after tau more inner steps. ``True`` is 1, ``False`` 0 (each
            sync waits for its all-reduce); tau < ``sync_every``.
        alpha: how the ranks' parameters of a fragment meet its new global
            ones. ``None`` (default): they take the global parameters plus
            the local progress of the tau overlapped steps,
            ``p = g + (p - p_at_sync)`` (without overlap, ``p = g``). A float
            in [0, 1]: the Streaming DiLoCo paper's mix ``p = alpha * p +
            (1 - alpha) * g``, which at 0 drops the overlapped steps' progress
            (TorchFT's ``fragment_update_alpha``).
        process_group, communicator, path: where pseudo-gradients go, as for
            the hooks (:class:`pycomm.hooks.HookState`).
        backup_device: where the global parameters and the outer
            optimizer's state live (default: the parameters' device). With
            CUDA parameters, ``"cpu"`` keeps those two copies of the model out
            of GPU memory (pinned), as TorchFT's ``backup_device`` and
            OpenDiLoCo do; each sync then moves its fragment across PCIe
            twice. The pseudo-gradients are still formed and averaged on the
            parameters' device.

    Building it is collective, as building DDP is: every rank checks that the
    others chose the same ``sync_every``, fragments, overlap, alpha and wire over
    parameters of the same shapes, and raises ``ValueError`` otherwise.

    Example::

        opt = pycomm.DiLoCo(model.parameters(), torch.optim.SGD(model.parameters(), lr=0.1),
                            sync_every=16, fragments=4, overlap=True)
    """

    def __init__(self, params: Iterable[torch.Tensor], inner: torch.optim.Optimizer, *, sync_every: int = 64,
                 outer_lr: Optional[float] = None, outer_momentum: Optional[float] = None,
                 nesterov: Optional[bool] = None,
                 outer: Optional[Callable[[List[Dict[str, Any]]], torch.optim.Optimizer]] = None, wire: Wire = None,
                 fragments: int = 1, overlap: Union[bool, int] = False, alpha: Optional[float] = None,
                 process_group: Group = None, communicator: Any = None, path: Optional[str] = None,
                 backup_device: Union[None, str, torch.device] = None) -> None:
        if isinstance(params, torch.nn.Module):  # TorchFT's DiLoCo takes the model
            params = params.parameters()
        if isinstance(params, torch.Tensor) or not isinstance(params, Iterable):
            raise TypeError("pycomm.DiLoCo: params must be the parameters inner optimizes (model.parameters()) "
                            f"or the model, got {type(params).__name__}")
        params = [p for p in params if p.requires_grad]
        if not params:
            raise ValueError("pycomm.DiLoCo: no parameters that require grad")
        if type(sync_every) is not int or sync_every < 1:
            raise ValueError(f"pycomm.DiLoCo: sync_every must be an int >= 1, got {sync_every!r}")
        if type(fragments) is not int or not 1 <= fragments <= min(len(params), sync_every):
            raise ValueError(f"pycomm.DiLoCo: fragments must be an int in [1, min(parameters, sync_every)] = "
                             f"[1, {min(len(params), sync_every)}], got {fragments!r}")
        if not (wire is None or wire in (torch.bfloat16, torch.float16) or _compression.is_quantizer(wire)):
            raise ValueError(f"pycomm.DiLoCo: wire={wire!r}; use None, torch.bfloat16, torch.float16, "
                             "pycomm.Int8() or pycomm.Int4()")
        if outer is not None and (outer_lr, outer_momentum, nesterov) != (None, None, None):
            raise ValueError("pycomm.DiLoCo: give outer= or outer_lr / outer_momentum / nesterov, not both (outer "
                             "builds the whole outer optimizer)")
        if len({p.device for p in params}) > 1 or len({p.dtype for p in params}) > 1:
            raise ValueError("pycomm.DiLoCo: every parameter must share one device and dtype")
        if type(overlap) not in (bool, int) or not 0 <= overlap < sync_every:
            raise ValueError(f"pycomm.DiLoCo: overlap must be a bool or an int in [0, sync_every) = "
                             f"[0, {sync_every}) (a fragment's sync must land before it syncs again), "
                             f"got {overlap!r}")
        if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float))
                                  or not 0.0 <= alpha <= 1.0):
            raise ValueError(f"pycomm.DiLoCo: alpha must be None or a float in [0, 1], got {alpha!r}")
        self.inner, self.sync_every, self.wire = inner, sync_every, wire
        #: Inner steps each sync travels behind (tau).
        self.overlap = int(overlap)
        self.alpha = None if alpha is None else float(alpha)
        self._router = Router(process_group, communicator=communicator, path=path)
        self._error_feedback = _compression.ErrorFeedback() if _compression.is_quantizer(wire) else None
        # The global parameters as plain tensors: a DTensor's (FSDP2's) are
        # this rank's shard of them.
        self._device = local_tensor(params[0]).device  # every parameter's (checked above)
        backup = self._device if backup_device is None else torch.device(backup_device)
        # Pinned host memory lets the copies to and from the GPU run
        # asynchronously (only where there is a GPU to pin for).
        self._pinned = backup.type == "cpu" and self._device.type == "cuda"
        glob = [local_tensor(p).detach().to(backup, copy=True) for p in params]
        if self._pinned:
            glob = [g.pin_memory() for g in glob]
        # Fragments of about equal numel, in parameter order.
        total, bounds, acc = sum(p.numel() for p in params), [0], 0
        for i, p in enumerate(params):
            acc += p.numel()
            if len(bounds) < fragments and acc >= total * len(bounds) / fragments and len(params) - i - 1 >= fragments - len(bounds):
                bounds.append(i + 1)
        bounds.append(len(params))
        self._fragments = [_Fragment(f, params[a:b], glob[a:b], f * sync_every // fragments)
                           for f, (a, b) in enumerate(zip(bounds, bounds[1:]))]
        groups: List[Dict[str, Any]] = [{"params": fr.glob} for fr in self._fragments]
        if outer is None:
            lr = 0.7 if outer_lr is None else outer_lr
            momentum = 0.9 if outer_momentum is None else outer_momentum
            self.outer = torch.optim.SGD(groups, lr=lr, momentum=momentum,
                                         nesterov=(True if nesterov is None else nesterov) and momentum > 0)
        else:
            self.outer = outer(groups)
            if not isinstance(self.outer, torch.optim.Optimizer):
                raise TypeError(f"pycomm.DiLoCo: outer must build a torch.optim.Optimizer over the groups it is "
                                f"given, got {type(self.outer).__name__}")
        self._wrap(inner)  # an optimizer to schedulers, GradScaler and step hooks (pycomm/_optim.py)
        #: Inner steps taken.
        self.local_step = 0
        #: Fragment syncs applied.
        self.outer_steps = 0
        self._check_ranks_agree(params)

    def step(self, closure: Any = None) -> Any:
        """One inner step; then the syncs this step is due for.

        Under ``torch.amp.GradScaler`` (``scaler.step(opt)``) a step whose
        gradients overflowed on this rank skips the inner update and still
        counts, so every rank syncs at the same steps."""
        loss = self._inner_step(closure)
        self.local_step += 1
        for fr in self._fragments:
            if fr.work is not None and fr.due == self.local_step:  # travelled behind the last tau steps
                self._finish(fr)
        for fr in self._fragments:
            if self.local_step % self.sync_every == fr.offset % self.sync_every:
                self._start(fr)
                if not self.overlap:
                    self._finish(fr)
        return loss

    def sync(self) -> None:
        """Sync every fragment now (collectively), e.g. at the end of
        training: a sync in flight lands as in training, then every
        fragment's progress since is averaged too, and every rank ends on the
        global parameters (whatever ``alpha``)."""
        for fr in self._fragments:
            if fr.work is not None:
                self._finish(fr)
        for fr in self._fragments:
            self._start(fr)
            self._finish(fr, to_global=True)

    def state_dict(self) -> Dict[str, Any]:
        """Inner and outer optimizers, the global parameters, the step and,
        for an int8 / int4 wire, the error-feedback residuals (call between
        steps; a sync in flight is finished first)."""
        for fr in self._fragments:
            if fr.work is not None:
                self._finish(fr)
        out = {"inner": self.inner.state_dict(), "outer": self.outer.state_dict(), "local_step": self.local_step,
               "outer_steps": self.outer_steps,
               "global": [t.detach().clone() for fr in self._fragments for t in fr.glob]}
        if self._error_feedback is not None:
            out["error_feedback"] = self._error_feedback.state_dict()
        return out

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.inner.load_state_dict(state["inner"])
        self.outer.load_state_dict(state["outer"])
        self.local_step, self.outer_steps = int(state["local_step"]), int(state["outer_steps"])
        if self._error_feedback is not None:
            if "error_feedback" in state:
                self._error_feedback.load_state_dict(state["error_feedback"])
            else:
                logger.warning("pycomm.DiLoCo: the checkpoint holds no error-feedback residuals (saved without a "
                               "quantized wire); they restart from zero")
                self._error_feedback.reset()
        if self._pinned:  # copies from the pinned global parameters may still be in flight
            torch.cuda.synchronize(self._device)
        saved = iter(state["global"])
        with torch.no_grad():
            for fr in self._fragments:
                for g in fr.glob:
                    g.copy_(next(saved))

    # ------------------------------------------------------------- internals

    def _check_ranks_agree(self, params: List[torch.Tensor]) -> None:
        """One small collective at construction, as DDP checks its parameters'
        shapes: every rank must sync the same fragments at the same steps.
        Ranks built otherwise would pair one rank's sync with another's at
        other steps, averaging the wrong steps' parameters or fragments of
        other sizes, and end with a collective no other rank calls.

        Each setting goes as 16-bit limbs with their squares, summed: n times
        the sum of squares equals the square of the sum only when the n ranks
        agree, and the sums stay exact in int64 over any world size (the group
        path's all-reduce only sums)."""
        wire = self.wire
        fields = {
            "sync_every": self.sync_every, "fragments": len(self._fragments), "overlap": self.overlap,
            "alpha": 0 if self.alpha is None else 1 + round(self.alpha * (1 << 30)),
            "wire": (0 if wire is None else {torch.bfloat16: 1, torch.float16: 2}.get(wire, 3)
                     if isinstance(wire, torch.dtype) else 10 + int(getattr(wire, "kind", 0))),
            "block": int(getattr(wire, "block", 0)),
            "parameters": len(params), "elements": sum(p.numel() for p in params),
            "shapes": hash(tuple(tuple(p.shape) for p in params)) & 0xFFFFFFFFFFFF,
        }
        limbs = [(v >> shift) & 0xFFFF for v in fields.values() for shift in (0, 16, 32)]
        local = torch.tensor(limbs + [x * x for x in limbs], dtype=torch.int64, device=self._device)
        self._router._start_all_reduce(self._router._route(local, compressed=False), local, "sum").wait()
        n, got = self._router.world_size, local.tolist()
        sums, squares = got[:len(limbs)], got[len(limbs):]
        differ = [name for i, name in enumerate(fields)
                  if any(n * squares[3 * i + k] != sums[3 * i + k] ** 2 for k in range(3))]
        if differ:
            mine = ", ".join(f"{name}={fields[name]}" for name in differ)
            raise ValueError(f"pycomm.DiLoCo: the ranks were built with different {', '.join(differ)} (this rank: "
                             f"{mine}); every rank must build DiLoCo with the same settings over the same "
                             "parameters, or their syncs pair up wrongly")

    def _start(self, fr: _Fragment) -> None:
        """The fragment's pseudo-gradient, averaged on its way."""
        with torch.no_grad():
            flat = torch.cat([(g.to(self._device, non_blocking=True) - local_tensor(p).detach()).reshape(-1)
                              for g, p in zip(fr.glob, fr.local)])
            # The keep rule needs where the overlapped steps began.
            fr.at_sync = ([local_tensor(p).detach().clone() for p in fr.local]
                          if self.overlap and self.alpha is None else None)
            fr.due = self.local_step + self.overlap
            route = self._router._route(flat, compressed=self.wire is not None)
            if isinstance(self.wire, torch.dtype):
                fr.flat = flat.to(self.wire)
            else:
                fr.flat = flat
            codec = self.wire if _compression.is_quantizer(self.wire) else None
            fr.work = self._router._start_all_reduce(route, fr.flat, "avg", codec, self._error_feedback,
                                                     key=("diloco", fr.index) if codec is not None else None)

    def _finish(self, fr: _Fragment, to_global: bool = False) -> None:
        """The outer step of the fragment, and its ranks back to the global
        parameters (``to_global``: exactly onto them)."""
        fr.work.wait()
        fr.work = None
        avg = fr.flat.to(fr.glob[0].device, fr.glob[0].dtype)
        with torch.no_grad():
            off = 0
            for other in self._fragments:
                for g in other.glob:
                    g.grad = None
            for g in fr.glob:
                g.grad = avg[off:off + g.numel()].view_as(g).clone()
                off += g.numel()
            self.outer.step()
            for i, (glob, param) in enumerate(zip(fr.glob, fr.local)):
                p = local_tensor(param)  # a DTensor's shard, written in place
                g = glob.to(self._device, non_blocking=True)  # itself, unless backup_device put it elsewhere
                if to_global:
                    p.copy_(g)
                elif self.alpha is not None:  # the paper's mix of local and global
                    p.mul_(self.alpha).add_(g, alpha=1.0 - self.alpha)
                elif fr.at_sync is not None:  # keep the local progress of the overlapped steps
                    p.sub_(fr.at_sync[i]).add_(g)
                else:
                    p.copy_(g)
                glob.grad = None
        fr.flat = fr.at_sync = None
        self.outer_steps += 1
