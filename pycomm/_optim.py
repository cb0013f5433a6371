"""What pycomm's optimizer wrappers (:class:`pycomm.DiLoCo`,
:class:`pycomm.hooks.LocalSGD`) share.

Each wraps an optimizer whose steps each rank takes alone and syncs on a
schedule of its own counting. To torch they are optimizers whose parameter
groups are the wrapped one's (as torch's ``PostLocalSGDOptimizer``), so LR
schedulers, ``GradScaler`` and step hooks take them as they take any. And
they take GradScaler's protocol for optimizers that handle scaling
themselves: ``GradScaler.step`` hands them the scale and the overflow flag
instead of not calling ``step()``. Their ranks' steps are not averaged, so
each rank's scaler sees only its own gradients and skips only its own
overflowing steps; a skipped step must still count on that rank, or its
sync schedule falls behind the others' and its syncs meet other steps'.
"""
from __future__ import annotations

import sys
from collections import OrderedDict
from typing import Any, Dict, List

import torch


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (sharing its storage); any other tensor
    itself. The wrappers average what ranks hold: with FSDP2 sharding a model
    within a group and a wrapper averaging between groups, ranks of the same
    place in their groups hold the same shards."""
    # Looked up, not imported: importing torch.distributed.tensor pulls in
    # sympy (~0.9 s of every rank's start, most of importing pycomm), and no
    # tensor can be a DTensor before something imported that module.
    dtensor = sys.modules.get("torch.distributed.tensor")
    cls = getattr(dtensor, "DTensor", None)
    return t.to_local() if cls is not None and isinstance(t, cls) else t


_HOOK_DICTS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
               "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
               "_optimizer_load_state_dict_post_hooks")


class WrappedOptimizer(torch.optim.Optimizer):
    """Base of an optimizer wrapper: call :meth:`_wrap` in ``__init__`` (in
    place of ``Optimizer.__init__``) and take each inner step through
    :meth:`_inner_step`."""

    _step_supports_amp_scaling = True

    def _wrap(self, wrapped: torch.optim.Optimizer) -> None:
        """torch.optim.Optimizer's bookkeeping, without parameter groups of
        its own (those are ``wrapped``'s)."""
        self._wrapped = wrapped
        self.defaults = wrapped.defaults
        for name in _HOOK_DICTS:
            setattr(self, name, OrderedDict())
        self._patch_step_function()

    @property  # type: ignore[override]
    def param_groups(self) -> List[Dict[str, Any]]:
        """The wrapped optimizer's parameter groups (what an LR scheduler sets)."""
        return self._wrapped.param_groups

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self._wrapped.state

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        raise NotImplementedError(f"pycomm.{type(self).__name__}: its parameters are fixed when it is built; "
                                  f"build a new {type(self).__name__} over every parameter instead")

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._wrapped.zero_grad(set_to_none=set_to_none)

    def _inner_step(self, closure: Any = None) -> Any:
        """The wrapped optimizer's step; under ``GradScaler`` (which set
        ``found_inf`` and ``grad_scale`` on this wrapper for this call) the
        step as GradScaler would take it: skipped when the gradients
        overflowed, else on the unscaled gradients (``grad_scale`` is None
        when the user already called ``scaler.unscale_(opt)``)."""
        found_inf = getattr(self, "found_inf", None)
        if found_inf is None:
            return self._wrapped.step(closure) if closure is not None else self._wrapped.step()
        grad_scale = getattr(self, "grad_scale", None)
        inner = self._wrapped
        if getattr(inner, "_step_supports_amp_scaling", False):
            # A fused inner optimizer unscales and skips in its own kernels,
            # without reading the flag on the host.
            inner.grad_scale, inner.found_inf = grad_scale, found_inf  # type: ignore[attr-defined]
            try:
                return inner.step()
            finally:
                del inner.grad_scale, inner.found_inf  # type: ignore[attr-defined]
        if found_inf.item():
            return None
        if grad_scale is not None:
            # GradScaler's arithmetic: the reciprocal in float64, then a multiply.
            grads = [p.grad for g in inner.param_groups for p in g["params"] if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, grad_scale.double().reciprocal().float().to(grads[0].device))
        return inner.step()
