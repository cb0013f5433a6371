"""pycomm as a ``torch.distributed`` backend.

``import pycomm`` registers the backend ``"pycomm"``; existing code runs on it
by changing one string::

    import pycomm  # noqa: F401  (registers the backend)
    dist.init_process_group("cpu:pycomm")              # or "cpu:pycomm,cuda:nccl"
    dist.all_reduce(t)                                 # runs on pycomm
    model = torch.nn.parallel.DistributedDataParallel(model)

    group = dist.new_group([0, 1], backend="pycomm")   # subgroups too

What runs where:

- all_reduce (and ``all_reduce_coalesced``), broadcast, reduce, all_gather
  (list and into one tensor, coalesced too), gather, scatter, reduce_scatter
  (list and tensor, coalesced too), all_to_all (equal blocks), barrier: a
  pycomm collective, with its checks (ranks that disagree raise on every
  rank), timeouts and dead-peer detection. Tensor lists are staged through
  one flat buffer, so a coalesced call is one collective.
- send / recv / irecv from any source, all-to-all with uneven blocks (list or
  ``all_to_all_single`` with splits), sparse all-reduce and
  ``monitored_barrier``: a private Gloo group over the same ranks (pycomm's
  transports move fixed-size data in collective lock-step; these calls are
  not fixed-size collectives).
- Every dtype for copies (broadcast, gathers, scatter, all-to-all): bool,
  int8/16, unsigned, complex, float8 ... Reductions take the dtypes Gloo
  reduces (floating, int8, uint8, int32, int64, bool) with SUM, AVG
  (floating), PRODUCT, MIN, MAX and, on integral and bool tensors, BAND, BOR
  and BXOR; PREMUL_SUM (NCCL's scaled sum, FSDP2's gradient divide factor)
  on floating tensors: each rank's input times its own factor, then SUM.
- Tensors that are not contiguous (transposed, channels_last, strided
  views) travel through a contiguous copy: exact results whatever the
  layout, also when ranks' layouts differ (Gloo reads their memory as if
  contiguous). An output whose elements share memory is refused.
- Errors are ``pycomm.CommError``, a ``torch.distributed.DistBackendError``;
  timeouts say "Timed out waiting <N>ms" as Gloo's do.

The group's timeout (``init_process_group(timeout=...)``) is pycomm's
timeout; a call's own (``dist.barrier(timeout=...)``) bounds that call. ``PYCOMM_ALGO``, ``PYCOMM_TRANSPORT``, ``PYCOMM_LOCAL_SIZE`` and the
other ``PYCOMM_*`` variables apply as for :class:`pycomm.Communicator`.
"""
from __future__ import annotations

import datetime
import functools
import logging
from typing import List

import torch.distributed as dist

from ._loader import load_core

logger = logging.getLogger("pycomm")

BACKEND_NAME = "pycomm"


def _create_backend(options: "dist.distributed_c10d._DistributedBackendOptions", backend_options: object):
    """The creator torch.distributed calls for every group that uses "pycomm"."""
    from .bootstrap import restart_prefix
    from .communicator import Communicator

    timeout = options.timeout
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    # torch already gives each group (and device) its own store prefix.
    comm = Communicator(store=options.store, rank=options.group_rank, world_size=options.group_size,
                        timeout=timeout, name="c10d")
    peer = dist.ProcessGroupGloo(dist.PrefixStore(f"pycomm-p2p/{restart_prefix()}", options.store), options.group_rank,
                                 options.group_size, timeout)
    logger.debug("pycomm: backend for group %s: rank %d of %d, %r", options.group_id, options.group_rank,
                 options.group_size, comm)
    return comm.as_c10d_backend(peer)


def register() -> None:
    """Register the "pycomm" backend with torch.distributed (``import pycomm`` does it).

    Example::

        pycomm.c10d.register()
        dist.init_process_group("cpu:pycomm")
    """
    if not dist.is_available():
        return
    if BACKEND_NAME.upper() in getattr(dist.Backend, "_plugins", {}):
        return
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=devices())
    _name_backend_in_ddp_logging()


def _name_backend_in_ddp_logging() -> None:
    """Make DDP's logging data name pycomm instead of "custom".

    torch's DDP logger asks the ProcessGroup for its name, and the
    ProcessGroup knows only torch's built-in backend types, so every
    third-party backend is "custom" there. For groups whose backend is
    pycomm, ``DistributedDataParallel._get_ddp_logging_data()`` reports what
    ``dist.get_backend(group)`` says, as it does for Gloo and NCCL.
    """
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:
        return
    original = DistributedDataParallel._get_ddp_logging_data
    if getattr(original, "_pycomm_names_backend", False):
        return

    @functools.wraps(original)
    def _get_ddp_logging_data(self):  # type: ignore[no-untyped-def]
        data = original(self)
        if data.get("backend_name") == "custom":
            try:
                name = str(dist.get_backend(self.process_group))
            except (RuntimeError, ValueError):  # a group torch no longer knows
                return data
            if BACKEND_NAME in name:
                data["backend_name"] = name
        return data

    _get_ddp_logging_data._pycomm_names_backend = True  # type: ignore[attr-defined]
    DistributedDataParallel._get_ddp_logging_data = _get_ddp_logging_data  # type: ignore[method-assign]


def devices() -> List[str]:
    """The devices the backend registers: those whose tensors pycomm's communicator takes.

    The compiled core says which (``collective_devices``), whatever the build:
    a CUDA build's kernels and IPC all-reduce do not make the communicator
    take CUDA tensors, so the backend never claims ``cuda``, and
    ``init_process_group("cpu:pycomm,cuda:nccl")`` gives CUDA tensors to NCCL.
    Without the build, ``["cpu"]`` (the creator then raises the loader's message).

    Example::

        pycomm.c10d.devices()   # ['cpu']
    """
    try:
        return list(load_core().collective_devices)
    except ImportError:
        return ["cpu"]
