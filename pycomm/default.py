"""The one default communicator, and the module-level collectives that use it.

``pycomm.all_reduce(t)`` and friends run on :func:`get_default`, which is
created from the default ``torch.distributed`` group on first use (or by
:func:`init`). This is the only global state pycomm keeps.

Example::

    dist.init_process_group("gloo")
    pycomm.init()
    pycomm.all_reduce(t)
"""
from __future__ import annotations

import atexit
from typing import List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from ._loader import CommError, Work
from ._tables import Op
from .communicator import Communicator

_default: Optional[Communicator] = None


def init(group: Optional["dist.ProcessGroup"] = None, **kwargs: object) -> Communicator:
    """Create the default communicator (used by the module-level functions).

    Example::

        dist.init_process_group("gloo")
        pycomm.init()
        pycomm.all_reduce(t)
    """
    global _default
    if _default is not None:
        raise CommError("pycomm: the default communicator already exists; call pycomm.destroy() first")
    _default = Communicator(group, **kwargs)
    return _default


def get_default() -> Communicator:
    """The default communicator, created from the default group on first use."""
    if _default is None:
        init()
    assert _default is not None
    return _default


def destroy() -> None:
    """Close and drop the default communicator."""
    global _default
    if _default is not None:
        _default.close()
        _default = None


atexit.register(destroy)


def all_reduce(tensor: torch.Tensor, op: Op = "sum", **kwargs) -> Optional[Work]:
    """:meth:`Communicator.all_reduce` on the default communicator."""
    return get_default().all_reduce(tensor, op, **kwargs)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: Op = "sum", **kwargs) -> Optional[Work]:
    """:meth:`Communicator.reduce_scatter` on the default communicator."""
    return get_default().reduce_scatter(output, input, op, **kwargs)


def all_gather(output: torch.Tensor, input: torch.Tensor, **kwargs) -> Optional[Work]:
    """:meth:`Communicator.all_gather` on the default communicator."""
    return get_default().all_gather(output, input, **kwargs)


def broadcast(tensor: torch.Tensor, src: int = 0, **kwargs) -> Optional[Work]:
    """:meth:`Communicator.broadcast` on the default communicator."""
    return get_default().broadcast(tensor, src, **kwargs)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, **kwargs) -> Optional[Work]:
    """:meth:`Communicator.all_to_all_single` on the default communicator."""
    return get_default().all_to_all_single(output, input, **kwargs)


def send(tensor: Union[torch.Tensor, Sequence[torch.Tensor]], dst: int, **kwargs) -> Optional[Work]:
    """:meth:`Communicator.send` on the default communicator."""
    return get_default().send(tensor, dst, **kwargs)


def recv(src: int, **kwargs) -> Union[torch.Tensor, List[torch.Tensor], Work]:
    """:meth:`Communicator.recv` on the default communicator."""
    return get_default().recv(src, **kwargs)


def barrier(**kwargs) -> Optional[Work]:
    """:meth:`Communicator.barrier` on the default communicator."""
    return get_default().barrier(**kwargs)
