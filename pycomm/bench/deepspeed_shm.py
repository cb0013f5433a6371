"""DeepSpeed's shared-memory all-reduce as a second baseline (``--deepspeed``).

DeepSpeed's CPU path (``deepspeed.comm.inference_all_reduce`` with
``DS_ACCELERATOR=cpu``) is what many users of one multi-core host compare
against. It runs in the same processes, on the same buffers, as pycomm's
rows. DeepSpeed is not a dependency of pycomm: install it for the benchmark
(``pip install deepspeed``); its operator is compiled on first use.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import os
from types import ModuleType
from typing import Callable

import torch
import torch.distributed as dist

# What DeepSpeed's shared-memory operator reduces in place; other dtypes and
# ops fall back to torch.distributed inside DeepSpeed, which is not what this
# row means to measure.
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def load() -> ModuleType:
    """Imports DeepSpeed's communication module; call it before the default
    group exists (before ``dist.init_process_group``), then :func:`setup`.

    DeepSpeed's torch backend names ``GroupMember.WORLD`` as a default
    argument, evaluated when its module is imported. Imported after
    ``init_process_group``, it holds the group past
    ``destroy_process_group``, until the interpreter's exit; Gloo's worker
    threads may then need the GIL that the exit no longer gives, and the
    process aborts ("terminate called without an active exception"; 1 run in
    ~15 under load). Imported first, the default is None.

    Example::

        ds_comm = load()
        dist.init_process_group("gloo")
        all_reduce = setup(local_size=2)
    """
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed.comm as ds_comm

        # By its full name: the package's attribute "torch" is torch itself.
        ds_torch = importlib.import_module("deepspeed.comm.torch")
    except ImportError as e:
        raise SystemExit("pycomm-bench --deepspeed needs DeepSpeed: pip install deepspeed") from e
    if _holds_group(ds_torch):
        raise RuntimeError("pycomm-bench: DeepSpeed was imported after init_process_group: it would keep the "
                           "default group alive into the interpreter's exit; call deepspeed_shm.load() first")
    return ds_comm


def _holds_group(ds_torch: ModuleType) -> bool:
    """Whether DeepSpeed's torch backend took a live group as a default argument."""
    backend = ds_torch.TorchBackend
    methods = [inspect.unwrap(getattr(backend, name)) for name in ("barrier", "monitored_barrier")
               if hasattr(backend, name)]  # unwrapped: DeepSpeed decorates them
    return any(isinstance(d, dist.ProcessGroup) for m in methods for d in (getattr(m, "__defaults__", None) or ()))


def setup(local_size: int) -> Callable[[torch.Tensor], None]:
    """Initialises DeepSpeed's communication on the already initialised
    default group (DeepSpeed loaded by :func:`load` before it); returns the
    in-place all-reduce (sum) to time.

    Example::

        all_reduce = setup(local_size=2)
        all_reduce(t)  # t summed over the ranks, in place
    """
    # DeepSpeed reads these in its operator's initialize(): the segment is
    # named after the master address and port, and it uses shared memory
    # only when every rank is local (LOCAL_SIZE == world).
    os.environ.setdefault("LOCAL_SIZE", str(local_size))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(os.getpid()))
    ds_comm = load()
    if int(os.environ["LOCAL_SIZE"]) != dist.get_world_size():
        raise SystemExit("pycomm-bench --deepspeed: DeepSpeed's shared-memory all-reduce needs every rank on one host")
    ds_comm.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False, verbose=False)
    if not (hasattr(torch.ops, "deepspeed") and hasattr(torch.ops.deepspeed, "inference_all_reduce_")):
        raise SystemExit("pycomm-bench --deepspeed: DeepSpeed's shared-memory operator did not load "
                         "(DS_ACCELERATOR must be cpu)")
    # DeepSpeed never unlinks its segments (~64 MB per rank, kept in memory
    # by /dev/shm after the processes end: a dozen launches of the benchmark
    # held gigabytes). Once every rank has mapped every segment (initialize
    # returns only then, so after a barrier), each rank unlinks its own:
    # the mappings stay, the names go, and the memory with the last process.
    dist.barrier()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(segment_path(dist.get_rank()))
    return lambda t: ds_comm.inference_all_reduce(t)


def segment_path(rank: int) -> str:
    """Where DeepSpeed's shared-memory operator keeps ``rank``'s segment (its
    name: uid, MASTER_ADDR and MASTER_PORT as it read them, and the rank)."""
    return (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{rank}")
