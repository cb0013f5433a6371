"""pycomm: collective communication for PyTorch.

Ring, tree and direct all-reduce (and reduce-scatter, all-gather, all-to-all,
broadcast, barrier) among the ranks of a torch.distributed group, over shared
memory; compressed all-reduce (Int8, Int4, TopK with error feedback).

Example::

    import torch, torch.distributed as dist, pycomm
    dist.init_process_group("gloo")          # any backend: pycomm uses its Store
    comm = pycomm.Communicator()
    x = torch.randn(1 << 20)
    comm.all_reduce(x)                       # in place, summed over ranks
    work = comm.all_reduce(x, op="avg", async_op=True)
    work.get_future().wait()
    comm.all_reduce(x, op="avg", compression=pycomm.Int8())

    dist.init_process_group("cpu:pycomm")    # or as a torch.distributed backend
"""
from . import _debug, bootstrap, c10d, compression, cuda_ipc, elastic, group
from ._loader import CommError, Work, load_core
from ._version import __version__
from ._tables import ALGORITHMS
from .compression import ErrorFeedback, Int4, Int8, TopK
from .communicator import Communicator
from .diloco import DiLoCo
from .group import GroupCommunicator
from .straggler import DeadlineAverager, Straggler
from .default import (
    all_gather,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast,
    destroy,
    get_default,
    init,
    recv,
    reduce_scatter,
    send,
)


c10d.register()
_debug.configure_from_env()

__all__ = [
    "ALGORITHMS",
    "CommError",
    "Communicator",
    "DeadlineAverager",
    "DiLoCo",
    "ErrorFeedback",
    "GroupCommunicator",
    "Int4",
    "Int8",
    "Straggler",
    "TopK",
    "Work",
    "all_gather",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "c10d",
    "compression",
    "group",
    "destroy",
    "get_default",
    "init",
    "load_core",
    "recv",
    "reduce_scatter",
    "send",
]
