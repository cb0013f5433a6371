"""pycomm: collective communication for PyTorch.

Ring, tree and direct all-reduce (and reduce-scatter, all-gather, broadcast,
barrier) among the ranks of a torch.distributed group, over shared memory.

Example::

    import torch, torch.distributed as dist, pycomm
    dist.init_process_group("gloo")          # any backend: pycomm uses its Store
    comm = pycomm.Communicator()
    x = torch.randn(1 << 20)
    comm.all_reduce(x)                       # in place, summed over ranks
    work = comm.all_reduce(x, op="avg", async_op=True)
    work.get_future().wait()
"""
from ._loader import CommError, Work, load_core
from .communicator import (
    ALGORITHMS,
    Communicator,
    all_gather,
    all_reduce,
    barrier,
    broadcast,
    destroy,
    get_default,
    init,
    reduce_scatter,
)

__version__ = "0.1.0"

__all__ = [
    "ALGORITHMS",
    "CommError",
    "Communicator",
    "Work",
    "all_gather",
    "all_reduce",
    "barrier",
    "broadcast",
    "destroy",
    "get_default",
    "init",
    "load_core",
    "reduce_scatter",
]
