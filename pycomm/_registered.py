"""Registered (symmetric) shared memory, as methods of
:class:`pycomm.Communicator`: tensors every local rank maps, on which
collectives run in place instead of through the staging mailboxes."""
from __future__ import annotations

from typing import Sequence, Union

import torch

from ._loader import CommError


class RegisteredMemory:
    """``empty``, ``register`` and what tells whether a buffer is used as meant."""

    _c: object

    def empty(self, *size: Union[int, Sequence[int]], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A CPU tensor in registered (symmetric) shared memory: collectives on it copy less.

        Every local rank maps every rank's registered buffer, so a collective
        whose tensors were all made by ``empty`` of this communicator reads
        peers' data where it lies: an all-reduce reduces its part straight
        from every rank's buffer and writes the result straight into every
        rank's output, with no copy into and out of the staging mailboxes (what
        NCCL's buffer registration and ``torch.distributed._symmetric_memory``
        do on GPUs). Results are bitwise identical to the unregistered call
        with the same algorithm.

        A collective: every local rank calls it with the same shape and dtype,
        in the same order as its other calls (like ``symm_mem.empty``). The
        tensor is contiguous and cannot grow (``resize_`` beyond it raises);
        its memory stays valid while any tensor uses it, even after the
        communicator is closed, and nothing stays in ``/dev/shm`` after the job,
        killed or not. Passing it to another communicator raises CommError.
        Without shared memory (one rank per host) it is an ordinary tensor.

        In place: the two-shot all-reduce (what ``"auto"`` and ``"direct"``
        pick above 32 KiB; the output must be registered, the input may be
        either), reduce-scatter, all-gather and all-to-all (registered input),
        and broadcast (registered tensor). An explicit ``"ring"``/``"tree"``, a
        one-shot all-reduce, or any rank's buffer outside registered memory
        runs the staged path, on every rank alike.

        Example::

            buf = comm.empty(1 << 24)            # 16M float32, registered
            buf.copy_(grads)
            comm.all_reduce(buf, op="avg")       # no staging copies
        """
        shape = tuple(size[0]) if len(size) == 1 and not isinstance(size[0], int) else tuple(size)
        if not all(type(s) is int for s in shape):
            raise CommError(f"pycomm: comm.empty: sizes must be ints, got {shape!r}")
        return self._c.empty(list(shape), torch.empty(0, dtype=dtype))

    def register(self, tensor: torch.Tensor) -> torch.Tensor:
        """Move ``tensor``'s data into registered memory, in place; returns ``tensor``.

        CPU memory a process allocated on its own cannot be read by its peers,
        so registering copies it once into a buffer from :meth:`empty` and
        points ``tensor`` (the same Python object: a parameter, a flat
        gradient buffer) at it. A collective like :meth:`empty`: every local
        rank registers a tensor of the same shape and dtype. Already
        registered with this communicator: returned as is. Views of the old
        storage keep the old memory.

        Example::

            flat = comm.register(torch.zeros(n))   # flat now lives in shared memory
            comm.all_reduce(flat)
        """
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu" or tensor.layout != torch.strided:
            raise CommError("pycomm: comm.register: takes a dense CPU tensor")
        if self.is_registered(tensor):
            return tensor
        buf = self.empty(tuple(tensor.shape), dtype=tensor.dtype)
        buf.copy_(tensor)
        with torch.no_grad():
            tensor.set_(buf)
        return tensor

    def is_registered(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s storage came from this communicator's :meth:`empty`."""
        return self._c.registered_by(tensor) == 1

    @property
    def in_place_calls(self) -> int:
        """Collectives so far that ran in place on registered memory (to check that a buffer is used as meant)."""
        return self._c.in_place_calls
