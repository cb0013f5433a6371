"""Pipeline x data parallelism: the communicators of each rank's pipeline and data-parallel group."""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch.distributed as dist

from ..communicator import Communicator

def grid(num_stages: int, group: Optional["dist.ProcessGroup"] = None,
         **kwargs: Any) -> Tuple[Communicator, Optional[Communicator]]:
    """Communicators for pipeline x data parallelism over a torch.distributed group.

    Ranks ``r * num_stages .. (r + 1) * num_stages - 1`` form replica ``r``'s
    pipeline (consecutive ranks: one host, for shared memory); the ranks that
    run the same stage form its data-parallel group. Returns
    ``(pipeline_comm, dp_comm)`` for this rank (``dp_comm`` is None with one
    replica). Every rank of ``group`` must call it. ``kwargs`` go to each
    :class:`pycomm.Communicator`.

    Example::

        pipe_comm, dp_comm = grid(num_stages=2)       # 4 ranks: 2 stages x 2 replicas
        pipe = Pipeline(stage_layers(layers, pipe_comm.rank, 2), pipe_comm, dp_comm=dp_comm, ...)
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if num_stages < 1 or world % num_stages:
        raise ValueError(f"{world} ranks cannot form pipelines of {num_stages} stages")
    replicas = world // num_stages
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    pipe_comm = dp_comm = None
    # torch.distributed wants every rank to create every group, in one order.
    for r in range(replicas):
        members = [ranks[r * num_stages + s] for s in range(num_stages)]
        g = dist.new_group(members)
        if rank // num_stages == r:
            pipe_comm = Communicator(g, **kwargs)
    if replicas > 1:
        for s in range(num_stages):
            members = [ranks[r * num_stages + s] for r in range(replicas)]
            g = dist.new_group(members)
            if rank % num_stages == s:
                dp_comm = Communicator(g, **kwargs)
    return pipe_comm, dp_comm
