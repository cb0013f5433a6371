"""What a stage's backward needs from autograd: the activation memory a
schedule keeps alive (saved tensors, counted per micro-batch), and a forward
cut layer by layer so that zero-bubble schedules can split the backward into
B (input gradients) and W (weight gradients).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

def as_list(x: Any) -> List[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in x):
        return list(x)
    raise TypeError(f"a pipeline stage must take and return a tensor or a tuple of tensors, got {type(x).__name__}")


def needs_grad(t: torch.Tensor) -> bool:
    # Both sides of a link apply the same rule, so the gradients sent back
    # line up with the activations sent forward.
    return t.is_floating_point() or t.is_complex()


class MemoryTracker:
    """Bytes autograd saves for backward (parameters excluded), plus what a
    split backward keeps for W: the activation memory a schedule keeps
    alive. Accounts per key (a micro-batch of a stage, or one layer of it);
    a tensor held under several keys counts once, until the last lets go."""

    def __init__(self, module: nn.Module) -> None:
        self.param_storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.live = 0
        self.peak = 0
        self.per_mb: Dict[Any, List[Any]] = {}
        self._refs: Dict[Any, int] = {}
        self._sizes: Dict[Any, int] = {}

    def _hold(self, key: Any, what: Any, nbytes: int) -> None:
        held = self.per_mb.setdefault(key, [])
        if what in held:
            return
        held.append(what)
        self._refs[what] = self._refs.get(what, 0) + 1
        if self._refs[what] == 1:
            self._sizes[what] = nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)

    def hooks(self, mb: Any):
        def pack(t: torch.Tensor) -> torch.Tensor:
            ptr = t.untyped_storage().data_ptr()
            # A view counts its own bytes (a micro-batch of the inputs is a
            # view of the whole batch).
            if ptr not in self.param_storages:
                self._hold(mb, (ptr, t.storage_offset(), tuple(t.shape)), t.numel() * t.element_size())
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def add(self, mb: Any, nbytes: int) -> None:
        """Counts bytes kept for ``mb`` besides saved tensors."""
        self._hold(mb, object(), nbytes)

    def release(self, mb: Any) -> None:
        for what in self.per_mb.pop(mb, []):
            self._refs[what] -= 1
            if self._refs[what] == 0:
                del self._refs[what]
                self.live -= self._sizes.pop(what)

    def release_all(self, stage: int, mb: int) -> None:
        """Releases ``(stage, mb)`` and every per-layer key ``(stage, mb, layer)``."""
        for key in [key for key in self.per_mb if key[:2] == (stage, mb)]:
            self.release(key)


class Segment:
    """One layer of a stage whose backward is split: its inputs that need a
    gradient, its outputs, and its trainable parameters."""

    __slots__ = ("ins", "outs", "leaves", "params")

    def __init__(self, ins: List[torch.Tensor], outs: List[torch.Tensor], params: List[torch.Tensor]) -> None:
        self.ins, self.outs, self.params = ins, outs, params
        # The new leaves the next layer took in place of ``outs`` (None where no gradient flows).
        self.leaves: List[Optional[torch.Tensor]] = [o.detach().requires_grad_() if o.requires_grad else None
                                                     for o in outs]


def cut_forward(module: nn.Module, xs: Sequence[torch.Tensor],
                 hooks: Optional[Callable[[int], Any]] = None) -> Tuple[Any, List[Segment]]:
    """Runs ``module`` layer by layer, cutting autograd's graph between
    layers (each layer's floating outputs become new leaves), so that a
    backward can be split per layer: B walks the layers from the last,
    computing only input gradients; W then computes each layer's weight
    gradients from the output gradient B left at it (for a Linear, B is
    g @ W and W is g^T @ x: nothing is computed twice)."""
    layers = list(module) if isinstance(module, nn.Sequential) else [module]
    args: Tuple[Any, ...] = tuple(xs)
    segments: List[Segment] = []
    out: Any = None
    for i, layer in enumerate(layers):
        ins = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        if hooks is None:
            out = layer(*args)
        else:  # memory accounting per layer: B frees what parameter-free layers saved
            with hooks(i):
                out = layer(*args)
        outs = as_list(out)
        params = [p for p in layer.parameters() if p.requires_grad]
        seg = Segment(ins, outs, params)
        segments.append(seg)
        args = tuple(o if leaf is None else leaf for o, leaf in zip(outs, seg.leaves))
        out = args if isinstance(out, tuple) else args[0]
    return out, segments


class SplitState:
    """The state a split backward keeps from F through B to W."""

    __slots__ = ("xs", "rng", "segments", "stash")

    def __init__(self, xs: List[torch.Tensor], rng: Optional[torch.Tensor]) -> None:
        self.xs, self.rng = xs, rng
        self.segments: List[Segment] = []
        self.stash: List[Tuple[List[torch.Tensor], List[torch.Tensor], List[torch.Tensor]]] = []

