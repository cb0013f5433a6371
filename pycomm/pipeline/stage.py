"""Cutting a model into pipeline stages.

A model is an ``nn.Sequential`` or a list of layers; a layer may also be a
zero-argument factory (``functools.partial(nn.Linear, 512, 512)``), so that a
rank constructs only the layers of its own stage. Stages are contiguous runs
of layers, given by an explicit ``balance`` (layers per stage) or chosen to
even out parameter counts.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Union

import torch
from torch import nn

Layer = Union[nn.Module, Callable[[], nn.Module]]


class StageModule(nn.Sequential):
    """Layers run in a row, where a layer that returns a tuple passes its items
    as separate arguments to the next (a stage's inputs arrive the same way).

    Example::

        StageModule(nn.Linear(8, 8), Fork(), Join())(x)   # Fork returns (a, b); Join(a, b)
    """

    def forward(self, *args: Any) -> Any:  # type: ignore[override]
        out: Any = args
        for layer in self:
            out = layer(*args)
            args = out if isinstance(out, tuple) else (out,)
        return out


def _num_params(layer: Layer) -> int:
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters())
    # A factory: build it on the meta device, which allocates nothing.
    with torch.device("meta"):
        return sum(p.numel() for p in layer().parameters())


def partition(costs: Sequence[float], num_stages: int) -> List[int]:
    """Layers per stage: contiguous, at least one each, minimising the largest stage's cost.

    Example::

        partition([4, 1, 1, 4], 2)   # [2, 2]
    """
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot cut {n} layers into {num_stages} stages (each stage needs a layer)")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest largest-stage cost of the first i layers in k stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i]:
                    best[k][i], cut[k][i] = v, j
    sizes, i = [], n
    for k in range(num_stages, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def stage_layers(model: Union[nn.Sequential, Sequence[Layer]], stage: int, num_stages: int,
                 balance: Optional[Sequence[int]] = None) -> StageModule:
    """The :class:`StageModule` of ``stage``'s layers (factories are called for this stage only).

    ``balance`` lists layers per stage; by default stages get about equal
    parameter counts (parameter-free layers count as one parameter, so they
    spread too).

    Example::

        layers = [functools.partial(nn.Linear, 64, 64) for _ in range(8)]
        mine = stage_layers(layers, stage=comm.rank, num_stages=comm.world_size)
    """
    layers = list(model)
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} is not in 0..{num_stages - 1}")
    if balance is None:
        balance = partition([_num_params(layer) + 1 for layer in layers], num_stages)
    balance = list(balance)
    if len(balance) != num_stages or any(b < 1 for b in balance) or sum(balance) != len(layers):
        raise ValueError(f"balance {balance} must give each of the {num_stages} stages at least one layer "
                         f"and {len(layers)} layers in all")
    start = sum(balance[:stage])
    mine = [layer if isinstance(layer, nn.Module) else layer() for layer in layers[start:start + balance[stage]]]
    for layer in mine:
        if not isinstance(layer, nn.Module):
            raise TypeError(f"a layer factory returned {type(layer).__name__}, not an nn.Module")
    return StageModule(*mine)
