"""Worker-side cases for several (simulated) hosts (run inside harness workers)."""
from __future__ import annotations

from typing import Dict, List

import torch

from harness import make_comm


def topology(rank: int, world: int, name: str, sizes: List[int], **comm_kwargs) -> Dict:
    """What the communicator learnt about the hosts, and what "auto" runs at each size."""
    comm = make_comm(rank, world, name, **comm_kwargs)
    try:
        return {
            "host": comm.host, "local_rank": comm.local_rank, "local_size": comm.local_size,
            "num_hosts": comm.num_hosts, "transport": comm.transport,
            "auto": {n: comm.resolve_algorithm("all_reduce", "auto", n) for n in sizes},
            "hier_rs": comm.resolve_algorithm("reduce_scatter", "hierarchical", sizes[-1]),
            "ring": comm.resolve_algorithm("all_reduce", "ring", sizes[-1]),
        }
    finally:
        comm.close()


def mixed_stream(rank: int, world: int, name: str, steps: int, **comm_kwargs) -> List[torch.Tensor]:
    """Back-to-back async collectives of every kind on one communicator, then
    one wait: ops queued behind each other must not mix up their messages.
    Step i's inputs are make_input(i, rank, ...); returns every output."""
    from collective_cases import make_input

    comm = make_comm(rank, world, name, **comm_kwargs)
    try:
        works, outs = [], []
        for i in range(steps):
            n = STREAM_SIZES[i % len(STREAM_SIZES)]
            kind = STREAM_KINDS[i % len(STREAM_KINDS)]
            if kind == "all_reduce":
                x = make_input(i, rank, n, torch.float32)
                algo = ["ring", "tree", "direct", "hierarchical"][(i // len(STREAM_KINDS)) % 4]
                works.append(comm.all_reduce(x, algorithm=algo, async_op=True))
            elif kind == "all_gather":
                x = torch.empty(world * n)
                works.append(comm.all_gather(x, make_input(i, rank, n, torch.float32), async_op=True))
            elif kind == "broadcast":
                x = make_input(i, rank, n, torch.float32)
                works.append(comm.broadcast(x, src=i % world, async_op=True))
            else:
                x = torch.empty(n)
                works.append(comm.reduce_scatter(x, make_input(i, rank, world * n, torch.float32), async_op=True))
            outs.append(x)
        for w in works:
            w.wait()
        return outs
    finally:
        comm.close()


STREAM_SIZES = [5, 4099, 70001]
STREAM_KINDS = ["all_reduce", "all_gather", "broadcast", "reduce_scatter"]
