"""Point-to-point messages between two ranks of a host, as methods of
:class:`pycomm.Communicator` (the C++ side is ``communicator_p2p.cpp``)."""
from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch

from ._loader import CommError, Work


def _check_tag(tag: int) -> int:
    if type(tag) is not int or not 0 <= tag < 2 ** 32:
        raise CommError(f"pycomm: tag must be an int in [0, 2**32), got {tag!r}")
    return tag



class PointToPoint:
    """``send`` and ``recv`` over the communicator's lanes (``self._c``)."""

    _c: object

    def send(
        self,
        tensor: Union[torch.Tensor, Sequence[torch.Tensor]],
        dst: int,
        *,
        tag: int = 0,
        async_op: bool = False,
    ) -> Optional[Work]:
        """Send a tensor (or a list of tensors, as one message) to rank ``dst`` of this host.

        Messages between two ranks arrive in the order they were sent; the
        receiver needs no shapes: each tensor travels with its dtype and shape.
        Returns once the data is in the channel (the receiver may not have it
        yet), or a Work that completes then. Only the two ranks take part:
        unlike collectives, other ranks need not call anything. Between hosts
        use ``torch.distributed.send``.

        ``tag`` is checked, not matched: a ``recv`` whose tag differs from the
        next message's raises :class:`pycomm.CommError` on both ranks.

        Example::

            if comm.rank == 0:
                comm.send(torch.randn(4, 8), dst=1)
            else:
                x = comm.recv(src=0)          # a float32 tensor of shape (4, 8)
        """
        tensors = [tensor] if isinstance(tensor, torch.Tensor) else list(tensor)
        work = self._c.send(tensors, int(dst), _check_tag(tag), async_op)
        return work if async_op else None

    def recv(
        self,
        src: int,
        *,
        out: Optional[Union[torch.Tensor, Sequence[torch.Tensor]]] = None,
        tag: int = 0,
        async_op: bool = False,
    ) -> Union[torch.Tensor, List[torch.Tensor], Work]:
        """Receive the next message from rank ``src``: its tensor, or its list of tensors.

        With ``out`` (tensors of the dtypes and shapes sent) the data lands
        there; otherwise new tensors are allocated from the message. With
        ``async_op=True`` returns a Work whose ``result()`` (and future) holds
        the list of tensors.

        Example::

            x = comm.recv(src=0)
            work = comm.recv(src=0, async_op=True); work.wait(); x, = work.result()
        """
        outs = [] if out is None else ([out] if isinstance(out, torch.Tensor) else list(out))
        work = self._c.recv(outs, int(src), _check_tag(tag), async_op)
        if async_op:
            return work
        result = work.result()
        return result[0] if len(result) == 1 else result
