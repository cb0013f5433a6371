"""Sending one rank's training state to the others of a communicator (a heal)."""
from __future__ import annotations

import io
from typing import Any

import torch

from ..communicator import Communicator


def broadcast_state(comm: Communicator, state: Any, src: int) -> Any:
    """Rank ``src``'s ``state`` (anything ``torch.save`` takes: state dicts)
    on every rank of ``comm``, loaded onto the CPU; collective. Other ranks
    pass None.

    Example::

        got = broadcast_state(comm, {"model": model.state_dict()} if comm.rank == 0 else None, src=0)
    """
    payload = None
    size = torch.zeros(1, dtype=torch.int64)
    if comm.rank == src:
        out = io.BytesIO()
        torch.save(state, out)
        payload = torch.frombuffer(bytearray(out.getbuffer()), dtype=torch.uint8)
        size[0] = payload.numel()
    comm.broadcast(size, src=src)
    if payload is None:
        payload = torch.empty(int(size), dtype=torch.uint8)
    comm.broadcast(payload, src=src)
    if comm.rank == src:
        return state
    return torch.load(io.BytesIO(payload.numpy().tobytes()), map_location="cpu", weights_only=False)
