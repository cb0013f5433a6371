"""The names the compiled core publishes, read from it instead of restated.

Algorithms, collectives, reduce ops and codecs are enums of the C++ core
(``csrc/core``); the core exports their tables and Python maps user-facing
names to ids through them. Read lazily, so that the pure-Python parts of
pycomm import without the build.
"""
from __future__ import annotations

import functools
from typing import Dict, Iterator, List, Mapping, Optional, Union

import torch.distributed as dist

from ._loader import load_core


class CoreTable(Mapping):
    """A read-only name -> id table of the compiled core, loaded on first use.

    Example::

        pycomm.ALGORITHMS["ring"]      # the core's id of the ring algorithm
        list(pycomm.ALGORITHMS)        # the names a user may pass
    """

    def __init__(self, attr: str) -> None:
        self._attr = attr
        self._cache: Optional[Dict[str, int]] = None

    def _table(self) -> Dict[str, int]:
        # Read once: collectives look names up on every call.
        if self._cache is None:
            self._cache = dict(getattr(load_core(), self._attr))
        return self._cache

    def get(self, name: str, default: Optional[int] = None) -> Optional[int]:
        return self._table().get(name, default)

    def __getitem__(self, name: str) -> int:
        return self._table()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())

    def __repr__(self) -> str:
        try:
            return repr(dict(self._table()))
        except ImportError:
            return f"<pycomm table {self._attr!r}: the compiled core is not built>"


#: User-facing algorithm names -> ids ("auto", "ring", "tree", "direct", "hierarchical", "hier").
ALGORITHMS = CoreTable("algorithms")
#: Reduce op names -> ids ("sum", "avg", "max", "min", "product", "band", "bor", "bxor").
REDUCE_OPS = CoreTable("reduce_ops")
#: Codec names -> ids ("int8", "int4", "topk").
CODECS = CoreTable("codecs")

Op = Union[str, "dist.ReduceOp", "dist.ReduceOp.RedOpType"]


@functools.lru_cache(maxsize=None)
def collective_names() -> List[str]:
    """Collective names indexed by the core's collective id."""
    return list(load_core().collectives)


def collective_id(name: str) -> int:
    """The core's id of collective ``name`` ("all_reduce", "broadcast", ...)."""
    return collective_names().index(name)


def codec_default(field: str) -> object:
    """The core's default for a codec parameter ("block", "ratio", ...)."""
    return load_core().codec_defaults[field]


@functools.lru_cache(maxsize=None)
def _op_ids() -> Dict[object, int]:
    """Reduce op names and the matching ``dist.ReduceOp`` members -> the core's ids."""
    ids: Dict[object, int] = dict(REDUCE_OPS)
    for name, op_id in REDUCE_OPS.items():
        torch_op = getattr(getattr(dist, "ReduceOp", None), name.upper(), None)
        if torch_op is not None:
            ids[torch_op] = op_id
    return ids


def reduce_op_id(op: Op) -> Optional[int]:
    """The core's id of a reduce op given by name or as a ``dist.ReduceOp``; None if it is neither."""
    # A bare int would match torch's RedOpType of the same value (3 is MIN):
    # a silent reinterpretation, so it is refused like any unknown op.
    if type(op) in (int, bool):
        return None
    ids = _op_ids()
    if isinstance(op, str):
        return ids.get(op.lower())
    try:
        return ids[op]
    except (KeyError, TypeError):  # a ReduceOp object (unhashable), or no op at all
        pass
    for key, op_id in ids.items():
        try:
            if not isinstance(key, str) and bool(op == key):
                return op_id
        except Exception:  # noqa: BLE001 - an object that does not compare is no op
            return None
    return None
